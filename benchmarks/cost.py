#!/usr/bin/env python3
"""The cost curve: CPU per event of every process of the pipeline at steady rates, against a
fair floor measured in the same run (issues 24 and 43).

    .venv/bin/python benchmarks/cost.py                       # 250, 1,000, 2,000 events/s, 180 s each
    .venv/bin/python benchmarks/cost.py --rates 250,1000 --seconds 20 --warmup 5   # a smoke run
    .venv/bin/python benchmarks/cost.py --rates 250,1000,2000 --max-rate --seconds 20 --warmup 5

Pipeline: an embedded nats-server, `aep-bridge mapper` and `aep-bridge pairing` (one of each,
`tests/support/pipeline.py`'s `Pipeline`), `aep-bridge relay` with 10 SSE subscribers (one process of
their own, `--sse-worker`), `aep-bridge exporter` with one Kafka sink (a Tansu broker), and
the fleet simulator (`bridge.sim.fleet.Fleet`, 1,000 instances, in-process shims) publishing
at each rate for ``--warmup`` + ``--seconds`` seconds; an observer process (soak.py's) measures
shim receive -> AEP_EVENTS latency.

The floor (issue 43): a second nats-server, bootstrapped alike, and two
`benchmarks/floor_relay.py` processes in the mapper's and pairing's places: the same streams,
subjects and consumers, the same fetch, pause and gather (`bridge.nats.pull.Puller`,
`bridge.runtime.lifecycle.Linger`, pairing's ``GATHER_S``, imported), every publish of a batch
with nats-py's public ``publish_async``, one wait for all their acks, then the raw messages'
acks; no mapping, no state, no metrics. Fed by the same simulator at the same rate, right
before or after the pipeline's phase (the order alternates from one rate to the next;
``--floor-publish bridge``: the services' `AckPublisher` instead of ``publish_async``), with an
observer of its own (shim receive, the raw id's ULID time, -> AEP_EVENTS). Its own flatness
(its cost per event at the lowest rate over the highest) is printed: at most 1.3, or the floor
is not fair (it pays wake-ups the pipeline's policies avoid, or the other way round).
``--bare-chain``: the baseline before issue 43 instead (two `benchmarks/bare_relay.py`: fetch,
``publish_async``, ack, no pause; flatness ~3: not a fair floor).

First, ``--idle`` seconds with no traffic: each process's % of a core, the cost that tracks
wall time rather than events (and what it adds per event at each rate).

Per rate, over the ``--seconds`` after the warm-up: each process's CPU (utime + stime from
/proc/<pid>/stat) in ms per raw event (the raw messages the mapper, or the floor's mapper,
acked in that window) and in % of a core, its RSS at the end, e2e p50/p99; then
(mapper + pairing) ms/event / (floor mapper + floor pairing) ms/event, the ms per event above
the floor, and the flatness figures (the lowest rate's cost per event / the highest rate's).
Targets (issue 43): ratio <= 2.0 at every rate, flatness <= 1.3 (the pipeline's and the
floor's). Figures only, no assertion. Every figure says the event loop it ran on (the services'
`event_loop_factory`: uvloop when installed, else asyncio's; the floor runs on the same).

``--max-rate``: then each system alone (the other's processes stopped with SIGSTOP), the
offered rate raised by ``--max-step`` from ``--max-start`` until the system stops keeping it
(its mapper acked less than 95 % of what the simulator sent, or the backlog grew by more than a
quarter of a second's events over the window), or the simulator itself could not send it; the
highest rate kept is printed, for the pipeline and the floor. The pipeline runs with its relay,
exporter, SSE readers and Kafka broker, the floor without: ``--max-rate-alone`` measures the
pipeline a second time with those stopped too (mapper and pairing alone, as the floor is).

``--profile DIR``: py-spy (PyPI py-spy) records the mapper and pairing during each rate's
measured window (attached by pid; ``--format raw``, collapsed stacks), and the top frames,
self and cumulative, are printed from them (``--top``), then the buckets of issue 43
(`benchmarks/profile_buckets.py`) in µs per event. ``--cpu-profile DIR``: the same buckets from
`benchmarks/cpu_sampler` (CPU-time samples, which py-spy's are not on a loaded machine).
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
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from profile_buckets import read as read_buckets, table as bucket_table  # noqa: E402
from soak import cpu_s, observe, pct, ulid_ms  # noqa: E402

from bridge.nats import streams as S  # noqa: E402
from bridge.runtime.lifecycle import event_loop_factory  # noqa: E402
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
          counter: tuple[str, str], profile: dict[str, int] | None = None, cpu_profile: dict[str, int] | None = None) -> dict:
    """The fleet at ``rate`` for ``--warmup`` + ``--seconds``; the figures of the measured window.
    ``profile``: py-spy on these processes over the window; ``cpu_profile``: `cpu_sampler` on them
    (SIGUSR1 at its start and end; the samples moved to ``<name>-<rate>.cpu.txt``)."""
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
    floor0, lag0 = acked(url, *counter)
    stats0 = server_stats(url)
    t0 = time.monotonic()
    cpu0 = {k: cpu_s(v) for k, v in pids.items()}
    for pid in (cpu_profile or {}).values():
        os.kill(pid, signal.SIGUSR1)  # cpu_sampler: start
    sent0 = fleet.sent
    unix0 = time.time()
    time.sleep(a.seconds)
    dt = time.monotonic() - t0
    cpu1 = {k: cpu_s(v) for k, v in pids.items()}
    for pid in (cpu_profile or {}).values():
        os.kill(pid, signal.SIGUSR1)  # cpu_sampler: stop and write <role>-<pid>.txt
    floor1, lag = acked(url, *counter)
    stats1 = server_stats(url)
    sent = fleet.sent - sent0
    rss = {k: rss_kb(v) for k, v in pids.items()}
    fleet.stop()
    th.join(60)
    fleet.close()
    for s in spies:
        s.wait(30)
    for name, pid in (cpu_profile or {}).items():
        for f in Path(a.cpu_profile).glob(f"*-{pid}.txt"):
            f.replace(Path(a.cpu_profile) / f"{name}-{int(rate)}.cpu.txt")
    events = max(1, floor1 - floor0)
    return {"rate": rate, "events": events, "sent": sent, "dt": dt, "lag": lag, "lag0": lag0, "window": (unix0, unix0 + dt),
            "ms": {k: 1000 * (cpu1[k] - cpu0[k]) / events for k in pids},
            "pct": {k: 100 * (cpu1[k] - cpu0[k]) / dt for k in pids}, "rss": rss,
            "server": {k: (stats1[k] - stats0.get(k, 0)) / events for k in stats1} if stats0 and stats1 else {}}


MONITORS: dict[str, str] = {}  # a nats-server's client URL -> its monitoring URL (--server-stats)


def server_stats(url: str) -> dict[str, float]:
    """The counters of the server at ``url`` (`--server-stats`): messages and bytes in and out
    (/varz: every client and route), JetStream API calls, and each stream's messages (/jsz).
    Empty without a monitoring port."""
    base = MONITORS.get(url)
    if base is None:
        return {}
    import json
    import urllib.request

    def get(path: str) -> dict[str, Any]:
        with urllib.request.urlopen(base + path, timeout=5) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]

    try:
        varz, jsz = get("/varz"), get("/jsz?streams=true")
    except Exception:
        return {}
    out = {k: float(varz.get(k, 0)) for k in ("in_msgs", "out_msgs", "in_bytes", "out_bytes")}
    out["js api"] = float((jsz.get("api") or {}).get("total", 0))
    for acc in jsz.get("account_details") or []:
        for st in acc.get("stream_detail") or []:
            out[f"stream {st['name']}"] = float((st.get("state") or {}).get("last_seq", 0))
    return out


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


def raw_id_latency_ms(msg: Any) -> int | None:
    """The floor's latency (soak.py's `observe` with it): what reaches AEP_EVENTS is the raw
    message itself, so its store time there less the time in its raw id (``Nats-Msg-Id``, the
    ULID the shim stamped on receipt). A quarter of the messages, like soak.py's (the ids' last
    character); None for the others."""
    rid = (msg.headers or {}).get("Nats-Msg-Id", "")
    if len(rid) != 26 or rid[-1] not in "01234567":
        return None
    return int(msg.metadata.timestamp.timestamp() * 1000) - ulid_ms(rid.encode())


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


def loop_of_services() -> str:
    """The event loop the mapper and pairing run on (and the floor, `floor_relay.py`)."""
    return "uvloop" if event_loop_factory() is not None else "asyncio"


def stopped(pids: list[int], stop: bool) -> None:
    """SIGSTOP (or SIGCONT) a system's processes: the other system runs alone (`--max-rate`)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGSTOP if stop else signal.SIGCONT)
        except ProcessLookupError:
            pass


