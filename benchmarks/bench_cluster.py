"""The pipeline on three engines in one run: R1 (one nats-server), R3 (a three-node cluster at
JetStream's default fsync, `sync_interval` 2m) and R3 with `sync_interval: always` (fsync every
write: what deploy/nats/nats.conf and the chart set).

For each engine, a fresh server or cluster (tests/natsfixture.py's process server;
tests/clusterfixture.py), the bridge's bootstrap at its replicas, then:

(a) **Backlog.** N raw messages published to HERMES_RAW (rate: acked publishes/s, pipelined
    as the shims of a fleet are), then one mapper and one pairing worker; the time from their
    start until AEP_EVENTS holds every event (rate: events/s through mapper + pairing).
(b) **Steady load.** With the same two workers, the fleet simulator (`bridge.sim.fleet`, the
    shim's code in-process) at `--rate` events/s for `--seconds`, below capacity; end to end =
    the shim's receive time (a mapped event id's ULID time: the raw message's `ts`) to the time
    JetStream stored the event on AEP_EVENTS, measured by `benchmarks/soak.py`'s observer (its
    own process), over the mapped events after `--warmup` s: p50, p99, max.

Prints each engine's figures, then ratios against R1 measured in the same run, and the load
average (`os.getloadavg`) around each engine: the machine is shared.

    .venv/bin/python benchmarks/bench_cluster.py --n 20000 --rate 300 --seconds 40
    .venv/bin/python benchmarks/bench_cluster.py --n 3000 --seconds 15       # a smoke run
    .venv/bin/python benchmarks/bench_cluster.py --rounds 3                  # interleaved, medians
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bridge.sim.fleet import Fleet, FleetConfig  # noqa: E402
from tests.support.pipeline import Pipeline  # noqa: E402
from bridge.sim.sessions import realistic_envelopes  # noqa: E402
from soak import observe, pct  # noqa: E402  # the soak's e2e observer and percentiles
from tests.clusterfixture import Cluster  # noqa: E402
from tests.natsfixture import ProcessNats  # noqa: E402
from tests.support.services import expected_events, publish_all, raw_records  # noqa: E402

# (label, replicas, sync_interval: None = nats-server's default, 2m)
ENGINES: tuple[tuple[str, int, str | None], ...] = (("R1", 1, None), ("R3", 3, None), ("R3 always", 3, "always"))


def set_sync(config_path: Path, sync: str | None) -> None:
    if sync:
        text = config_path.read_text()
        config_path.write_text(text.replace("jetstream {\n", f"jetstream {{\n  sync_interval: {sync}\n", 1))


def start_engine(replicas: int, sync: str | None) -> tuple[str, Callable[[], None]]:
    """A started, bootstrapped engine: (the URL the clients take, close)."""
    if replicas == 1:
        server = ProcessNats()
        set_sync(server.config_path, sync)
        try:
            server.start()
            Pipeline(server.url, server.dir / "boot").bootstrap(replicas=1)
        except BaseException:
            server.close()
            raise
        return server.url, server.close
    cluster = Cluster(replicas)
    for n in cluster.nodes:
        set_sync(n.config_path, sync)
    try:
        cluster.start()
        cluster.bootstrap(replicas)
    except BaseException:
        cluster.close()
        raise
    return cluster.url, cluster.close


def backlog(pipe: Pipeline, n: int) -> dict[str, float]:
    """(a): publish N raw messages, then start 1 mapper + 1 pairing and time the drain.
    The two workers stay running for (b)."""
    records = raw_records(realistic_envelopes(n, seed=5), instance="bench")
    t0 = time.monotonic()
    pipe.run(lambda js: publish_all(js, records), timeout=600)
    publish_s = time.monotonic() - t0
    want = len(expected_events([(i + 1, body) for i, (_, body, _) in enumerate(records)], 1))
    t1 = time.monotonic()
    pipe.add("mapper")
    pipe.add("pairing", name="pairing-0", env={"AEP_BRIDGE_TICK_S": "3600"})
    last, since, through_s = -1, time.monotonic(), 0.0
    while True:  # until every event is there (pairing may suppress a few), or no growth for 10 s
        got = pipe.counts()["AEP_EVENTS"]
        if got != last:
            last, since, through_s = got, time.monotonic(), time.monotonic() - t1
        if got >= want * 0.98 or time.monotonic() - since > 10:
            break
        time.sleep(0.2)
    return {"publish_per_s": n / publish_s, "events": last, "through_per_s": last / through_s if through_s else 0.0}


def steady(pipe: Pipeline, url: str, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """(b): the fleet at --rate for --seconds; e2e latency from soak.py's observer."""
    lat_path = work / "latency.jsonl"
    stop = mp.get_context("fork").Event()
    observer = mp.get_context("fork").Process(target=observe, args=(url, str(lat_path), 1.0, stop), daemon=True)
    observer.start()
    time.sleep(1.0)  # its consumer is there before the first event
    before = pipe.counts()["AEP_EVENTS"]
    fleet = Fleet(FleetConfig(nats_url=url, instances=args.instances, rate=args.rate, duration=args.seconds,
                              wind_down=False, seed=42, spool_dir=str(work / "spool"), manifest=str(work / "manifest.jsonl")))
    started = time.time()
    try:
        snap = fleet.run()
        left = fleet.drain(timeout=60)
    finally:
        fleet.close()
    try:
        pipe.settle(timeout=120, quiet_s=2.0)
        settled = True
    except TimeoutError:
        settled = False
    time.sleep(1.5)  # the observer's last window
    stop.set()
    observer.join(10)
    if observer.is_alive():
        observer.terminate()
    rows = [json.loads(line) for line in lat_path.read_text().splitlines() if line.strip()] if lat_path.exists() else []
    lat = [v for r in rows if r["t"] - 1.0 >= started + args.warmup for v in r["lat"]]
    return {"sent": snap["sent"], "sent_per_s": snap["sent"] / snap["elapsed_s"] if snap["elapsed_s"] else 0.0,
            "outcomes": snap["outcomes"], "spool_left": len(left), "settled": settled,
            "events": pipe.counts()["AEP_EVENTS"] - before, "samples": len(lat),
            "p50": pct(lat, 0.5), "p99": pct(lat, 0.99), "max": max(lat) if lat else float("nan")}


