#!/usr/bin/env python3
"""Mapper throughput against the nats-py relay ceiling, in one run, on one server.

    .venv/bin/python benchmarks/bench_mapper.py [--n 50000]

1. Starts an embedded nats-server with JetStream and bootstraps the bridge's streams.
2. Loads N realistic raw messages (copies of the real Hermes sessions shipped in
   bridge/data, wrapped exactly as the shim wraps them) into HERMES_RAW.
3. Ceiling: a trivial nats-py relay (pull fetch 256, publish the same bytes to another
   stream with publish_async, ack after the publish acks) over all N messages.
4. The mapper (`bridge.services.mapper.Mapper`, one replica, in-process) over the same N.
Prints messages/s for both, the events/s the mapper emits, and the ratio (target >= 0.8, issue
24); then each side's client CPU per message (process time) and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bridge.config import Settings  # noqa: E402
from bridge.core.ceiling import CapturePolicy  # noqa: E402
from bridge.core.identity import event_id  # noqa: E402
from bridge.stack.server import EmbeddedNats  # noqa: E402
from bridge.sim.sessions import realistic_envelopes  # noqa: E402

BATCH = 256
# Client-side CPU seconds of each side (this process; nats-server is its own): less sensitive
# than throughput to other work on a shared machine, which takes wall time, not CPU time.
CPU: dict[str, float] = {}


def raw_messages(n: int) -> list[tuple[str, bytes, str]]:
    out = []
    base = time.time_ns()
    for i, env in enumerate(realistic_envelopes(n, seed=1)):
        ts = base + i * 1000
        rid = event_id("bench", i, ts // 1_000_000)
        hook = env.get("hook_event_name", "x")
        body = json.dumps({"v": 1, "id": rid, "instance": "bench", "ts": ts, "hook": hook, "envelope": env}, separators=(",", ":")).encode()
        out.append((f"hermes.raw.bench.{hook}", body, rid))
    return out


async def load(js, msgs) -> None:  # type: ignore[no-untyped-def]
    futures = []
    for subject, body, rid in msgs:
        futures.append(await js.publish_async(subject, body, headers={"Nats-Msg-Id": rid}))
        if len(futures) >= 2048:
            await asyncio.gather(*futures)
            futures = []
    await asyncio.gather(*futures)


async def relay(js, n: int, stream: str = "HERMES_RAW", subjects: str = "hermes.raw.>") -> float:  # type: ignore[no-untyped-def]
    """The ceiling: fetch a batch, publish the same bytes to another stream, ack after the acks."""
    from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

    import nats.errors

    await js.add_stream(StreamConfig(name="RELAY_OUT", subjects=["relay.>"], duplicate_window=120.0))
    sub = await js.pull_subscribe(subjects, durable="relay", stream=stream,
                                  config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, max_ack_pending=8192))
    done = 0
    started, cpu0 = time.perf_counter(), time.process_time()
    while done < n:
        try:
            msgs = await sub.fetch(BATCH, timeout=1.0)
        except nats.errors.TimeoutError:
            continue
        await relay_batch(js, msgs, lambda subject: "relay." + subject)
        done += len(msgs)
    CPU["relay"] = time.process_time() - cpu0
    return time.perf_counter() - started


async def relay_batch(js, msgs, to) -> None:  # type: ignore[no-untyped-def]
    """The bare relay's step (also benchmarks/bare_relay.py's): publish each message's bytes
    to ``to(subject)`` with publish_async, then ack them all once every publish is acked."""
    futures = [await js.publish_async(to(m.subject), m.data, headers={"Nats-Msg-Id": m.headers.get("Nats-Msg-Id", "")})
               for m in msgs]
    await asyncio.gather(*futures)
    for m in msgs:
        await m.ack()


async def mapper_run(settings: Settings, n: int) -> tuple[float, int]:
    from bridge.nats.pull import Puller
    from bridge.services.mapper import Mapper

    import nats.errors

    mapper = Mapper(settings, CapturePolicy(), batch=BATCH)
    await mapper.connect()
    sub = Puller(await mapper.bind(), burst=True)  # the fetch of Mapper.consume
    done = 0
    started, cpu0 = time.perf_counter(), time.process_time()
    while done < n:
        try:
            msgs = await sub.fetch(BATCH, timeout=1.0)
        except nats.errors.TimeoutError:
            continue
        await mapper.process_batch(msgs)
        done += len(msgs)
    elapsed = time.perf_counter() - started
    CPU["mapper"] = time.process_time() - cpu0
    events = int(sum(s.value for m in mapper.metrics.events_out.collect() for s in m.samples if s.name.endswith("_total")))
    waits = mapper.registry.get_sample_value("aep_bridge_mapper_lane_waits_total") or 0
    timeouts = mapper.registry.get_sample_value("aep_bridge_mapper_lane_wait_timeouts_total") or 0
    print(f"lane waits (session-less events whose session was not known at once): {waits:.0f}, timed out: {timeouts:.0f}")
    await mapper.close()
    return elapsed, events


def service_loop(name: str):  # type: ignore[no-untyped-def]
    """The event loop the service side of a benchmark runs on: ``service`` = what `aep-bridge
    mapper` / `pairing` run on (uvloop when installed), ``asyncio`` = asyncio's. The bare relay
    always runs on asyncio's: the baseline is nats-py as it comes."""
    from bridge.runtime.lifecycle import event_loop_factory

    return event_loop_factory() if name == "service" else None


