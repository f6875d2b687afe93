#!/usr/bin/env python3
"""One bare nats-py relay as a process: the baseline of benchmarks/cost.py.

    .venv/bin/python benchmarks/bare_relay.py --nats URL --stream HERMES_RAW --durable bare-1 \\
        --strip 2 --prefix bridge.mapped.0

A durable pull consumer on ``--stream`` (explicit acks); forever: fetch up to ``--batch``,
publish each message's bytes to ``<prefix>.<its subject without the first --strip tokens>``
with ``publish_async`` (its ``Nats-Msg-Id`` kept), ack them all once every publish is acked
(`bench_mapper.relay_batch`, the relay of bench_mapper.py and bench_pairing.py). Two of them,
HERMES_RAW -> BRIDGE_MAPPED -> AEP_EVENTS, are what a pipeline of two stages costs at least
with this client. Runs until SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(__file__))

from bench_mapper import BATCH, relay_batch  # noqa: E402


async def main(a: argparse.Namespace) -> None:
    import nats
    import nats.errors
    from nats.js.api import AckPolicy, ConsumerConfig

    nc = await nats.connect(a.nats)
    js = nc.jetstream(publish_async_max_pending=4096)
    sub = await js.pull_subscribe(a.filter or "", durable=a.durable, stream=a.stream,
                                  config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, max_ack_pending=8192))
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)

    def to(subject: str) -> str:
        return a.prefix + "." + subject.split(".", a.strip)[-1]

    while not stop.is_set():
        try:
            msgs = await sub.fetch(a.batch, timeout=1.0)
        except (nats.errors.TimeoutError, asyncio.TimeoutError):  # nats-py raises either when nothing came
            continue
        await relay_batch(js, msgs, to)
    await nc.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nats", required=True)
    p.add_argument("--stream", required=True)
    p.add_argument("--filter", default=None, help="the consumer's filter subject (default: the whole stream)")
    p.add_argument("--durable", required=True)
    p.add_argument("--strip", type=int, required=True, help="leading subject tokens replaced by --prefix")
    p.add_argument("--prefix", required=True)
    p.add_argument("--batch", type=int, default=BATCH)
    asyncio.run(main(p.parse_args()))
