"""One consumer per pairing replica: the reader and the partitions' feeds (issue 24).

A replica reads every partition it owns through one ephemeral consumer (`filter_subjects`)
and puts each message into its partition's `Feed`; each partition's loop folds and
publishes its own. Here: the feed on its own; the reader's dispatch (past each feed's
``last`` only, by partition); and on a real nats-server, one consumer for the owned
partitions, a new one (with the partitions left) when one is dropped, nothing lost or
folded twice when the reader is started over mid-stream, and partitions restored at
different positions each read from their own.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import nats
import nats.js.errors
import pytest

from bridge.nats import streams as S
from bridge.services import pairing as P
from tests.support.pairing_service import BOUND_S, bootstrapped, publish_sessions, sample, service, until


@pytest.fixture
def url(nats_factory) -> str:  # type: ignore[no-untyped-def]
    """A nats-server of its own, bootstrapped."""
    return bootstrapped(nats_factory().url)


def msg(subject: str, seq: int) -> Any:
    return SimpleNamespace(subject=subject, metadata=SimpleNamespace(sequence=SimpleNamespace(stream=seq)))


def test_a_feed_gives_what_was_put_in_batches_and_wakes_its_reader() -> None:
    async def scenario() -> None:
        feed = P.Feed(last=4)
        assert await feed.get(10, 0.05) == []  # nothing came: [] after the timeout
        waiting = asyncio.create_task(feed.get(2, 5))
        await asyncio.sleep(0.01)
        feed.put([msg("bridge.mapped.0.a", 5), msg("bridge.mapped.0.a", 7), msg("bridge.mapped.0.b", 9)])
        assert feed.last == 9
        first = await asyncio.wait_for(waiting, 1)  # woken by the put, not by its timeout
        assert [m.metadata.sequence.stream for m in first] == [5, 7]
        assert [m.metadata.sequence.stream for m in await feed.get(2, 5)] == [9]
        woken = asyncio.create_task(feed.get(2, 5))
        await asyncio.sleep(0.01)
        feed.wake()  # a stop: the loop sees it at once
        assert await asyncio.wait_for(woken, 1) == []

    asyncio.run(scenario())


def test_the_reader_puts_each_message_into_its_partition_past_what_it_has() -> None:
    feeds = {0: P.Feed(last=10), 2: P.Feed(last=0)}
    P.PairingService.dispatch(feeds, [
        msg("bridge.mapped.0.a", 9),   # partition 0 has it already (restored past it)
        msg("bridge.mapped.2.a", 10),
        msg("bridge.mapped.0.b", 11),
        msg("bridge.mapped.1.a", 12),  # not a partition this reader reads
        msg("bridge.mapped.2.__tick__", 13),
        msg("bridge.mapped.x.a", 14),  # not a partition's subject
    ])
    assert [(m.subject, m.metadata.sequence.stream) for m in feeds[0].msgs] == [("bridge.mapped.0.b", 11)]
    assert [m.metadata.sequence.stream for m in feeds[2].msgs] == [10, 13]
    assert (feeds[0].last, feeds[2].last) == (11, 13)
    P.PairingService.dispatch(feeds, [msg("bridge.mapped.2.a", 13), msg("bridge.mapped.0.b", 11)])  # read again
    assert (len(feeds[0].msgs), len(feeds[2].msgs)) == (1, 2), "a message read again is not put twice"


async def mapped_consumers(js: Any) -> list[list[str]]:
    """The filter subjects of each consumer on BRIDGE_MAPPED."""
    return [sorted(c.config.filter_subjects or [c.config.filter_subject]) for c in await js.consumers_info(S.BRIDGE_MAPPED)]


async def consumers_become(js: Any, want: list[list[str]]) -> list[list[str]]:
    """The consumers on BRIDGE_MAPPED once they are ``want`` (or after 20 s: what they are; ~5 s
    was not enough at load 5, 2026-12-07: the old consumer was still there)."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if (got := await mapped_consumers(js)) == want:
            return got
        await asyncio.sleep(0.05)
    return await mapped_consumers(js)


async def stop(*services: P.PairingService | None) -> None:
    for svc in services:
        if svc is not None:
            svc.stopper.trigger("test")
            await svc.stop()
            await svc.close()


