"""The cluster fault suite's one harness (issue 23): the whole bridge as real processes on the
three-node cluster (tests/clusterfixture.py), the fleet simulator's traffic, and the checks
every scenario ends with.

``ClusterRun`` bootstraps at R3, starts a Tansu broker, then 2 mappers, 2 pairing workers, the
gate, the relay and an exporter (one Kafka sink, CloudEvents) with the cluster's full server
list, and the simulator (canaries, approvals, subagents: its normal mix) at ``RATE`` events/s
for ``DURATION`` s. A scenario injects its fault while the traffic runs, then ``finish()``:
the simulator winds down, the spools drain, the pipeline settles, ``verify`` must be clean
(0 lost, 0 duplicates, invariants, approvals, canaries), every service is still running,
and Kafka holds every AEP_EVENTS id exactly once.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bridge.sim.fleet import Fleet, FleetConfig
from tests.support.pipeline import Pipeline, Worker
from bridge.sim.verify import Report, StreamReader
from tests.clusterfixture import Cluster
from tests.support.cli import free_port
from tests.support.faults import PRICED, assert_clean, finish
from tests.support.tansu import Tansu, consume

RATE = 200.0
# 40 s: each fault comes at 6-12 s and every scenario has >= 10 s of traffic after its fault
# has healed (60 s before: the suite's time, 2026-12-04, and no scenario found more with it).
DURATION = 40.0
TOPIC = "aep-ce"
#: Windows shorter than production's by configuration (the suite's time), wider than the
#: single-server runs' (tests/support/faults.py SHORT_WINDOWS): a publish stalled by an
#: election must not look like a dead replica. A message a mapper took and did not ack comes
#: back after 10 s (production 30); pairing holds 15 s (45), still above that.
CLUSTER_WINDOWS = {"AEP_BRIDGE_MAPPER_ACK_WAIT_S": "10", "AEP_BRIDGE_PAIRING_HOLD_S": "15"}
SINK = "ce"


class RelayWorker(Worker):
    """The relay: no metrics port; ``/healthz`` on its listen address."""

    def start(self) -> "RelayWorker":
        self.port = free_port()
        self.starts += 1
        cmd = [*self._python(), "relay", "--nats", self.url, "--listen", f"127.0.0.1:{self.port}", *self.args]
        import subprocess

        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        return self

    def _python(self) -> list[str]:
        import sys

        return [sys.executable, "-m", self.module]

    def ready(self, timeout: float = 2.0) -> bool:
        import urllib.request

        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=timeout) as r:
                return r.status == 200
        except OSError:
            return False


class ClusterRun:
    def __init__(self, cluster: Cluster, tmp_path: Path, *, pairing_env: dict[str, str] | None = None) -> None:
        self.cluster = cluster
        self.tmp = tmp_path
        cluster.bootstrap(3)
        self.tansu = Tansu(tmp_path / "tansu.log").start()
        self.tansu.create_topics(TOPIC, partitions=3)
        self.pipe = Pipeline(cluster.url, tmp_path / "logs", env=dict(CLUSTER_WINDOWS, **PRICED))
        p = self.pipe
        for _ in range(2):
            p.add("mapper", args=["--batch", "64"])
        for i in range(2):
            p.add("pairing", name=f"pairing-{i}", env={"AEP_BRIDGE_TICK_S": "2", **(pairing_env or {})})
        p.add("gate")
        p.add("exporter", args=["--sink", f"kafka://{self.tansu.bootstrap}/{TOPIC}?name={SINK}"])
        relay = RelayWorker("relay", cluster.url, p.dir, "relay", env={**p.env, "AEP_BRIDGE_CONFIG": os.devnull,
                                                                        "AEP_BRIDGE_LOG_FORMAT": "json"})
        relay.env = {**os.environ, **relay.env}
        p.workers.append(relay.start())
        p.wait_ready(60)
        self.fleet: Fleet | None = None
        self.thread: threading.Thread | None = None
        self.t0 = 0.0

    # ------------------------------------------------------------ traffic

    def start_traffic(self, rate: float = RATE, duration: float = DURATION, **kw: Any) -> Fleet:
        # The shim's own code in-process only: a real shim process the loaded 2-core machine
        # starts late finds no stdin within its deadline (`_invalid stdin_timeout`), which
        # says nothing about the cluster (tests/sim/test_faults.py runs real shims).
        cfg = dict(nats_url=self.cluster.url, instances=40, rate=rate, duration=duration, shim_fraction=0.0,
                   canary_fraction=0.05, seed=int.from_bytes(os.urandom(2), "big"),
                   manifest=str(self.tmp / "manifest.jsonl"), spool_dir=str(self.tmp / "spool"))
        cfg.update(kw)
        self.fleet = Fleet(FleetConfig(**cfg))
        print(f"fleet seed {self.fleet.config.seed}")
        self.thread = threading.Thread(target=self.fleet.run, name="fleet", daemon=True)
        self.t0 = time.monotonic()
        self.thread.start()
        return self.fleet

    def at(self, seconds: float) -> None:
        """Sleep until ``seconds`` after the traffic started."""
        time.sleep(max(0.0, self.t0 + seconds - time.monotonic()))

    # ------------------------------------------------------------ the end of every scenario

    def finish(self, wait: float = 120.0) -> Report:
        assert self.fleet is not None and self.thread is not None
        report = finish(self.fleet, self.thread, self.pipe, wait=wait)
        dead = [w.name for w in self.pipe.workers if not w.alive()]
        assert not dead, f"services that did not ride out the faults: {dead}\n" + self.pipe.logs()
        gate = self.pipe.of("gate")[0].log(10_000_000)
        assert "handle_given_up" not in gate, "the gate gave up a message while NATS changed leaders:\n" + "\n".join(
            line for line in gate.splitlines() if "handle_given_up" in line)[:3000]
        assert_clean(report, self.pipe)
        assert report.approvals_checked > 0, "the run carried approvals:\n" + report.render()
        assert report.approval_count == 0, report.render()
        t0 = time.monotonic()
        self.assert_kafka_exactly_once()
        print(f"approvals checked {report.approvals_checked}; backfills {report.backfills}; "
              f"spooled {self.fleet.outcomes['spooled']}; kafka check {time.monotonic() - t0:.1f} s")
        return report

    def aep_ids(self) -> list[str]:
        async def read(js: Any) -> list[str]:
            out: list[str] = []
            r = StreamReader(js, "AEP_EVENTS", "aep.>")
            await r.read_new(lambda m: out.append(json.loads(m.data)["id"]))
            await r.close()
            return out

        return self.pipe.run(read, timeout=120)

    def export_settled(self, timeout: float = 90.0) -> None:
        async def pending(js: Any) -> int:
            info = await js.consumer_info("AEP_EVENTS", f"export-{SINK}")
            return (info.num_pending or 0) + (info.num_ack_pending or 0)

        deadline = time.monotonic() + timeout
        left = -1
        while time.monotonic() < deadline:
            try:
                left = self.pipe.run(pending)
            except Exception as exc:  # a node coming back
                left = -1
                print(f"export lag: {exc!r}")
            if left == 0:
                return
            time.sleep(0.5)
        raise AssertionError(f"the exporter did not catch up within {timeout}s ({left} left)\n"
                             + self.exporter().log())

    def assert_kafka_exactly_once(self) -> None:
        self.export_settled()
        ids = self.aep_ids()
        assert len(ids) == len(set(ids)), "AEP_EVENTS holds each id once"
        got = [dict(m.headers() or [])["aep-id"].decode() for m in consume(self.tansu.bootstrap, TOPIC, len(ids), 120)]
        counts = Counter(got)
        missing = set(ids) - set(counts)
        extra = set(counts) - set(ids)
        twice = {i: n for i, n in counts.items() if n > 1}
        print(f"kafka: {len(got)} records, {len(counts)} ids; AEP_EVENTS {len(ids)}")
        if missing or extra or twice:  # keep the evidence: every stream, and the exporter's own account
            try:
                where = f"streams dumped to {self.pipe.dump(self.pipe.dir.parent / 'dump')}"
            except Exception as exc:
                where = f"(stream dump failed: {exc!r})"
            letters = "\n".join(line for line in self.exporter().log(10_000_000).splitlines()
                                 if '"dead_letter' in line or "export_" in line)[-3000:]
            raise AssertionError(
                f"Kafka holds every event exactly once by id: {len(missing)} missing (e.g. {sorted(missing)[:3]}), "
                f"{len(extra)} unknown, {len(twice)} more than once (e.g. {list(twice.items())[:3]})\n{where}\n"
                f"the exporter's dead letters:\n{letters}")

    def exporter(self) -> Worker:
        return self.pipe.of("exporter")[0]

    def close(self) -> None:
        try:
            if self.fleet is not None and self.thread is not None and self.thread.is_alive():
                self.fleet.stop()
                self.thread.join(30)
        finally:
            self.pipe.stop()
            self.tansu.stop()
