"""`aep-bridge config`: the effective settings of a role and where each came from."""

from __future__ import annotations

import argparse
import json
import sys


def config_flags() -> list[tuple[str, str, str]]:
    """The flags `config` takes, as the services take them (flag, argparse dest, variable), from
    FIELDS' ``flag``; the exporter's --config is --export-config here (--config is the settings file)."""
    from bridge.config import flag_fields

    return [("--export-config", "export_config", var) if flag == "--config" else (flag, dest, var)
            for flag, dest, var in flag_fields()]


def register(sub: argparse._SubParsersAction) -> None:
    from bridge.config import ROLES

    p = sub.add_parser(
        "config",
        help="print the effective settings (of one role) and where each came from",
        description="Every setting a role reads (all of them without --role), resolved as that command "
        "resolves it: flag, then environment, then the AEP_BRIDGE_CONFIG file, then the default. "
        "Secrets are masked (passwords, tokens, nkey seeds, a password in a URL). Exit 2 when a "
        "value is not one the command accepts (each is named).",
    )
    p.add_argument("--role", choices=ROLES, default=None, help="only the settings this role reads")
    p.add_argument("--config", default=None, metavar="FILE", help="settings file (default: AEP_BRIDGE_CONFIG, else ~/.config/aep-bridge/env)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    for flag, dest, var in config_flags():
        p.add_argument(flag, dest=dest, default=None, help=f"as the command's {flag} (overrides {var})")
    p.set_defaults(func=cmd_config)


def effective(role: str | None, flags: dict[str, str], config_path: str | None = None,
              environ: dict[str, str] | None = None) -> dict:  # type: ignore[type-arg]
    """The rows `aep-bridge config` prints: every setting with its shown (masked) value, its
    source and, for a bad one, the error."""
    from bridge.config import Layers, SettingError, family, fields_for, resolve_field

    layers = Layers.load(environ, flags, config_path)
    rows, errors = [], []
    for f in fields_for(role):
        row = {"name": f.name, "roles": sorted(f.roles), "secret": f.secret, "help": f.help, "accepts": f.accepts()}
        if f.prefix:  # each variable of the family that is set
            rows += [{**row, "name": v.name, "value": v.shown(), "source": v.source} for v in family(f, layers)]
            continue
        try:
            v = resolve_field(f, layers, role)
        except SettingError as exc:
            row.update(value=None, source=layers.raw(f.name)[1], error=str(exc))
            errors.append(str(exc))
        else:
            row.update(value=v.shown() if v.value not in (None, ()) else None, source=v.source)
            if v.note:
                row["note"] = v.note
        rows.append(row)
    return {"role": role, "settings_file": layers.path, "settings_file_found": bool(layers.file),
            "settings": rows, "errors": errors}


def cmd_config(args: argparse.Namespace) -> int:
    import os

    if args.config is not None and not os.path.exists(args.config):  # asked for by name: not "defaults"
        print(f"aep-bridge config: --config {args.config}: no such file", file=sys.stderr)
        return 2
    flags = {var: getattr(args, dest) for _, dest, var in config_flags() if getattr(args, dest, None) is not None}
    out = effective(args.role, flags, args.config)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        found = "" if out["settings_file_found"] else " (not found or empty)"
        print(f"# role {args.role or 'all'}; settings file {out['settings_file']}{found}")
        width = max((len(r["name"]) for r in out["settings"]), default=0)
        for r in out["settings"]:
            value = r["value"] if r["value"] is not None else "-"
            line = f"{r['name']:<{width}}  {value}  ({r['source']})"
            if r.get("note"):
                line += f"  # {r['note']}"
            if r.get("error"):
                line = f"{r['name']:<{width}}  !  ({r['source']})  # {r['error']}"
            print(line)
    for error in out["errors"]:
        print(f"aep-bridge config: {error}", file=sys.stderr)
    return 2 if out["errors"] else 0
