#!/usr/bin/env python3
"""The cost curve: CPU per event of every process of the pipeline at steady rates, against a
bare two-relay chain measured in the same run (issue 24).

    .venv/bin/python benchmarks/cost.py                       # 250, 1,000, 2,000 events/s, 180 s each
    .venv/bin/python benchmarks/cost.py --rates 250,1000 --seconds 20 --warmup 5   # a smoke run

Pipeline: an embedded nats-server, `aep-bridge mapper` and `aep-bridge pairing` (one of each,
`tests/support/pipeline.py`'s `Pipeline`), `aep-bridge relay` with 10 SSE subscribers (one process of
their own, `--sse-worker`), `aep-bridge exporter` with one Kafka sink (a Tansu broker), and
the fleet simulator (`bridge.sim.fleet.Fleet`, 1,000 instances, in-process shims) publishing
at each rate for ``--warmup`` + ``--seconds`` seconds; an observer process (soak.py's) measures
shim receive -> AEP_EVENTS latency.

Baseline: a second nats-server, bootstrapped alike, and two `benchmarks/bare_relay.py`
processes (HERMES_RAW -> BRIDGE_MAPPED -> AEP_EVENTS: fetch, publish_async, ack after the
publish acks), fed by the same simulator at the same rate right after the pipeline's phase.

First, ``--idle`` seconds with no traffic: each process's % of a core, the cost that tracks
wall time rather than events (and what it adds per event at each rate).

Per rate, over the ``--seconds`` after the warm-up: each process's CPU (utime + stime from
/proc/<pid>/stat) in ms per raw event (the raw messages the mapper, or the first bare relay,
acked in that window) and in % of a core, its RSS at the end, e2e p50/p99; then
(mapper + pairing) ms/event / (relay 1 + relay 2) ms/event, and the flatness figure (the
lowest rate's cost per event / the highest rate's). Targets (issue 24): ratio <= 1.5 at every
rate, flatness <= 1.3. Figures only, no assertion.

``--profile DIR``: py-spy (PyPI py-spy) records the mapper and pairing during each rate's
measured window (attached by pid; ``--format raw``, collapsed stacks), and the top frames,
self and cumulative, are printed from them (``--top``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import multiprocessing as mp
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import json
import urllib.request
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from soak import cpu_s, observe, pct  # noqa: E402

from bridge.nats import streams as S  # noqa: E402
from bridge.runtime.profiling import rss_kb  # noqa: E402
from bridge.sim.fleet import Fleet, FleetConfig  # noqa: E402
from tests.support.cli import free_port  # noqa: E402
from tests.support.pipeline import Pipeline  # noqa: E402
from bridge.stack.server import EmbeddedNats  # noqa: E402

HERE = Path(__file__).resolve().parent
_LINE = re.compile(r"\(([^()]*?):\d+\)$")


# ---------------------------------------------------------------- the SSE subscribers (their own process)


async def sse_worker(url: str, n: int) -> None:
    host, port = url.split("//", 1)[1].split(":")
    frames = [0] * n
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)

    async def one(i: int) -> None:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(f"GET /stream HTTP/1.1\r\nHost: {host}\r\nAccept: text/event-stream\r\n\r\n".encode())
        await writer.drain()
        tail = b""
        while chunk := await reader.read(1 << 16):
            data = tail + chunk
            frames[i] += data.count(b"\n\n")
            tail = data[-1:]

    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    await stop.wait()
    for t in tasks:
        t.cancel()
    print(json.dumps({"frames": frames}), flush=True)


# ---------------------------------------------------------------- processes


def wait_http(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=1)
            return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer within {timeout}s")


class Procs:
    """Child processes started here (not the Pipeline's workers), stopped at the end."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, cmd: list[str], env: dict[str, str] | None = None, stdout: int | None = None) -> subprocess.Popen[bytes]:
        log = open(self.logs / f"{name}.log", "ab")
        p = subprocess.Popen(cmd, env={**os.environ, "AEP_BRIDGE_CONFIG": os.devnull, "AEP_BRIDGE_LOG_LEVEL": "warning",
                                       **(env or {})},
                             stdout=stdout if stdout is not None else log, stderr=log, cwd=HERE.parent)
        log.close()
        self.procs[name] = p
        return p

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def acked(url: str, stream: str, durable: str) -> tuple[int, int]:
    """(ack floor stream sequence, pending + unacked) of a durable consumer."""
    async def f() -> tuple[int, int]:
        import nats

        nc = await nats.connect(url)
        try:
            info = await nc.jetstream().consumer_info(stream, durable)
            return int(info.ack_floor.stream_seq or 0), int((info.num_pending or 0) + (info.num_ack_pending or 0))
        finally:
            await nc.close()

    return asyncio.run(f())


# ---------------------------------------------------------------- one phase: the fleet at a rate, CPU over the window


def phase(url: str, rate: float, a: argparse.Namespace, work: Path, tag: str, pids: dict[str, int],
          counter: tuple[str, str], profile: dict[str, int] | None = None) -> dict:
    fleet = Fleet(FleetConfig(
        nats_url=url, instances=a.instances, rate=rate, duration=a.warmup + a.seconds, wind_down=False,
        shim_fraction=0.0, canary_fraction=0.01, hostile_fraction=0.0, seed=int(rate),
        instance_prefix=f"{tag}{int(rate)}", manifest=str(work / f"manifest-{tag}-{int(rate)}.jsonl"),
        spool_dir=str(work / f"spool-{tag}-{int(rate)}"),
    ))
    th = threading.Thread(target=fleet.run, daemon=True, name=f"fleet-{tag}")
    th.start()
    time.sleep(a.warmup)
    spies = []
    if profile:
        for name, pid in profile.items():
            out = Path(a.profile) / f"{name}-{int(rate)}.txt"
            spies.append(subprocess.Popen(["py-spy" if shutil.which("py-spy") else str(Path(sys.executable).with_name("py-spy")),
                                           "record", "--pid", str(pid), "--rate", str(a.profile_rate), "--format", "raw",
                                           "--duration", str(int(a.seconds)), "--nonblocking", "-o", str(out),
                                           *(["--idle"] if a.profile_idle else [])],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    t0, floor0 = time.monotonic(), acked(url, *counter)[0]
    cpu0 = {k: cpu_s(v) for k, v in pids.items()}
    sent0 = fleet.sent
    unix0 = time.time()
    time.sleep(a.seconds)
    dt = time.monotonic() - t0
    cpu1 = {k: cpu_s(v) for k, v in pids.items()}
    floor1, lag = acked(url, *counter)
    sent = fleet.sent - sent0
    rss = {k: rss_kb(v) for k, v in pids.items()}
    fleet.stop()
    th.join(60)
    fleet.close()
    for s in spies:
        s.wait(30)
    events = max(1, floor1 - floor0)
    return {"rate": rate, "events": events, "sent": sent, "dt": dt, "lag": lag, "window": (unix0, unix0 + dt),
            "ms": {k: 1000 * (cpu1[k] - cpu0[k]) / events for k in pids},
            "pct": {k: 100 * (cpu1[k] - cpu0[k]) / dt for k in pids}, "rss": rss}


def idle_phase(pids: dict[str, int], seconds: float, services: dict[str, int], profile: str | None,
               a: argparse.Namespace) -> dict[str, float]:
    """% of a core each process uses with no traffic at all: the cost that tracks wall time."""
    spies = []
    if profile:
        for name, pid in services.items():
            spies.append(subprocess.Popen(["py-spy" if shutil.which("py-spy") else str(Path(sys.executable).with_name("py-spy")),
                                           "record", "--pid", str(pid), "--rate", str(a.profile_rate), "--format", "raw",
                                           "--duration", str(int(seconds)), "--nonblocking", "--idle",
                                           "-o", str(Path(profile) / f"{name}-idle.txt")],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    t0, cpu0 = time.monotonic(), {k: cpu_s(v) for k, v in pids.items()}
    time.sleep(seconds)
    dt, cpu1 = time.monotonic() - t0, {k: cpu_s(v) for k, v in pids.items()}
    for spy in spies:
        spy.wait(30)
    return {k: 100 * (cpu1[k] - cpu0[k]) / dt for k in pids if k != "sim"}


def latencies(path: Path, window: tuple[float, float], interval: float) -> list[float]:
    out: list[float] = []
    try:
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if window[0] + interval <= r["t"] <= window[1] + 0.5:
                out.extend(r["lat"])
    except (OSError, ValueError):
        pass
    return out


# ---------------------------------------------------------------- profiles


def top_frames(path: Path, n: int) -> str:
    """Self and cumulative share of samples per function from py-spy's collapsed stacks."""
    self_c: collections.Counter[str] = collections.Counter()
    cum_c: collections.Counter[str] = collections.Counter()
    total = 0
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return f"  (no profile at {path})"
    for line in lines:
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        k = int(count)
        total += k
        frames = [_LINE.sub(r"(\1)", f) for f in stack.split(";")]  # per function, not per line
        self_c[frames[-1]] += k
        for f in set(frames):
            cum_c[f] += k
    if not total:
        return f"  (empty profile {path})"
    rows = [f"  {total} samples; self:"]
    rows += [f"    {100 * c / total:5.1f} %  {f}" for f, c in self_c.most_common(n)]
    outer = max(cum_c.values())
    rows.append("  cumulative (the entry chain, every frame in as many samples as the outermost, left out):")
    rows += [f"    {100 * c / total:5.1f} %  {f}" for f, c in [fc for fc in cum_c.most_common() if fc[1] < outer][:n]]
    return "\n".join(rows)


# ---------------------------------------------------------------- the run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="250,1000,2000", help="events per second, comma-separated (default 250,1000,2000)")
    ap.add_argument("--seconds", type=float, default=180.0, help="measured seconds per rate (default 180)")
    ap.add_argument("--warmup", type=float, default=30.0, help="seconds per rate before measuring (default 30)")
    ap.add_argument("--instances", type=int, default=1000)
    ap.add_argument("--subscribers", type=int, default=10, help="SSE subscribers of the relay (default 10)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the bare relay chain")
    ap.add_argument("--idle", type=float, default=20.0, help="seconds measured with no traffic first (0: none; default 20)")
    ap.add_argument("--profile", default=None, metavar="DIR", help="py-spy the mapper and pairing into DIR (per rate)")
    ap.add_argument("--profile-idle", action="store_true",
                    help="with --profile: sample waiting threads too (where a loop waits: wall time, not CPU)")
    ap.add_argument("--profile-rate", type=int, default=100, help="py-spy samples per second (default 100)")
    ap.add_argument("--top", type=int, default=15, help="frames printed per profile (default 15)")
    ap.add_argument("--service-env", action="append", default=[], metavar="KEY=VALUE",
                    help="added to the mapper's and pairing's environment (repeatable)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    ap.add_argument("--sse-worker", nargs=2, metavar=("URL", "N"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.sse_worker:
        asyncio.run(sse_worker(a.sse_worker[0], int(a.sse_worker[1])))
        return 0
    rates = [float(r) for r in a.rates.split(",") if r.strip()]
    env = dict(kv.split("=", 1) for kv in a.service_env)
    if a.profile:
        Path(a.profile).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="aep-cost-"))
    logs = work / "logs"
    logs.mkdir()
    print(f"cost: rates {', '.join(f'{r:.0f}' for r in rates)} events/s, {a.warmup:.0f} s warm-up + {a.seconds:.0f} s "
          f"measured each, {a.instances} instances, {a.subscribers} SSE subscribers; {os.cpu_count()} CPUs; "
          f"load average {os.getloadavg()[0]:.1f}; work dir {work}", flush=True)
    from tests.support.tansu import Tansu

    server = EmbeddedNats(work / "nats", log_file=logs / "nats.log").start()
    bare_server = EmbeddedNats(work / "nats-bare", log_file=logs / "nats-bare.log").start() if not a.no_baseline else None
    broker = Tansu(logs / "tansu.log").start()
    procs = Procs(logs)
    pipe = Pipeline(server.url, logs, env=env)
    stop_obs = mp.Event()
    observer = None
    results: dict[str, list[dict]] = {"pipeline": [], "baseline": []}
    try:
        broker.create_topics("cost", partitions=3)
        pipe.bootstrap()
        mapper, pairing = pipe.add("mapper", name="mapper"), pipe.add("pairing", name="pairing")
        port = free_port()
        relay = procs.start("relay", [sys.executable, "-m", "bridge.cli", "relay", "--nats", server.url,
                                      "--listen", f"127.0.0.1:{port}"], env={"AEP_BRIDGE_RELAY_QUEUE": "100000"})
        exporter = procs.start("exporter", [sys.executable, "-m", "bridge.cli", "exporter", "--nats", server.url,
                                            "--metrics-port", str(free_port()),
                                            "--sink", f"kafka://{broker.bootstrap}/cost?name=cost"])
        pipe.wait_ready()
        wait_http(f"http://127.0.0.1:{port}/healthz")
        sse = procs.start("sse", [sys.executable, __file__, "--sse-worker", f"http://127.0.0.1:{port}", str(a.subscribers)],
                          stdout=subprocess.PIPE)
        lat_path = work / "latency.jsonl"
        observer = mp.get_context("fork").Process(target=observe, args=(server.url, str(lat_path), 2.0, stop_obs), daemon=True)
        observer.start()
        time.sleep(2.0)
        pids = {"nats": server.proc.pid, "mapper": mapper.pid, "pairing": pairing.pid, "relay": relay.pid,
                "exporter": exporter.pid, "sse x10": sse.pid, "tansu": broker.proc.pid, "sim": os.getpid(),
                "observer": observer.pid}
        bare_pids: dict[str, int] = {}
        if bare_server is not None:
            Pipeline(bare_server.url, logs).bootstrap()
            r1 = procs.start("bare-1", [sys.executable, str(HERE / "bare_relay.py"), "--nats", bare_server.url,
                                        "--stream", S.HERMES_RAW, "--durable", "bare-1", "--strip", "2",
                                        "--prefix", f"{S.MAPPED_PREFIX}.0"])
            r2 = procs.start("bare-2", [sys.executable, str(HERE / "bare_relay.py"), "--nats", bare_server.url,
                                        "--stream", S.BRIDGE_MAPPED, "--durable", "bare-2", "--strip", "3",
                                        "--prefix", "aep.hermes"])
            bare_pids = {"nats": bare_server.proc.pid, "relay 1": r1.pid, "relay 2": r2.pid, "sim": os.getpid()}
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    acked(bare_server.url, S.HERMES_RAW, "bare-1"), acked(bare_server.url, S.BRIDGE_MAPPED, "bare-2")
                    break
                except Exception:
                    time.sleep(0.2)
        profile = {"mapper": mapper.pid, "pairing": pairing.pid} if a.profile else None
        if a.idle:
            results["idle"] = idle_phase(pids, a.idle, {"mapper": mapper.pid, "pairing": pairing.pid}, a.profile, a)
            print("  idle: " + ", ".join(f"{k} {v:.1f} %" for k, v in results["idle"].items()) + " of a core", flush=True)
        for rate in rates:
            r = phase(server.url, rate, a, work, "c", pids, (S.HERMES_RAW, S.MAPPER_DURABLE), profile)
            lat = latencies(lat_path, r["window"], 2.0)
            r["p50"], r["p99"], r["n_lat"] = pct(lat, .5), pct(lat, .99), len(lat)
            results["pipeline"].append(r)
            print(f"  {rate:6.0f}/s pipeline: {r['events'] / r['dt']:6.0f} raw/s acked by the mapper, backlog at the end "
                  f"{r['lag']}; mapper {r['ms']['mapper']:.3f} + pairing {r['ms']['pairing']:.3f} ms/event; "
                  f"e2e p50 {r['p50']:.0f} ms p99 {r['p99']:.0f} ms", flush=True)
            if bare_pids:
                b = phase(bare_server.url, rate, a, work, "b", bare_pids, (S.HERMES_RAW, "bare-1"))
                results["baseline"].append(b)
                print(f"  {rate:6.0f}/s baseline: {b['events'] / b['dt']:6.0f} raw/s acked by relay 1, backlog {b['lag']}; "
                      f"relay 1 {b['ms']['relay 1']:.3f} + relay 2 {b['ms']['relay 2']:.3f} ms/event", flush=True)
        report(results, a, rates)
        if a.profile:
            for rate in rates:
                for name in ("mapper", "pairing"):
                    print(f"\nprofile {name} at {rate:.0f} events/s ({Path(a.profile) / f'{name}-{int(rate)}.txt'}):")
                    print(top_frames(Path(a.profile) / f"{name}-{int(rate)}.txt", a.top))
        return 0
    finally:
        stop_obs.set()
        if observer is not None and observer.is_alive():
            observer.terminate()
        procs.stop()
        pipe.stop()
        broker.stop()
        server.stop()
        if bare_server is not None:
            bare_server.stop()
        if a.keep:
            print(f"cost: work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def report(results: dict[str, list[dict]], a: argparse.Namespace, rates: list[float]) -> None:
    pipe = results["pipeline"]
    names = list(pipe[0]["ms"]) if pipe else []
    print(f"\nCPU per raw event (ms), % of a core and RSS (MiB) at the end of each rate's {a.seconds:.0f} s window:")
    print(f"  {'process':<10}" + "".join(f"{f'{r:.0f}/s':>26}" for r in rates))
    for n in names:
        print(f"  {n:<10}" + "".join(f"{x['ms'][n]:>9.3f} ms {x['pct'][n]:>4.0f} % {x['rss'][n] / 1024:>5.0f} MiB" for x in pipe))
    e2e = ["p50 %.0f p99 %.0f ms" % (x["p50"], x["p99"]) for x in pipe]
    print(f"  {'e2e':<10}" + "".join(f"{e:>26}" for e in e2e))
    print(f"  {'backlog':<10}" + "".join(f"{x['lag']:>26}" for x in pipe))
    cost = [x["ms"]["mapper"] + x["ms"]["pairing"] for x in pipe]
    print(f"  {'map+pair':<10}" + "".join(f"{c:>23.3f} ms" for c in cost))
    base = results["baseline"]
    if base:
        bcost = [x["ms"]["relay 1"] + x["ms"]["relay 2"] for x in base]
        print("baseline, two bare nats-py relays (HERMES_RAW -> BRIDGE_MAPPED -> AEP_EVENTS):")
        for n in base[0]["ms"]:
            print(f"  {n:<10}" + "".join(f"{x['ms'][n]:>9.3f} ms {x['pct'][n]:>4.0f} % {x['rss'][n] / 1024:>5.0f} MiB" for x in base))
        print(f"  {'relays':<10}" + "".join(f"{c:>23.3f} ms" for c in bcost))
        print(f"  {'ratio':<10}" + "".join(f"{c / b:>26.2f}" for c, b in zip(cost, bcost))
              + "   (mapper+pairing / relay 1+relay 2; target <= 1.5)")
        if len(bcost) > 1:
            print(f"flatness, baseline: {bcost[0] / bcost[-1]:.2f} ({rates[0]:.0f}/s cost / {rates[-1]:.0f}/s cost)")
    if results.get("idle"):
        idle = results["idle"]
        print(f"idle, no traffic for {a.idle:.0f} s, % of a core: " + ", ".join(f"{k} {v:.1f}" for k, v in idle.items())
              + f"; mapper + pairing {idle['mapper'] + idle['pairing']:.1f} % (= "
              + ", ".join(f"{10 * (idle['mapper'] + idle['pairing']) / r:.3f} ms per event at {r:.0f}/s" for r in rates) + ")")
    if len(cost) > 1:
        print(f"flatness, pipeline (mapper+pairing): {cost[0] / cost[-1]:.2f} "
              f"({rates[0]:.0f}/s cost per event / {rates[-1]:.0f}/s cost per event; target <= 1.3)")


if __name__ == "__main__":
    sys.exit(main())
