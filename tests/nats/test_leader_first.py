"""The mapper's buckets are read from the stream's leader first, and from a replica's copy only
when the leader does not answer and the copy has the key (bridge/nats/lanes.py `LeaderFirst`,
issue 42): a replica behind its leader answers "not found" for a key the leader holds, and
during an election (a partition's heal, a flapping link) the leader's message get is answered
503 "JetStream system temporarily unavailable" while every replica still holds the keys.

A real server plays the leader that does not answer: the reader's user may not send
``STREAM.MSG.GET`` (the request goes unanswered, as to a stale leader cut off), direct gets
allowed."""

from __future__ import annotations

import asyncio

import nats
import pytest

from bridge.nats import streams as S
from bridge.nats.bootstrap import bootstrap
from bridge.nats.connection import outage
from bridge.nats.lanes import KvLanes, PinnedLane, lane_fact_key, lane_facts_bucket

USERS = """authorization {
  users = [
    {user: admin, password: admin}
    {user: reader, password: reader, permissions: {publish: {deny: ["$JS.API.STREAM.MSG.GET.>"]}}}
  ]
}
"""


def test_a_fact_is_read_from_a_copy_only_when_the_leader_is_silent_and_the_copy_has_it(nats_factory):
    url = nats_factory(USERS).url
    recorded, missing = lane_fact_key("inst", "01M9RECORDED00000000000000"), lane_fact_key("inst", "01M9MISSING000000000000000")

    async def run() -> tuple[object, object, object]:
        admin = await nats.connect(url.replace("nats://", "nats://admin:admin@", 1))
        await bootstrap(admin.jetstream(), None, replicas=1)
        writer = KvLanes(None, facts=await lane_facts_bucket(admin.jetstream()))
        assert await writer.record_lane(recorded, PinnedLane("s1")) == PinnedLane("s1")
        nc = await nats.connect(url.replace("nats://", "nats://reader:reader@", 1))
        try:
            reader = KvLanes(None, facts=await lane_facts_bucket(nc.jetstream(timeout=0.5)))
            found = await reader.recorded_lane(recorded)
            try:
                absent: object = await reader.recorded_lane(missing)
            except Exception as exc:  # noqa: BLE001
                absent = exc
            leader_alone = await writer.recorded_lane(missing)  # the leader answers: none recorded
        finally:
            await nc.close()
            await admin.close()
        return found, absent, leader_alone

    found, absent, leader_alone = asyncio.run(run())
    assert found == PinnedLane("s1")  # the leader silent: the copy's value (never changed once recorded)
    # the leader silent and the copy without it: "cannot tell" (retried), never "none recorded"
    assert isinstance(absent, BaseException) and outage(absent), absent
    assert leader_alone is None
