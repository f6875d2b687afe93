"""`aep-bridge simulate` and `aep-bridge verify`: a fleet's traffic, and the proof nothing was lost."""

from __future__ import annotations

import argparse
import json
import sys

from bridge.commands.stack import settings_for


def register(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser(
        "simulate",
        help="play realistic Hermes sessions for N instances at a given event rate through the shim's code path",
        description=(
            "Simulate a fleet of Hermes instances (sessions, tool calls with every status, approvals with every "
            "choice, clarify forms, subagents with late stops, resets, resumed sessions, execute_code inner calls) "
            "publishing through the shim's own stamping, wire protocol and spool: in-process for volume, plus a "
            "fraction of the instances through real shim processes. Every raw message sent is recorded in a JSON "
            "Lines manifest for `aep-bridge verify`. Canary secrets are planted in tool arguments and results, "
            "user messages, approval commands and clarify answers."
        ),
    )
    s.add_argument("--nats", default=None, metavar="URL", help="NATS URL (default: the running `up`, else AEP_BRIDGE_NATS_URL)")
    s.add_argument("--instances", type=int, default=100, help="simulated Hermes instances (default 100)")
    s.add_argument("--rate", type=float, default=200.0, help="combined events per second (default 200)")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--duration", type=float, default=None, help="seconds of traffic at --rate (default 30); then the sessions in progress are "
                        "finished at 10x the rate (at least 2,000/s), a second or two more")
    g.add_argument("--count", type=int, default=None, help="stop after this many events instead")
    s.add_argument("--shim-fraction", type=float, default=0.01, help="fraction of instances served by real shim processes (default 0.01)")
    s.add_argument("--shim-workers", type=int, default=4, help="parallel real shim processes (default 4)")
    s.add_argument("--canary-fraction", type=float, default=0.02, help="fraction of eligible fields that get a canary secret (default 0.02)")
    s.add_argument("--hostile-fraction", type=float, default=0.0, help="fraction of events replaced by hostile input (default 0)")
    s.add_argument("--hostile-mix", type=float, default=0.0, metavar="FRACTION",
                   help="fraction of events replaced by issue 13's hostile mix, each kind in turn: through the shim a "
                        "5,000-char session id, a 6 KB hook name, NaN, secrets, ...; raw messages straight to HERMES_RAW "
                        "(ts -1, ts 2**80, an id that is not a ULID, v 2, another instance, 100k-deep JSON). The manifest "
                        "records the reason each is owed; `verify` checks it in the DLQ (default 0)")
    s.add_argument("--manifest", default="aep-sim-manifest.jsonl", help="manifest file (default aep-sim-manifest.jsonl)")
    s.add_argument("--spool-dir", default=None, help="spool directory of the simulated shims (default: a new temporary directory)")
    s.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    s.add_argument("--deadline-ms", type=int, default=250, help="shim publish + ack deadline (default 250)")
    s.add_argument("--instance-prefix", default="sim", help="instance names are PREFIX-0000.. (default sim)")
    s.add_argument("--no-wind-down", action="store_true", help="stop mid-session instead of finishing every session")
    s.add_argument("--no-drain", action="store_true", help="leave spooled events in the spool at the end")
    s.add_argument("--quiet", action="store_true", help="no progress lines")
    s.set_defaults(func=cmd_simulate)

    v = sub.add_parser(
        "verify",
        help="check AEP_EVENTS, BRIDGE_MAPPED and BRIDGE_DLQ against a simulation manifest",
        description=(
            "Read HERMES_RAW, BRIDGE_MAPPED, BRIDGE_DLQ and AEP_EVENTS and check against the manifest of "
            "`aep-bridge simulate`: no loss (every event sent is on AEP_EVENTS, or in the DLQ with a reason, or "
            "counted by the shim as an edge loss), no duplicates by (source, id), per-session (epoch, seq) order "
            "of mapped events, the pairing invariants, schema validity, no planted canary anywhere but HERMES_RAW, "
            "and every input of the hostile mix in the DLQ with the reason it is owed (or mapped, when it must "
            "map). Prints a report; exits 1 on any violation."
        ),
    )
    v.add_argument("--manifest", required=True, help="the manifest `aep-bridge simulate` wrote")
    v.add_argument("--nats", default=None, metavar="URL", help="NATS URL (default: the running `up`, else AEP_BRIDGE_NATS_URL)")
    v.add_argument("--wait", type=float, default=30.0, help="keep reading for up to this many seconds while events are missing (default 30)")
    v.add_argument("--strict-order", action="store_true", help="count backfills (a mapped event behind a later one of its session) as violations")
    v.add_argument("--schema-sample", type=int, default=None, metavar="N",
                   help="validate the first N events of each type and 1 in 50 after that (default: every event)")
    v.add_argument("--json", action="store_true", help="print the report as JSON")
    v.set_defaults(func=cmd_verify)


