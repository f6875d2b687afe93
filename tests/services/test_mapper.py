"""The mapper service end to end on a real nats-server: shim -> HERMES_RAW -> 2 mappers -> BRIDGE_MAPPED;
and what it writes to the dead-letter stream."""

from __future__ import annotations

import base64
import collections
import hashlib
import json
import random
import subprocess
import sys
import time

import pytest

from bridge.core import deadletter
from bridge.core.aep import encode_event
from bridge.core.ceiling import CapturePolicy
from bridge.nats.lanes import epoch_of
from bridge.nats.streams import MAPPER_DURABLE
from tests.corpus import envelopes
from tests.natsfixture import JetStreamClient
from tests.support.services import Service, expected_events, publish_all, raw_records, wait_for
from tests.support.shim import compiled_hook, run_hook, shim_env
from tests.support.streams import consumer_idle


def mapped_count(client: JetStreamClient) -> int:
    return client.stream_info("BRIDGE_MAPPED").state.messages


def test_two_mappers_produce_exactly_what_map_gives(nats_server_fn, tmp_path):
    client = JetStreamClient(nats_server_fn.url)
    client.bootstrap()
    # The lane wait on: "byte-identical to `aep-bridge map`" over two replicas needs it for what the
    # envelope cannot name (a session-less event with only a task id); approvals never wait.
    mappers = [Service("mapper", nats_server_fn.url, tmp_path, env={"AEP_BRIDGE_INSTANCE": f"m{i}", "AEP_BRIDGE_LANE_WAIT_MS": "5000"})
               for i in range(2)]
    for i, m in enumerate(mappers):
        m.log_dir = tmp_path / f"m{i}"
        m.log_dir.mkdir()
        m.start()
    try:
        env = shim_env(nats_server_fn.url, tmp_path / "spool", "gw-e2e")
        corpus = envelopes()
        for e in corpus:
            assert run_hook(json.dumps(e), env, script=compiled_hook()).answered_empty_object
        garbage = run_hook(b"\xff\xfe not json", env, script=compiled_hook())
        assert garbage.answered_empty_object
        # HERMES_RAW now holds the shim's records, in order: raw seq = line number.
        raw = client.fetch("hermes.raw.>", expected=len(corpus) + 1, timeout=10)
        assert len(raw) == len(corpus) + 1
        epoch = epoch_of(client.stream_info("HERMES_RAW").created)
        want = expected_events([(m.seq, m.data) for m in raw], epoch)
        wait_for(lambda: mapped_count(client) >= len(want), 30, what=f"{len(want)} mapped events")
        # Both replicas have taken and acked every raw message (a mapper acks only after the
        # publish acks of its events): whatever they would publish, a duplicate too, is stored.
        wait_for(lambda: consumer_idle(client, "HERMES_RAW", MAPPER_DURABLE), 30, what="every raw message acked")
        got = client.fetch("bridge.mapped.>", stream="BRIDGE_MAPPED")
        assert len(got) == len(want), "every event exactly once"
        assert sorted(m.data for m in got) == sorted(encode_event(e) for e in want), "byte-identical to `aep-bridge map`"
        assert all(m.headers["Nats-Msg-Id"] == json.loads(m.data)["id"] for m in got)

        # The same through the command line, as a user converting a recorded log would.
        lines = "\n".join(m.data.decode() for m in raw) + "\n"
        proc = subprocess.run([sys.executable, "-m", "bridge.cli", "map", "--epoch", str(epoch)], input=lines.encode(), capture_output=True)
        assert proc.returncode == 1 and b"line 170" in proc.stderr  # the garbage line is reported, the rest mapped
        assert sorted(proc.stdout.splitlines()) == sorted(m.data for m in got)

        # Approvals (session_id "") land on their session's lane.
        by_type = [json.loads(m.data) for m in got]
        approvals = [e for e in by_type if e["type"] == "attention.requested" and "20261130_224954_177c7f" in e.get("run", "")]
        assert approvals and all(e["session"] == "20261130_224954_177c7f" for e in approvals)

        # The garbage landed in the DLQ with its reason and the position of the original
        # (at the default capture, none of its content: docs/ARCHITECTURE.md "Dead letters").
        dlq = client.fetch("bridge.dlq.>", stream="BRIDGE_DLQ", expected=1, timeout=10)
        assert len(dlq) == 1
        assert dlq[0].subject == "bridge.dlq.shim_not_utf8"
        assert dlq[0].headers["Bridge-Dlq-Reason"] == "shim_not_utf8"
        assert int(dlq[0].headers["Bridge-Raw-Seq"]) == raw[-1].seq
        letter = json.loads(dlq[0].data)
        assert letter["original"]["seq"] == raw[-1].seq and letter["original"]["bytes"] == len(raw[-1].data)
        assert letter["original"]["sha256"] == hashlib.sha256(raw[-1].data).hexdigest()[:32]
        assert letter["original"]["id"] == json.loads(raw[-1].data)["id"] and "content" not in letter
        assert all(m.alive() for m in mappers), "no consumer loop died"
    finally:
        for m in mappers:
            m.terminate()
        client.close()


