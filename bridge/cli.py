"""The one `aep-bridge` command.

Each subcommand lives in its own module, which exposes ``register(subparsers)``;
``register`` adds its parser(s) and sets ``func`` (a callable taking the parsed
namespace and returning an exit code). Modules are imported lazily only for the
subcommand being run would be nicer, but argparse needs every parser for
``--help``; the modules keep their heavy imports inside ``func``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from bridge import __version__

COMMAND_MODULES = (
    "bridge.commands.core",  # map, schemas
    "bridge.commands.export",  # export (the AEP-0005 bridges)
    "bridge.commands.shim",  # spool, hermes install/uninstall/doctor
    "bridge.commands.nats",  # bootstrap
    "bridge.commands.services",  # mapper, pairing
    "bridge.commands.local",  # up, demo, tail
    "bridge.commands.sim",  # simulate, verify
    "bridge.commands.control",  # gate, control respond|instruct|hello|pending
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aep-bridge",
        description="Turn Hermes Agent hook events into an AEP 0.1 stream on NATS JetStream.",
    )
    parser.add_argument("--version", action="version", version=f"aep-bridge {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:  # a command group not built yet
            if exc.name != name:
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
