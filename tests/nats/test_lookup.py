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


def test_dead_letter_bodies_are_redacted_unless_everything_is_full():
    m = mapper()
    raw = {"v": 1, "id": "X", "instance": "i", "ts": 1, "hook": "_invalid", "error": "not_json: ...",
           "raw": f"{{broken json with key {SECRET} and password=hunter2xx", "raw_encoding": "utf-8", "raw_bytes": 50}
    body, redacted = m.dlq_body(json.dumps(raw).encode())
    assert redacted and SECRET.encode() not in body and b"hunter2xx" not in body
    assert json.loads(body)["id"] == "X" and json.loads(body)["error"] == "not_json: ..."  # structure kept

    clean = json.dumps({"v": 1, "id": "Y", "hook": "_invalid", "raw": "nothing secret"}).encode()
    assert m.dlq_body(clean) == (clean, False)  # untouched bytes when nothing needs redacting

    text = f"not json at all, token {SECRET}".encode()
    body, redacted = m.dlq_body(text)
    assert redacted and SECRET.encode() not in body

    hidden = base64.b64encode(b"\xff\xfe" + f"export KEY={SECRET}".encode() + b"\x80").decode()
    raw_b64 = json.dumps({"v": 1, "id": "Z", "hook": "_invalid", "raw": hidden, "raw_encoding": "base64"}).encode()
    body, redacted = m.dlq_body(raw_b64)
    assert redacted and SECRET.encode() not in body and hidden.encode() not in body
    assert json.loads(body)["raw_encoding"] == "utf-8-replaced"

    full = mapper(CapturePolicy(default="full", overrides={}))
    assert full.dlq_body(json.dumps(raw).encode()) == (json.dumps(raw).encode(), False)
    assert mapper(CapturePolicy(default="full")).dlq_body(json.dumps(raw).encode())[1], \
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
