"""Throughput of the pipeline at R3 with JetStream's fsync at its default interval vs `always`.

`sync_interval` is how often JetStream fsyncs its files (the chart's default: 2m, which is
nats-server's). `always` fsyncs every write: nothing acked is lost even when all three
machines lose power at once, at a cost. For each setting: a fresh three-node cluster
(tests/clusterfixture.py), `bootstrap --replicas 3`, N raw messages published to HERMES_RAW
(rate: acked publishes/s), then one mapper and one pairing worker; the time from their
start until AEP_EVENTS holds every event (rate: events/s through mapper + pairing).

    .venv/bin/python benchmarks/bench_sync_interval.py --n 20000
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bridge.sim.harness import Pipeline  # noqa: E402
from bridge.sim.sessions import realistic_envelopes  # noqa: E402
from tests.clusterfixture import Cluster  # noqa: E402
from tests.support.services import expected_events, publish_all, raw_records  # noqa: E402


def cluster_with(sync: str | None) -> Cluster:
    cluster = Cluster()
    if sync:
        for n in cluster.nodes:
            text = n.config_path.read_text()
            n.config_path.write_text(text.replace("jetstream {\n", f"jetstream {{\n  sync_interval: {sync}\n", 1))
    cluster.start()
    return cluster


def run(sync: str | None, n: int) -> dict[str, float]:
    cluster = cluster_with(sync)
    try:
        cluster.bootstrap(3)
        records = raw_records(realistic_envelopes(n, seed=5), instance="bench")
        pipe = Pipeline(cluster.url, tempfile.mkdtemp(prefix="aep-bench-sync-"))
        t0 = time.monotonic()
        pipe.run(lambda js: publish_all(js, records), timeout=600)
        publish_s = time.monotonic() - t0
        want = len(expected_events([(i + 1, body) for i, (_, body, _) in enumerate(records)], 1))
        t1 = time.monotonic()
        pipe.add("mapper")
        pipe.add("pairing", name="pairing-0", env={"AEP_BRIDGE_TICK_S": "3600"})
        try:
            last, since, through_s = -1, time.monotonic(), 0.0
            while True:  # until every event is there (pairing may suppress a few), or no growth for 10 s
                got = pipe.counts()["AEP_EVENTS"]
                if got != last:
                    last, since, through_s = got, time.monotonic(), time.monotonic() - t1
                if got >= want * 0.98 or time.monotonic() - since > 10:
                    break
                time.sleep(0.2)
        finally:
            pipe.stop()
        events = pipe.counts()["AEP_EVENTS"]
        return {"publish_per_s": n / publish_s, "events": events, "through_per_s": events / through_s}
    finally:
        cluster.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=20000)
    args = ap.parse_args()
    for sync in (None, "always"):
        r = run(sync, args.n)
        print(f"sync_interval {sync or 'default (2m)'}: HERMES_RAW publish {r['publish_per_s']:.0f} msgs/s; "
              f"mapper + pairing {r['through_per_s']:.0f} events/s ({r['events']:.0f} events)", flush=True)


if __name__ == "__main__":
    asyncio.set_event_loop_policy(None)
    main()
