"""One raw message, one lane, on every attempt (issue 25 item 9).

A raw message whose lane comes from a look-up (a task alias, an approval's `session_key`)
can resolve to another lane on a later attempt: the alias changed, or the KV get failed and
was taken for a miss. An earlier attempt killed before its ack has stored its events on the
first lane; a redelivery past BRIDGE_MAPPED's duplicate window used to store them again on
the second, and pairing (which drops a repeated id only within a partition) published them
twice on AEP_EVENTS. The lane is now a fact of the raw message, recorded before its first
publish and reused on every attempt.

The tests play the replicas (as tests/services/test_mapper_redelivery.py): attempt 1
publishes, is "killed" (never acks, the raw message is nak'ed), the window passes (2 s
here), a fresh replica maps the redelivery. A real pairing runs meanwhile.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any, Callable

import nats
import nats.errors
from prometheus_client import CollectorRegistry

from bridge.config import Settings
from bridge.core.ceiling import CapturePolicy
from bridge.core.lanes import UNKNOWN_TOKEN, lane_token, partition_of
from bridge.nats import streams as S
from bridge.services.mapper import Mapper
from tests.support.pipeline import Pipeline
from tests.support.streams import stored_ids
from tests.support.services import publish_all, raw_records, wait_for

WINDOW_S = 2.0
PARTITIONS = 8
TASK = "task-9"
# A window probe on a partition no pairing consumer reads (partitions are 0..7).
PROBE_SUBJECT = "bridge.mapped.99.window-probe"


def session_on_another_partition(*tokens: str) -> str:
    taken = {partition_of(t, PARTITIONS) for t in tokens}
    return next(s for s in (f"20261202_0909{i:02d}_lanefact" for i in range(100))
                if partition_of(lane_token(s), PARTITIONS) not in taken)


S1 = session_on_another_partition(UNKNOWN_TOKEN)
S2 = session_on_another_partition(UNKNOWN_TOKEN, lane_token(S1))


def start_of(session: str) -> dict:
    return {"hook_event_name": "pre_llm_call", "session_id": session, "tool_name": None, "tool_input": None,
            "cwd": "/tmp", "extra": {"task_id": TASK, "turn_id": f"{session}:{TASK}:0a1b2c3d", "model": "m",
                                     "platform": "cli"}}


INNER = {"hook_event_name": "pre_tool_call", "session_id": "", "tool_name": "terminal",
         "tool_input": {"command": "ls"}, "cwd": "/tmp",
         "extra": {"task_id": TASK, "tool_call_id": "", "turn_id": "", "api_request_id": ""}}


class FailingGets:
    """The lanes KV of one replica whose gets of some keys fail (a timeout, a lost leader)."""

    def __init__(self, kv: Any, fails: Callable[[str], bool]) -> None:
        self._kv, self._fails = kv, fails

    async def get(self, key: str, *args: Any, **kwargs: Any) -> Any:
        if self._fails(key):
            raise nats.errors.TimeoutError
        return await self._kv.get(key, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kv, name)


def mapper(url: str, name: str, lane_wait_ms: int = 2000) -> Mapper:
    return Mapper(Settings(nats_url=url, instance=name, lane_wait_ms=lane_wait_ms), CapturePolicy(),
                  registry=CollectorRegistry())


async def bound_with(url: str, name: str, n: int, lane_wait_ms: int = 2000) -> tuple[Mapper, Any, list[Any]]:
    """A fresh replica, bound to the durable, and the next ``n`` raw messages it fetched."""
    m = mapper(url, name, lane_wait_ms)
    await m.connect()
    sub = await m.bind()
    msgs: list[Any] = []
    while len(msgs) < n:
        msgs += await sub.fetch(n - len(msgs), timeout=5)
    return m, sub, msgs


async def ids_of(js: Any, stream: str, subjects: str, field: str = "id") -> list[tuple[str, Any]]:
    return await stored_ids(js, stream, subjects, PROBE_SUBJECT, field)


async def window_passed(js: Any) -> None:
    """Wait out the duplicate window and prove it (a probe is stored again under its id)."""
    assert not (await js.publish(PROBE_SUBJECT, b"{}", headers={"Nats-Msg-Id": "window-probe"})).duplicate
    await asyncio.sleep(WINDOW_S + 1.0)
    assert not (await js.publish(PROBE_SUBJECT, b"{}", headers={"Nats-Msg-Id": "window-probe"})).duplicate


def two_attempts(url: str, tmp_path: Any, between: Callable[[Any], Any],
                 second: Callable[[Mapper], None] = lambda m: None, lane_wait_ms: int = 2000) -> dict[str, Any]:
    """S1's first event, then an inner call of its task. Attempt 1 maps both and dies before
    acking the inner call; ``between(js)`` runs, the window passes; a fresh replica (changed by
    ``second``) maps the redelivery. Returns what BRIDGE_MAPPED and AEP_EVENTS hold."""
    pipe = Pipeline(url, tmp_path / "pipe")
    pipe.bootstrap(duplicate_window_s=WINDOW_S)
    pipe.run(lambda js: publish_all(js, raw_records([start_of(S1), INNER], instance="lanefact")))
    pipe.add("pairing", name="solo")
    try:
        async def attempt_1(js: Any) -> list[tuple[str, str]]:
            first, _, (start, inner) = await bound_with(url, "m-first", 2)
            await first.process_batch([start])
            futures, _ = await first.handle(inner)
            await first.release_held()  # its events follow its lane fact's ack
            await asyncio.gather(*futures)
            await inner.nak()  # killed before the ack
            await first.close()
            return await ids_of(js, S.BRIDGE_MAPPED, "bridge.mapped.>")

        before = pipe.run(attempt_1)
        wait_for(lambda: pipe.counts()["AEP_EVENTS"] >= len(before), 60, what="pairing publishing attempt 1")

        async def attempt_2(js: Any) -> dict[str, Any]:
            await between(js)
            await window_passed(js)
            again, _, [msg] = await bound_with(url, "m-second", 1, lane_wait_ms)
            second(again)
            assert msg.metadata.num_delivered == 2
            await again.process_batch([msg])
            retries = again.metrics.retries._value.get()
            await again.close()
            return {"retries": retries}

        out = pipe.run(attempt_2)
        if not out["retries"]:
            pipe.settle(timeout=60)
        out["before"] = before
        out["mapped"] = pipe.run(lambda js: ids_of(js, S.BRIDGE_MAPPED, "bridge.mapped.>"))
        out["events"] = pipe.run(lambda js: ids_of(js, S.AEP_EVENTS, "aep.hermes.>"))
        return out
    finally:
        pipe.stop()


def stored_once(out: dict[str, Any]) -> None:
    before = out["before"]
    assert {s.rsplit(".", 1)[1] for s, _ in before} == {lane_token(S1)}, f"attempt 1 filed both under S1: {before}"
    mapped = collections.Counter(i for _, i in out["mapped"])
    assert set(mapped) == {i for _, i in before}
    assert max(mapped.values()) == 1, f"stored twice on BRIDGE_MAPPED: {out['mapped']}"
    events = collections.Counter(i for _, i in out["events"])
    assert {i for _, i in before} <= set(events), f"every event reached AEP_EVENTS: {out['events']}"
    assert max(events.values()) == 1, f"published twice on AEP_EVENTS: {out['events']}"


def test_a_redelivery_whose_alias_changed_stores_its_event_once(nats_server_fn, tmp_path):
    """Between the attempts the task alias moved to S2 (another partition): the redelivery
    keeps attempt 1's lane, S1."""

    async def alias_moves(js: Any) -> None:
        kv = await js.key_value(S.LANES_BUCKET)
        await kv.put("s." + lane_token(S2), b"1")
        await kv.put("t." + lane_token(TASK), S2.encode())

    stored_once(two_attempts(nats_server_fn.url, tmp_path, alias_moves))


