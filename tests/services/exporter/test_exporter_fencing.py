"""Exporter replicas sharing a sink (`replicas` > 1) must not split a partition between two
replicas (issue 39, item 2): a replica whose lease may have lapsed fetches and delivers no
more (pairing's fence), a failed members read does not skip the renewals, and the exporter
is not ready while a lease is unsure.

In process, against a real nats-server, with a sink that records what each replica
delivered (the Kafka record's key is the lane, its `aep-id` header the event id)."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import nats

from bridge.config import Settings
from bridge.core.sinks import sink_from_url
from bridge.services.exporter import partitions as P
from bridge.services.exporter.service import Exporter
from bridge.services.exporter.sinks import Outcome
from tests.natsfixture import JetStreamClient
from tests.support.exporter import sim_messages
from tests.support.services import publish_all


class Recording:
    """A sink that confirms everything and records (replica, lane, event id) in one shared
    list, in the order the replicas sent them."""

    def __init__(self, log: list[tuple[str, str, str]], replica: str) -> None:
        self.log, self.replica = log, replica

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def send(self, records: list[Any]) -> list[Outcome]:
        for key, _, headers in records:
            self.log.append((self.replica, key.decode(), dict(headers)["aep-id"].decode()))
        await asyncio.sleep(0.002)  # a sink takes a moment: the loop interleaves the partitions
        return [Outcome(True) for _ in records]


async def exporter(url: str, name: str, sink: str, log: list) -> Exporter:
    exp = Exporter(Settings(nats_url=url, instance=name), [sink_from_url(sink)])
    await exp.connect()
    exp.workers[0].sink = Recording(log, name)
    return exp


def ready(exp: Exporter) -> bool:
    exp._readiness()
    return exp.health.ready


def check_split(log: list[tuple[str, str, str]], order: dict[str, int]) -> tuple[dict[str, list[str]], list[str], list[str]]:
    """(lanes -> replicas in the order they delivered them, lanes a replica delivered after
    another had taken them over, lanes whose first copies are out of AEP_EVENTS order)."""
    owners: dict[str, list[str]] = defaultdict(list)
    shared, firsts, seen = [], defaultdict(list), set()
    for replica, lane, eid in log:
        if replica in owners[lane] and owners[lane][-1] != replica and lane not in shared:
            shared.append(lane)  # back to a replica after another one delivered the lane
        if not owners[lane] or owners[lane][-1] != replica:
            owners[lane].append(replica)
        if eid not in seen:
            seen.add(eid)
            firsts[lane].append(order[eid])
    disordered = [lane for lane, pos in firsts.items() if pos != sorted(pos)]
    return owners, shared, disordered


def test_a_replica_whose_members_read_fails_keeps_renewing_and_no_partition_is_split(nats_server_fn):
    """The issue's repro: A's `members()` raises after its first round. Before the fix that
    skipped every renewal of A's rounds: A's leases lapsed after 10 s, B took partitions
    0-5, and A's workers went on fetching from the consumers B recreated under the same
    names: lanes delivered by both, first copies out of order, A still ready."""
    client = JetStreamClient(nats_server_fn.url)
    client.bootstrap()
    client.close()
    msgs = sim_messages(4000, seed=39)
    order = {eid: i for i, (_, _, eid) in enumerate(msgs)}
    sink = "kafka://k:9092/t?name=fx&replicas=2"

    async def scenario() -> tuple[list, list[bool], list[bool], int]:
        log: list[tuple[str, str, str]] = []
        a = await exporter(nats_server_fn.url, "A", sink, log)
        b = await exporter(nats_server_fn.url, "B", sink, log)
        nc = await nats.connect(nats_server_fn.url)
        js = nc.jetstream(timeout=20)
        pa, pb = a.workers[0], b.workers[0]
        calls = {"n": 0}
        members = pa.members

        async def failing() -> int:
            calls["n"] += 1
            if calls["n"] > 1:
                raise TimeoutError("nats: timeout (the leases bucket's stream info)")
            return await members()

        pa.members = failing
        tasks = [asyncio.create_task(pa.run())]
        a_ready: list[bool] = []
        b_ready: list[bool] = []
        try:
            while len(pa.owned) < 12:
                await asyncio.sleep(0.05)
            tasks.append(asyncio.create_task(pb.run()))
            # 16 s of traffic: A's leases (renewed last at ~0 s before the fix) lapse at ~10 s,
            # and B takes its share at its next round
            parts = 32
            for i in range(parts):
                await publish_all(js, msgs[i * len(msgs) // parts:(i + 1) * len(msgs) // parts])
                await asyncio.sleep(0.5)
                if i >= 8:  # from A's fourth failed round on
                    a_ready.append(ready(a))
                    b_ready.append(ready(b))
            deadline = time.monotonic() + 20
            while len({eid for _, _, eid in log}) < len(msgs) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            return log, a_ready, b_ready, calls["n"]
        finally:
            for s in (a, b):
                s.stopper.trigger()
            await asyncio.gather(*tasks, return_exceptions=True)
            for s in (a, b):
                await s.nc.close()
            await nc.close()

    log, a_ready, b_ready, member_reads = asyncio.run(scenario())
    assert member_reads > 5, "A's members read failed round after round"
    owners, shared, disordered = check_split(log, order)
    assert not shared, f"{len(shared)} lanes went back and forth between replicas: one partition split across two"
    assert not disordered, f"{len(disordered)} of {len(owners)} lanes have their first copies out of AEP_EVENTS order"
    assert {eid for _, _, eid in log} == set(order), "every event delivered"
    assert not any(a_ready), "A cannot read the members (its leases' bucket): not ready"
    assert all(b_ready[-4:]), "B is"


def test_a_worker_whose_lease_may_have_lapsed_stops_fetching_and_delivering(nats_server_fn, monkeypatch):
    """A replica paused past its lease (here: its monotonic clock jumps 60 s, as across a
    SIGSTOP) resumes with its partitions' workers running. They must stop before their
    next fetch or send, however the renewal loop fares: the lease may be another
    replica's, which recreated the consumer under the same name. Before the fix they went
    on delivering until the next renewal failed (and forever when the round itself hangs)."""
    client = JetStreamClient(nats_server_fn.url)
    client.bootstrap()
    client.close()
    msgs = sim_messages(1200, seed=7)
    first, second = msgs[:600], msgs[600:]
    sink = "kafka://k:9092/t?name=fy&replicas=2"
    clock = SimpleNamespace(offset=0.0)
    real = time.monotonic
    monkeypatch.setattr(P, "time", SimpleNamespace(monotonic=lambda: real() + clock.offset), raising=False)

    async def scenario() -> dict[str, Any]:
        log: list[tuple[str, str, str]] = []
        a = await exporter(nats_server_fn.url, "A", sink, log)
        nc = await nats.connect(nats_server_fn.url)
        js = nc.jetstream(timeout=20)
        pa = a.workers[0]
        out: dict[str, Any] = {}
        try:
            await pa.setup()
            pa.bound = True
            await pa.maintain()
            assert len(pa.owned) == 12
            await publish_all(js, first)
            deadline = time.monotonic() + 20
            while len(log) < len(first) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            out["before"] = len({eid for _, _, eid in log})
            out["ready_before"] = ready(a)
            clock.offset = 60.0  # the pause: every lease may have lapsed meanwhile
            mark = len(log)
            await publish_all(js, second)
            await asyncio.sleep(3.0)  # more than a fetch's wait (1 s): every worker had its turn
            out["during"] = log[mark:]
            tasks = [own.task for own in pa.owned.values()]
            out["ended"] = [t.done() and not t.cancelled() and t.exception() is None for t in tasks]
            out["ready_during"] = ready(a)
            # the next round drops them (fenced), gives the leases back and takes them again:
            # new workers, recreated consumers, and what was left is delivered
            clock.offset = 0.0
            await pa.maintain()
            await pa.maintain()
            deadline = time.monotonic() + 20
            while len({eid for _, _, eid in log}) < len(msgs) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            out["after"] = {eid for _, _, eid in log}
            out["owned"] = len(pa.owned)
            out["ready_after"] = ready(a)
            return out
        finally:
            a.stopper.trigger()
            for own in list(pa.owned.values()):
                own.task.cancel()
            await asyncio.gather(*(own.task for own in pa.owned.values()), return_exceptions=True)
            await a.nc.close()
            await nc.close()

    out = asyncio.run(scenario())
    assert out["before"] == len(first) and out["ready_before"]
    assert out["during"] == [], f"{len(out['during'])} events delivered after the lease may have lapsed"
    assert out["ended"] == [True] * 12, "each worker stopped on its own, without an error"
    assert not out["ready_during"], "not ready while the leases are unsure"
    assert out["after"] == {eid for _, _, eid in msgs} and out["owned"] == 12 and out["ready_after"]
