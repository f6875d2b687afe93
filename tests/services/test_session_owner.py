"""Issue 44 item 3 in the pipeline: a session belongs to the first instance seen for it.

Sessions are keyed by session id. Before the fix the mapper mapped instance A's
``on_session_finalize`` naming instance B's session like any other: pairing then emitted a
``session.ended`` with source A, swept B's open tool (``x.hermes.pairing.orphaned``, source
A) and suppressed B's own ``session.ended`` later. Now the mapper records the session's
instance (``o.<lane token>`` in aep_lane_facts, a KV create: the first wins, every replica
reads the same), and a raw message of another instance naming it changes nothing of the
session: counted, dead-lettered as ``bridge.dlq.instance_conflict``.

Process level: a real nats-server with the sample deploy/nats/nats.conf and again with the
chart's values rendered, the mapper and pairing as their own users, the real shim as B (the
shared shim user) and A (the strict per-instance user ``hermes-gateway-0`` in the sample;
the shared shim user, another instance, with the chart's values)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest

from bridge.core.lanes import lane_token
from tests.support.nats_roles import (as_user, configured_server, dlq_subjects, ensure_streams, read_as, role_hook,
                                      sample_nats_conf, values_nats_conf)
from tests.support.services import Service, wait_for
from tests.support.shim import envelope


@pytest.fixture(scope="module", params=["sample", "values"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp(f"nats-owner-{request.param}")
    text = sample_nats_conf(tmp / "js") if request.param == "sample" else values_nats_conf(tmp / "js")
    with configured_server(tmp, text) as url:
        asyncio.run(ensure_streams(url))
        yield {"url": url, "kind": request.param, "log": tmp / "server.log"}


def test_an_instance_cannot_end_another_instances_session_in_the_pipeline(server: dict, tmp_path: Path) -> None:
    url = server["url"]
    a_role, a_instance = ("gateway-0", "gateway-0") if server["kind"] == "sample" else ("shim", "gw-a")
    mapper = Service("mapper", url, tmp_path, env=as_user("mapper")).start()
    pairing = Service("pairing", url, tmp_path, "--replica", "solo", env=as_user("pairing")).start()
    session = f"s-{time.time_ns()}"
    token = lane_token(session)

    def events() -> list[dict]:
        return [json.loads(m.data) for m in asyncio.run(read_as(url, "consumer", "AEP_EVENTS", f"aep.hermes.{token}.>"))]

    try:
        # B: a session with a tool open
        role_hook(url, tmp_path, "shim", "gw-b", envelope("on_session_start", session=session))
        role_hook(url, tmp_path, "shim", "gw-b", envelope("pre_tool_call", session=session, tool_call_id="call_1"))
        wait_for(lambda: "tool.requested" in [e["type"] for e in events()], 30,
                 what=f"B's tool on the stream:\n{mapper.log()}\n{pairing.log()}")
        # A names B's session: its finalize, and a tool result of B's open call
        role_hook(url, tmp_path, a_role, a_instance, envelope("post_tool_call", session=session, tool_call_id="call_1"))
        role_hook(url, tmp_path, a_role, a_instance, envelope("on_session_finalize", session=session, reason="shutdown"))
        wait_for(lambda: asyncio.run(dlq_subjects(url)).get("bridge.dlq.instance_conflict", 0) >= 2
                 or "session.ended" in [e["type"] for e in events()], 30, what=f"A's messages handled:\n{mapper.log()}")
        # B ends its own session
        role_hook(url, tmp_path, "shim", "gw-b", envelope("on_session_finalize", session=session, reason="shutdown"))
        wait_for(lambda: any(e["type"] == "session.ended" and "gw-b" in e["source"] for e in events()), 30,
                 what=f"B's own session.ended:\n{mapper.log()}\n{pairing.log()}")
        got = events()
        sources = {(e["type"], e["source"].split("/agent/")[0]) for e in got}
        assert not [s for s in sources if s[1] != "aep://gw-b"], sources  # nothing of A on B's session
        assert [e["type"] for e in got].count("session.ended") == 1, got
        assert "tool.completed" not in [e["type"] for e in got], got  # A's result did not close B's call
        # B's own end swept B's call (by B), as it would have without A
        assert ("x.hermes.pairing.orphaned", "aep://gw-b") in sources, sources
        # counted and dead-lettered with the reason
        assert asyncio.run(dlq_subjects(url)).get("bridge.dlq.instance_conflict") == 2
        assert 'aep_bridge_dead_letters_total{reason="instance_conflict"} 2.0' in mapper.metrics_text()
        assert not [line for line in server["log"].read_text().splitlines() if "Violation" in line and "aep-mapper" in line]
    finally:
        mapper.terminate()
        pairing.terminate()
    assert "Traceback" not in mapper.log() + pairing.log()


def test_the_gate_and_the_mapper_agree_on_a_sessions_instance(server: dict, tmp_path: Path) -> None:
    """One record for both: the gate started after B's session began (its raw durable
    delivers new messages only), so the first message of that session it sees is A's
    finalize. Before, the gate had no record of its own and took A's finalize for the
    session's (ended it, and would have refused B's held calls as another instance's),
    while the mapper dead-lettered it: the two disagreed. Now the gate reads the instance the
    mapper recorded (``o.<lane token>`` in aep_lane_facts)."""
    url = server["url"]
    a_role, a_instance = ("gateway-0", "gateway-0") if server["kind"] == "sample" else ("shim", "gw-a")
    mapper = Service("mapper", url, tmp_path, env=as_user("mapper")).start()
    session = f"s-{time.time_ns()}"
    gate = None
    try:
        wait_for(lambda: "mapper_ready" in mapper.log(), 20, what=f"the mapper ready:\n{mapper.log()}")
        role_hook(url, tmp_path, "shim", "gw-b", envelope("on_session_start", session=session))
        wait_for(lambda: metric_sum(mapper.metrics_text(), "aep_bridge_mapper_raw_messages_total") >= 1, 20,
                 what=f"B's start mapped:\n{mapper.log()}")
        gate = Service("gate", url, tmp_path, "--probe-ms", "300",
                       env={**as_user("gate"), "AEP_HERMES_CONTROL": "1", "AEP_INSTRUCT": "1"}).start()
        wait_for(lambda: "gate_ready" in gate.log(), 20, what=f"the gate ready:\n{gate.log()}")
        role_hook(url, tmp_path, a_role, a_instance, envelope("on_session_finalize", session=session, reason="shutdown"))
        # (before: no foreign_instance, the gate finalized the session as A's)
        wait_for(lambda: "foreign_instance" in gate.log(), 20, what=f"the gate to refuse A's finalize:\n{gate.log()}")
        assert "aep_bridge_gate_foreign_instance_total 1.0" in gate.metrics_text(), gate.log()
        assert 'aep_bridge_dead_letters_total{reason="instance_conflict"} 1.0' in mapper.metrics_text()
        assert not [line for line in server["log"].read_text().splitlines() if "Violation" in line and "aep-gate" in line]
    finally:
        mapper.terminate()
        if gate is not None:
            gate.terminate()
    assert "Traceback" not in mapper.log() + (gate.log() if gate else "")


def metric_sum(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_the_gate_may_touch_the_sessions_instances_only(server: dict) -> None:
    """The aep-gate user reads and creates `o.<lane token>` of aep_lane_facts and nothing
    else of that bucket (the raw messages' lanes, `r.*`, are the mapper's)."""
    from tests.support.nats_roles import Client, expect_api_refused, expect_publish_refused

    async def run() -> None:
        c = await Client.connect(server["url"], "gate")
        try:
            facts = await c.js.key_value("aep_lane_facts")
            key = f"o.gate-probe-{time.time_ns()}"
            await facts.create(key, b"gw-z")
            assert (await facts.get(key)).value == b"gw-z"
            await expect_publish_refused(c, "$KV.aep_lane_facts.r.gw-1.x")
            await expect_api_refused(c, facts.get("r.gw-1.x"), "KV_aep_lane_facts")
        finally:
            await c.close()

    asyncio.run(run())