def test_a_redelivery_whose_lane_get_fails_stores_its_event_once(nats_server_fn, tmp_path):
    """The redelivery's replica cannot read the task alias (its KV get times out), which was
    taken for a miss and filed the event under `_unknown` too."""

    async def nothing(js: Any) -> None:
        return None

    def alias_gets_fail(m: Mapper) -> None:
        assert m.lanes is not None
        m.lanes.kv = FailingGets(m.lanes.kv, lambda key: key.startswith("t."))

    stored_once(two_attempts(nats_server_fn.url, tmp_path, nothing, alias_gets_fail, lane_wait_ms=0))


def test_a_redelivery_that_cannot_read_its_lane_is_retried_not_guessed(nats_server_fn, tmp_path):
    """Every KV get of the redelivery's replica fails: it cannot tell which lane attempt 1
    chose, so it publishes nothing and retries the message later."""

    async def nothing(js: Any) -> None:
        return None

    def all_gets_fail(m: Mapper) -> None:
        assert m.lanes is not None
        m.lanes.kv = FailingGets(m.lanes.kv, lambda key: True)
        m.lanes.facts = FailingGets(m.lanes.facts, lambda key: True)

    out = two_attempts(nats_server_fn.url, tmp_path, nothing, all_gets_fail, lane_wait_ms=0)
    assert out["retries"] == 1, out
    assert sorted(out["mapped"]) == sorted(out["before"]), "nothing published by the blind attempt"


