#!/usr/bin/env python3
"""SSE fan-out of `aep-bridge relay` to S concurrent subscribers, against a bare nats-py
ordered consumer per subscriber, in the same run (issue 16's benchmark; not a timed test).

    .venv/bin/python benchmarks/bench_relay.py [--subscribers 100] [--procs 2] [--n 3000]
                                               [--rate 1000] [--seconds 5]

1. An embedded nats-server, bootstrapped; the relay as its own process (`aep-bridge relay`).
   The subscribers run in --procs worker processes (this script with --worker; in the latency
   measurement one of them runs alone in one more process), so that the
   measuring side is not one Python process taking 100 deliveries per event; the publisher
   runs in this process, which does nothing else during a measurement.
   * relay path: each subscriber is one HTTP/1.1 SSE stream (`GET /stream` with a session
     filter), read by a bare asyncio Protocol that takes the publish time stamps out of
     every complete frame with one regex call per read (no HTTP client library in the way).
   * bare path (the baseline): each subscriber is its own nats-py connection with its own
     ordered consumer on AEP_EVENTS (what every client of AEP_EVENTS would run without the
     relay).
2. Sustained rate: S subscribers connect, then N events (~725 B, realistic envelope) are
   published as fast as the publisher goes; the rate is N / (time from the first publish
   until the LAST subscriber has the LAST event): the highest rate at which every subscriber
   keeps up, end to end. Ratio = relay / bare.
3. Latency at --rate events/s for --seconds: every event carries its publish time
   (time.time_ns() when it is built, just before `publish_async`); every subscriber notes the
   delay of every event it receives. End to end = receipt minus publish time; p50/p99 over
   all deliveries. A path "keeps up" when its last delivery lands within 250 ms of the last
   publish (else the printed lag says by how much it fell behind).
   Reference: one more nats-py ordered consumer, in its own process, runs during both paths:
   the delay with which a single JetStream consumer - which is what the relay itself holds
   on AEP_EVENTS - gets each event under the same load.
   "p99 the relay adds" = relay end-to-end p99 minus the bare path's end-to-end p99 when the
   bare path keeps up at that rate; when it does not, minus the reference consumer's p99 in
   the relay run (the time a JetStream consumer receives the event; all the relay's own work
   - its consumer's process, decode, fan-out, HTTP writes, the SSE client's read - counts as
   added). The output says which was used.
4. CPU per process over each measurement (from /proc; 100 % = one core): publisher,
   subscriber workers, reference consumer, relay, nats-server; the whole machine's busy time
   and what of it was other work (machine minus these processes), and `uptime`'s load
   average before and after: the 2 cores may be shared with other work, and the relay's
   tail latency follows it.
Targets (issue 16): ratio >= 0.5, added p99 <= 50 ms at 1,000 events/s; stretch: ratio > 1.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SESSION = "bench-relay-session"
SUBJECT = f"aep.hermes.{SESSION}.tool.completed"
PAD = "x" * 380
STAMP = re.compile(rb'"t":(\d+)')
TICK = os.sysconf("SC_CLK_TCK")


def body(i: int) -> bytes:
    return (
        '{"aep":"0.1","id":"%026d","type":"tool.completed","time":"2026-12-01T10:00:00.000Z",'
        '"source":"aep://bench/agent/hermes","agent":"hermes","session":"%s","run":"%s:t:1","seq":%d,'
        '"epoch":0,"capture":"metadata","data":{"t":%d,"tool":{"name":"terminal","call_id":"c%d"},"pad":"%s"}}'
        % (i, SESSION, SESSION, i, time.time_ns(), i, PAD)
    ).encode()


# ------------------------------------------------------------------ worker side


class Sink:
    """What one subscriber saw: count, wall time (ns) of the last event, delays (ns)."""

    def __init__(self, want: int, delays: array.array | None) -> None:
        self.want = want
        self.n = 0
        self.reads = 0
        self.last = 0
        self.delays = delays
        self.done = asyncio.Event()

    def got(self, stamps: list[bytes], now: int) -> None:
        self.reads += 1
        self.n += len(stamps)
        if self.delays is not None:
            self.delays.extend(now - int(t) for t in stamps)
        if self.n >= self.want and not self.done.is_set():
            self.last = now
            self.done.set()


class SSEReader(asyncio.Protocol):
    """One SSE subscriber on a raw connection: only complete frames (up to the last blank
    line) are scanned; the relay writes whole frames, so chunked-encoding size lines fall
    between frames and never inside a time stamp."""

    def __init__(self, sink: Sink, request: bytes, ready: asyncio.Event) -> None:
        self.sink = sink
        self.request = request
        self.ready = ready
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.write(self.request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        now = time.time_ns()
        if not self.ready.is_set() and b": aep-bridge relay" in self.buf + data:
            self.ready.set()
        buf = self.buf + data if self.buf else data
        k = buf.rfind(b"\n\n")
        if k < 0:
            self.buf = buf
            return
        self.buf = buf[k + 2:]
        stamps = STAMP.findall(buf, 0, k)
        if stamps:
            self.sink.got(stamps, now)

    def connection_lost(self, exc: Exception | None) -> None:
        self.ready.set()


async def worker(a: argparse.Namespace) -> None:
    want = a.n
    sinks = [Sink(want, array.array("q") if a.latency else None) for _ in range(a.subscribers)]
    closers = []
    if a.worker == "relay":
        u = urllib.parse.urlsplit(a.url)
        query = urllib.parse.urlencode({"filter": json.dumps({"session": SESSION})})
        request = (f"GET /stream?{query} HTTP/1.1\r\nHost: {u.netloc}\r\nAccept: text/event-stream\r\n\r\n").encode()
        loop = asyncio.get_running_loop()
        readies = []
        for s in sinks:
            ready = asyncio.Event()
            readies.append(ready)
            tr, _ = await loop.create_connection(lambda s=s, r=ready: SSEReader(s, request, r), u.hostname, u.port)
            closers.append(tr.close)
        await asyncio.wait_for(asyncio.gather(*(r.wait() for r in readies)), 60)
    else:
        import nats
        from nats.js.api import ConsumerConfig, DeliverPolicy

        for s in sinks:
            nc = await nats.connect(a.url)

            async def cb(msg, s: Sink = s) -> None:  # type: ignore[no-untyped-def]
                d = msg.data
                j = d.find(b'"t":') + 4
                s.got([d[j:d.find(b",", j)]], time.time_ns())

            await nc.jetstream().subscribe(SUBJECT, stream="AEP_EVENTS", ordered_consumer=True, cb=cb,
                                           config=ConsumerConfig(deliver_policy=DeliverPolicy.NEW),
                                           pending_msgs_limit=-1, pending_bytes_limit=-1)
            closers.append(nc.close)
    print("READY", flush=True)
    t0 = os.times()
    try:
        await asyncio.wait_for(asyncio.gather(*(s.done.wait() for s in sinks)), a.timeout)
    except asyncio.TimeoutError:
        pass
    if a.latency:
        with open(a.out, "wb") as f:
            for s in sinks:
                s.delays.tofile(f)  # type: ignore[union-attr]
    t1 = os.times()
    print("DONE " + json.dumps({"last": max(s.last for s in sinks), "short": sum(1 for s in sinks if s.n < want),
                                "min_n": min(s.n for s in sinks), "reads": sum(s.reads for s in sinks),
                                "cpu": t1.user + t1.system - t0.user - t0.system}), flush=True)
    for c in closers:
        r = c()
        if asyncio.iscoroutine(r):
            await r


# ------------------------------------------------------------------ driver side


def cpu_ticks(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime
    except OSError:
        return 0


def machine_ticks() -> int:
    """CPU time (ticks, all cores) the machine spent busy: what is not idle or iowait."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return sum(v) - v[3] - v[4]


