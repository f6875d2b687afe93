"""`aep-bridge fleet init | issue | revoke | list | push`: a fleet's own NATS identities (bridge/nats/fleet.py)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path


def default_dir() -> str:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.environ.get("AEP_BRIDGE_FLEET_DIR") or os.path.join(base, "aep-bridge", "fleet")


def register(sub: argparse._SubParsersAction) -> None:
    f = sub.add_parser(
        "fleet",
        help="per-instance NATS credentials (decentralized JWT auth): init, issue, revoke, list, push, rotate",
        description="A fleet's own identities: an operator, the accounts AEP (the bridge's roles and streams) and "
                    "FLEET (one user per Hermes instance, bound to its own subjects by a scoped signing key), and a "
                    "`full` resolver block for nats-server. Issuing needs no server; revoking pushes the FLEET "
                    "account to every server, which closes the instance's live connections. No server "
                    "configuration is edited or reloaded after `init`. (deploy/README.md, docs/THREAT_MODEL.md)",
    )
    fs = f.add_subparsers(dest="fleet_cmd", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--dir", default=default_dir(),
                       help="the keys directory (0700; default $AEP_BRIDGE_FLEET_DIR or ~/.config/aep-bridge/fleet)")

    p = fs.add_parser("init", help="create the operator, accounts, signing keys, role creds and resolver.conf")
    common(p)
    p.add_argument("--nats", default="", metavar="URL[,URL...]",
                   help="the servers the shims and `revoke` reach (written into issued settings)")
    p.add_argument("--resolver-dir", default="jwt",
                   help="the resolver's store directory written into resolver.conf (default: jwt, relative to the "
                        "server's working directory)")
    p.set_defaults(func=cmd_init)

    p = fs.add_parser("issue", help="write an instance's shim settings with its own credential (no server call)")
    common(p)
    p.add_argument("--instance", required=True, help="the Hermes instance name (AEP_BRIDGE_INSTANCE)")
    p.add_argument("--expires", default="30d", help="lifetime: 30d, 12h, 90m; `never` (default 30d)")
    p.add_argument("--out", default=None, help="the settings file to write (mode 0600; default: stdout)")
    p.add_argument("--control", action="store_true",
                   help="the control-plane scope: also the instruction pull and replies to the gate's requests")
    p.add_argument("--nats", default=None, metavar="URL[,URL...]", help="AEP_BRIDGE_NATS_URL to write (default: init's)")
    p.set_defaults(func=cmd_issue)

    p = fs.add_parser("revoke", help="revoke an instance's credentials and push the account to every server")
    common(p)
    p.add_argument("--instance", required=True)
    p.add_argument("--nats", default=None, metavar="URL[,URL...]", help="the servers to push to (default: init's)")
    p.add_argument("--no-push", action="store_true", help="record the revocation only (push later: `fleet push`)")
    p.set_defaults(func=cmd_revoke)

    p = fs.add_parser("push", help="push the accounts (AEP, FLEET) to every server")
    common(p)
    p.add_argument("--nats", default=None, metavar="URL[,URL...]")
    p.set_defaults(func=cmd_push)

    p = fs.add_parser("roles", help="new .creds for the bridge's roles; the old ones are revoked (pushed)")
    common(p)
    p.add_argument("--role", action="append", default=None, metavar="aep-ROLE",
                   help="only this role (repeatable; default: every role)")
    p.add_argument("--nats", default=None, metavar="URL[,URL...]", help="the servers to push to (default: init's)")
    p.add_argument("--no-push", action="store_true")
    p.set_defaults(func=cmd_roles)

    p = fs.add_parser("rotate", help="new signing keys for the instances (then re-issue; --retire drops the old ones)")
    common(p)
    p.add_argument("--retire", action="store_true",
                   help="drop the signing keys a previous rotate set aside: what they signed stops working")
    p.add_argument("--nats", default=None, metavar="URL[,URL...]", help="the servers to push to (default: init's)")
    p.add_argument("--no-push", action="store_true")
    p.set_defaults(func=cmd_rotate)

    p = fs.add_parser("watch", help="count the instances the servers refuse (revoked, expired), as the system user")
    common(p)
    p.add_argument("--nats", default=None, metavar="URL[,URL...]", help="the servers (default: init's)")
    p.add_argument("--seconds", type=float, default=0, help="stop after this long (default: until Ctrl-C)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve aep_bridge_fleet_refused_connections_total{instance,reason} on this port (loopback)")
    p.set_defaults(func=cmd_watch)

    p = fs.add_parser("list", help="the issued credentials: issued, revoked, expired")
    common(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_list)


def _fail(msg: str) -> int:
    print(f"aep-bridge fleet: {msg}", file=sys.stderr)
    return 2


def cmd_init(args: argparse.Namespace) -> int:
    from bridge.nats.fleet import Fleet, FleetError

    try:
        fleet = Fleet.init(args.dir, urls=args.nats, resolver_dir=args.resolver_dir)
    except FleetError as exc:
        return _fail(str(exc))
    d = fleet.dir
    print(f"fleet keys in {d} (0700; keys.json holds every seed: keep it offline and backed up)")
    print(f"  server config  include {d / 'resolver.conf'} in every nats-server's config (`include` or paste), "
          f"with JetStream on; the chart: -f values-fleet.yaml -f {d / 'helm-values.yaml'}")
    print(f"  accounts       once the servers run: aep-bridge fleet push --dir {d} --nats URL[,URL...]")
    print(f"  role creds     {d / 'creds'}/aep-<role>.creds: AEP_BRIDGE_NATS_CREDS of each service")
    print("  next           aep-bridge fleet issue --instance NAME --out NAME.env")
    return 0


def _urls(args: argparse.Namespace, fleet) -> str:
    return args.nats if args.nats is not None else fleet.keys.get("urls") or ""


def cmd_issue(args: argparse.Namespace) -> int:
    from bridge.nats.fleet import Fleet, FleetError, locked, parse_duration, write_private

    try:
        with locked(args.dir):
            fleet = Fleet.load(args.dir)
            text, rec = fleet.issue(args.instance, parse_duration(args.expires), control=args.control,
                                    urls=args.nats)
    except FleetError as exc:
        return _fail(str(exc))
    if args.out:
        write_private(Path(args.out), text)
        until = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(rec.expires)) if rec.expires else "never"
        print(f"issued {args.instance} (user {rec.user[:12]}…, expires {until}) -> {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def _push(fleet, urls: str, accounts: tuple[str, ...]) -> int:
    from bridge.nats.fleet import FleetError, push

    try:
        took = asyncio.run(push(fleet, urls, accounts))
    except FleetError as exc:
        return _fail(f"push: {exc}")
    except Exception as exc:  # cannot connect: nats-py's errors
        return _fail(f"push: cannot reach {urls}: {type(exc).__name__}: {exc}")
    for account, servers in took.items():
        print(f"pushed account {account} to {len(servers)} server(s): {', '.join(servers)}")
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    from bridge.nats.fleet import Fleet, FleetError, locked

    try:
        with locked(args.dir):
            fleet = Fleet.load(args.dir)
            done = fleet.revoke(args.instance)
    except FleetError as exc:
        return _fail(str(exc))
    print(f"revoked {len(done)} credential(s) of {args.instance}")
    if args.no_push:
        return 0
    return _push(fleet, _urls(args, fleet), ("FLEET",))


def cmd_push(args: argparse.Namespace) -> int:
    from bridge.nats.fleet import Fleet, FleetError

    try:
        fleet = Fleet.load(args.dir)
    except FleetError as exc:
        return _fail(str(exc))
    return _push(fleet, _urls(args, fleet), ("AEP", "FLEET"))


def cmd_list(args: argparse.Namespace) -> int:
    from bridge.nats.fleet import Fleet, FleetError

    try:
        rows = Fleet.load(args.dir).listing()
    except FleetError as exc:
        return _fail(str(exc))
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0

    def when(t: int) -> str:
        return time.strftime("%Y-%m-%d %H:%M", time.gmtime(t)) if t else "-"

    print(f"{'instance':<24} {'state':<8} {'issued':<16} {'expires':<16} {'revoked':<16} user")
    for r in rows:
        print(f"{r['instance'][:24]:<24} {r['state']:<8} {when(r['issued']):<16} {when(r['expires']):<16} "
              f"{when(r['revoked']):<16} {r['user'][:16]}…")
    counts = {s: sum(r["state"] == s for r in rows) for s in ("issued", "revoked", "expired")}
    print(", ".join(f"{n} {s}" for s, n in counts.items()))
    return 0


def cmd_rotate(args: argparse.Namespace) -> int:
    from bridge.nats.fleet import Fleet, FleetError, locked

    try:
        with locked(args.dir):
            fleet = Fleet.load(args.dir)
            if args.retire:
                done = fleet.retire()
            else:
                new = fleet.rotate()
        if args.retire:
            print(f"retired the old signing keys: {len(done)} credential(s) signed by them no longer work")
        else:
            print(f"new signing keys {', '.join(k[:12] + '…' for k in new)}: issues sign with them; credentials "
                  "signed by the old ones work until `aep-bridge fleet rotate --retire`")
    except FleetError as exc:
        return _fail(str(exc))
    if args.no_push:
        return 0
    return _push(fleet, _urls(args, fleet), ("FLEET",))


def cmd_watch(args: argparse.Namespace) -> int:
    from bridge.nats.fleet import Fleet, FleetError, watch_refusals
    from bridge.runtime.labels import BoundedLabel

    try:
        fleet = Fleet.load(args.dir)
    except FleetError as exc:
        return _fail(str(exc))
    counter = None
    instances = BoundedLabel(cap=1000)
    if args.metrics_port is not None:
        from prometheus_client import Counter, start_http_server

        counter = Counter("aep_bridge_fleet_refused_connections", "connections of fleet instances the servers "
                          "refused (the system account's auth-error advisories)", ["instance", "reason"])
        start_http_server(args.metrics_port, addr="127.0.0.1")
    totals: dict[tuple[str, str], int] = {}

    def on_refusal(instance: str, reason: str, server: str) -> None:
        totals[(instance, reason)] = totals.get((instance, reason), 0) + 1
        if counter is not None:
            counter.labels(instances(instance), reason).inc()
        print(f"{time.strftime('%H:%M:%S')} refused {instance} ({reason}) at {server}", flush=True)

    async def main() -> None:
        stop = asyncio.Event()
        if args.seconds:
            asyncio.get_running_loop().call_later(args.seconds, stop.set)
        await watch_refusals(fleet, _urls(args, fleet), on_refusal, stop)

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
    except Exception as exc:
        return _fail(f"watch: {type(exc).__name__}: {exc}")
    for (instance, reason), n in sorted(totals.items()):
        print(f"{instance:<24} {reason:<8} {n}")
    return 0


def cmd_roles(args: argparse.Namespace) -> int:
    from bridge.nats.fleet import Fleet, FleetError, locked

    try:
        with locked(args.dir):
            fleet = Fleet.load(args.dir)
            done = fleet.reissue_roles(args.role)
    except FleetError as exc:
        return _fail(str(exc))
    print(f"new creds for {', '.join(done)} in {fleet.dir / 'creds'}: replace each service's file (the chart's "
          "Secret), the old ones are revoked once pushed")
    if args.no_push:
        return 0
    return _push(fleet, _urls(args, fleet), ("AEP",))