def test_a_late_scan_that_meets_an_error_reply_is_incomplete_and_counted(nats_server_fn):
    """BRIDGE_MAPPED is not there (an error reply other than "no message"): the scan is not
    taken for a complete one, and it is counted."""

    async def run() -> tuple[set[str], float, bool]:
        m = mapper(nats_server_fn.url, "m-scan")
        await m.connect()
        try:
            ids = await m.mapped_ids("bridge.mapped.0.s1", 0, 1)
            counted = m.metrics.late_scans_incomplete.labels(reason="error")._value.get()
            return ids, counted, "bridge.mapped.0.s1" in m._late_scans
        finally:
            await m.close()

    ids, counted, cached = asyncio.run(run())
    assert ids == set()
    assert counted == 1
    assert not cached, "an incomplete read is not reused for the batch"


def test_a_first_delivery_whose_lane_is_recorded_already_files_it_there(nats_server_fn):
    """A server that lost the consumer's delivery count (a crash) redelivers as a first
    delivery: its fact, recorded by the attempt it forgot, wins over what the KV says now."""
    from bridge.nats.bootstrap import bootstrap
    from bridge.nats.lanes import PinnedLane, lane_fact_key

    records = raw_records([start_of(S1), INNER], instance="lanefact")

    async def run() -> tuple[list[tuple[str, str]], dict[str, float]]:
        nc = await nats.connect(nats_server_fn.url)
        js = nc.jetstream()
        await bootstrap(js, None, replicas=1, duplicate_window_s=WINDOW_S)
        await publish_all(js, records)
        kv = await js.key_value(S.LANES_BUCKET)
        await kv.put("s." + lane_token(S2), b"1")
        facts = await js.key_value(S.LANE_FACTS_BUCKET)
        await facts.create(lane_fact_key("lanefact", records[1][2]), PinnedLane(S2).encode())  # the forgotten attempt's
        m, _, msgs = await bound_with(nats_server_fn.url, "m-forgot", 2)
        assert [x.metadata.num_delivered for x in msgs] == [1, 1]
        await m.process_batch(msgs)
        facts = {o: m.metrics.lane_facts.labels(outcome=o)._value.get() for o in ("recorded", "reused")}
        await m.close()
        ids = await ids_of(js, S.BRIDGE_MAPPED, "bridge.mapped.>")
        await nc.close()
        return ids, facts

    ids, facts = asyncio.run(run())
    lanes = [s.rsplit(".", 1)[1] for s, _ in ids]
    assert lanes == [lane_token(S1), lane_token(S2)], ids
    assert facts == {"recorded": 0, "reused": 1}


def test_a_first_delivery_records_its_lane_once_acked(nats_server_fn):
    """The first attempt of an inner call records its lane (S1), before its event is stored."""
    from bridge.nats.bootstrap import bootstrap
    from bridge.nats.lanes import PinnedLane, lane_fact_key

    records = raw_records([start_of(S1), INNER, start_of(S2), start_of(S1)], instance="lanefact")

    async def run() -> tuple[Any, list[tuple[str, str]]]:
        nc = await nats.connect(nats_server_fn.url)
        js = nc.jetstream()
        await bootstrap(js, None, replicas=1, duplicate_window_s=WINDOW_S)
        await publish_all(js, records)
        m, _, msgs = await bound_with(nats_server_fn.url, "m-fact", 4)
        await m.process_batch(msgs)
        await m.close()
        facts = await js.key_value(S.LANE_FACTS_BUCKET)
        fact = PinnedLane.decode((await facts.get(lane_fact_key("lanefact", records[1][2]))).value)
        ids = await ids_of(js, S.BRIDGE_MAPPED, "bridge.mapped.>", field="seq")
        await nc.close()
        return fact, ids

    fact, ids = asyncio.run(run())
    assert fact == PinnedLane(S1)
    # In raw order within each lane: the inner call's event (held for its fact's ack) may follow
    # S2's start (another lane), never S1's next event.
    s1 = [seq for s, seq in ids if s.rsplit(".", 1)[1] == lane_token(S1)]
    assert len(s1) == 3 and s1 == sorted(s1), ids
    assert [s.rsplit(".", 1)[1] for s, _ in ids].count(lane_token(S2)) == 1


