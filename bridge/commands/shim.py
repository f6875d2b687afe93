"""`aep-bridge spool status|drain` and `aep-bridge hermes install|uninstall|doctor`."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def register(sub: argparse._SubParsersAction) -> None:
    spool = sub.add_parser("spool", help="inspect or drain the shim's local spool")
    ssub = spool.add_subparsers(dest="spool_command", metavar="ACTION")
    st = ssub.add_parser("status", help="pending, dropped and set-aside records of this instance's spool")
    _config_arg(st)
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.set_defaults(func=cmd_spool_status)
    dr = ssub.add_parser("drain", help="republish every spooled event to HERMES_RAW, in order")
    _config_arg(dr)
    dr.add_argument("--timeout", type=float, default=10.0, help="seconds without progress before giving up (default 10)")
    dr.add_argument("--quiet", action="store_true", help="no progress lines")
    dr.set_defaults(func=cmd_spool_drain)
    spool.set_defaults(func=lambda a: _usage(spool))

    hermes = sub.add_parser("hermes", help="register the shim with Hermes Agent, remove it, or check it")
    hsub = hermes.add_subparsers(dest="hermes_command", metavar="ACTION")
    ins = hsub.add_parser(
        "install",
        help="add the shim to $HERMES_HOME/config.yaml hooks and record consent",
        description=(
            "Write hooks entries for the events into $HERMES_HOME/config.yaml (keeping the rest of the "
            "file and its comments), record consent in shell-hooks-allowlist.json so the hooks register "
            "without a TTY, and write the shim's settings (the AEP_BRIDGE_* variables set now) to "
            "$HERMES_HOME/aep-bridge.env. Idempotent; `uninstall` takes exactly this back."
        ),
    )
    _home_arg(ins)
    ins.add_argument(
        "--events",
        action="append",
        default=None,
        metavar="EVENT[,EVENT...]",
        help="Hermes events to hook (repeatable or comma-separated; default: all 23 it can fire)",
    )
    ins.add_argument("--python", default=None, help="absolute interpreter for the hook (default: this one)")
    ins.add_argument(
        "--mode",
        choices=["compiled", "source"],
        default="compiled",
        help="register the byte-compiled shim (default; ~11 ms faster per event) or hook.py itself",
    )
    ins.add_argument("--timeout", type=int, default=None, help="Hermes's hook timeout in seconds (default: deadline + 2 s)")
    ins.set_defaults(func=cmd_install)
    un = hsub.add_parser("uninstall", help="remove exactly what `install` added")
    _home_arg(un)
    un.set_defaults(func=cmd_uninstall)
    doc = hsub.add_parser("doctor", help="are the hooks registered, is the shim current, does NATS answer?")
    _home_arg(doc)
    doc.add_argument("--timeout", type=float, default=2.0, help="NATS connect timeout in seconds (default 2)")
    doc.set_defaults(func=cmd_doctor)
    hermes.set_defaults(func=lambda a: _usage(hermes))


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def _config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="KEY=VALUE settings file, as the hook's --config; default AEP_BRIDGE_CONFIG, else the file the "
        "installed hook reads ($HERMES_HOME/aep-bridge.env) when `hermes install` ran, else ~/.config/aep-bridge/env",
    )


def _home_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hermes-home", default=None, metavar="DIR", help="Hermes home (default: $HERMES_HOME or ~/.hermes)")


def _shim_config(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The shim's settings as the installed hook sees them, and the settings file they came from:
    --config, else AEP_BRIDGE_CONFIG, else the hook's own --config file when Hermes wiring exists
    ($HERMES_HOME or ~/.hermes), else the default file."""
    from bridge.shim import hook

    path = os.path.expanduser(args.config) if args.config else None
    if path is None and not os.environ.get("AEP_BRIDGE_CONFIG"):
        from bridge.hermes.install import installed_env_file

        installed = installed_env_file()
        path = str(installed) if installed is not None else None
    environ = dict(os.environ)
    return hook.Config(environ=environ, config_path=path), hook.settings_file(environ, path)


# ---------------------------------------------------------------- spool


