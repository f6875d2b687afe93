"""`aep-bridge up`, `aep-bridge demo`, `aep-bridge tail`: the bridge on a laptop."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    u = sub.add_parser("up", help="run everything locally: embedded nats-server, bootstrap, mapper and pairing workers "
                                  "(and the gate with --gate)")
    u.add_argument("--nats", default=None, metavar="URL", help="use this NATS server instead of starting an embedded one")
    u.add_argument("--port", type=int, default=None, help="embedded server port (default 4222, or a free port when taken)")
    u.add_argument("--state-dir", default=None, help="where the embedded store, logs and up.json live (default: $XDG_STATE_HOME/aep-bridge)")
    u.add_argument("--demo", action="store_true", help="replay the demo sessions once the bridge is up, then follow the stream")
    u.add_argument("--no-follow", action="store_true", help="with --demo: do not follow the stream after the summary")
    u.add_argument("--mapper-port", type=int, default=None, help="mapper metrics port (default 9464, or free)")
    u.add_argument("--pairing-port", type=int, default=None, help="pairing metrics port (default 9465, or free)")
    u.add_argument("--gate", action="store_true",
                   help="also run the opt-in control plane, `aep-bridge gate` (operator-deny gate and steering; "
                        "accepts both commands unless AEP_HERMES_CONTROL / AEP_INSTRUCT say otherwise)")
    u.add_argument("--gate-port", type=int, default=None, help="with --gate: gate metrics port (default 9466, or free)")
    u.add_argument("--export", action="append", default=[], metavar="URL",
                   help="also run `aep-bridge exporter` with this sink (repeatable): kafka://HOST:PORT/TOPIC"
                        "[?format=cloudevents|otlp|ocsf] or otlp+http://HOST:PORT/v1/logs")
    u.add_argument("--export-port", type=int, default=None, help="with --export: exporter metrics port (default 9467, or free)")
    u.add_argument("--relay-port", type=int, default=None, help="the relay's port, the AEP door (default 8787, or free)")
    u.add_argument("--cluster", type=int, default=0, metavar="N",
                   help="N (>= 3) embedded nats-servers in one JetStream cluster on loopback, streams at R3, "
                        "every worker given all N; kill one and the rest go on")
    u.add_argument("--fleet", action="store_true",
                   help="the embedded server(s) in a fleet's operator mode (decentralized JWT auth, issue 41): each "
                        "worker with its role's .creds, shims with their own `aep-bridge fleet issue` credential, "
                        "`fleet revoke` pushes to every server; the fleet's keys stay in <state dir>/fleet")
    u.set_defaults(func=cmd_up)

    d = sub.add_parser("demo", help="replay real Hermes sessions through the shim into a running bridge and summarise")
    d.add_argument("--nats", default=None, metavar="URL", help="the bridge's NATS (default: the running `up`, else AEP_BRIDGE_NATS_URL)")
    d.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the events (default 60)")
    d.add_argument("--json-summary", default=None, help="also write the summary as JSON to this file")
    d.set_defaults(func=cmd_demo)

    t = sub.add_parser("tail", help="follow AEP_EVENTS: one readable line per event, grouped by session lane")
    t.add_argument("--nats", default=None, metavar="URL", help="NATS URL (default: the running `up`, else AEP_BRIDGE_NATS_URL)")
    t.add_argument("--session", default=None, help="only this session (lane); `unknown` for the unknown lane")
    t.add_argument("--type", dest="type_pattern", default=None, metavar="PATTERN", help="only types matching this glob, e.g. 'tool.*'")
    t.add_argument("--since", default=None, help="start this far back (5m, 2h, 1d) or at an RFC 3339 time")
    t.add_argument("--all", action="store_true", help="start at the beginning of the stream (default: new events only)")
    t.add_argument("--json", action="store_true", help="print the raw events, one JSON object per line")
    t.add_argument("--count", type=int, default=None, help="exit after this many events")
    t.add_argument("--idle-exit", type=float, default=None, metavar="SECONDS", help="exit after this long without events")
    t.add_argument("--color", choices=["auto", "always", "never"], default="auto")
    t.set_defaults(func=cmd_tail)


def settings_for(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """Settings whose NATS URL is `--nats`, else the running `aep-bridge up`'s, else AEP_BRIDGE_NATS_URL."""
    from bridge.stack.up import client_settings

    return client_settings(args.nats)


#: up's port flags (argparse dest, flag)
UP_PORTS = (("port", "--port"), ("mapper_port", "--mapper-port"), ("pairing_port", "--pairing-port"),
            ("gate_port", "--gate-port"), ("export_port", "--export-port"), ("relay_port", "--relay-port"))