def test_a_raw_message_that_is_not_a_raw_message_is_dead_lettered(nats_server_fn, tmp_path):
    client = JetStreamClient(nats_server_fn.url)
    client.bootstrap()
    mapper = Service("mapper", nats_server_fn.url, tmp_path).start()
    try:
        client.run(client.js.publish("hermes.raw.x.pre_tool_call", b'{"v":1,"no":"id"}'))
        client.run(client.js.publish("hermes.raw.x.pre_tool_call", b"[1,2]"))
        records = raw_records(envelopes()[:3], instance="ok")
        client.run(publish_all(client.js, records))
        dlq = client.fetch("bridge.dlq.>", stream="BRIDGE_DLQ", expected=2, timeout=15)
        assert sorted(m.headers["Bridge-Dlq-Reason"] for m in dlq) == ["bad_raw", "bad_raw"]
        wait_for(lambda: mapped_count(client) >= 3, 15, what="the good messages after the bad ones")
        assert mapper.alive()
    finally:
        assert mapper.terminate() == 0, mapper.log()
        client.close()


@pytest.mark.slow
def test_kill_9_replicas_repeatedly_loses_and_duplicates_nothing(nats_server_fn, tmp_path):
    from bridge.sim.sessions import realistic_envelopes

    client = JetStreamClient(nats_server_fn.url)
    client.bootstrap()
    records = raw_records(realistic_envelopes(12_000, seed=7), instance="crash")  # 20,000 before: the suite's time
    # In four parts, the next one published after each of the first three kills: published at
    # once, the replicas mapped everything before a third kill (a CI run on a faster mapper,
    # 2026-12-05), and a kill after the end shows nothing.
    parts = [records[i:i + 3000] for i in range(0, len(records), 3000)]
    client.run(publish_all(client.js, parts.pop(0)))

    mappers = []
    for i in range(2):
        d = tmp_path / f"m{i}"
        d.mkdir()
        # A killed replica's messages come back after 5 s, not 30 (the suite's time; the same
        # redelivery either way): AEP_BRIDGE_MAPPER_ACK_WAIT_S.
        mappers.append(Service("mapper", nats_server_fn.url, d, "--batch", "64",
                               env={"AEP_BRIDGE_MAPPER_ACK_WAIT_S": "5"}).start())
    rng = random.Random(3)
    kills = 0
    try:
        # A kill every 0.8-2 s: a replica lives long enough to start, take a batch and map part
        # of it (a kill every 0.2-0.6 s mostly killed replicas still importing: 120 s for no
        # more evidence), for at most 40 s or until every event is out.
        deadline = time.monotonic() + 40
        want: set[str] = set()
        while (parts or mapped_count(client) < len(want)) and time.monotonic() < deadline:
            time.sleep(rng.uniform(0.8, 2.0))
            victim = rng.choice(mappers)
            victim.kill()
            kills += 1
            victim.start()
            if parts:
                client.run(publish_all(client.js, parts.pop(0)))
            if not parts and not want:
                epoch = epoch_of(client.stream_info("HERMES_RAW").created)
                raw = client.fetch("hermes.raw.>", expected=len(records), timeout=30)
                want = {e.id for e in expected_events([(m.seq, m.data) for m in raw], epoch)}
        assert want, "every part published before the deadline"
        wait_for(lambda: mapped_count(client) >= len(want), 60, what="all events after the kills")
        time.sleep(1.0)
        got = client.fetch("bridge.mapped.>", stream="BRIDGE_MAPPED")
        ids = [json.loads(m.data)["id"] for m in got]
        assert kills >= 3, "the test must actually kill replicas mid-run"
        counts = collections.Counter(ids)
        twice = [(m.subject, m.seq, i) for m, i in zip(got, ids) if counts[i] > 1]
        assert len(ids) == len(set(ids)), f"no duplicates (subject, BRIDGE_MAPPED seq, id): {twice}"
        assert set(ids) == want, "every expected event, nothing else"
    finally:
        for m in mappers:
            m.terminate()
        client.close()