def test_one_consumer_reads_the_partitions_a_replica_owns(url: str) -> None:
    async def scenario() -> None:
        nc = await nats.connect(url)
        js = nc.jetstream()
        svc = None
        try:
            # maintain() runs once here: a lease that lapsed under load (20 s at load 5) would
            # stop the reader of partition 0 at the end (no consumer at all), not the rule tested
            svc = await service(url, "one", partitions=4, lease_ttl_s=300)
            await svc.maintain()
            assert sorted(svc.partitions) == [0, 1, 2, 3]
            await until(lambda: bool(svc.readers))
            # Every partition: one filter (nats-server delivers a consumer of several far more slowly).
            assert await consumers_become(js, [["bridge.mapped.>"]]) == [["bridge.mapped.>"]]
            base = 1_700_000_000_000_000_000
            sent = {n: 0 for n in range(4)}
            # Published in parts, the reader started over (as a partition taken or dropped
            # does) between them and mid-stream: nothing lost, nothing folded twice.
            for part_no in range(6):
                for n in range(4):
                    first = 1 + n * 10_000 + part_no * 50
                    await publish_sessions(js, range(first, first + 50), base, partition=n)
                    sent[n] += 50
                svc.restart_reader()
                await asyncio.sleep(0.05 * part_no)
            last = (await js.stream_info(S.BRIDGE_MAPPED)).state.last_seq
            await until(lambda: all(sample(svc, "aep_bridge_pairing_events_in_total", partition=str(n)) >= sent[n]
                                    for n in range(4)))
            assert max(p.position for p in svc.partitions.values()) == last
            await asyncio.sleep(0.5)
            assert {n: sample(svc, "aep_bridge_pairing_events_in_total", partition=str(n)) for n in range(4)} == sent
            assert sample(svc, "aep_bridge_pairing_consumer_gaps_total") == 0
            # A partition dropped (its lease lost): a new consumer, for the others only.
            dropped = svc.partitions.pop(3)
            dropped.lost = True
            assert dropped.task is not None
            dropped.task.cancel()
            svc.restart_reader()
            left = [[f"bridge.mapped.{n}.>" for n in range(3)]]
            assert await consumers_become(js, left) == left, "the old consumer is removed and the new one reads the partitions left"
            # One partition: its own filter.
            for n in (1, 2):
                gone = svc.partitions.pop(n)
                gone.lost = True
                assert gone.task is not None
                gone.task.cancel()
            svc.restart_reader()
            assert await consumers_become(js, [["bridge.mapped.0.>"]]) == [["bridge.mapped.0.>"]]
            assert [c.config.filter_subjects for c in await js.consumers_info(S.BRIDGE_MAPPED)] in ([None], [[]]), \
                "one partition: a consumer of one filter_subject, not a list of one"
        finally:
            await stop(svc)
            await nc.close()

    asyncio.run(asyncio.wait_for(scenario(), BOUND_S))