def reachable(settings, command: str) -> bool:  # type: ignore[no-untyped-def]
    """Connect once as the command will (URL, credentials, TLS), so a wrong URL, a dead server or a
    refused credential is one line within seconds, not a run that spools everything; False then."""
    import asyncio

    from bridge.nats.connection import NatsConnectError, connect_client

    async def check() -> None:
        nc = await connect_client(settings, name=f"aep-bridge-{command}")
        await nc.close()

    try:
        asyncio.run(check())
    except NatsConnectError as exc:
        print(f"aep-bridge {command}: {exc}", file=sys.stderr)
        return False
    return True


def cmd_simulate(args: argparse.Namespace) -> int:
    from bridge.nats.connection import shim_env
    from bridge.sim.fleet import Fleet, FleetConfig

    settings = settings_for(args)  # --nats, else the running `up` (its URL and credential), else the environment
    if not reachable(settings, "simulate"):
        return 1
    duration = args.duration if args.duration is not None else (None if args.count else 30.0)
    config = FleetConfig(
        nats_url=settings.nats_url, nats_env=shim_env(settings), instances=args.instances, rate=args.rate, duration=duration, count=args.count,
        shim_fraction=args.shim_fraction, shim_workers=args.shim_workers, canary_fraction=args.canary_fraction,
        hostile_fraction=args.hostile_fraction, hostile_mix=args.hostile_mix, seed=args.seed, deadline_ms=args.deadline_ms,
        spool_dir=args.spool_dir, wind_down=not args.no_wind_down, instance_prefix=args.instance_prefix,
        manifest=args.manifest, wind_down_rate=max(10 * args.rate, 2000.0),
    )

    def progress(snap: dict) -> None:
        if not args.quiet:
            print(f"aep-bridge simulate: {snap['elapsed_s']:.0f}s sent {snap['sent']} ({snap['rate']}/s) "
                  f"outcomes {snap['outcomes']} spooled instances {snap['spooled_instances']} "
                  f"shim runs {snap['shim_runs']} (p50 {snap['shim_p50_ms']} ms, max {snap['shim_max_ms']} ms)",
                  file=sys.stderr, flush=True)

    fleet = Fleet(config, progress=progress)
    try:
        snap = fleet.run()
    except KeyboardInterrupt:
        fleet.stop()
        snap = fleet.snapshot()
    left = {} if args.no_drain else fleet.drain()
    fleet.close()
    report = {**snap, **honest(fleet.complete or args.no_wind_down, snap, left, drained=not args.no_drain), "spool_left": left,
              "manifest": str(fleet.manifest_path), "spool_dir": fleet.spool_dir}
    print(json.dumps(report, indent=2))
    if report.get("incomplete"):
        print(f"aep-bridge simulate: not complete: {report['incomplete']}", file=sys.stderr)
    return 0 if report["complete"] else 1


#: outcomes of an event that did not land (bridge/sim/fleet.py: the manifest's "o")
NOT_LANDED = ("rejected", "dropped", "lost", "unknown")


def honest(wound_down: bool, snap: dict, left: dict, drained: bool) -> dict:  # type: ignore[type-arg]
    """The report's verdict. ``complete``: every session wound down, nothing refused, dropped or
    lost, no shim failed, and every spooled event delivered by the final drain (with
    ``--no-drain``: nothing spooled); ``landed``: the events on HERMES_RAW (published, plus the
    spooled ones once the drain left nothing); ``incomplete``: why not."""
    outcomes = snap.get("outcomes", {})
    why = [f"{outcomes[o]} events {o}" for o in NOT_LANDED if outcomes.get(o)]
    if left:
        why.append(f"spools left undelivered: {'; '.join(f'{k}: {v}' for k, v in list(left.items())[:3])}")
    elif not drained and outcomes.get("spooled"):
        why.append(f"{outcomes['spooled']} events left in the spool (--no-drain)")
    if snap.get("shim_failures"):
        why.append(f"{snap['shim_failures']} shim runs failed")
    if not wound_down:
        why.append("not every session was wound down")
    landed = outcomes.get("published", 0) + (outcomes.get("spooled", 0) if drained and not left else 0)
    if landed <= 0:
        why.append("nothing landed" + (f" (sender errors: {snap['sender_errors']})" if snap.get("sender_errors") else ""))
    return {"complete": not why, "landed": landed, **({"incomplete": "; ".join(why)} if why else {})}


def cmd_verify(args: argparse.Namespace) -> int:
    from bridge.sim.verify import verify

    settings = settings_for(args)
    try:
        report = verify(settings, args.manifest, wait=args.wait, strict_order=args.strict_order,
                        schema_sample=args.schema_sample,
                        progress=None if args.json else (lambda m: print(f"aep-bridge verify: {m}", file=sys.stderr)))
    except Exception as exc:
        from bridge.nats.connection import NatsConnectError

        # a NATS that cannot be reached says what, where and what to do itself
        print(f"aep-bridge verify: {exc if isinstance(exc, NatsConnectError) else f'{type(exc).__name__}: {exc}'}",
              file=sys.stderr)
        return 2
    print(json.dumps(report.as_dict(), indent=2) if args.json else report.render())
    return 0 if report.ok else 1