def test_the_ack_wait_is_a_setting_and_reaches_an_existing_durable(nats_server_fn, tmp_path):
    """AEP_BRIDGE_MAPPER_ACK_WAIT_S is the ack_wait the mapper creates its durable with; a
    mapper started with another value on an existing durable sets its own (and says so)."""
    client = JetStreamClient(nats_server_fn.url)
    client.bootstrap()

    def ack_wait() -> float:
        try:
            return float(client.run(client.js.consumer_info("HERMES_RAW", MAPPER_DURABLE)).config.ack_wait)
        except Exception:  # not created yet
            return 0.0

    try:
        for want in ("7", "12.5"):
            mapper = Service("mapper", nats_server_fn.url, tmp_path, env={"AEP_BRIDGE_MAPPER_ACK_WAIT_S": want}).start()
            try:
                wait_for(lambda: ack_wait() == float(want), 20, what=f"the durable's ack_wait at {want} s")
            finally:
                assert mapper.terminate() == 0, mapper.log()
        assert "mapper_consumer_updated" in mapper.log()
    finally:
        client.close()


def test_recreating_the_raw_stream_raises_the_epoch(nats_server_fn, tmp_path):
    client = JetStreamClient(nats_server_fn.url)
    client.bootstrap()
    mapper = Service("mapper", nats_server_fn.url, tmp_path).start()
    try:
        client.run(publish_all(client.js, raw_records(envelopes()[:5], instance="e1")))
        wait_for(lambda: mapped_count(client) >= 5, 20, what="the first events")
        first = {json.loads(m.data)["epoch"] for m in client.fetch("bridge.mapped.>", stream="BRIDGE_MAPPED")}
        client.run(client.js.delete_stream("HERMES_RAW"))
        client.bootstrap()  # a new HERMES_RAW: its sequence starts again at 1
        # the same instance: the session belongs to e1 (another instance naming it is dead-lettered)
        client.run(publish_all(client.js, raw_records(envelopes()[5:10], instance="e1")))
        wait_for(lambda: mapped_count(client) >= 10, 30, what="events after the recreation")
        events = [json.loads(m.data) for m in client.fetch("bridge.mapped.>", stream="BRIDGE_MAPPED")]
        second = {e["epoch"] for e in events} - first
        assert len(first) == 1 and len(second) == 1
        assert min(second) > max(first), "a new epoch, never a reused one: (epoch, seq) stays unique"
        assert "mapper_rebound" in mapper.log()
    finally:
        mapper.terminate()
        client.close()


SECRET = "AKIAABCDEFGHIJKLMNOP"


def letter(policy: CapturePolicy, data: bytes) -> dict:
    original = deadletter.Original("HERMES_RAW", 7, "hermes.raw.i._invalid", data)
    return json.loads(deadletter.build("mapper", "shim_not_json", "shim_not_json", "not_json: ...", original, policy).body)


def test_dead_letter_bodies_are_redacted_unless_everything_is_full():
    """Dead letters kept planted secrets verbatim for 30 days (found by the fleet simulator, issue 8).
    Since issue 13, below `redacted` a dead letter has no content at all (see
    tests/services/test_hostile_capture.py); at `redacted` its content is redacted."""
    redacted = CapturePolicy(default="redacted", overrides={})
    raw = {"v": 1, "id": "X", "instance": "i", "ts": 1, "hook": "_invalid", "error": "not_json: ...",
           "raw": f"{{broken json with key {SECRET} and password=hunter2xx", "raw_encoding": "utf-8", "raw_bytes": 50}
    body = letter(redacted, json.dumps(raw).encode())
    assert SECRET not in json.dumps(body) and "hunter2xx" not in json.dumps(body)
    assert body["content"]["id"] == "X" and body["content"]["error"] == "not_json: ..."  # structure kept
    assert body["original"]["id"] == "X" and body["capture"] == "redacted"

    text = f"not json at all, token {SECRET}".encode()
    body = letter(redacted, text)
    assert SECRET not in body["content_text"] and "not json at all" in body["content_text"]

    hidden = base64.b64encode(b"\xff\xfe" + f"export KEY={SECRET}".encode() + b"\x80").decode()
    raw_b64 = json.dumps({"v": 1, "id": "Z", "hook": "_invalid", "raw": hidden, "raw_encoding": "base64"}).encode()
    body = letter(redacted, raw_b64)
    assert SECRET not in json.dumps(body) and hidden not in json.dumps(body)
    assert body["content"]["raw_encoding"] == "utf-8-replaced"

    assert letter(CapturePolicy(default="full", overrides={}), json.dumps(raw).encode())["content"] == raw
    assert "content" in letter(CapturePolicy(default="full"), json.dumps(raw).encode()) and \
        SECRET not in json.dumps(letter(CapturePolicy(default="full"), json.dumps(raw).encode())), \
        "attention=redacted (the default override) keeps dead letters redacted"
