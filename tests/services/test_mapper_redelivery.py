"""A raw message redelivered after BRIDGE_MAPPED's duplicate window: its events stored once.

The mapper acks a raw message only after its publishes are acked, so a replica killed in
between leaves events in BRIDGE_MAPPED and the raw message unacked. Redelivered within the
duplicate window, the same events (same `Nats-Msg-Id`) are dropped by the server; redelivered
later (a chain of kills, each costing an `ack_wait`), the mapper must find them itself.

Found by `test_kill_9_replicas_repeatedly_loses_and_duplicates_nothing` (1 run in 3: 4 events
stored twice). Its 20,000 raw messages put 930 events on the shared `_unknown` lane; the
lookup started at the raw message's stored time and read at most 64 messages of the lane,
so an earlier copy further along was not seen and the event was stored again. A second way
to miss it: the earlier attempt filed a session-less event under `_unknown` (its lane wait
gave up on a replica that died holding the session's first event), the redelivery finds
the session and looks only on the session's lane.

These tests play the replicas themselves, with a 2 s window: attempt 1 publishes and is
"killed" (never acks; the raw message is nak'ed, i.e. redelivered as after ack_wait), the
window passes, a fresh replica gets the redelivery. Nothing here is timed but the window.
"""

from __future__ import annotations

import asyncio
import collections
import json
from typing import Any

import nats
from prometheus_client import CollectorRegistry

from bridge.config import Settings
from bridge.core.ceiling import CapturePolicy
from bridge.core.lanes import lane_token
from bridge.nats import streams as S
from bridge.nats.bootstrap import bootstrap
from bridge.services.mapper import Mapper
from tests.support.lanes import SESSION, TASK, envelopes
from tests.support.services import publish_all, raw_records
from tests.support.streams import PROBE_SUBJECT, stored_ids

WINDOW_S = 2.0  # BRIDGE_MAPPED's duplicate window here (120 s in production): late = 1 s


async def window_passed(js) -> None:  # type: ignore[no-untyped-def]
    """Wait out the duplicate window of everything stored so far, and prove it: a probe
    published now is stored again later under the same id (else the test could pass only
    because the server still dropped the copies)."""
    first = await js.publish(PROBE_SUBJECT, b"{}", headers={"Nats-Msg-Id": "window-probe"})
    assert not first.duplicate
    await asyncio.sleep(WINDOW_S + 1.0)
    again = await js.publish(PROBE_SUBJECT, b"{}", headers={"Nats-Msg-Id": "window-probe"})
    assert not again.duplicate, "the duplicate window has passed"


def mapper(url: str, name: str, lane_wait_ms: int = 2000) -> Mapper:
    return Mapper(Settings(nats_url=url, instance=name, lane_wait_ms=lane_wait_ms), CapturePolicy(),
                  registry=CollectorRegistry())


def test_a_late_redelivery_finds_its_events_past_64_others_on_its_lane(nats_server_fn):
    """Attempt 1 of raw message A publishes its event after 100 other events of the same lane
    (mapped meanwhile from later raw messages); B was delivered with it but never mapped. Past
    the window both are redelivered: A's event is not stored again, B's is stored (no loss)."""
    start = envelopes("inner")[0]
    envs = [{**start, "extra": {**start["extra"], "turn_id": f"{SESSION}:{TASK}:{i:08x}"}} for i in range(102)]

    async def run() -> list[tuple[str, str]]:
        nc = await nats.connect(nats_server_fn.url)
        js = nc.jetstream()
        await bootstrap(js, None, replicas=1, duplicate_window_s=WINDOW_S)
        await publish_all(js, raw_records(envs, instance="late"))
        first = mapper(nats_server_fn.url, "m-first")
        await first.connect()
        sub = await first.bind()
        msgs = []
        while len(msgs) < len(envs):
            msgs += await sub.fetch(len(envs) - len(msgs), timeout=5)
        a, b, others = msgs[0], msgs[1], msgs[2:]
        await first.process_batch(others)  # 100 events on the session's lane, acked
        futures, _ = await first.handle(a)  # A's event after them...
        await asyncio.gather(*futures)
        await a.nak()  # ...then the replica dies before acking A (or mapping B)
        await b.nak()
        await first.close()
        await window_passed(js)

        second = mapper(nats_server_fn.url, "m-second")
        await second.connect()
        sub = await second.bind()
        redelivered = await sub.fetch(2, timeout=5)
        assert sorted(m.metadata.num_delivered for m in redelivered) == [2, 2]
        await second.process_batch(redelivered)
        ids = await stored_ids(js)
        await second.close()
        await nc.close()
        return ids

    ids = asyncio.run(run())
    counts = collections.Counter(i for _, i in ids)
    assert len(counts) == len(envs), "every raw message's event, B's included"
    assert max(counts.values()) == 1, f"stored twice: {[i for i, n in counts.items() if n > 1]}"
    assert {s for s, _ in ids} == {s for s, _ in ids[:1]}, "all on the session's lane"


def test_a_late_redelivery_finds_its_event_filed_under_unknown_before(nats_server_fn):
    """An inner call's first attempt gave up waiting for the replica holding its session's
    first event (killed) and filed it under `_unknown`; the replica dies before acking. Past
    the window, the redelivery knows the session (the first event was mapped since): the event
    already stored under `_unknown` is found, not stored again on the session's lane."""

    async def run() -> list[tuple[str, str]]:
        nc = await nats.connect(nats_server_fn.url)
        js = nc.jetstream()
        await bootstrap(js, None, replicas=1, duplicate_window_s=WINDOW_S)
        await publish_all(js, raw_records(envelopes("inner"), instance="lanes"))
        holder = await js.pull_subscribe(S.RAW_SUBJECTS, durable=S.MAPPER_DURABLE, stream=S.HERMES_RAW,
                                         config=S.mapper_consumer_config())
        [held] = await holder.fetch(1, timeout=5)  # the session's first event, held by a dying replica
        first = mapper(nats_server_fn.url, "m-first", lane_wait_ms=0)
        await first.connect()
        sub = await first.bind()
        [inner] = await sub.fetch(1, timeout=5)
        futures, _ = await first.handle(inner)
        await first.release_held()  # its events follow its lane fact's ack
        await asyncio.gather(*futures)
        await inner.nak()  # killed before the ack
        await first.close()
        # The first event is mapped at last (its lanes learned, acked), as the other replica does.
        kv = await js.key_value(S.LANES_BUCKET)
        await kv.put("s." + lane_token(SESSION), b"1")
        await kv.put("t." + lane_token(TASK), SESSION.encode())
        await held.ack_sync()
        before = await stored_ids(js)
        await window_passed(js)

        second = mapper(nats_server_fn.url, "m-second")
        await second.connect()
        sub = await second.bind()
        [again] = await sub.fetch(1, timeout=5)
        assert again.metadata.num_delivered == 2
        await second.process_batch([again])
        after = await stored_ids(js)
        await second.close()
        await nc.close()
        assert [s.rsplit(".", 1)[1] for s, _ in before] == ["_unknown"], "attempt 1 filed it under unknown"
        return after

    ids = asyncio.run(run())
    assert len(ids) == 1, f"the event is stored once: {ids}"
