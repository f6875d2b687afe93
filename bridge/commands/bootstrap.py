"""`aep-bridge bootstrap`: create or update every stream, KV bucket and object store, idempotently."""

from __future__ import annotations

import argparse
import sys


API_TIMEOUT_S = 30.0  # each JetStream API request of bootstrap (stream and bucket create/update)
# A three-node cluster just started calls a peer offline until it has heard from it (seconds on
# a loaded machine; CI saw it right after every node answered /healthz), a rolling restart for
# as long as a pod restarts.
OFFLINE_WAIT_S = 60.0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bootstrap",
        help="create or update the JetStream streams, KV buckets and object store (idempotent)",
        description=(
            "Create or update HERMES_RAW, BRIDGE_MAPPED, BRIDGE_DLQ, AEP_EVENTS, the KV buckets "
            "aep_lanes, aep_pairing, aep_leases and the object store aep_checkpoints with the limits of "
            "bridge/nats/streams.py. Running it "
            "again changes nothing. Connection settings: AEP_BRIDGE_NATS_URL and friends."
        ),
    )
    p.add_argument(
        "--replicas",
        type=_replicas,
        default=None,
        help="replicas of every stream, KV bucket and object store, 1-5 (default: AEP_BRIDGE_STREAM_REPLICAS "
             "or 1; 3 on a three-node cluster). Existing ones with another count are scaled in place; more "
             "replicas than servers is an error (exit 2)",
    )
    p.add_argument("--timeout", type=float, default=5.0, help="connect timeout in seconds (default 5)")
    p.add_argument(
        "--wait", type=float, default=OFFLINE_WAIT_S, metavar="SECONDS",
        help=f"while the cluster calls a server offline (one restarting, or a cluster still starting), keep "
             f"trying this long before exiting 2; while JetStream does not answer yet (no meta leader), this "
             f"long before exiting 1 (default {OFFLINE_WAIT_S:g}; 0: fail at once)",
    )
    p.set_defaults(func=cmd_bootstrap)


def _replicas(raw: str) -> int:
    """--replicas, parsed and checked as AEP_BRIDGE_STREAM_REPLICAS is (bridge/config.py FIELDS: 1-5)."""
    from bridge.config import BY_NAME, SettingError

    try:
        return int(BY_NAME["AEP_BRIDGE_STREAM_REPLICAS"].parse(raw))
    except SettingError:
        raise argparse.ArgumentTypeError(f"must be an integer in 1-5 (JetStream's limit), got {raw!r}") from None


def cmd_bootstrap(args: argparse.Namespace) -> int:
    import asyncio

    from bridge.config import Settings
    from bridge.nats.bootstrap import BootstrapError, ReplicasError, bootstrap
    from bridge.nats import connection
    from bridge.nats.connection import JETSTREAM_NOT_ENABLED, UNANSWERED, NatsConnectError

    settings = Settings.from_env()

    def report(name: str, outcome: str, diff: dict) -> None:
        detail = ", ".join(f"scaled from {a} to {b} replicas" if k == "num_replicas" else f"{k} {a!r} -> {b!r}"
                           for k, (a, b) in diff.items())
        print(f"{name:<16} {outcome}" + (f" ({detail})" if detail else ""))

    def waiting(exc: Exception) -> None:
        what = exc if isinstance(exc, ReplicasError) else f"JetStream did not answer ({unanswered(exc)})"
        print(f"aep-bridge bootstrap: {what}; waiting up to {args.wait:g} s for it", file=sys.stderr, flush=True)

    def not_answered(exc: BaseException, last: object) -> int:
        if getattr(exc, "err_code", None) == JETSTREAM_NOT_ENABLED:
            print(f"aep-bridge bootstrap: JetStream is not enabled for this account or server ({unanswered(exc)})",
                  file=sys.stderr)
        elif last is not None and "permissions violation" in str(last).lower():
            print(f"aep-bridge bootstrap: the server refused a JetStream request: {last}", file=sys.stderr)
        else:
            print(f"aep-bridge bootstrap: JetStream did not answer ({unanswered(exc)}) within --wait {args.wait:g} s: "
                  "has the cluster a meta leader (a majority of its servers up)?", file=sys.stderr)
        return 1

    async def run() -> int:
        nc = await connection.quick_connect(settings, name="aep-bridge-bootstrap", timeout=args.timeout, role="bootstrap")
        try:
            # Creating or scaling an R3 stream is a raft group's round trips on every node: on a
            # loaded cluster it can take longer than nats-py's 5 s API default.
            await bootstrap(nc.jetstream(timeout=API_TIMEOUT_S), settings, replicas=args.replicas, report=report,
                            offline_wait_s=max(0.0, args.wait), waiting=waiting, nc=nc)
        except UNANSWERED as exc:
            return not_answered(exc, getattr(nc, "last_error", None))
        finally:
            await nc.close()
        return 0

    try:
        return asyncio.run(run())
    except ReplicasError as exc:
        print(f"aep-bridge bootstrap: {exc}", file=sys.stderr)
        return 2
    except (NatsConnectError, BootstrapError) as exc:
        print(f"aep-bridge bootstrap: {exc}", file=sys.stderr)
        return 1


def unanswered(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
