#!/usr/bin/env python3
"""Pairing throughput against the nats-py relay ceiling, and memory per idle open session.

    .venv/bin/python benchmarks/bench_pairing.py [--n 50000]

1. Embedded nats-server; bootstrap; N realistic raw messages into HERMES_RAW; the
   mapper (in-process, untimed) fills BRIDGE_MAPPED.
2. Ceiling: the same trivial nats-py relay as benchmarks/bench_mapper.py (pull fetch
   256, publish the same bytes to another stream with publish_async, ack), over
   BRIDGE_MAPPED.
3. The pairing service (`bridge.services.pairing.PairingService`, one replica owning
   all partitions, in-process) over the same BRIDGE_MAPPED, timed until its last
   event reached AEP_EVENTS; and this process's CPU time until then per mapped event (the
   figure to compare for CPU per event: the wall-clock ratio moves with the machine's load).
4. Memory: bytes per idle open session (tracemalloc, 10,000 sessions; also as RSS).
Targets: pairing >= 0.9 of the ceiling (issue 24; 0.6 before); <= 2 KB per idle open session.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import resource
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench_mapper import BATCH, CPU, load, raw_messages, relay, service_loop  # noqa: E402

from bridge.config import Settings  # noqa: E402
from bridge.core.ceiling import CapturePolicy  # noqa: E402
from bridge.stack.server import EmbeddedNats  # noqa: E402


async def fill_mapped(settings: Settings, n: int) -> int:
    from bridge.services.mapper import Mapper

    import nats.errors

    mapper = Mapper(settings, CapturePolicy(), batch=BATCH)
    await mapper.connect()
    sub = await mapper.bind()
    done = 0
    while done < n:
        try:
            msgs = await sub.fetch(BATCH, timeout=1.0)
        except nats.errors.TimeoutError:
            continue
        await mapper.process_batch(msgs)
        done += len(msgs)
    info = await mapper.js.stream_info("BRIDGE_MAPPED")
    await mapper.close()
    return int(info.state.messages)


async def pairing_run(settings: Settings, js) -> tuple[float, int, int]:  # type: ignore[no-untyped-def]
    from bridge.runtime import serve
    from bridge.services.pairing import PairingService

    service = PairingService(settings, replica="bench", tick_s=3600)
    started, cpu0 = time.perf_counter(), time.process_time()
    task = asyncio.create_task(serve(service, port=0))
    last_count, last_change, last_cpu = -1, time.perf_counter(), cpu0
    while True:
        await asyncio.sleep(0.05)
        count = (await js.stream_info("AEP_EVENTS")).state.messages
        if count != last_count:
            last_count, last_change, last_cpu = count, time.perf_counter(), time.process_time()
        elif count > 0 and time.perf_counter() - last_change > 2.0:
            break
    elapsed = last_change - started
    CPU["pairing"] = last_cpu - cpu0  # the process's CPU until the last event reached AEP_EVENTS
    service.stopper.trigger("bench done")
    await task
    consumed = int(sum(s.value for m in service.metrics.events_in.collect() for s in m.samples if s.name.endswith("_total")))
    return elapsed, last_count, consumed


def memory() -> None:
    from bridge.core.pairing import PairingState
    from pairing_footprint import idle_session_footprint, idle_session_inputs

    fp = idle_session_footprint(10_000)
    print(f"memory per idle open session (tracemalloc, {int(fp['sessions']):,} sessions): {fp['bytes_per_session']:.0f} B "
          f"(target <= 2048); snapshot {fp['snapshot_bytes_per_session']:.0f} B/session")
    inputs = list(idle_session_inputs(10_000))
    gc.collect()
    rss0 = rss_bytes()
    state = PairingState()
    for i, (event, hints) in enumerate(inputs, start=1):
        state.process(event, dict(hints), i)
    del inputs
    gc.collect()
    rss1 = rss_bytes()
    print(f"RSS growth holding 10,000 open sessions: {(rss1 - rss0) / 10_000:.0f} B/session "
          f"(an upper bound: allocator arenas; {state.metrics()['sessions']} sessions held)")


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize()


async def prepare(url: str, settings: Settings, n: int) -> tuple[int, float]:
    """Bootstrap, N raw messages mapped into BRIDGE_MAPPED, the relay over them: (events, its seconds)."""
    import nats

    from bridge.nats.bootstrap import bootstrap

    nc = await nats.connect(url)
    js = nc.jetstream(publish_async_max_pending=4096)
    await bootstrap(js, settings)
    await load(js, raw_messages(n))
    mapped = await fill_mapped(settings, n)
    print(f"BRIDGE_MAPPED holds {mapped} events from {n} raw messages")
    relay_s = await relay(js, mapped, stream="BRIDGE_MAPPED", subjects="bridge.mapped.>")
    await nc.close()
    return mapped, relay_s


async def timed_pairing(url: str, settings: Settings) -> tuple[float, int, int]:
    import nats

    nc = await nats.connect(url)
    try:
        return await pairing_run(settings, nc.jetstream())
    finally:
        await nc.close()


def main(n: int, loop: str) -> None:
    with tempfile.TemporaryDirectory() as tmp, EmbeddedNats(tmp) as server:
        settings = Settings.from_env({"AEP_BRIDGE_NATS_URL": server.url, "AEP_BRIDGE_CONFIG": os.devnull})
        mapped, relay_s = asyncio.run(prepare(server.url, settings, n))
        factory = service_loop(loop)
        with asyncio.Runner(loop_factory=factory) as runner:
            pairing_s, out, consumed = runner.run(timed_pairing(server.url, settings))
    relay_rate, pairing_rate = mapped / relay_s, consumed / pairing_s
    print(f"relay ceiling (fetch {BATCH}, publish_async, ack; asyncio): {relay_rate:,.0f} msg/s ({relay_s:.2f}s)")
    print(f"pairing, 1 replica, all partitions ({'uvloop' if factory else 'asyncio'}): {pairing_rate:,.0f} msg/s in ({pairing_s:.2f}s), {out / pairing_s:,.0f} events/s out ({out} events)")
    print(f"ratio pairing/ceiling: {pairing_rate / relay_rate:.2f} (target >= 0.9)")
    print(f"pairing CPU (this process, loop and client): {CPU['pairing'] * 1e6 / consumed:.1f} us per mapped event "
          f"({CPU['pairing']:.2f} s for {consumed}); relay {CPU['relay'] * 1e6 / mapped:.1f} us")
    memory()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=50_000)
    p.add_argument("--loop", choices=["service", "asyncio"], default="service",
                   help="pairing's event loop: the service's (uvloop when installed, default) or asyncio's")
    a = p.parse_args()
    main(a.n, a.loop)
