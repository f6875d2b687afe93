"""Regression tests for what the fleet simulator and the fault scenarios found (issue 8).

* Dead letters kept planted secrets verbatim for 30 days: the mapper now redacts the
  body (and the error header) unless every capture ceiling is `full`.
* Resends past a stream's duplicate window were stored twice: `bridge.nats.lookup`
  finds an earlier copy by `Nats-Msg-Id` on its subject from a start time; the mapper
  uses it for late raw messages and late redeliveries, pairing for the batch in flight
  when a previous owner stopped, and the owner's acked progress (`q.<n>`) for the rest.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time

import pytest

from bridge.config import Settings
from bridge.core import deadletter
from bridge.core.capture import CapturePolicy
from bridge.nats.lookup import find_msg_id, parse_rfc3339_ns, rfc3339_ns
from bridge.services.mapper import Mapper
from bridge.sim.harness import Pipeline
from bridge.sim.sessions import realistic_envelopes
from bridge.sim.verify import StreamReader
from tests.support.services import publish_all, raw_records, wait_for

SECRET = "AKIAABCDEFGHIJKLMNOP"


def mapper(policy: CapturePolicy | None = None) -> Mapper:
    return Mapper(Settings(), policy or CapturePolicy())


def letter(policy: CapturePolicy, data: bytes) -> dict:
    original = deadletter.Original("HERMES_RAW", 7, "hermes.raw.i._invalid", data)
    return json.loads(deadletter.build("mapper", "shim_not_json", "shim_not_json", "not_json: ...", original, policy).body)


def test_dead_letter_bodies_are_redacted_unless_everything_is_full():
    """(Since issue 13: below `redacted` a dead letter has no content at all; see
    tests/test_hostile_capture.py.) At `redacted` its content is redacted."""
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


def test_rfc3339_round_trip():
    now = time.time_ns()
    assert parse_rfc3339_ns(rfc3339_ns(now)) == now
    assert parse_rfc3339_ns("2026-12-01T00:04:18Z") % 1_000_000_000 == 0


def test_find_msg_id_by_subject_from_a_start_time(nats_server, jetstream):
    import nats

    stream = "LOOKUP_TEST"

    async def main() -> None:
        nc = await nats.connect(nats_server.url)
        js = nc.jetstream()
        try:
            await js.add_stream(name=stream, subjects=["lookup.>"], duplicate_window=1.0)
            before = time.time_ns()
            seqs = []
            for i in range(5):
                seqs.append((await js.publish("lookup.a", b"x", headers={"Nats-Msg-Id": f"id-{i}"})).seq)
                await js.publish("lookup.b", b"y", headers={"Nats-Msg-Id": f"other-{i}"})
            assert await find_msg_id(nc, stream, "lookup.a", "id-3", before) == seqs[3]
            assert await find_msg_id(nc, stream, "lookup.a", "other-3", before) is None  # another subject
            assert await find_msg_id(nc, stream, "lookup.a", "id-4", before, before_seq=seqs[4]) is None
            assert await find_msg_id(nc, stream, "lookup.a", "id-4", before, max_probes=2) is None
            assert await find_msg_id(nc, stream, "lookup.a", "id-0", time.time_ns() + 10**9) is None
            await asyncio.sleep(1.2)  # past the window: the server stores the same id again
            again = (await js.publish("lookup.a", b"x", headers={"Nats-Msg-Id": "id-1"})).seq
            assert again > seqs[-1]
            assert await find_msg_id(nc, stream, "lookup.a", "id-1", before, before_seq=again) == seqs[1]
        finally:
            await js.delete_stream(stream)
            await nc.close()

    asyncio.run(main())


@pytest.mark.slow
def test_a_pairing_owner_back_after_the_duplicate_window_publishes_nothing_twice(nats_server_fn, tmp_path):
    """The owner dies before its first checkpoint; the next one restores later than AEP_EVENTS'
    duplicate window. Before the fix every event of the partition reached consumers twice."""
    pipe = Pipeline(nats_server_fn.url, tmp_path / "logs")
    pipe.bootstrap(duplicate_window_s=2.0)
    records = raw_records(realistic_envelopes(3000, seed=3), instance="tail")
    pipe.run(lambda js: publish_all(js, records))
    pipe.add("mapper")
    try:
        wait_for(lambda: pipe.counts()["BRIDGE_MAPPED"] >= 3000, 60, what="the mapped events")
        owner = pipe.add("pairing", name="owner")
        wait_for(lambda: pipe.counts()["AEP_EVENTS"] >= 1500, 60, interval=0.02, what="the owner publishing")
        owner.kill()  # SIGKILL: no checkpoint yet, leases held until they expire (10 s > the 2 s window)
        published_before = pipe.counts()["AEP_EVENTS"]
        successor = pipe.add("pairing", name="successor")
        wait_for(lambda: "partition_acquired" in successor.log(), 40, what="the takeover")
        pipe.settle(timeout=60)

        async def ids(js) -> list[str]:  # type: ignore[no-untyped-def]
            out: list[str] = []
            r = StreamReader(js, "AEP_EVENTS", "aep.hermes.>")
            await r.read_new(lambda m: out.append(json.loads(m.data)["id"]))
            await r.close()
            return out

        got = pipe.run(ids)
        assert len(got) > published_before, "the successor went on"
        assert len(got) == len(set(got)), f"{len(got) - len(set(got))} events published twice"
        skipped = successor.metrics().get("aep_bridge_pairing_republish_skipped_total", 0)
        assert skipped >= published_before * 0.5, skipped
    finally:
        pipe.stop()
