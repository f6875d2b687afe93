"""The relay hub's fan-out, on the real `hub.Hub` without NATS: equal filters are one object
(`intern_filter`), an event is matched once per distinct filter and handed to every
subscription of that filter; what subscriptions ask of an item is worked out once."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from bridge.core.attrmatch import Filter, InvalidFilter
from bridge.services.relay.hub import Hub, Item, Subscription, intern_filter
from tests.support.relay import encode, event


def test_equal_filters_are_one_object_and_bad_ones_are_refused():
    a = intern_filter({"session": "s1", "type": ["tool.called", "tool.completed"]})
    b = intern_filter({"type": ["tool.called", "tool.completed"], "session": "s1"})
    assert a is b
    assert intern_filter({"session": "s2"}) is not a
    assert intern_filter({"epoch": 1}) is not intern_filter({"epoch": True})  # 1 is not true
    with pytest.raises(InvalidFilter):
        intern_filter({"data": 1})


class Counting(Filter):
    calls = 0

    def matches(self, event):  # type: ignore[no-untyped-def]
        Counting.calls += 1
        return super().matches(event)


def counting(spec: dict) -> Filter:
    f = intern_filter(spec)
    return Counting(f.source, f.predicates)


def test_one_match_per_distinct_filter_and_every_subscription_served():
    async def go():
        hub = Hub(js=None, replay_buffer=10)
        mine, other = counting({"session": "s1"}), counting({"session": "s2"})
        subs = [Subscription(mine) for _ in range(3)] + [Subscription(other)]
        for s in subs:
            hub.add(s)
        Counting.calls = 0
        for seq in (1, 2):
            ev = event("s1", seq)
            await hub._on_msg(SimpleNamespace(metadata=SimpleNamespace(sequence=SimpleNamespace(stream=seq)), subject="aep.hermes.s.x",
                                              data=encode(ev)))
        assert Counting.calls == 4, "2 events x 2 distinct filters, not x 4 subscriptions"
        assert [[i.seq for i in s.queue] for s in subs] == [[1, 2], [1, 2], [1, 2], []]
        assert hub.position == 2

    asyncio.run(go())


def test_item_fields_are_computed_once_from_the_event():
    ev = event("s1", 7, severity="notice")
    it = Item(3, encode(ev), ev)
    assert (it.session, it.position, it.low_severity) == ("s1", (ev.get("epoch", 0), 7), False)
    ev2 = {"type": "agent.started", "epoch": "x", "seq": 4}
    it2 = Item(4, encode(ev2), ev2)
    assert (it2.session, it2.position, it2.low_severity) == (None, None, True)
    ev3 = {"type": "x", "session": "s", "seq": 2, "epoch": "bad", "severity": "debug"}
    assert Item(5, encode(ev3), ev3).position == (0, 2)


def msg(ev: dict, seq: int) -> SimpleNamespace:
    return SimpleNamespace(metadata=SimpleNamespace(sequence=SimpleNamespace(stream=seq)), data=encode(ev),
                           subject="aep.hermes.s.tool.called")


def test_direct_writes_one_flush_per_batch_and_the_task_takes_over_when_they_cannot():
    async def go():
        hub = Hub(js=None, replay_buffer=10)
        flt = intern_filter({"session": "s1"})
        written: list[list[int]] = []
        refuse = {"now": False}

        def direct(sub: Subscription) -> bool:
            if refuse["now"]:
                return False
            written.append([i.seq for i in sub.take(len(sub.queue))])
            return True

        parked, busy = Subscription(flt), Subscription(flt)
        for s in (parked, busy):
            s.direct = direct
            hub.add(s)
        parked.idle = True  # its task waits; busy's task is writing
        for seq in (1, 2, 3):
            await hub._on_msg(msg(event("s1", seq), seq))
        assert not parked.wake.is_set() and busy.wake.is_set()
        await asyncio.sleep(0)  # the hub's one flush for the batch
        assert written == [[1, 2, 3]], "one write for the three events, only for the parked subscription"
        assert not parked.queue and [i.seq for i in busy.queue] == [1, 2, 3]
        refuse["now"] = True  # a full or closing connection
        await hub._on_msg(msg(event("s1", 4), 4))
        await asyncio.sleep(0)
        assert parked.wake.is_set() and [i.seq for i in parked.queue] == [4], "kept for the task"

    asyncio.run(go())


def test_a_direct_write_that_fails_ends_the_stream_so_the_consumer_resumes():
    async def go():
        hub = Hub(js=None, replay_buffer=10)
        sub = Subscription(intern_filter({}))

        def direct(s: Subscription) -> bool:
            s.take(len(s.queue))  # taken, then the write fails: those items are gone from the queue
            raise RuntimeError("transport gone")

        sub.direct, sub.idle = direct, True
        hub.add(sub)
        await hub._on_msg(msg(event("s1", 1), 1))
        await asyncio.sleep(0)
        assert sub.overflowed and sub.wake.is_set(), "ended (resumable), not silently short of an event"

    asyncio.run(go())