def kept(r: dict) -> tuple[bool, str]:
    """Whether a phase kept its offered rate: the mapper acked 95 % of what was sent in the window
    and the backlog grew by no more than a quarter of a second's events; (False, why) else."""
    sent_s, acked_s = r["sent"] / r["dt"], r["events"] / r["dt"]
    if acked_s < 0.95 * sent_s:
        return False, f"acked {acked_s:.0f}/s of {sent_s:.0f}/s sent"
    if r["lag"] - r["lag0"] > 0.25 * r["rate"]:
        return False, f"backlog {r['lag0']} -> {r['lag']}"
    if sent_s < 0.95 * r["rate"]:  # the system kept what came, the simulator (its acks) sent less
        return False, f"the simulator sent {sent_s:.0f}/s: its limit, or the server's acks"
    return True, ""


def max_rate(name: str, url: str, a: argparse.Namespace, work: Path, tag: str, pids: dict[str, int],
             counter: tuple[str, str], lat_path: Path | None) -> dict:
    """Raise the offered rate step by step until the system stops keeping it."""
    best, steps, why = 0.0, [], ""
    rate = a.max_start
    while rate <= a.max_top:
        r = phase(url, rate, a, work, tag, pids, counter)
        lat = latencies(lat_path, r["window"], 2.0) if lat_path else []
        ok, why = kept(r)
        steps.append((rate, r, ok))
        print(f"  max-rate {name}: {rate:6.0f}/s offered, sent {r['sent'] / r['dt']:6.0f}/s, acked {r['events'] / r['dt']:6.0f}/s, "
              f"backlog {r['lag0']} -> {r['lag']}, e2e p99 {pct(lat, .99):.0f} ms: {'kept' if ok else 'NOT kept (' + why + ')'}",
              flush=True)
        # where the two cores went (the stopped processes show ~0)
        print("    % of a core: " + ", ".join(f"{k} {v:.0f}" for k, v in r["pct"].items() if v >= 0.5)
              + f" (all {sum(r['pct'].values()):.0f}); ms per raw event: "
              + ", ".join(f"{k} {v:.3f}" for k, v in r["ms"].items() if r["pct"][k] >= 0.5), flush=True)
        if not ok:
            break
        best = rate
        rate += a.max_step
    return {"best": best, "why": why, "steps": steps}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="250,1000,2000", help="events per second, comma-separated (default 250,1000,2000)")
    ap.add_argument("--seconds", type=float, default=180.0, help="measured seconds per rate (default 180)")
    ap.add_argument("--warmup", type=float, default=30.0, help="seconds per rate before measuring (default 30)")
    ap.add_argument("--instances", type=int, default=1000)
    ap.add_argument("--subscribers", type=int, default=10, help="SSE subscribers of the relay (default 10)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the floor (or the bare chain)")
    ap.add_argument("--bare-chain", action="store_true",
                    help="the baseline before issue 43 instead of the floor: two bare relays, no pause (not a fair floor)")
    ap.add_argument("--floor-loop", choices=("service", "asyncio"), default="service",
                    help="the floor's event loop: the services' (default) or asyncio's")
    ap.add_argument("--floor-publish", choices=("public", "bridge"), default="public",
                    help="the floor's publish: nats-py's publish_async (default) or the services' AckPublisher")
    ap.add_argument("--max-rate", action="store_true", help="then the highest rate each system keeps alone")
    ap.add_argument("--max-rate-alone", action="store_true",
                    help="with --max-rate: the pipeline's highest rate again with its relay, exporter, SSE readers and "
                         "broker stopped (mapper and pairing alone, in the floor's company)")
    ap.add_argument("--max-start", type=float, default=1000.0, help="--max-rate's first offered rate (default 1000)")
    ap.add_argument("--max-step", type=float, default=1000.0, help="--max-rate's step (default 1000)")
    ap.add_argument("--max-top", type=float, default=12000.0, help="--max-rate's last step (default 12000)")
    ap.add_argument("--idle", type=float, default=20.0, help="seconds measured with no traffic first (0: none; default 20)")
    ap.add_argument("--profile", default=None, metavar="DIR", help="py-spy the mapper and pairing into DIR (per rate)")
    ap.add_argument("--profile-idle", action="store_true",
                    help="with --profile: sample waiting threads too (where a loop waits: wall time, not CPU)")
    ap.add_argument("--profile-rate", type=int, default=100, help="py-spy samples per second (default 100)")
    ap.add_argument("--cpu-profile", default=None, metavar="DIR",
                    help="benchmarks/cpu_sampler (CPU-time samples) on the mapper and pairing into DIR (per rate)")
    ap.add_argument("--top", type=int, default=15, help="frames printed per profile (default 15)")
    ap.add_argument("--service-env", action="append", default=[], metavar="KEY=VALUE",
                    help="added to the mapper's and pairing's environment, and the floor's (repeatable)")
    ap.add_argument("--server-stats", action="store_true",
                    help="each nats-server's messages, bytes and JetStream API calls per raw event in each window "
                         "(its monitoring port, /varz and /jsz)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    ap.add_argument("--sse-worker", nargs=2, metavar=("URL", "N"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.sse_worker:
        asyncio.run(sse_worker(a.sse_worker[0], int(a.sse_worker[1])))
        return 0
    rates = [float(r) for r in a.rates.split(",") if r.strip()]
    env = dict(kv.split("=", 1) for kv in a.service_env)
    floor_env = dict(env)
    for d in (a.profile, a.cpu_profile):
        if d:
            Path(d).mkdir(parents=True, exist_ok=True)
    if a.cpu_profile:
        a.cpu_profile = str(Path(a.cpu_profile).resolve())
        env.update(AEP_CPUPROF=a.cpu_profile, PYTHONPATH=os.pathsep.join(
            [str(HERE / "cpu_sampler"), str(HERE.parent), *filter(None, [os.environ.get("PYTHONPATH")])]))
    work = Path(tempfile.mkdtemp(prefix="aep-cost-"))
    logs = work / "logs"
    logs.mkdir()
    baseline = "none" if a.no_baseline else "bare chain" if a.bare_chain else "floor"
    print(f"cost: rates {', '.join(f'{r:.0f}' for r in rates)} events/s, {a.warmup:.0f} s warm-up + {a.seconds:.0f} s "
          f"measured each, {a.instances} instances, {a.subscribers} SSE subscribers; {os.cpu_count()} CPUs; "
          f"load average {os.getloadavg()[0]:.1f}; mapper and pairing on {loop_of_services()}; baseline: {baseline}"
          f"{'' if a.no_baseline or a.bare_chain else ' on ' + (loop_of_services() if a.floor_loop == 'service' else 'asyncio')}"
          f"; work dir {work}", flush=True)
    from tests.support.tansu import Tansu

    def monitored(store: str) -> EmbeddedNats:
        if not a.server_stats:
            return EmbeddedNats(work / store, log_file=logs / f"{store}.log").start()
        http = free_port()
        srv = EmbeddedNats(work / store, log_file=logs / f"{store}.log", extra_args=["-m", str(http)]).start()
        MONITORS[srv.url] = f"http://127.0.0.1:{http}"
        return srv

    server = monitored("nats")
    bare_server = monitored("nats-bare") if not a.no_baseline else None
    broker = Tansu(logs / "tansu.log").start()
    procs = Procs(logs)
    pipe = Pipeline(server.url, logs, env=env)
    stop_obs = mp.Event()
    stop_spawned = mp.get_context("spawn").Event()  # (for the spawned observers)
    observers: list[Any] = []
    results: dict[str, Any] = {"pipeline": [], "baseline": [], "kind": baseline}
    paused: list[int] = []
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
        observers.append(observer)
        time.sleep(2.0)
        pids = {"nats": server.proc.pid, "mapper": mapper.pid, "pairing": pairing.pid, "relay": relay.pid,
                "exporter": exporter.pid, "sse x10": sse.pid, "tansu": broker.proc.pid, "sim": os.getpid(),
                "observer": observer.pid}
        bare_pids: dict[str, int] = {}
        names = ("relay 1", "relay 2") if a.bare_chain else ("floor mapper", "floor pairing")
        bare_lat = work / "latency-floor.jsonl"
        if bare_server is not None:
            Pipeline(bare_server.url, logs).bootstrap()
            if a.bare_chain:
                r1 = procs.start("bare-1", [sys.executable, str(HERE / "bare_relay.py"), "--nats", bare_server.url,
                                            "--stream", S.HERMES_RAW, "--durable", "bare-1", "--strip", "2",
                                            "--prefix", f"{S.MAPPED_PREFIX}.0"])
                r2 = procs.start("bare-2", [sys.executable, str(HERE / "bare_relay.py"), "--nats", bare_server.url,
                                            "--stream", S.BRIDGE_MAPPED, "--durable", "bare-2", "--strip", "3",
                                            "--prefix", "aep.hermes"])
                bare_counter = (S.HERMES_RAW, "bare-1")
                ready = lambda: (acked(bare_server.url, S.HERMES_RAW, "bare-1"), acked(bare_server.url, S.BRIDGE_MAPPED, "bare-2"))  # noqa: E731
            else:
                r1, r2 = (procs.start(f"floor-{role}", [sys.executable, str(HERE / "floor_relay.py"), "--nats", bare_server.url,
                                                         "--role", role, "--loop", a.floor_loop, "--publish", a.floor_publish],
                                         env=floor_env)
                          for role in ("mapper", "pairing"))
                bare_counter = (S.HERMES_RAW, S.MAPPER_DURABLE)
                ready = lambda: all(b"ready on" in (logs / f"floor-{r}.log").read_bytes() for r in ("mapper", "pairing")) or 1 / 0  # noqa: E731
            def floor_observer() -> Any:
                # (spawned: a fork of this process, which runs threads of its own by then, may hang
                # in the child; the restarted observer of --max-rate recorded nothing once)
                o = mp.get_context("spawn").Process(target=observe, args=(bare_server.url, str(bare_lat), 2.0, stop_spawned, raw_id_latency_ms,
                                                                         f"{S.EVENTS_PREFIX}.>"), daemon=True)
                o.start()
                observers.append(o)
                return o

            fobs = floor_observer()
            bare_pids = {"nats": bare_server.proc.pid, names[0]: r1.pid, names[1]: r2.pid, "sim": os.getpid(),
                         "observer": fobs.pid}
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    ready()
                    break
                except Exception:
                    time.sleep(0.2)
            if not a.bare_chain:
                print("  " + "; ".join((logs / f"floor-{r}.log").read_text().strip().splitlines()[0] for r in ("mapper", "pairing")),
                      flush=True)
        profile = {"mapper": mapper.pid, "pairing": pairing.pid} if a.profile else None
        cpu_profile = {"mapper": mapper.pid, "pairing": pairing.pid} if a.cpu_profile else None
        if a.idle:
            results["idle"] = idle_phase(pids, a.idle, {"mapper": mapper.pid, "pairing": pairing.pid}, a.profile, a)
            print("  idle: " + ", ".join(f"{k} {v:.1f} %" for k, v in results["idle"].items()) + " of a core", flush=True)
        for i, rate in enumerate(rates):
            order = ("pipeline", "baseline") if i % 2 == 0 else ("baseline", "pipeline")  # alternated
            for which in order:
                if which == "pipeline":
                    r = phase(server.url, rate, a, work, "c", pids, (S.HERMES_RAW, S.MAPPER_DURABLE), profile, cpu_profile)
                    path, (first, second), label = lat_path, ("mapper", "pairing"), "pipeline"
                elif bare_pids:
                    r = phase(bare_server.url, rate, a, work, "b", bare_pids, bare_counter)
                    path, (first, second), label = bare_lat, names, baseline
                else:
                    continue
                lat = latencies(path, r["window"], 2.0)
                r["p50"], r["p99"], r["n_lat"] = pct(lat, .5), pct(lat, .99), len(lat)
                results[which].append(r)
                print(f"  {rate:6.0f}/s {label}: sent {r['sent'] / r['dt']:6.0f}/s, {r['events'] / r['dt']:6.0f} raw/s acked by {first}, "
                      f"backlog at the end {r['lag']}; {first} {r['ms'][first]:.3f} + {second} {r['ms'][second]:.3f} ms/event; "
                      f"e2e p50 {r['p50']:.0f} ms p99 {r['p99']:.0f} ms", flush=True)
        report(results, a, rates, names)
        if a.profile or a.cpu_profile:
            for rate, r in zip(rates, results["pipeline"]):
                for name in ("mapper", "pairing"):
                    if a.profile:
                        path = Path(a.profile) / f"{name}-{int(rate)}.txt"
                        print(f"\nprofile {name} at {rate:.0f} events/s ({path}):")
                        print(top_frames(path, a.top))
                        if path.exists():
                            print(bucket_table(read_buckets([path]), r["ms"][name], 3, "py-spy buckets:"))
                    if a.cpu_profile:
                        path = Path(a.cpu_profile) / f"{name}-{int(rate)}.cpu.txt"
                        if path.exists():
                            print(f"\nCPU-time profile {name} at {rate:.0f} events/s ({path}):")
                            print(bucket_table(read_buckets([path]), r["ms"][name], 3, "cpu_sampler buckets:"))
        if a.max_rate:
            print(f"\nhighest rate kept, each system alone (the other stopped), from {a.max_start:.0f}/s by {a.max_step:.0f}/s:",
                  flush=True)
            # (not the observers: an ordered consumer stopped and resumed may stay stalled; idle, they cost nothing)
            others = [bare_server.proc.pid, *(p for k, p in bare_pids.items() if k not in ("sim", "nats", "observer"))] if bare_pids else []
            mine = [server.proc.pid, *(p for k, p in pids.items() if k not in ("sim", "nats", "observer"))]
            paused = others
            stopped(paused, True)
            mp_ = max_rate("pipeline", server.url, a, work, "mc", pids, (S.HERMES_RAW, S.MAPPER_DURABLE), lat_path)
            ma = None
            if a.max_rate_alone:  # the floor's company: the relay, exporter, SSE readers and broker stopped too
                downstream = [pids[k] for k in ("relay", "exporter", "sse x10", "tansu")]
                paused = others + downstream
                stopped(downstream, True)
                ma = max_rate("mapper + pairing alone", server.url, a, work, "ma", pids, (S.HERMES_RAW, S.MAPPER_DURABLE), lat_path)
            stopped(paused, False)
            mb = None
            if bare_pids:
                # The floor's observer lost its server for the pipeline's steps (its ordered consumer
                # does not come back by itself): a new one.
                fobs.terminate()
                fobs.join(5)
                fobs = floor_observer()
                bare_pids["observer"] = fobs.pid
                time.sleep(2.0)
                paused = mine
                stopped(paused, True)
                mb = max_rate(baseline, bare_server.url, a, work, "mb", bare_pids, bare_counter, bare_lat)
                stopped(paused, False)
            paused = []
            print(f"highest rate kept ({loop_of_services()}): pipeline {mp_['best']:.0f}/s (next step: {mp_['why'] or 'the last'})"
                  + (f"; mapper + pairing alone {ma['best']:.0f}/s (next step: {ma['why'] or 'the last'})" if ma else "")
                  + (f"; {baseline} {mb['best']:.0f}/s (next step: {mb['why'] or 'the last'})" if mb else ""), flush=True)
        return 0
    finally:
        stopped(paused, False)
        stop_obs.set()
        stop_spawned.set()
        for o in observers:
            if o.is_alive():
                o.terminate()
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


def acked_rate(r: dict) -> str:
    """The raw messages acked per second in a window, and whether that kept the offered rate
    (a ratio between two systems at different actual rates compares different batch sizes)."""
    ok, _ = kept(r)
    return f"{r['events'] / r['dt']:.0f}{'' if ok else ' (not kept)'}"


def report(results: dict[str, Any], a: argparse.Namespace, rates: list[float], names: tuple[str, str]) -> None:
    loop = loop_of_services()
    pipe = results["pipeline"]
    procs = list(pipe[0]["ms"]) if pipe else []
    print(f"\nCPU per raw event (ms), % of a core and RSS (MiB) at the end of each rate's {a.seconds:.0f} s window "
          f"(mapper and pairing on {loop}):")
    print(f"  {'process':<13}" + "".join(f"{f'{r:.0f}/s':>26}" for r in rates))
    for n in procs:
        print(f"  {n:<13}" + "".join(f"{x['ms'][n]:>9.3f} ms {x['pct'][n]:>4.0f} % {x['rss'][n] / 1024:>5.0f} MiB" for x in pipe))
    e2e = ["p50 %.0f p99 %.0f ms" % (x["p50"], x["p99"]) for x in pipe]
    print(f"  {'e2e':<13}" + "".join(f"{e:>26}" for e in e2e))
    print(f"  {'backlog':<13}" + "".join(f"{x['lag']:>26}" for x in pipe))
    print(f"  {'acked/s':<13}" + "".join(f"{acked_rate(x):>26}" for x in pipe))
    cost = [x["ms"]["mapper"] + x["ms"]["pairing"] for x in pipe]
    print(f"  {'map+pair':<13}" + "".join(f"{c:>23.3f} ms" for c in cost))
    base = results["baseline"]
    if base:
        kind = results["kind"]
        bcost = [x["ms"][names[0]] + x["ms"][names[1]] for x in base]
        what = ("two bare nats-py relays, no pause (HERMES_RAW -> BRIDGE_MAPPED -> AEP_EVENTS; not a fair floor)"
                if kind == "bare chain" else
                f"the floor: two nats-py processes in the mapper's and pairing's places, their consumers, fetch, pause "
                f"and gather, {'public publish_async' if a.floor_publish == 'public' else 'the services AckPublisher'}, "
                f"no mapping or state (on {loop if a.floor_loop == 'service' else 'asyncio'})")
        print(f"{kind}, {what}:")
        for n in base[0]["ms"]:
            print(f"  {n:<13}" + "".join(f"{x['ms'][n]:>9.3f} ms {x['pct'][n]:>4.0f} % {x['rss'][n] / 1024:>5.0f} MiB" for x in base))
        e2e = ["p50 %.0f p99 %.0f ms" % (x["p50"], x["p99"]) for x in base]
        print(f"  {'e2e':<13}" + "".join(f"{e:>26}" for e in e2e))
        print(f"  {'backlog':<13}" + "".join(f"{x['lag']:>26}" for x in base))
        print(f"  {'acked/s':<13}" + "".join(f"{acked_rate(x):>26}" for x in base))
        print(f"  {'sum':<13}" + "".join(f"{c:>23.3f} ms" for c in bcost))
        print(f"pipeline against the {kind}, per rate:")
        print(f"  {'ratio':<13}" + "".join(f"{c / b:>26.2f}" for c, b in zip(cost, bcost))
              + f"   ((mapper + pairing) / ({names[0]} + {names[1]}); target <= 2.0)")
        print(f"  {'above it':<13}" + "".join(f"{c - b:>23.3f} ms" for c, b in zip(cost, bcost)) + "   (ms of CPU per raw event)")
        print(f"  {'e2e p50':<13}" + "".join(f"{f'{x[0]:.0f} / {x[1]:.0f} ms':>26}" for x in zip([p['p50'] for p in pipe], [b['p50'] for b in base]))
              + "   (pipeline / baseline)")
        print(f"  {'e2e p99':<13}" + "".join(f"{f'{x[0]:.0f} / {x[1]:.0f} ms':>26}" for x in zip([p['p99'] for p in pipe], [b['p99'] for b in base])))
        if len(bcost) > 1:
            print(f"flatness, {kind}: {bcost[0] / bcost[-1]:.2f} ({rates[0]:.0f}/s cost / {rates[-1]:.0f}/s cost"
                  + ("; at most 1.3, or the floor is not fair)" if kind == "floor" else ")"))
    for label, runs in (("pipeline's", pipe), ("floor's", results["baseline"])):
        keys = sorted({k for x in runs for k in x.get("server", {})})
        if keys:
            print(f"the {label} nats-server, per raw event (messages and bytes in and out, JetStream API calls, "
                  f"each stream's new messages):")
            for k in keys:
                print(f"  {k:<26}" + "".join(f"{x['server'].get(k, float('nan')):>13.2f}" for x in runs))
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
