"""The one `aep-bridge` command.

Each subcommand lives in its own module, which exposes ``register(subparsers)``;
``register`` adds its parser(s) and sets ``func`` (a callable taking the parsed
namespace and returning an exit code). argparse needs every parser for ``--help``,
so every command module is imported; they keep their heavy imports (services, NATS,
the simulator, the stack) inside ``func``, the one place in the bridge where imports
are function-local on purpose. Measured (2-core machine shared with other jobs,
2026-12-01, 5 runs each): ``aep-bridge --help`` 0.36-0.68 s as is; with those imports
made first (services, gate, sim, stack, hermes install, schemas) 1.49-2.27 s.
Commands that run often and briefly (``spool``, ``hermes doctor``, ``control``) keep
that saving too.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from bridge import __version__

COMMAND_MODULES = (
    "bridge.commands.mapping",  # map, schemas
    "bridge.commands.export",  # export (the AEP-0005 bridges)
    "bridge.commands.shim",  # spool, hermes install/uninstall/doctor
    "bridge.commands.bootstrap",  # bootstrap
    "bridge.commands.services",  # mapper, pairing, gate, exporter, relay: the services, one path
    "bridge.commands.stack",  # up, demo, tail
    "bridge.commands.usage",  # usage: what the model calls cost
    "bridge.commands.sim",  # simulate, verify
    "bridge.commands.control",  # control respond|instruct|hello|pending
    "bridge.commands.config",  # config: the effective settings and where each came from
    "bridge.commands.status",  # status: the whole bridge on one screen
    "bridge.commands.fleet",  # fleet init|issue|revoke|list|push: per-instance NATS credentials
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
    from bridge.config import SettingError

    try:
        return int(args.func(args) or 0)
    except SettingError as exc:  # a bad setting: its name and what it accepts, no traceback
        print(f"aep-bridge {args.command}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # stdout's reader went away (`tail --all | head -2`)
        return broken_pipe()


#: the exit code of a command whose stdout's reader went away: a Unix tool's, killed by SIGPIPE
EXIT_BROKEN_PIPE = 128 + 13


def broken_pipe() -> int:
    """Exit quietly, as a Unix tool does, when stdout's reader went away: stdout goes to
    /dev/null, so the interpreter's own flush at exit does not raise (and print) again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
    return EXIT_BROKEN_PIPE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