def test_a_held_event_whose_publish_fails_is_retried_not_a_crash(nats_server_fn):
    """The events of a first attempt are published after its fact's ack, at the end of the
    batch; a publish that raises then (the connection going away) retries that message,
    like any failed publish, instead of escaping the batch loop."""
    from bridge.nats.bootstrap import bootstrap

    async def run() -> tuple[float, list[tuple[str, str]]]:
        nc = await nats.connect(nats_server_fn.url)
        js = nc.jetstream()
        await bootstrap(js, None, replicas=1, duplicate_window_s=WINDOW_S)
        await publish_all(js, raw_records([start_of(S1), INNER], instance="lanefact"))
        m, _, msgs = await bound_with(nats_server_fn.url, "m-raise", 2)
        publish = m.publisher.publish

        async def refuse_inner(subject: str, *args: Any, **kwargs: Any) -> Any:
            if (kwargs.get("headers") or {}).get("Nats-Msg-Id") in inner_ids:
                raise nats.errors.ConnectionClosedError
            return await publish(subject, *args, **kwargs)

        inner_ids: set[str] = set()
        original_map = m.map_one

        def remember(record: Any, raw_seq: int, lanes: Any) -> Any:
            out = original_map(record, raw_seq, lanes)
            if not record.envelope.session_id:
                inner_ids.update(e.id for e in out[0].events)
            return out

        m.map_one = remember  # type: ignore[method-assign]
        m.publisher.publish = refuse_inner  # type: ignore[method-assign]
        await m.process_batch(msgs)
        retries = m.metrics.retries._value.get()
        await m.close()
        ids = await ids_of(js, S.BRIDGE_MAPPED, "bridge.mapped.>")
        await nc.close()
        return retries, ids

    retries, ids = asyncio.run(run())
    assert retries == 1
    assert len(ids) == 1, "the start's event only: the inner call is retried"


def test_a_first_delivery_filed_on_a_recorded_lane_is_not_published_after_that_lanes_later_events(nats_server_fn):
    """Issue 39 item 4. A first delivery whose fact an attempt the server forgot recorded
    (S2) is held for its fact's ack, under the lane it chose (S1); S2's next raw message, in
    the same batch, went out at once (its subject held nothing), and the held event followed
    it on S2 when released: S2's events on BRIDGE_MAPPED out of raw order."""
    from bridge.nats.bootstrap import bootstrap
    from bridge.nats.lanes import PinnedLane, lane_fact_key

    records = raw_records([start_of(S1), INNER, start_of(S2)], instance="lanefact")

    async def run() -> list[tuple[str, Any]]:
        nc = await nats.connect(nats_server_fn.url)
        js = nc.jetstream()
        await bootstrap(js, None, replicas=1, duplicate_window_s=WINDOW_S)
        await publish_all(js, records)
        kv = await js.key_value(S.LANES_BUCKET)
        await kv.put("s." + lane_token(S2), b"1")
        facts = await js.key_value(S.LANE_FACTS_BUCKET)
        await facts.create(lane_fact_key("lanefact", records[1][2]), PinnedLane(S2).encode())  # the forgotten attempt's
        m, _, msgs = await bound_with(nats_server_fn.url, "m-order", 3)
        assert [x.metadata.num_delivered for x in msgs] == [1, 1, 1]
        await m.process_batch(msgs)
        await m.close()
        ids = await ids_of(js, S.BRIDGE_MAPPED, "bridge.mapped.>", field="seq")
        await nc.close()
        return ids

    ids = asyncio.run(run())
    s2 = [seq for s, seq in ids if s.rsplit(".", 1)[1] == lane_token(S2)]
    assert len(s2) == 2 and s2 == sorted(s2), f"S2's events in raw order: {ids}"
