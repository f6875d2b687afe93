"""The mapper's batch answers (issue 43 sends a batch's session-owner creates and lane-fact creates
as publishes and waits for them once per batch): the hostile review of 54b6885 found two ways
that broke issue 44's and the lane facts' rules. Both tests failed on 54b6885.

- A batch shares one owner create per new session, sent with the instance of the session's
  first message; it must be judged with that instance, not each held message's own (else a
  second instance whose first message failed after the send takes the session in this
  replica's cache while the record says the first).
- A lane fact's create that the server never answers maps the message as before lane facts
  (the late look-ups are the backstop), after FACT_TIMEOUT_S, as the request it replaced did
  (it was retried after 10 s, never published, while a bucket took no writes)."""

from __future__ import annotations

import asyncio
import json
import time

import nats
import nats.errors
from prometheus_client import CollectorRegistry

from bridge.config import Settings
from bridge.core.ceiling import CapturePolicy
from bridge.core.lanes import lane_token
from bridge.nats import streams as S
from bridge.services.mapper import Mapper
from bridge.nats.bootstrap import bootstrap
from tests.support.services import publish_all, raw_records

FACTS = "$KV.aep_lane_facts.r."


def env(hook: str, session: str) -> dict:
    return {"hook_event_name": hook, "session_id": session, "tool_name": None, "tool_input": None,
            "cwd": "/tmp", "extra": {"platform": "cli", "model": "m"}}


def test_a_second_instance_does_not_take_a_session_whose_first_message_failed(nats_server_fn) -> None:
    session = f"s-{time.time_ns()}"
    url = nats_server_fn.url

    async def run() -> dict:
        nc = await nats.connect(url)
        js = nc.jetstream()
        await bootstrap(js, None, replicas=1)
        recs = raw_records([env("on_session_start", session)], instance="gw-a") + \
            raw_records([env("pre_llm_call", session)], instance="gw-b")
        await publish_all(js, recs)
        m = Mapper(Settings(nats_url=url, instance="rev"), CapturePolicy(), registry=CollectorRegistry())
        await m.connect()
        sub = await m.bind()
        msgs: list = []
        while len(msgs) < 2:
            msgs += await sub.fetch(2 - len(msgs), timeout=5)
        learn = m.lanes.learn
        failed = []

        async def flaky_learn(result, publish):
            if not failed:  # gw-a's first message: its KV put's publish raises (nats-py, reconnecting)
                failed.append(1)
                raise nats.errors.OutboundBufferLimitError
            return await learn(result, publish)

        m.lanes.learn = flaky_learn
        await m.process_batch(msgs)
        facts = await js.key_value(S.LANE_FACTS_BUCKET)
        recorded = (await facts.get("o." + lane_token(session))).value.decode()
        cached = m.lanes.cached_owner(session)
        mapped = []
        try:
            psub = await js.subscribe(f"bridge.mapped.*.{lane_token(session)}", deliver_policy="all", ordered_consumer=True)
            while True:
                mapped.append(json.loads((await psub.next_msg(timeout=1)).data))
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            pass
        await nc.close()
        await m.nc.close()
        return {"recorded": recorded, "cached": cached, "mapped_sources": [e["source"] for e in mapped]}

    got = asyncio.run(run())
    assert got["recorded"] == "gw-a"  # the record: the first instance that named the session
    # the replica must agree with the record, and publish nothing of gw-b on gw-a's session
    assert got["cached"] == got["recorded"], got
    assert not [s for s in got["mapped_sources"] if "gw-b" in s], got


def test_an_unanswered_lane_fact_maps_the_message_as_before_lane_facts(nats_server_fn) -> None:
    session, task = f"s{time.time_ns()}", f"t{time.time_ns()}"
    start = {"hook_event_name": "pre_llm_call", "session_id": session, "tool_name": None, "tool_input": None,
             "cwd": "/tmp", "extra": {"task_id": task, "turn_id": f"{session}:{task}:0a1b2c3d", "model": "m",
                                      "platform": "cli"}}
    inner = {"hook_event_name": "pre_tool_call", "session_id": "", "tool_name": "terminal",
             "tool_input": {"command": "ls"}, "cwd": "/tmp",
             "extra": {"task_id": task, "tool_call_id": "", "turn_id": "", "api_request_id": ""}}

    async def run() -> dict:
        nc = await nats.connect(nats_server_fn.url)
        js = nc.jetstream()
        await bootstrap(js, None, replicas=1)
        await publish_all(js, raw_records([start, inner], instance="gw-lf"))
        m = Mapper(Settings(nats_url=nats_server_fn.url, instance="rev2"), CapturePolicy(), registry=CollectorRegistry())
        await m.connect()
        sub = await m.bind()
        msgs: list = []
        while len(msgs) < 2:
            msgs += await sub.fetch(2 - len(msgs), timeout=5)
        await m.process_batch([msgs[0]])  # the session and its task alias learned
        publish = m.publisher.publish

        async def silent(subject, payload, headers=None):  # the lane fact's create: never answered
            if subject.startswith(FACTS):
                return asyncio.get_running_loop().create_future()
            return await publish(subject, payload, headers=headers)

        m.publisher.publish = silent
        m.fact_timeout_s = 0.5  # (FACT_TIMEOUT_S, 5 s, in the service)
        t0 = time.monotonic()
        await m.process_batch([msgs[1]])
        took = time.monotonic() - t0
        stored = []
        try:
            psub = await js.subscribe(f"bridge.mapped.*.{lane_token(session)}", deliver_policy="all", ordered_consumer=True)
            while True:
                stored.append((await psub.next_msg(timeout=1)).headers.get("Nats-Msg-Id"))
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            pass
        retries = m.metrics.retries._value.get()
        await m.nc.close()
        await nc.close()
        return {"took_s": round(took, 1), "stored_on_lane": len(stored), "retries": retries}

    got = asyncio.run(run())
    # the session's start and the inner call: both on the session's lane, nothing retried
    assert got["stored_on_lane"] == 2 and got["retries"] == 0, got