def cmd_spool_status(args: argparse.Namespace) -> int:
    from bridge.shim import hook

    cfg, settings_file = _shim_config(args)
    st = hook.spool_for(cfg).status()
    if args.json:
        print(json.dumps({**st, "settings_file": settings_file}, indent=2, sort_keys=True))
        return 0
    print(f"settings       {settings_file}")
    print(f"spool          {st['path']}")
    print(f"pending        {st['pending_records']} record(s), {st['pending_bytes']} bytes (cap {st['max_bytes']})")
    fb = st.get("fallback")
    if fb and (fb["pending_records"] or fb["file_bytes"] or fb["torn_tail_bytes"]):
        print(f"fallback       {fb['path']}: {fb['pending_records']} record(s), {fb['pending_bytes']} bytes "
              f"(spooled while {cfg.spool_dir} could not be written)")
    print(f"dropped        {st['dropped_records']} record(s), {st['dropped_bytes']} bytes (spool full or unwritable)")
    if st["torn_tail_bytes"]:
        print(f"torn tail      {st['torn_tail_bytes']} bytes (set aside at the next replay)")
    aside = st["set_aside_files"]
    if aside:
        print("set aside      " + ", ".join(f"{n} {k} file(s)" for k, n in sorted(aside.items())) + f" in {cfg.spool_dir}")
    if st.get("refused_runs"):
        last = hook.spool_for(cfg).refused()[1] or ""
        print(f"refused        {st['refused_runs']} run(s) by the server (credential revoked, expired or for another "
              f"instance; `aep-bridge hermes doctor`); last: {last[:200]}")
    return 0


def cmd_spool_drain(args: argparse.Namespace) -> int:
    from bridge.shim import hook

    cfg, settings_file = _shim_config(args)
    if not args.quiet:
        print(f"settings       {settings_file}", file=sys.stderr)
    spool = hook.spool_for(cfg)
    start = spool.status()
    fb = start.get("fallback") or {"pending_records": 0, "torn_tail_bytes": 0}
    total = start["pending_records"] + fb["pending_records"]
    if not total and not start["torn_tail_bytes"] and not fb["torn_tail_bytes"]:
        print(f"spool {spool.path}: nothing to drain")
        return 0
    last = [0.0]

    def progress(sent: int, pending_bytes: int) -> None:
        now = time.monotonic()
        if not args.quiet and (now - last[0] > 0.5 or not pending_bytes):
            last[0] = now
            print(f"drained {done + sent}/{total} ({pending_bytes} bytes pending)", file=sys.stderr)

    done = 0
    while True:
        errors: list[str] = []
        deadline = time.monotonic() + args.timeout
        order = hook.server_order(cfg)
        sent, empty, tried = 0, False, False
        # As the hook: each server but the last has a share of the timeout to ack; one that
        # does not is left for the next (which replays from the committed position).
        for conn in hook.connect_candidates(cfg, deadline, errors, order):
            tried = True
            try:
                sent, empty, _ = spool.replay(conn, deadline, progress=progress, wait_lock=True)
            finally:
                conn.close()
            if conn.answered:
                hook.acked(cfg, conn)
            if sent or empty or conn.error is None:
                break
            errors.append(str(conn.error))
        else:
            hook.left_unacked(cfg, order)
        if not tried:
            print(f"aep-bridge spool drain: no NATS server answered: {'; '.join(errors)}", file=sys.stderr)
            return 1
        done += sent
        if empty:
            print(f"drained {done} record(s) from {spool.path} to HERMES_RAW")
            return 0
        if sent == 0:
            why = "; ".join(errors) or "no ack before the timeout"
            print(f"aep-bridge spool drain: stalled after {done} record(s): {why}", file=sys.stderr)
            return 1


# ---------------------------------------------------------------- hermes


def cmd_install(args: argparse.Namespace) -> int:
    from bridge.hermes.install import InstallError, hermes_home, install

    events = [e.strip() for chunk in args.events or [] for e in chunk.split(",") if e.strip()] or None
    home = hermes_home(args.hermes_home)
    try:
        res = install(home, events=events, python=args.python, mode=args.mode, timeout=args.timeout)
    except InstallError as exc:
        print(f"aep-bridge hermes install: {exc}", file=sys.stderr)
        return 1
    print(f"hook command   {res.command}")
    print(f"config         {res.config_path}: added {len(res.added)} event(s), {len(res.already)} already there")
    print(f"consent        {len(res.approved)} new approval(s) in {home / 'shell-hooks-allowlist.json'}")
    print(f"settings       {res.env_file} (AEP_BRIDGE_* for the shim; Hermes's environment wins)")
    print("Restart Hermes (CLI or gateway) to load the hooks; check with `aep-bridge hermes doctor`.")
    return 0


def cmd_uninstall(args: argparse.Namespace) -> int:
    from bridge.hermes.install import InstallError, hermes_home, uninstall

    try:
        done = uninstall(hermes_home(args.hermes_home))
    except InstallError as exc:
        print(f"aep-bridge hermes uninstall: {exc}", file=sys.stderr)
        return 1
    for line in done or ["nothing left to remove"]:
        print(line)
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from bridge.hermes.doctor import doctor
    from bridge.hermes.install import hermes_home

    failed = False
    for check in doctor(hermes_home(args.hermes_home), nats_timeout=args.timeout):
        mark = "ok  " if check.ok else ("warn" if check.warning else "FAIL")
        failed = failed or not (check.ok or check.warning)
        print(f"[{mark}] {check.what}")
    return 1 if failed else 0
