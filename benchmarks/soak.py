#!/usr/bin/env python3
"""Soak: the fleet simulator at fleet scale against the whole bridge on this machine.

    .venv/bin/python benchmarks/soak.py --duration 600            # 1,000 instances, 2,000 events/s

1. Starts an embedded nats-server with JetStream, bootstraps, and runs `aep-bridge mapper`
   and `aep-bridge pairing` as processes (one of each by default).
2. Runs `bridge.sim.fleet` (in-process shims plus a fraction of real shim processes) at
   the target combined rate for ``--duration`` seconds, then lets every session finish.
3. Meanwhile an observer process follows AEP_EVENTS and measures end-to-end latency:
   shim receive time (the ULID time of a mapped event's id, i.e. the raw ``ts`` in ms)
   to the time JetStream stored the event on AEP_EVENTS. A sampler records consumer lag
   (mapper: pending + unacked on HERMES_RAW; pairing: pending on BRIDGE_MAPPED), stream
   rates and the resident memory (/proc VmRSS) of nats-server, mapper and pairing.
4. At the end: drains the spools, waits for the pipeline to settle and runs the verifier
   (no loss, no duplicates, invariants, schema on a sample, canaries).

Prints sustained throughput, latency percentiles (overall after warm-up and per
interval), lag over time, memory at start / after warm-up / at the end, and the targets:
the rate sustained with zero loss, p99 <= ``--p99-ms`` (150: issue 24's target), memory growth <= 10 % after warm-up.
Exit code 0 when every target is met.

Memory investigations: ``--tracemalloc`` makes the services write tracemalloc snapshots
(``AEP_BRIDGE_TRACEMALLOC``, every ``--tracemalloc-every`` s) into ``<work dir>/tracemalloc``,
keeps the work directory and, at the end, prints per service the traced bytes against RSS
over time and the top growth sites between the end of the warm-up and the end of the
traffic (`benchmarks/tracemalloc_report.py`). tracemalloc slows the services and its own
bookkeeping adds to their RSS: the latency and memory targets do not apply to such a run.
``--tracemalloc-frames 0`` keeps the rows and the container census but not tracemalloc itself
(no per-allocation cost: for runs at full rate). ``--service-env KEY=VALUE`` (repeatable) adds
to the services' environment, e.g. ``MALLOC_ARENA_MAX=2`` (a fragmentation experiment).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bridge.stack.server import EmbeddedNats  # noqa: E402
from bridge.sim.fleet import Fleet, FleetConfig  # noqa: E402
from tests.support.pipeline import Pipeline, rss_kb  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and its reaped children (0 when gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return sum(int(x) for x in fields[11:15]) / TICK  # utime stime cutime cstime
    except (OSError, IndexError, ValueError):
        return 0.0


def machine_busy_s() -> float:
    with open("/proc/stat") as f:
        parts = [int(x) for x in f.readline().split()[1:]]
    return (sum(parts) - parts[3] - parts[4]) / TICK  # all but idle and iowait

CROCKFORD = {c: i for i, c in enumerate("0123456789ABCDEFGHJKMNPQRSTVWXYZ")}


def ulid_ms(ulid: bytes) -> int:
    v = 0
    for ch in ulid[:10].decode():
        v = v * 32 + CROCKFORD[ch]
    return v


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


# ---------------------------------------------------------------- the latency observer (its own process: no GIL sharing)


def mapped_latency_ms(msg: Any) -> int | None:
    """An AEP event's end-to-end latency: its store time in AEP_EVENTS less the time in its id
    (the shim's receive time), for mapped events only (slots 512-767 of its ``seq``); None for
    the others."""
    data = msg.data
    i = data.find(b'"seq":')
    if i < 0:
        return None
    j = k = i + 6
    while data[k:k + 1].isdigit():
        k += 1
    if not 512 <= int(data[j:k]) % 1024 < 768:  # mapped events only (their id time is the shim's receive time)
        return None
    a = data.find(b'"id":"') + 6
    return int(msg.metadata.timestamp.timestamp() * 1000) - ulid_ms(data[a:a + 26])


def observe(url: str, out_path: str, interval: float, stop: "mp.synchronize.Event",
            latency_ms: Callable[[Any], int | None] = mapped_latency_ms, subject: str = "aep.hermes.>") -> None:
    """Follow ``subject`` (new messages only) and write, every ``interval`` s, a line with how
    many came and ``latency_ms`` of each (None: not sampled)."""
    import nats

    async def main() -> None:
        servers = [u.strip() for u in url.split(",") if u.strip()]  # one server or a cluster's list
        async def quiet(exc: Exception) -> None:  # (nats-py's default prints each error's traceback)
            print(f"observer: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)

        nc = await nats.connect(servers, max_reconnect_attempts=-1, error_cb=quiet)
        js = nc.jetstream()
        window: list[int] = []
        counts = {"n": 0}

        async def cb(msg) -> None:  # type: ignore[no-untyped-def]
            counts["n"] += 1
            ms = latency_ms(msg)
            if ms is not None:
                window.append(ms)

        await js.subscribe(subject, cb=cb, ordered_consumer=True, deliver_policy=nats.js.api.DeliverPolicy.NEW)
        with open(out_path, "a") as out:
            while not stop.is_set():
                await asyncio.sleep(interval)
                lat, window[:] = list(window), []
                out.write(json.dumps({"t": time.time(), "events": counts["n"], "lat": lat}) + "\n")
                out.flush()
                counts["n"] = 0
        await nc.close()

    asyncio.run(main())


# ---------------------------------------------------------------- sampling


class Sampler(threading.Thread):
    def __init__(self, pipe: Pipeline, server: EmbeddedNats, fleet: Fleet, interval: float) -> None:
        super().__init__(daemon=True, name="soak-sampler")
        self.pipe, self.server, self.fleet, self.interval = pipe, server, fleet, interval
        self.rows: list[dict] = []
        self.stop = threading.Event()
        self.t0 = time.monotonic()
        self.pids: dict[str, int] = {}

    def cpu(self) -> dict[str, float]:
        pids = {"nats": self.server.proc.pid if self.server.proc else 0, **{w.name: w.pid for w in self.pipe.workers},
                "sim": os.getpid(), **self.pids}
        return {**{k: cpu_s(v) for k, v in pids.items()}, "machine": machine_busy_s()}

    def rss(self) -> dict[str, int]:
        out = {"nats": rss_kb(self.server.proc.pid) if self.server.proc else 0}
        for w in self.pipe.workers:
            out[w.name] = w.rss_kb()
        return out

    def run(self) -> None:
        last_counts, last_t, last_sent = None, time.monotonic(), 0
        last_cpu = self.cpu()
        while not self.stop.wait(self.interval):
            try:
                lag, counts = self.pipe.lag(), self.pipe.counts()
            except Exception as exc:  # keep sampling
                print(f"soak: sample failed: {exc}", file=sys.stderr)
                continue
            now = time.monotonic()
            dt = now - last_t
            cpu = self.cpu()
            row = {"t": round(now - self.t0, 1), **lag, **counts, "rss_kb": self.rss(), "sent": self.fleet.sent,
                   "sent_rate": round((self.fleet.sent - last_sent) / dt, 1),
                   "cpu": {k: round(100 * (cpu[k] - last_cpu.get(k, 0.0)) / dt) for k in cpu}}
            last_cpu = cpu
            if last_counts:
                for k in ("HERMES_RAW", "BRIDGE_MAPPED", "AEP_EVENTS"):
                    row[k + "_rate"] = round((counts[k] - last_counts[k]) / dt, 1)
            self.rows.append(row)
            last_counts, last_t, last_sent = counts, now, self.fleet.sent


# ---------------------------------------------------------------- the run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of traffic (default 600)")
    ap.add_argument("--instances", type=int, default=1000)
    ap.add_argument("--rate", type=float, default=2000.0, help="combined events per second")
    ap.add_argument("--shim-fraction", type=float, default=0.002, help="instances served by real shim processes")
    ap.add_argument("--mappers", type=int, default=1)
    ap.add_argument("--pairings", type=int, default=1)
    ap.add_argument("--warmup", type=float, default=180.0,
                    help="seconds excluded from the memory baseline and latency (default 180: past pairing's 2 min recent_ns, when ended sessions start to be evicted)")
    ap.add_argument("--sample", type=float, default=10.0, help="sampling interval (s)")
    ap.add_argument("--p99-ms", type=float, default=150.0, help="the e2e p99 target after warm-up (default 150 ms)")
    ap.add_argument("--hostile-fraction", type=float, default=0.0005)
    ap.add_argument("--schema-sample", type=int, default=500, help="verifier: events of each type validated in full, then 1 in 50")
    ap.add_argument("--dir", default=None, help="work directory (default: a temporary one, removed at the end)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--profile", action="store_true", help="run the services under cProfile (<work dir>/<name>.prof)")
    ap.add_argument("--tracemalloc", action="store_true",
                    help="services write tracemalloc snapshots to <work dir>/tracemalloc (kept); growth sites printed at the end")
    ap.add_argument("--tracemalloc-every", type=float, default=30.0, help="seconds between snapshots (default 30)")
    ap.add_argument("--tracemalloc-frames", type=int, default=1,
                    help="frames per allocation (default 1; 0: no tracemalloc, only RSS/malloc rows and the container census)")
    ap.add_argument("--service-env", action="append", default=[], metavar="KEY=VALUE",
                    help="added to the services' environment (repeatable), e.g. MALLOC_ARENA_MAX=2")
    args = ap.parse_args()

    work = Path(args.dir or tempfile.mkdtemp(prefix="aep-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    service_env: dict[str, str] = {}
    tm_dir = work / "tracemalloc"
    if args.tracemalloc:
        args.keep = True
        service_env.update({"AEP_BRIDGE_TRACEMALLOC": str(tm_dir),
                            "AEP_BRIDGE_TRACEMALLOC_EVERY_S": str(args.tracemalloc_every),
                            "AEP_BRIDGE_TRACEMALLOC_FRAMES": str(args.tracemalloc_frames)})
    for item in args.service_env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            ap.error(f"--service-env wants KEY=VALUE, not {item!r}")
        service_env[key] = value
    if service_env:
        print(f"soak: service environment {service_env}", flush=True)
    window: dict[str, float] = {}  # unix times: end of the warm-up, end of the traffic
    print(f"soak: {args.instances} instances, {args.rate:.0f} events/s for {args.duration:.0f} s; "
          f"{args.mappers} mapper(s), {args.pairings} pairing worker(s); {os.cpu_count()} CPUs; work dir {work}", flush=True)
    server = EmbeddedNats(work / "nats", log_file=work / "nats.log").start()
    pipe = Pipeline(server.url, work / "logs", env=service_env)
    observer = None
    stop_obs = mp.Event()
    ok = False
    try:
        pipe.bootstrap()
        def prof(name: str) -> list[str]:
            return ["-m", "cProfile", "-o", str(work / f"{name}.prof")] if args.profile else []

        for i in range(args.mappers):
            pipe.add("mapper", name=f"mapper-{i}", python_args=prof(f"mapper-{i}"))
        for i in range(args.pairings):
            pipe.add("pairing", name=f"pairing-{i}", python_args=prof(f"pairing-{i}"))
        pipe.wait_ready()
        time.sleep(1.0)
        lat_path = work / "latency.jsonl"
        observer = mp.get_context("fork").Process(target=observe, args=(server.url, str(lat_path), args.sample, stop_obs),
                                                  daemon=True)
        observer.start()
        time.sleep(1.0)
        observer_pid = observer.pid
        fleet = Fleet(FleetConfig(
            nats_url=server.url, instances=args.instances, rate=args.rate, duration=args.duration,
            shim_fraction=args.shim_fraction, shim_workers=4, canary_fraction=0.01, hostile_fraction=args.hostile_fraction,
            seed=42, manifest=str(work / "manifest.jsonl"), spool_dir=str(work / "spool"), wind_down_timeout=180.0,
        ))
        sampler = Sampler(pipe, server, fleet, args.sample)
        window["since"] = time.time() + args.warmup
        sampler.pids["observer"] = observer_pid
        rss_start = sampler.rss()
        sampler.start()
        print(f"{'t(s)':>6} {'sent/s':>7} {'raw/s':>7} {'mapped/s':>8} {'aep/s':>7} {'mapper lag':>10} "
              f"{'pairing lag':>11} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7}  RSS MiB nats/map/pair   "
              f"CPU % nats/map/pair/sim(+shims)/obs/machine", flush=True)
        printed = [0]

        def progress(_snap: dict) -> None:
            lat_rows = read_latency(lat_path)
            for row in sampler.rows[printed[0]:]:
                printed[0] += 1
                lat = next((r["lat"] for r in reversed(lat_rows) if abs(r["rel"] - row["t"]) < args.sample), [])
                rss = row["rss_kb"]
                c = row["cpu"]
                print(f"{row['t']:>6.0f} {row['sent_rate']:>7.0f} {row.get('HERMES_RAW_rate', 0):>7.0f} "
                      f"{row.get('BRIDGE_MAPPED_rate', 0):>8.0f} {row.get('AEP_EVENTS_rate', 0):>7.0f} "
                      f"{row['mapper_pending'] + row['mapper_ack_pending']:>10} {row['pairing_pending']:>11} "
                      f"{pct(lat, .5):>7.0f} {pct(lat, .99):>7.0f} {max(lat) if lat else float('nan'):>7.0f}  "
                      f"{rss['nats'] / 1024:>4.0f}/{rss.get('mapper-0', 0) / 1024:.0f}/{rss.get('pairing-0', 0) / 1024:.0f}"
                      f"{'':>10}{c.get('nats', 0)}/{c.get('mapper-0', 0)}/{c.get('pairing-0', 0)}/{c.get('sim', 0)}/"
                      f"{c.get('observer', 0)}/{c.get('machine', 0)}",
                      flush=True)

        def read_latency(path: Path) -> list[dict]:
            rows = []
            try:
                for line in path.read_text().splitlines():
                    r = json.loads(line)
                    r["rel"] = r["t"] - (time.time() - (time.monotonic() - sampler.t0))
                    rows.append(r)
            except (OSError, ValueError):
                pass
            return rows

        fleet.progress = progress
        started = time.monotonic()
        traffic_wall = time.time()
        snap = fleet.run()
        traffic_s = snap["elapsed_s"]
        window["until"] = traffic_wall + traffic_s
        print(f"soak: traffic phase over after {time.monotonic() - started:.0f} s (wind-down included); draining spools",
              flush=True)
        left = fleet.drain(timeout=120)
        fleet.close()
        try:
            settled = pipe.settle(timeout=180, quiet_s=3.0)
        except TimeoutError as exc:  # a backlog (the services could not keep up): report what was measured
            settled = {"not settled": str(exc)}
            print(f"soak: {exc}", flush=True)
        time.sleep(args.sample + 1)
        sampler.stop.set()
        sampler.join()
        progress({})
        rss_end = sampler.rss()
        stop_obs.set()
        observer.join(timeout=args.sample + 5)

        # ------------------------------------------------------------ figures
        lat_rows = read_latency(lat_path)
        warm = [v for r in lat_rows if r["rel"] >= args.warmup for v in r["lat"]]
        allv = [v for r in lat_rows for v in r["lat"]]
        rows_after = [r for r in sampler.rows if r["t"] >= args.warmup]
        base = rows_after[0]["rss_kb"] if rows_after else rss_start
        steady = [r for r in sampler.rows if args.warmup <= r["t"] <= traffic_s]
        sent_rate = snap["sent"] / traffic_s if traffic_s else 0
        aep_rates = [r.get("AEP_EVENTS_rate", 0) for r in steady]
        print()
        print("soak: summary")
        print(f"  traffic        {snap['sent']} events in {traffic_s:.0f} s = {sent_rate:.0f} events/s sent "
              f"(target {args.rate:.0f}); outcomes {snap['outcomes']}; via {snap['via']}")
        print(f"  real shims     {snap['shim_runs']} runs, p50 {snap['shim_p50_ms']} ms, max {snap['shim_max_ms']} ms, "
              f"{snap['shim_failures']} failures")
        if steady:
            print(f"  sustained      after warm-up: raw {statistics.mean(r.get('HERMES_RAW_rate', 0) for r in steady):.0f}/s, "
                  f"mapped {statistics.mean(r.get('BRIDGE_MAPPED_rate', 0) for r in steady):.0f}/s, "
                  f"AEP {statistics.mean(aep_rates):.0f}/s (min interval {min(aep_rates):.0f}/s)")
            print(f"  lag            mapper max {max(r['mapper_pending'] + r['mapper_ack_pending'] for r in steady)}, "
                  f"pairing max {max(r['pairing_pending'] for r in steady)} messages (after warm-up)")
        print(f"  latency        shim receive -> AEP_EVENTS stored, mapped events, after warm-up ({len(warm)}): "
              f"p50 {pct(warm, .5):.0f} ms, p90 {pct(warm, .9):.0f} ms, p99 {pct(warm, .99):.0f} ms, "
              f"p99.9 {pct(warm, .999):.0f} ms, max {max(warm) if warm else float('nan'):.0f} ms; "
              f"whole run p99 {pct(allv, .99):.0f} ms")
        growth = {}
        for name in rss_end:
            b = base.get(name) or 0
            growth[name] = (rss_end[name] / b - 1) if b else float("nan")
            print(f"  memory {name:<8} start {rss_start.get(name, 0) / 1024:7.1f} MiB, after warm-up {b / 1024:7.1f} MiB, "
                  f"end {rss_end[name] / 1024:7.1f} MiB ({100 * growth[name]:+.1f} % after warm-up)")
        print(f"  settled        {settled}")
        print(f"  spool left     {left or 'none'}")
        if "not settled" in settled:
            print("soak: not verified (the pipeline did not settle)", flush=True)
            report = None
        else:
            print("soak: verifying (reading every stream) ...", flush=True)
            from bridge.sim.verify import verify

            t = time.monotonic()
            # One mapper and no faults: per-session order must hold strictly (no backfill).
            report = verify(server.url, work / "manifest.jsonl", wait=60, schema_sample=args.schema_sample,
                            strict_order=args.mappers == 1)
            print(report.render())
            print(f"soak: verified in {time.monotonic() - t:.0f} s")
        targets = {
            f"rate sustained (sent >= 95 % of {args.rate:.0f}/s, AEP keeps up)": sent_rate >= 0.95 * args.rate
            and bool(steady) and statistics.mean(aep_rates) >= 0.95 * sent_rate,
            "zero loss, zero duplicates (verifier)": report is not None and report.lost_count == 0
            and report.duplicate_count == 0 and report.id_under_two_sources == 0,
            "verifier clean (invariants, schema, canaries)": report is not None and report.ok,
            f"p99 end-to-end <= {args.p99_ms:.0f} ms (after warm-up)": bool(warm) and pct(warm, .99) <= args.p99_ms,
            "memory growth <= 10 % after warm-up (mapper, pairing)": all(
                growth.get(w.name, 1.0) <= 0.10 for w in pipe.workers),
        }
        print("soak: targets")
        for name, met in targets.items():
            print(f"  {'PASS' if met else 'FAIL'}  {name}")
        ok = all(targets.values())
        return 0 if ok else 1
    finally:
        stop_obs.set()
        if observer is not None and observer.is_alive():
            observer.terminate()
        pipe.stop()  # the services write their last snapshot as they stop
        server.stop()
        if args.tracemalloc:
            tracemalloc_post_step(tm_dir, window)
        if not args.keep and not args.dir:
            shutil.rmtree(work, ignore_errors=True)
        elif args.keep:
            print(f"soak: work directory kept: {work}", flush=True)


def tracemalloc_post_step(tm_dir: Path, window: dict[str, float]) -> None:
    """Per service: traced bytes vs RSS over time, top growth sites (end of warm-up -> end of traffic)."""
    sys.path.insert(0, os.path.dirname(__file__))
    from tracemalloc_report import report

    print(f"soak: tracemalloc snapshots in {tm_dir} (compare again: "
          f"benchmarks/tracemalloc_report.py {tm_dir} --since {window.get('since', 0):.0f} "
          f"--until {window.get('until', 0):.0f})", flush=True)
    try:
        report(tm_dir, window.get("since"), window.get("until"))
    except Exception as exc:  # the soak's verdict stands; the snapshots are kept
        print(f"soak: tracemalloc report failed: {type(exc).__name__}: {exc}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