def bad_port(args: argparse.Namespace) -> str | None:
    """Why a port flag of `up` cannot be used (out of range, taken), else None: said in one line
    at once, instead of a worker's restart loop or a bare RuntimeError."""
    from bridge.stack.server import port_is_free

    for dest, flag in UP_PORTS:
        port = getattr(args, dest, None)
        if port is None:
            continue
        if not 1 <= port <= 65535:
            return f"{flag} {port}: a port is 1-65535 (or leave {flag} out for the default, or a free one)"
        if not port_is_free(port):
            return f"{flag} {port}: the port is taken on 127.0.0.1 (another process listens there); give another or leave {flag} out for a free one"
    return None


def cmd_up(args: argparse.Namespace) -> int:
    from bridge.config import Settings, default_state_dir
    from bridge.stack.up import StateDirBusy, Up, lock_state_dir

    settings = Settings.from_env()
    state_dir = Path(args.state_dir) if args.state_dir else default_state_dir()
    why = bad_port(args)
    if why:
        print(f"aep-bridge up: {why}", file=sys.stderr)
        return 2
    if args.cluster and args.nats:
        print("aep-bridge up: --cluster starts embedded servers; it cannot be used with --nats", file=sys.stderr)
        return 2
    if args.cluster and args.cluster < 3:
        print(f"aep-bridge up: --cluster {args.cluster}: a JetStream cluster for R3 needs at least 3 servers",
              file=sys.stderr)
        return 2
    if args.fleet and args.nats:
        print("aep-bridge up: --fleet runs the embedded server(s) in the fleet's mode; it cannot be used with --nats "
              "(for your own servers: `aep-bridge fleet init` and deploy/README.md)", file=sys.stderr)
        return 2
    if args.fleet and args.demo:
        print("aep-bridge up: --demo replays through the shared local credential; not with --fleet "
              "(issue an instance with `aep-bridge fleet issue` and run the shim with it)", file=sys.stderr)
        return 2
    if args.export:
        from bridge.core.sinks import SinkConfigError, check_unique, sink_from_url
        from bridge.services.exporter import ClientMissing, require_clients

        try:  # a bad URL, or a sink whose client is not installed, is said now, not in a worker's log
            sinks = [sink_from_url(url) for url in args.export]
            check_unique(sinks)
            require_clients(sinks)
        except (SinkConfigError, ClientMissing) as exc:
            print(f"aep-bridge up: --export: {exc}", file=sys.stderr)
            return 2
    try:
        lock = lock_state_dir(state_dir)  # held until this process ends
    except StateDirBusy as exc:
        print(f"aep-bridge up: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"aep-bridge up: cannot use the state directory {state_dir}: {exc}", file=sys.stderr)
        return 2
    up = Up(settings, nats_url=args.nats, port=args.port, state_dir=state_dir,
            mapper_port=args.mapper_port, pairing_port=args.pairing_port, gate=args.gate, gate_port=args.gate_port,
            export=args.export, export_port=args.export_port, relay_port=args.relay_port, cluster=args.cluster,
            fleet=args.fleet)
    try:
        return asyncio.run(up.run(demo=args.demo, follow=not args.no_follow, color=sys.stdout.isatty()))
    except Exception as exc:
        print(f"aep-bridge up: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        os.close(lock)


def cmd_demo(args: argparse.Namespace) -> int:
    from bridge.commands import run_client
    from bridge.stack.demo import run_demo

    settings = settings_for(args)
    result = run_client("demo", lambda: run_demo(settings, timeout=args.timeout, json_summary=Path(args.json_summary)
                                                 if args.json_summary else None),
                        hint=" (is the bridge running? start it with `aep-bridge up`)")
    if not isinstance(result, dict):  # said in one line
        return 1
    return 0 if result["shim_failures"] == 0 and result["events"] >= result["mapped_expected"] else 1


def cmd_tail(args: argparse.Namespace) -> int:
    from bridge.commands import run_client
    from bridge.nats.connection import connect_client
    from bridge.stack.tail import parse_since, tail

    settings = settings_for(args)
    try:
        since = parse_since(args.since)
    except ValueError as exc:
        print(f"aep-bridge tail: {exc}", file=sys.stderr)
        return 2
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty() and not args.json)

    async def main() -> int:
        nc = await connect_client(settings, name="aep-bridge-tail", role="consumer")
        try:
            await tail(nc, session=args.session, type_pattern=args.type_pattern, since=since, all_events=args.all,
                       as_json=args.json, color=color, count=args.count, idle_exit=args.idle_exit)
        finally:
            await nc.close()
        return 0

    return int(run_client("tail", main))