def load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


class Workers:
    """--procs subscriber processes of one kind, plus (optionally) the reference consumer."""

    def __init__(self, kind: str, url: str, subs: int, procs: int, n: int, latency: bool, tmp: str, ref_url: str | None):
        self.specs = []
        if latency and subs > 1:  # one of the S alone in its own process: what one subscriber sees
            self.specs.append(("probe", kind, url, 1, str(Path(tmp) / f"{kind}-probe.delays")))
            subs -= 1
        per = [subs // procs + (1 if i < subs % procs else 0) for i in range(procs)]
        for i, k in enumerate(p for p in per if p):
            self.specs.append(("sub", kind, url, k, str(Path(tmp) / f"{kind}-{i}.delays")))
        if ref_url:
            self.specs.append(("ref", "nats", ref_url, 1, str(Path(tmp) / "ref.delays")))
        self.n = n
        self.latency = latency
        self.procs: list[asyncio.subprocess.Process] = []

    async def start(self) -> None:
        for _role, kind, url, k, out in self.specs:
            cmd = [sys.executable, __file__, "--worker", kind, "--url", url, "--subscribers", str(k), "--n", str(self.n),
                   "--out", out] + (["--latency"] if self.latency else [])
            self.procs.append(await asyncio.create_subprocess_exec(*cmd, stdout=subprocess.PIPE))
        for p in self.procs:
            line = await asyncio.wait_for(p.stdout.readline(), 120)  # type: ignore[union-attr]
            if line.strip() != b"READY":
                raise RuntimeError(f"worker did not start: {line!r}")

    async def results(self) -> list[dict]:
        """One dict per process (the reference last): last (ns), short, min_n, cpu (s), role."""
        out = []
        for (role, *_), p in zip(self.specs, self.procs):
            line = await p.stdout.readline()  # type: ignore[union-attr]
            if not line.startswith(b"DONE "):
                raise RuntimeError(f"worker failed: {line!r}")
            out.append({**json.loads(line[5:]), "role": role})
            await p.wait()
        return out

    def delays(self, *roles: str) -> list[int]:
        values = array.array("q")
        for r, _kind, _url, _k, out in self.specs:
            if r in roles and os.path.exists(out):
                with open(out, "rb") as f:
                    values.frombytes(f.read())
        return sorted(values)

    async def stop(self) -> None:
        for p in self.procs:
            if p.returncode is None:
                p.kill()
                await p.wait()


async def publish(js, n: int, rate: float | None) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """Returns wall times (ns) of the first and the last publish."""
    first = time.time_ns()
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
    last = time.time_ns()
    await asyncio.gather(*futs)
    return first, last


def pct(values: list[int], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] / 1e6 if values else float("nan")


async def run_path(kind: str, a: argparse.Namespace, server: Any, relay_pid: int, relay_url: str, tmp: str,
                   n: int, rate: float | None) -> dict:
    import nats

    latency = rate is not None
    w = Workers(kind, relay_url if kind == "relay" else server.url, a.subscribers, a.procs, n, latency, tmp,
                server.url if latency else None)
    pub = await nats.connect(server.url)
    pjs = pub.jetstream(publish_async_max_pending=4096)
    try:
        await w.start()
        await asyncio.sleep(0.5)
        load0 = load()
        c0 = (os.times(), cpu_ticks(relay_pid), cpu_ticks(server.proc.pid), machine_ticks())
        w0 = time.perf_counter()
        first, last_pub = await publish(pjs, n, rate)
        res = await w.results()
        wall = time.perf_counter() - w0
        t = os.times()
        c1 = (t, cpu_ticks(relay_pid), cpu_ticks(server.proc.pid), machine_ticks())
        subs = [r for r in res if r["role"] in ("sub", "probe")]
        short = sum(r["short"] for r in subs)
        last = max(r["last"] for r in subs)
        out = {
            "rate": n / ((last - first) / 1e9) if not short else float("nan"),
            "lag_ms": (last - last_pub) / 1e6,
            "short": short,
            "per_read": n * a.subscribers / max(1, sum(r["reads"] for r in subs)) if kind == "relay" else None,
            "load": (load0, load()),
            "cpu": {
                "publisher": (c1[0].user + c1[0].system - c0[0].user - c0[0].system) / wall,
                "subscribers": sum(r["cpu"] for r in subs) / wall,
                "reference": sum(r["cpu"] for r in res if r["role"] == "ref") / wall,
                "relay": (c1[1] - c0[1]) / TICK / wall,
                "nats-server": (c1[2] - c0[2]) / TICK / wall,
            },
        }
        out["machine"] = (c1[3] - c0[3]) / TICK / wall
        out["others"] = out["machine"] - sum(out["cpu"].values())  # other work on the machine
        if latency:
            out["delays"] = w.delays("sub", "probe")
            out["probe"] = w.delays("probe")
            out["ref"] = w.delays("ref")
        return out
    finally:
        await w.stop()
        await pub.close()


async def main(a: argparse.Namespace) -> None:
    import nats

    from bridge.config import Settings
    from bridge.nats.bootstrap import bootstrap
    from bridge.stack.server import EmbeddedNats, free_port

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
            print(f"{a.subscribers} subscribers in {a.procs} worker processes, events of {len(body(0))} B, "
                  f"cpu={os.cpu_count()}, load average {load()}")
            kinds = [k for k in ("nats", "relay") if k in a.paths]
            if a.n:
                rates = {}
                for kind in kinds:
                    r = await run_path(kind, a, server, relay.pid, relay_url, tmp, a.n, None)
                    rates[kind] = r["rate"]
                    print(f"  sustained, {kind:5s}: {r['rate']:8,.0f} events/s to every subscriber ({a.n} events)  "
                          f"[{cpu_line(r)}]")
                if len(rates) == 2:
                    print(f"  ratio relay/bare nats-py: {rates['relay'] / rates['nats']:.2f} (target >= 0.5, stretch > 1)")
            if a.seconds:
                lat = {}
                n = int(a.rate * a.seconds)
                for kind in kinds:
                    r = lat[kind] = await run_path(kind, a, server, relay.pid, relay_url, tmp, n, a.rate)
                    r["keeps_up"] = not r["short"] and r["lag_ms"] <= 250
                    d, ref = r["delays"], r["ref"]
                    print(f"  at {a.rate:,.0f} events/s for {a.seconds:g} s, {kind:5s}: end to end p50 {pct(d, .5):7.1f} ms  "
                          f"p99 {pct(d, .99):7.1f} ms  max {pct(d, 1):7.1f} ms ({len(d):,} deliveries); "
                          f"last delivery {r['lag_ms']:,.0f} ms after the last publish: "
                          f"{'keeps up' if r['keeps_up'] else 'FALLS BEHIND'}")
                    print(f"      the one subscriber alone in its process: p50 {pct(r['probe'], .5):6.1f} ms  "
                          f"p99 {pct(r['probe'], .99):6.1f} ms; reference (1 more ordered consumer, own process): "
                          f"p50 {pct(ref, .5):6.1f} ms  p99 {pct(ref, .99):6.1f} ms")
                    print(f"      [{cpu_line(r)}]")
                if "relay" in lat:
                    rl = lat["relay"]
                    p99 = pct(rl["delays"], .99)
                    if "nats" in lat and lat["nats"]["keeps_up"]:
                        base, how = pct(lat["nats"]["delays"], .99), "the bare path's end-to-end p99 at the same rate"
                        how += f" (against the reference consumer instead: {p99 - pct(rl['ref'], .99):.1f} ms)"
                    else:
                        why = "the bare path falls behind at this rate" if "nats" in lat else "no bare path run"
                        base, how = pct(rl["ref"], .99), f"the reference consumer's p99 in the relay run ({why})"
                    print(f"  p99 the relay adds at {a.rate:,.0f} events/s: {p99 - base:.1f} ms "
                          f"= relay end-to-end p99 {p99:.1f} ms - {base:.1f} ms, {how} (target <= 50)"
                          + ("" if rl["keeps_up"] else "; THE RELAY PATH FELL BEHIND"))
        finally:
            relay.terminate()
            relay.wait(10)


def cpu_line(r: dict) -> str:
    c = r["cpu"]
    return ("cpu %: " + ", ".join(f"{k} {max(v, 0.0) * 100:.0f}" for k, v in c.items() if k != "reference" or v)
            + (f"; {r['per_read']:.1f} events per SSE read" if r["per_read"] else "")
            + f"; whole machine {r['machine'] * 100:.0f} % busy of {os.cpu_count() * 100}, "
            + f"other work {max(r['others'], 0.0) * 100:.0f} %"
            + f"; load average {r['load'][0]} -> {r['load'][1]}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--subscribers", type=int, default=100)
    p.add_argument("--procs", type=int, default=2, help="subscriber worker processes per path")
    p.add_argument("--n", type=int, default=3000, help="events of the sustained-rate measurement (0: skip it)")
    p.add_argument("--rate", type=float, default=1000.0)
    p.add_argument("--seconds", type=float, default=5.0, help="length of the latency measurement (0: skip it)")
    p.add_argument("--paths", default="nats,relay", help="which paths to run: nats,relay")
    p.add_argument("--worker", choices=("nats", "relay"), help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--latency", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--timeout", type=float, default=300.0, help=argparse.SUPPRESS)
    args = p.parse_args()
    asyncio.run(worker(args) if args.worker else main(args))