async def prepare(url: str, settings: Settings, n: int) -> float:
    """Bootstrap, load N raw messages, run the relay over them: its seconds."""
    import nats

    from bridge.nats.bootstrap import bootstrap

    nc = await nats.connect(url)
    js = nc.jetstream(publish_async_max_pending=4096)
    await bootstrap(js, settings)
    msgs = raw_messages(n)
    size = sum(len(b) for _, b, _ in msgs) / len(msgs)
    t0 = time.perf_counter()
    await load(js, msgs)
    print(f"loaded {n} raw messages (mean {size:.0f} B) into HERMES_RAW in {time.perf_counter() - t0:.1f}s")
    relay_s = await relay(js, n)
    await nc.close()
    return relay_s


def main(n: int, loop: str) -> None:
    with tempfile.TemporaryDirectory() as tmp, EmbeddedNats(tmp) as server:
        settings = Settings.from_env({"AEP_BRIDGE_NATS_URL": server.url, "AEP_BRIDGE_CONFIG": os.devnull})
        relay_s = asyncio.run(prepare(server.url, settings, n))
        factory = service_loop(loop)
        with asyncio.Runner(loop_factory=factory) as runner:
            mapper_s, events = runner.run(mapper_run(settings, n))
    relay_rate, mapper_rate = n / relay_s, n / mapper_s
    print(f"relay ceiling (fetch {BATCH}, publish_async, ack; asyncio): {relay_rate:,.0f} msg/s ({relay_s:.2f}s)")
    print(f"mapper, 1 replica ({'uvloop' if factory else 'asyncio'}):            {mapper_rate:,.0f} msg/s ({mapper_s:.2f}s), {events / mapper_s:,.0f} events/s out ({events} events)")
    print(f"ratio mapper/ceiling: {mapper_rate / relay_rate:.2f} (target >= 0.8)")
    relay_us, mapper_us = 1e6 * CPU["relay"] / n, 1e6 * CPU["mapper"] / n
    print(f"client CPU per raw message: relay {relay_us:.0f} us, mapper {mapper_us:.0f} us; "
          f"ratio relay/mapper {relay_us / mapper_us:.2f} (the throughput ratio's CPU-only twin)")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=50_000)
    p.add_argument("--loop", choices=["service", "asyncio"], default="service",
                   help="the mapper's event loop: the service's (uvloop when installed, default) or asyncio's")
    a = p.parse_args()
    main(a.n, a.loop)