def run(label: str, replicas: int, sync: str | None, args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="aep-bench-cluster-"))
    load_before = os.getloadavg()
    url, close = start_engine(replicas, sync)
    pipe = Pipeline(url, work / "logs")
    try:
        a = backlog(pipe, args.n)
        b = steady(pipe, url, work, args) if args.seconds > 0 else {}
    finally:
        pipe.stop()
        close()
        shutil.rmtree(work, ignore_errors=True)
    r = {"label": label, **a, **{f"e2e_{k}": v for k, v in b.items()}, "load": (load_before, os.getloadavg())}
    print(f"{label:<10} backlog of {args.n}: HERMES_RAW publish {r['publish_per_s']:,.0f} msgs/s; mapper + pairing "
          f"{r['through_per_s']:,.0f} events/s ({r['events']:,} events)", flush=True)
    if b:
        print(f"{'':<10} steady {args.rate:.0f} events/s for {args.seconds:.0f} s: sent {b['sent']:,} "
              f"({b['sent_per_s']:.0f}/s, {b['outcomes']}), {b['events']:,} events on AEP_EVENTS"
              f"{'' if b['settled'] else ' (NOT settled within 120 s)'}{spool_note(b['spool_left'])}; "
              f"e2e over {b['samples']:,} mapped events after {args.warmup:.0f} s: "
              f"p50 {b['p50']:.0f} ms, p99 {b['p99']:.0f} ms, max {b['max']:.0f} ms", flush=True)
    print(f"{'':<10} load average {' '.join(f'{x:.2f}' for x in load_before)} before, "
          f"{' '.join(f'{x:.2f}' for x in r['load'][1])} after", flush=True)
    return r


def spool_note(left: int) -> str:
    return f", spool left on {left} instances" if left else ""


def ratio(x: float, base: float) -> str:
    return f"{x / base:.2f}" if base and x == x and base == base else "n/a"  # x == x: not NaN


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=20000, help="raw messages in the backlog (default 20000)")
    ap.add_argument("--rate", type=float, default=300.0, help="steady load, events/s (default 300)")
    ap.add_argument("--seconds", type=float, default=40.0, help="seconds of steady load (default 40; 0: backlog only)")
    ap.add_argument("--warmup", type=float, default=5.0, help="seconds of steady load left out of the latency (default 5)")
    ap.add_argument("--instances", type=int, default=100, help="simulated instances in the steady load (default 100)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="rounds of every engine, interleaved (R1, R3, R3 always, R1, ...): each round's "
                         "ratios, then each engine's median (default 1)")
    ap.add_argument("--engines", default=",".join(e[0] for e in ENGINES),
                    help=f"comma-separated subset of {', '.join(e[0] for e in ENGINES)} (R1 first: the ratios' base)")
    args = ap.parse_args()
    wanted = [s.strip() for s in args.engines.split(",") if s.strip()]
    unknown = set(wanted) - {e[0] for e in ENGINES}
    if unknown:
        ap.error(f"unknown engine(s) {sorted(unknown)}")
    print(f"bench_cluster: backlog {args.n}, steady {args.rate:.0f} events/s for {args.seconds:.0f} s "
          f"(warm-up {args.warmup:.0f} s), {args.instances} instances; {os.cpu_count()} CPUs", flush=True)
    rounds: list[list[dict[str, Any]]] = []
    for k in range(args.rounds):
        if args.rounds > 1:
            print(f"\nround {k + 1} of {args.rounds}", flush=True)
        rounds.append([run(label, replicas, sync, args) for label, replicas, sync in ENGINES if label in wanted])
    for k, results in enumerate(rounds):
        base = results[0]
        print(f"\n{f'round {k + 1}: ' if args.rounds > 1 else ''}ratios against {base['label']} (same run): "
              f"publish, mapper + pairing, e2e p50, e2e p99")
        for r in results[1:]:
            print(f"  {r['label']:<10} {ratio(r['publish_per_s'], base['publish_per_s'])}, "
                  f"{ratio(r['through_per_s'], base['through_per_s'])}, "
                  f"{ratio(r.get('e2e_p50', float('nan')), base.get('e2e_p50', float('nan')))}, "
                  f"{ratio(r.get('e2e_p99', float('nan')), base.get('e2e_p99', float('nan')))}")
    if args.rounds > 1:
        print(f"\nmedians over {args.rounds} interleaved rounds: publish msgs/s, mapper + pairing events/s, "
              f"e2e p50 ms, e2e p99 ms")
        for i, label in enumerate(r["label"] for r in rounds[0]):
            runs = [results[i] for results in rounds]
            cols = [median([r.get(key, float("nan")) for r in runs])
                    for key in ("publish_per_s", "through_per_s", "e2e_p50", "e2e_p99")]
            print(f"  {label:<10} {cols[0]:,.0f}, {cols[1]:,.0f}, {cols[2]:.0f}, {cols[3]:.0f}")


def median(xs: list[float]) -> float:
    xs = sorted(x for x in xs if x == x)  # NaN left out
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2 if xs else float("nan")


if __name__ == "__main__":
    main()
