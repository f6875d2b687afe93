"""Several exporter replicas on one Kafka sink (`replicas` > 1): lane partitions owned through
leases, a scale-up and a replica killed with SIGKILL mid-run, against Tansu."""

from __future__ import annotations

import json
import time
from collections import defaultdict

import pytest

from bridge.core.sinks import PARTITIONS
from tests.corpus import envelopes
from tests.natsfixture import JetStreamClient
from tests.services.test_exporter_kafka import consume, tansu  # noqa: F401 - the fixture
from tests.support.exporter import aep_messages, load, sim_messages, topic_count
from tests.support.services import Service

TOPIC_PARTITIONS = 6


def wait_count(bootstrap: str, topic: str, at_least: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while True:
        n = topic_count(bootstrap, topic, TOPIC_PARTITIONS)
        if n >= at_least or time.monotonic() > deadline:
            return n
        time.sleep(0.2)


def lease_owners(client: JetStreamClient, sink: str) -> dict[int, str]:
    async def read() -> dict[int, str]:
        kv = await client.js.key_value("aep_leases")
        out = {}
        for n in range(PARTITIONS):
            try:
                out[n] = (await kv.get(f"x.{sink}.{n}")).value.decode()
            except Exception:
                pass
        return out
    return client.run(read())


@pytest.mark.slow
def test_three_replicas_scale_up_and_a_kill_deliver_every_event_once_in_lane_order(nats_server_fn, tansu, tmp_path):  # noqa: F811
    topic = "aep-scale"
    tansu.create_topics(topic, partitions=TOPIC_PARTITIONS)
    client = JetStreamClient(nats_server_fn.url)
    client.bootstrap()
    msgs = aep_messages(envelopes(), instance="corpus") + sim_messages(20_000)
    order = {eid: i for i, (_, _, eid) in enumerate(msgs)}  # AEP_EVENTS order
    assert len(order) == len(msgs)
    sink = f"kafka://{tansu.bootstrap}/{topic}?name=scale&replicas=3"
    replicas = [Service(f"exporter-{i}", nats_server_fn.url, tmp_path, "--sink", sink) for i in range(3)]
    try:
        for r in replicas[:2]:
            r.start()
        client.run(load(client.js, msgs))
        # Scale-up mid-run: the third replica takes its share from the other two.
        at_scale_up = wait_count(tansu.bootstrap, topic, len(msgs) // 5, 60)
        replicas[2].start()
        deadline = time.monotonic() + 30
        while len(set(lease_owners(client, "scale").values())) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        owners_after_scale_up = lease_owners(client, "scale")
        # Then one replica is killed mid-batch.
        at_kill = wait_count(tansu.bootstrap, topic, len(msgs) // 2, 60)
        replicas[0].kill()
        assert at_scale_up < len(msgs) and at_kill < len(msgs), "the run was over before the scale-up and the kill"
        assert len(set(owners_after_scale_up.values())) == 3, owners_after_scale_up

        got = consume(tansu.bootstrap, topic, len(msgs), timeout=120)
        seen: dict[str, bytes] = {}
        lanes_partition = defaultdict(set)
        firsts = defaultdict(list)  # (Kafka partition, lane) -> AEP_EVENTS positions of first copies
        for m in got:  # in partition order
            eid = dict(m.headers())["aep-id"].decode()
            lanes_partition[m.key()].add(m.partition())
            if eid in seen:
                assert seen[eid] == m.value(), "a duplicate is a same-id redelivery of the same record"
                continue
            seen[eid] = m.value()
            firsts[(m.partition(), m.key())].append(order[eid])
        assert set(seen) == set(order), f"{len(set(order) - set(seen))} events missing"
        assert all(len(p) == 1 for p in lanes_partition.values()), "a lane in one Kafka partition"
        for key, positions in firsts.items():
            assert positions == sorted(positions), f"lane {key} out of order"
        duplicates = len(got) - len(seen)
        print(f"{len(msgs)} events, {len(got)} Kafka messages ({duplicates} same-id duplicates)")
        # Every partition ended with a live replica.
        owners = lease_owners(client, "scale")
        assert sorted(owners) == list(range(PARTITIONS))
        killed = {json.loads(line[line.index("{"):]).get("replica") for line in replicas[0].log_path.read_text().splitlines()
                  if "export_partition_acquired" in line}
        assert killed and not set(owners.values()) & killed, "the killed replica owned partitions, and owns none now"
    finally:
        for r in replicas:
            r.terminate()
        client.close()
