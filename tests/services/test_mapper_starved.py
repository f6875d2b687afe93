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

A real server's paused consumer (nats-server's consumer pause) behaves the same way: it takes
pull requests and delivers nothing while its info counts the messages pending.
"""

from __future__ import annotations

import asyncio
import datetime
import json

import nats
from prometheus_client import CollectorRegistry

from bridge.config import Settings
from bridge.core.ceiling import CapturePolicy
from bridge.nats import follow
from bridge.nats import streams as S
from bridge.nats.bootstrap import bootstrap
import bridge.services.mapper as mapper_module
from bridge.services.mapper import Mapper
from tests.support.services import publish_all, raw_records


def env(session: str) -> dict:
    return {"hook_event_name": "pre_llm_call", "session_id": session, "tool_name": None, "tool_input": None,
            "cwd": "/tmp", "extra": {"platform": "cli", "model": "m"}}


async def pause(nc, until: datetime.datetime | None) -> None:
    body = {"pause_until": until.isoformat().replace("+00:00", "Z")} if until else {}
    reply = await nc.request(f"$JS.API.CONSUMER.PAUSE.{S.HERMES_RAW}.{S.MAPPER_DURABLE}", json.dumps(body).encode(),
                             timeout=5)
    assert b'"error"' not in reply.data, reply.data


AFTER_S = 0.5  # STARVED_AFTER_S, 2 s in the service


def test_a_mapper_fed_nothing_while_its_durable_holds_messages_reports_its_server_failing(nats_server_fn, monkeypatch):
    monkeypatch.setattr(mapper_module, "STARVED_AFTER_S", AFTER_S)

    async def run() -> dict:
        nc = await nats.connect(nats_server_fn.url)
        js = nc.jetstream()
        await bootstrap(js, None, replicas=1)
        m = Mapper(Settings(nats_url=nats_server_fn.url, instance="starved"), CapturePolicy(), registry=CollectorRegistry())
        await m.connect()
        sub = await m.bind()
        follower = follow.of(m.nc)
        assert follower is not None
        loop = asyncio.get_running_loop().create_task(m.consume(sub))
        out: dict = {}
        try:
            await asyncio.sleep(AFTER_S + 1.5)  # idle, nothing pending: all well
            out["idle"] = follower.failing_since()
            await pause(nc, datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=60))
            await publish_all(js, raw_records([env(f"s-starved-{i}") for i in range(3)], instance="gw-starved"))
            await asyncio.sleep(2 * AFTER_S + 1.5)
            out["paused"] = follower.failing_since()
            out["stats"] = follower.stats()
            await pause(nc, None)  # delivering again
            await asyncio.sleep(AFTER_S + 1.5)
            out["resumed"] = follower.failing_since()
            out["acked_floor"] = (await js.consumer_info(S.HERMES_RAW, S.MAPPER_DURABLE)).ack_floor.stream_seq
        finally:
            m.stopper.trigger("test over")
            loop.cancel()
            try:
                await loop
            except BaseException:
                pass
            await m.close()
            await nc.close()
        return out

    out = asyncio.run(run())
    assert out["idle"] is None, out
    assert out["paused"] is not None and out["stats"].get("nats_jetstream_failing_s", 0) > 0, out
    assert out["resumed"] is None and out["acked_floor"] == 3, out
