#!/usr/bin/env python3
"""CPU per publish: nats-py's public `Client.publish` against `bridge.nats.wire.publish_many`
(one write per batch), on an embedded nats-server, alternated, on the services' event loop.

    .venv/bin/python benchmarks/wire_publish.py [--messages 200000] [--batch 64] [--rounds 3]

Each message: a 600-byte payload, a reply subject and a Nats-Msg-Id header, as the mapper's
and pairing's event publishes. Prints µs of process CPU per publish for each path and round,
and the ratio public / wire.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import nats  # noqa: E402

from bridge.nats import wire  # noqa: E402
from bridge.runtime.lifecycle import event_loop_factory  # noqa: E402
from bridge.stack.server import EmbeddedNats  # noqa: E402

PAYLOAD = b"x" * 600


async def main(a: argparse.Namespace) -> None:
    server = EmbeddedNats(tempfile.mkdtemp(prefix="aep-wire-")).start()
    nc = await nats.connect(server.url)
    subjects = [f"bridge.mapped.{i % 8}.inst{i % 100}.pre_tool_call" for i in range(a.batch)]
    batches = a.messages // a.batch

    async def public() -> None:
        n = 0
        for _ in range(batches):
            for s in subjects:
                n += 1
                await nc.publish(s, PAYLOAD, reply=f"_INBOX.bench.{n}", headers={"Nats-Msg-Id": f"01JABCDEFGHJKMNPQRSTVWXYZ0:{n}"})
            await asyncio.sleep(0)

    async def direct() -> None:
        n = 0
        for _ in range(batches):
            items = []
            for s in subjects:
                n += 1
                items.append((s, PAYLOAD, f"_INBOX.bench.{n}", {"Nats-Msg-Id": f"01JABCDEFGHJKMNPQRSTVWXYZ0:{n}"}))
            await wire.publish_many(nc, items)
            await asyncio.sleep(0)

    loop = "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else "asyncio"
    print(f"wire_publish: {batches * a.batch} messages per path and round, batches of {a.batch}, on {loop}")
    for r in range(a.rounds):
        out = {}
        for name, f in (("public", public), ("wire", direct)) if r % 2 == 0 else (("wire", direct), ("public", public)):
            t = time.process_time()
            await f()
            await nc.flush()
            out[name] = (time.process_time() - t) / (batches * a.batch) * 1e6
        print(f"  round {r + 1}: public {out['public']:.2f} µs/publish, wire {out['wire']:.2f} µs/publish, "
              f"ratio {out['public'] / out['wire']:.1f}")
    await nc.close()
    server.stop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=200_000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    factory = event_loop_factory()
    if factory is not None:
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(main(args))
    else:
        asyncio.run(main(args))