def test_partitions_restored_at_different_positions_each_read_from_their_own(url: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Partition 0 restored at its checkpoint, partition 1 (none) from 0: each folds exactly what
    it has not. Partition 1 is further behind than `CATCH_UP_GAP` (made small here): it is read
    by a consumer of its own, not by one that would send partition 0 everything again, and joins
    partition 0's once it is near."""
    monkeypatch.setattr(P, "CATCH_UP_GAP", 50)
    started: list[tuple[list[int], bool]] = []
    read_loop = P.PairingService.read_loop

    async def recorded(self: P.PairingService, parts: dict, catch_up: bool = False) -> None:  # type: ignore[type-arg]
        started.append((sorted(parts), catch_up))
        await read_loop(self, parts, catch_up)

    monkeypatch.setattr(P.PairingService, "read_loop", recorded)

    async def scenario() -> None:
        nc = await nats.connect(url)
        js = nc.jetstream()
        first = second = None
        base = 1_700_000_000_000_000_000
        try:
            await publish_sessions(js, range(1, 101), base, partition=0)
            await publish_sessions(js, range(1001, 1031), base, partition=1)
            # The first owner reads partition 0 only, and stops: its checkpoint is at the head.
            first = await service(url, "first", partitions=1)
            await first.maintain()
            head = (await js.stream_info(S.BRIDGE_MAPPED)).state.last_seq
            await until(lambda: first.partitions[0].position >= 100)
            first.stopper.trigger("test")
            await first.stop()
            position = first.partitions[0].position
            await first.close()
            first = None
            await publish_sessions(js, range(101, 121), base, partition=0)
            await publish_sessions(js, range(1031, 1041), base, partition=1)
            # The second owns both: partition 0 from its checkpoint, partition 1 (none) from 0.
            second = await service(url, "second", partitions=2)
            await second.maintain()
            assert second.partitions[0].position == position and second.partitions[1].position == 0
            last = (await js.stream_info(S.BRIDGE_MAPPED)).state.last_seq
            assert last > head
            await until(lambda: sample(second, "aep_bridge_pairing_events_in_total", partition="0") >= 20
                        and sample(second, "aep_bridge_pairing_events_in_total", partition="1") >= 40)
            await asyncio.sleep(0.5)
            assert sample(second, "aep_bridge_pairing_events_in_total", partition="0") == 20, \
                "partition 0 folds only what came after its checkpoint"
            assert sample(second, "aep_bridge_pairing_events_in_total", partition="1") == 40
            assert ([1], True) in started, f"partition 1, 100 behind, had no consumer of its own: {started}"
            await until(lambda: started[-1] == ([0, 1], False))  # caught up: one consumer for both
            both = [["bridge.mapped.>"]]  # both partitions of two: every one, one filter
            assert await consumers_become(js, both) == both
        finally:
            await stop(first, second)
            await nc.close()

    asyncio.run(asyncio.wait_for(scenario(), BOUND_S))


def test_a_reader_that_cannot_read_says_so_and_hands_its_partitions_back(url: str) -> None:
    """A consumer that cannot be made (here: refused, as by a server that lost the stream)
    leaves the replica not ready; failing for longer than a lease lives without a renewal, the
    partitions are released (unowned here, with the reason) rather than held unread; once it
    can read again, it takes them back and is ready."""
    async def scenario() -> None:
        svc = await service(url, "broken", partitions=2)
        create = svc.reader_consumer

        async def refused(feeds: dict, made: Any = None) -> Any:  # type: ignore[type-arg]
            raise nats.js.errors.APIError(code=503, description="no responders (the test)")

        try:
            svc.reader_consumer = refused  # type: ignore[method-assign]
            await svc.maintain()
            assert sorted(svc.partitions) == [0, 1]
            await until(lambda: svc.reader_error is not None)
            await svc.maintain()
            assert svc.health.ready is False and "consumer fails" in (svc.health.reason or ""), svc.health.reason
            assert sorted(svc.partitions) == [0, 1], "not yet: a failure shorter than a lease"
            assert svc.reader_failing_since is not None
            svc.reader_failing_since -= 60.0  # as if it had failed for a minute
            await svc.maintain()
            assert svc.partitions == {}, "released, not held unread"
            assert sorted(svc.unowned) == [0, 1] and "consumer failed" in svc.unowned[0]
            assert svc.health.ready is False
            svc.reader_consumer = create  # type: ignore[method-assign]
            await svc.maintain()
            assert sorted(svc.partitions) == [0, 1] and svc.unowned == {}
            await until(lambda: svc.reader_error is None and bool(svc.readers))
            await svc.maintain()
            assert svc.health.ready is True, svc.health.reason
        finally:
            await stop(svc)

    asyncio.run(asyncio.wait_for(scenario(), BOUND_S))


def test_a_consumer_created_but_unanswered_is_deleted_not_left_to_its_inactive_threshold(url: str) -> None:
    """CI (2026-12-07, load): the create of the reader's consumer reached the server, which made
    it, but its answer did not come in time (or the reader was cancelled meanwhile): the reader
    had no subscription to remove, tried again, and the first consumer stayed until its 30 s
    inactive threshold (two consumers on the same filter). The consumer's name is chosen by the
    client (nats-py names ephemerals), so the reader deletes it by name."""
    async def scenario() -> None:
        nc = await nats.connect(url)
        js = nc.jetstream()
        svc = None
        try:
            svc = await service(url, "late-answer", partitions=2, lease_ttl_s=300)
            real = svc.js.pull_subscribe
            answered: list[Any] = []

            async def unanswered(*args: Any, **kwargs: Any) -> Any:
                sub = await real(*args, **kwargs)  # made on the server
                if not answered:
                    answered.append(sub)  # (its inbox left subscribed: the answer "lost")
                    raise nats.errors.TimeoutError
                return sub

            svc.js.pull_subscribe = unanswered  # type: ignore[method-assign]
            await svc.maintain()
            await until(lambda: bool(answered) and svc.reader_error is not None)
            await until(lambda: svc.reader_error is None)  # a new consumer, read from
            assert await consumers_become(js, [["bridge.mapped.>"]]) == [["bridge.mapped.>"]]
        finally:
            await stop(svc)
            await nc.close()

    asyncio.run(asyncio.wait_for(scenario(), 90))
