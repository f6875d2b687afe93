#!/usr/bin/env python3
"""SSE fan-out of `aep-bridge relay` to S concurrent subscribers, against a bare nats-py
ordered consumer per subscriber, in the same run (issue 16's benchmark; not a timed test).

    .venv/bin/python benchmarks/bench_relay.py [--subscribers 100] [--n 3000] [--rate 1000] [--seconds 5]

1. An embedded nats-server, bootstrapped; the relay as its own process (`aep-bridge relay`).
2. Sustained rate: S subscribers connect (SSE to the relay / one ordered consumer each on
   AEP_EVENTS), then N events (~600 B, realistic envelope) are published as fast as the
   publisher goes; the rate is N / (time until the LAST subscriber has the LAST event). That
   is the highest rate at which every subscriber keeps up, end to end. Ratio = relay / bare.
3. Latency at --rate events/s for --seconds: each event carries its publish time; every
   subscriber notes the delay of every event; p50/p99 over all deliveries, for both; the
   p99 the relay adds is the difference.
Clients (aiohttp for SSE, nats-py for the baseline) run in this process for both paths, so
their cost is alike; the machine's cores are shared by the publisher, the relay and nats-server.
Targets (issue 16): ratio >= 0.5, added p99 <= 50 ms; stretch: ratio > 1.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp  # noqa: E402
import nats  # noqa: E402
from nats.js.api import ConsumerConfig, DeliverPolicy  # noqa: E402

from bridge.config import Settings  # noqa: E402
from bridge.nats.bootstrap import bootstrap  # noqa: E402
from bridge.stack.server import EmbeddedNats  # noqa: E402
from tests.natsfixture import free_port  # noqa: E402

SESSION = "bench-relay-session"
SUBJECT = f"aep.hermes.{SESSION}.tool.completed"
PAD = "x" * 380


def body(i: int) -> bytes:
    return (
        '{"aep":"0.1","id":"%026d","type":"tool.completed","time":"2026-12-01T10:00:00.000Z",'
        '"source":"aep://bench/agent/hermes","agent":"hermes","session":"%s","run":"%s:t:1","seq":%d,'
        '"epoch":0,"capture":"metadata","data":{"t":%d,"tool":{"name":"terminal","call_id":"c%d"},"pad":"%s"}}'
        % (i, SESSION, SESSION, i, time.time_ns(), i, PAD)
    ).encode()


def sent_ns(data: bytes) -> int:
    j = data.find(b'"t":') + 4
    return int(data[j:data.find(b",", j)])


class Sink:
    """What one subscriber saw: count, time of the last event, delays."""

    def __init__(self, want: int) -> None:
        self.want = want
        self.n = 0
        self.last = 0.0
        self.delays: list[int] = []
        self.done = asyncio.Event()

    def got(self, data: bytes, latency: bool) -> None:
        self.n += 1
        if latency:
            self.delays.append(time.time_ns() - sent_ns(data))
        if self.n >= self.want:
            self.last = time.perf_counter()
            self.done.set()


async def sse_subscriber(session: aiohttp.ClientSession, url: str, sink: Sink, latency: bool, ready: asyncio.Event) -> None:
    async with session.get(url + "/stream", params={"filter": '{"session":"%s"}' % SESSION},
                           timeout=aiohttp.ClientTimeout(total=None)) as resp:
        buf = b""
        async for chunk in resp.content.iter_any():
            if not ready.is_set():
                ready.set()
            buf += chunk
            while True:
                k = buf.find(b"\n\n")
                if k < 0:
                    break
                frame, buf = buf[:k], buf[k + 2:]
                d = frame.find(b"data: ")
                if d >= 0:
                    sink.got(frame[d + 6:], latency)
            if sink.done.is_set():
                return


async def nats_subscriber(url: str, sink: Sink, latency: bool):  # type: ignore[no-untyped-def]
    """One subscriber = its own connection and its own ordered consumer (what each client
    of AEP_EVENTS would run without the relay)."""
    nc = await nats.connect(url)

    async def cb(msg) -> None:  # type: ignore[no-untyped-def]
        sink.got(msg.data, latency)

    await nc.jetstream().subscribe(SUBJECT, stream="AEP_EVENTS", ordered_consumer=True, cb=cb,
                                   config=ConsumerConfig(deliver_policy=DeliverPolicy.NEW),
                                   pending_msgs_limit=-1, pending_bytes_limit=-1)
    return nc


async def publish(js, n: int, rate: float | None) -> None:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    futs = []
    for i in range(n):
        if rate:
            delay = t0 + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
        futs.append(await js.publish_async(SUBJECT, body(i)))
        if len(futs) >= 512:
            await asyncio.gather(*futs)
            futs.clear()
    await asyncio.gather(*futs)


async def run_path(kind: str, url: str, relay_url: str, subs: int, n: int, rate: float | None) -> tuple[float, list[int]]:
    pub = await nats.connect(url)
    pjs = pub.jetstream(publish_async_max_pending=4096)
    sinks = [Sink(n) for _ in range(subs)]
    latency = rate is not None
    handles = []
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    try:
        if kind == "relay":
            readies = [asyncio.Event() for _ in sinks]
            handles = [asyncio.create_task(sse_subscriber(session, relay_url, s, latency, r)) for s, r in zip(sinks, readies)]
            await asyncio.wait_for(asyncio.gather(*(r.wait() for r in readies)), 60)
        else:
            handles = [await nats_subscriber(url, s, latency) for s in sinks]
        await asyncio.sleep(0.5)
        t0 = time.perf_counter()
        await publish(pjs, n, rate)
        await asyncio.wait_for(asyncio.gather(*(s.done.wait() for s in sinks)), 300)
        elapsed = max(s.last for s in sinks) - t0
        delays = [d for s in sinks for d in s.delays]
        return n / elapsed, delays
    finally:
        for h in handles:
            if isinstance(h, asyncio.Task):
                h.cancel()
            else:
                await h.close()
        await session.close()
        await pub.close()


def pct(values: list[int], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] / 1e6 if values else float("nan")


async def main(a: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp, EmbeddedNats(tmp) as server:
        settings = Settings.from_env({"AEP_BRIDGE_NATS_URL": server.url, "AEP_BRIDGE_CONFIG": os.devnull})
        nc = await nats.connect(server.url)
        await bootstrap(nc.jetstream(), settings)
        await nc.close()
        port = free_port()
        env = {**os.environ, "AEP_BRIDGE_NATS_URL": server.url, "AEP_BRIDGE_RELAY_LISTEN": f"127.0.0.1:{port}",
               "AEP_BRIDGE_LOG_LEVEL": "warning", "AEP_BRIDGE_RELAY_QUEUE": "100000", "AEP_BRIDGE_CONFIG": os.devnull}
        relay = subprocess.Popen([str(Path(sys.executable).with_name("aep-bridge")), "relay"], env=env,
                                 stdout=subprocess.DEVNULL, stderr=open(Path(tmp) / "relay.log", "wb"))
        relay_url = f"http://127.0.0.1:{port}"
        try:
            for _ in range(100):
                try:
                    urllib.request.urlopen(relay_url + "/healthz", timeout=1)
                    break
                except OSError:
                    time.sleep(0.1)
            print(f"{a.subscribers} subscribers, events of {len(body(0))} B, cpu={os.cpu_count()}")
            rates = {}
            for kind in ("nats", "relay"):
                rates[kind], _ = await run_path(kind, server.url, relay_url, a.subscribers, a.n, None)
                print(f"  sustained, {kind:5s}: {rates[kind]:8,.0f} events/s to every subscriber ({a.n} events)")
            print(f"  ratio relay/bare nats-py: {rates['relay'] / rates['nats']:.2f} (target >= 0.5, stretch > 1)")
            lat = {}
            for kind in ("nats", "relay"):
                _, delays = await run_path(kind, server.url, relay_url, a.subscribers, int(a.rate * a.seconds), a.rate)
                lat[kind] = (pct(delays, 0.5), pct(delays, 0.99))
                print(f"  at {a.rate:.0f} events/s, {kind:5s}: p50 {lat[kind][0]:7.1f} ms  p99 {lat[kind][1]:7.1f} ms ({len(delays):,} deliveries)")
            print(f"  p99 the relay adds at {a.rate:.0f} events/s: {lat['relay'][1] - lat['nats'][1]:.1f} ms (target <= 50)")
        finally:
            relay.terminate()
            relay.wait(10)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--subscribers", type=int, default=100)
    p.add_argument("--n", type=int, default=3000)
    p.add_argument("--rate", type=float, default=1000.0)
    p.add_argument("--seconds", type=float, default=5.0)
    asyncio.run(main(p.parse_args()))
