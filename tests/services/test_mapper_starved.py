"""A mapper whose server takes its pulls and delivers nothing while its durable holds messages
leaves that server (issue 42).

In a partition run (2026-12-07) the node cut off from its peers led the cluster's meta group:
it answered the follower's probe and the durable's info (its own stale view: 7,688 messages
pending) and took the pull requests, and delivered nothing for the whole 18 s cut. The
mapper's fetches timed out quietly, it published nothing, so no signal of the follower
(bridge/nats/follow.py) failed, and both mappers stayed there, the pipeline flat, while the
majority held the durable with 9,500-13,600 messages pending. The mapper now reports its
pulls that bring nothing while its durable says messages are waiting (`Deliveries`), one of
the follower's signals.

A real server plays the cut node: the mapper's user may not send pull requests (the server
drops them, the connection stays up) while it reads the durable's info; or, idle, may not
send a message get of HERMES_RAW (which only the stream's leader answers). A consumer an
operator paused delivers nothing too, and is no server's fault: not a failure.
"""

from __future__ import annotations

import asyncio
import datetime
import json

import nats
from prometheus_client import CollectorRegistry

import bridge.services.mapper as mapper_module
from bridge.config import Settings
from bridge.core.ceiling import CapturePolicy
from bridge.nats import follow
from bridge.nats import streams as S
from bridge.nats.bootstrap import bootstrap
from bridge.services.mapper import Mapper
from tests.support.services import publish_all, raw_records

AFTER_S = 0.5  # STARVED_AFTER_S, 2 s in the service
USERS = """authorization {
  users = [
    {user: admin, password: admin}
    {user: pulls, password: pulls}
    {user: nopulls, password: nopulls, permissions: {publish: {deny: ["$JS.API.CONSUMER.MSG.NEXT.>"]}}}
    {user: stale, password: stale, permissions: {publish: {deny: ["$JS.API.STREAM.MSG.GET.>", "$JS.API.CONSUMER.MSG.NEXT.>"]}}}
  ]
}
"""


def env(session: str) -> dict:
    return {"hook_event_name": "pre_llm_call", "session_id": session, "tool_name": None, "tool_input": None,
            "cwd": "/tmp", "extra": {"platform": "cli", "model": "m"}}


def as_user(url: str, user: str) -> str:
    return url.replace("nats://", f"nats://{user}:{user}@", 1)


async def watched(url: str, user: str, records: list, pause: bool = False) -> dict:
    """A mapper as ``user`` on a fresh stream with ``records`` published (its durable paused
    for a minute first when ``pause``); what its follower says after nothing came for a while."""
    nc = await nats.connect(as_user(url, "admin"))
    js = nc.jetstream()
    await bootstrap(js, None, replicas=1)
    m = Mapper(Settings(nats_url=as_user(url, user), instance=user), CapturePolicy(), registry=CollectorRegistry())
    await m.connect()
    sub = await m.bind()
    if pause:
        until = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=60)
        reply = await nc.request(f"$JS.API.CONSUMER.PAUSE.{S.HERMES_RAW}.{S.MAPPER_DURABLE}",
                                 json.dumps({"pause_until": until.isoformat().replace("+00:00", "Z")}).encode(), timeout=5)
        assert b'"error"' not in reply.data, reply.data
    await publish_all(js, records)
    follower = follow.of(m.nc)
    assert follower is not None
    loop = asyncio.get_running_loop().create_task(m.consume(sub))
    try:
        await asyncio.sleep(2 * AFTER_S + 1.5)
        out = {"failing_since": follower.failing_since(), "stats": follower.stats(),
               "floor": (await js.consumer_info(S.HERMES_RAW, S.MAPPER_DURABLE)).ack_floor.stream_seq}
    finally:
        m.stopper.trigger("test over")
        loop.cancel()
        try:
            await loop
        except BaseException:
            pass
        await m.close()
        await js.delete_stream(S.HERMES_RAW)  # the next case starts afresh
        await nc.close()
    return out


def test_a_mapper_fed_nothing_while_its_durable_holds_messages_reports_its_server_failing(nats_factory, monkeypatch):
    monkeypatch.setattr(mapper_module, "STARVED_AFTER_S", AFTER_S)
    url = nats_factory(USERS).url
    records = raw_records([env(f"s-starved-{i}") for i in range(3)], instance="gw-starved")

    starved = asyncio.run(watched(url, "nopulls", records))
    assert starved["failing_since"] is not None and starved["stats"].get("nats_jetstream_failing_s", 0) > 0, starved
    assert starved["floor"] == 0, starved
    idle = asyncio.run(watched(url, "pulls", []))  # nothing pending: all well
    assert idle["failing_since"] is None, idle
    paused = asyncio.run(watched(url, "pulls", records, pause=True))  # an operator's pause: all well
    assert paused["failing_since"] is None and paused["floor"] == 0, paused
    flowing = asyncio.run(watched(url, "pulls", records))
    assert flowing["failing_since"] is None and flowing["floor"] == 3, flowing


def test_an_idle_mapper_whose_stream_leader_does_not_answer_reports_its_server_failing(nats_factory, monkeypatch):
    """A node cut off from its peers that still leads the meta group and the mapper durable
    answers the durable's info from its stale view, with nothing pending, and the probe: both
    mappers sat 17 s on one (a partition run, 2026-12-07). HERMES_RAW's leader was on the other
    side: only it answers a message get of the stream, which an idle mapper now asks. Played by
    a user whose message gets (and pulls) go unanswered."""
    monkeypatch.setattr(mapper_module, "STARVED_AFTER_S", AFTER_S)
    url = nats_factory(USERS).url
    stale = asyncio.run(watched(url, "stale", []))
    assert stale["failing_since"] is not None, stale
