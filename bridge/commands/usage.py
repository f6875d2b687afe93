"""`aep-bridge usage`: what the fleet's model calls cost, per model, instance, session or day."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys

CONNECT_TIMEOUT_S = 3.0


def register(sub: argparse._SubParsersAction) -> None:
    u = sub.add_parser(
        "usage",
        help="sum the model calls on AEP_EVENTS: calls, tokens, p50/p99 duration and cost per model, instance, "
             "session or day (reads like `tail`, acks nothing)",
        description="Read the x.hermes.api.call / x.hermes.api.error events stored on AEP_EVENTS up to now (an "
                    "ephemeral consumer: nothing durable, nothing acked) and print, per group: calls, errors, "
                    "input/output/cache-read/cache-write/reasoning tokens, p50/p99 call duration (ms) and cost per "
                    "currency (what the bridge computed from the operator's price table; blank without one).",
    )
    u.add_argument("--nats", default=None, metavar="URL", help="NATS URL (default: the running `up`, else AEP_BRIDGE_NATS_URL)")
    u.add_argument("--since", default="24h",
                   help="events the stream stored this far back (30m, 24h, 7d) or since an RFC 3339 time; "
                        "`all` for the whole stream (default 24h)")
    u.add_argument("--by", choices=("model", "instance", "session", "day"), default="model", help="group by (default model)")
    u.add_argument("--json", action="store_true", help="print one JSON object (groups, total) instead of the table")
    u.set_defaults(func=cmd_usage)


def cmd_usage(args: argparse.Namespace) -> int:
    from bridge.commands.stack import settings_for
    from bridge.core.usage import Usage, format_table
    from bridge.nats.connection import NatsConnectError, quick_connect
    from bridge.stack.tail import parse_since
    from bridge.stack.usage import UsageReadError, read_usage

    try:
        since = None if args.since.strip().lower() == "all" else parse_since(args.since)
    except ValueError as exc:
        print(f"aep-bridge usage: {exc}", file=sys.stderr)
        return 2
    settings = settings_for(args)
    usage = Usage(args.by)

    async def main() -> int:
        try:
            nc = await asyncio.wait_for(
                quick_connect(settings, name="aep-bridge-usage", role="consumer", timeout=CONNECT_TIMEOUT_S),
                CONNECT_TIMEOUT_S + 2)
        except NatsConnectError:
            raise
        except Exception as exc:  # a URL nats-py cannot parse, a connect that never answers
            shown = re.sub(r"//[^@/]*@", "//", settings.nats_url or "")  # never a password on the terminal
            raise NatsConnectError(f"cannot connect to NATS at {shown}: "
                                   f"{type(exc).__name__}: {exc or 'no answer in time'}") from None
        try:
            return await read_usage(nc, usage, since=since, progress=sys.stderr)
        finally:
            await nc.close()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # one line, never a traceback: a wrong URL, a dead server, a refused credential
        said = isinstance(exc, (NatsConnectError, UsageReadError))
        text = " ".join(str(exc).split()) or "no answer in time"
        print(f"aep-bridge usage: {text if said else f'{type(exc).__name__}: {text}'}", file=sys.stderr)
        return 1
    if args.json:
        text = json.dumps({"by": args.by, "since": since.isoformat() if since else None, "events": usage.events,
                           "groups": usage.rows(), "total": usage.total()})
    elif not usage.groups:
        text = f"no model calls on the stream{' since ' + args.since if since else ''}"
    else:
        text = format_table(usage)
    try:
        print(text, flush=True)
    except BrokenPipeError:  # `| head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
