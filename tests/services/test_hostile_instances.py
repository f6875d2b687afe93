"""Issue 44, items 3 and 6c: an instance speaks for itself only.

* Item 3: sessions are keyed by session id; an instance naming another instance's session
  (its ``on_session_finalize``, a held call, a turn) must change nothing of that session at
  the gate: not its record, not the roster's live entry, not its queued instructions. The
  gate counts it and dead-letters it (``bridge.dlq.instance_conflict``).
* Item 6c: several names share one subject token (``gw.1``, ``gw 1``, ``gw/1``, ``gw@1`` and
  ``gw_1`` all publish on ``hermes.raw.gw_1.>``); the events of that subject speak for one
  instance, the token, whatever name the body gives.

Process level: a real nats-server with the sample deploy/nats/nats.conf (and, for item 3,
the chart's values rendered), each service as its own user, the real shim."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest

from bridge.commands.control import build_command, send_command
from bridge.core import control as C
from bridge.core.lanes import lane_token
from tests.support.nats_roles import (INBOX, USERS, as_user, configured_server, dlq_subjects, ensure_streams, read_as,
                                      role_hook, role_settings, sample_nats_conf, values_nats_conf)
from tests.support.services import Service, wait_for
from tests.support.shim import envelope


async def control_entries(url: str, *keys: str) -> dict[str, Any]:
    """aep_control entries as the operator reads them (the roster's ``live.<token>``)."""
    user, password = USERS["operator"]
    nc = await nats.connect(url, user=user, password=password, inbox_prefix=INBOX["operator"])
    try:
        kv = await nc.jetstream().key_value("aep_control")
        out: dict[str, Any] = {}
        for key in keys:
            try:
                entry = await kv.get(key)
                out[key] = json.loads(entry.value) if entry.value else None
            except nats.js.errors.KeyNotFoundError:
                out[key] = None
        return out
    finally:
        await nc.close()


@pytest.fixture(scope="module", params=["sample", "values"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp(f"nats-instances-{request.param}")
    text = sample_nats_conf(tmp / "js") if request.param == "sample" else values_nats_conf(tmp / "js")
    with configured_server(tmp, text) as url:
        asyncio.run(ensure_streams(url))
        yield {"url": url, "kind": request.param, "log": tmp / "server.log"}


def test_an_instance_cannot_end_another_instances_session(server: dict, tmp_path: Path) -> None:
    """B (the control shim user, instance gw-b) runs a session with an operator's instruction
    queued; A (the strict per-instance user hermes-gateway-0 in the sample, the shared shim
    user with the chart's values) sends an on_session_finalize naming B's session. Before the
    fix the gate ended B's session (roster entry gone, the instruction dropped,
    x.hermes.instruction.dropped on the stream)."""
    url = server["url"]
    a_role, a_instance = ("gateway-0", "gateway-0") if server["kind"] == "sample" else ("shim", "gw-a")
    gate = Service("gate", url, tmp_path, "--probe-ms", "300",
                   env={**as_user("gate"), "AEP_HERMES_CONTROL": "1", "AEP_INSTRUCT": "1"}).start()
    try:
        wait_for(lambda: "gate_ready" in gate.log(), 20, what=f"the gate ready:\n{gate.log()}")
        session = f"s-{time.time_ns()}"
        token = lane_token(session)
        role_hook(url, tmp_path, "shim-control", "gw-b", envelope("on_session_start", session=session))
        role_hook(url, tmp_path, "shim-control", "gw-b", envelope("pre_llm_call", session=session, turn_id=f"{session}:t:1"))
        wait_for(lambda: asyncio.run(control_entries(url, f"live.{token}"))[f"live.{token}"] is not None, 10,
                 what="the gate to learn B's session")
        kind, data = asyncio.run(send_command(role_settings(url, "operator"),
                                              build_command(C.INSTRUCT, session, {"text": "for B only"}, sender="op"),
                                              C.ACK_WINDOW_MS / 1000))
        assert kind == "accepted", (kind, data, gate.log())

        # A names B's session.
        role_hook(url, tmp_path, a_role, a_instance, envelope("on_session_finalize", session=session, reason="shutdown"))
        wait_for(lambda: "bridge.dlq.instance_conflict" in asyncio.run(dlq_subjects(url))
                 or asyncio.run(control_entries(url, f"live.{token}"))[f"live.{token}"] is None, 10,
                 what=f"the gate to handle A's finalize:\n{gate.log()}")
        # B's session is as it was: live in the roster, its record B's, its instruction queued.
        entries = asyncio.run(control_entries(url, f"live.{token}", f"sess.{token}"))
        assert entries[f"live.{token}"] is not None and entries[f"live.{token}"]["instance"] == "gw-b", entries
        assert entries[f"sess.{token}"]["instance"] == "gw-b" and not entries[f"sess.{token}"].get("ended"), entries
        out = role_hook(url, tmp_path, "shim-control", "gw-b",
                   envelope("pre_llm_call", session=session, turn_id=f"{session}:t:2"), AEP_INSTRUCT="1")
        assert json.loads(out) == {"context": "for B only"}
        events = [json.loads(m.data) for m in asyncio.run(read_as(url, "consumer", "AEP_EVENTS", f"aep.hermes.{token}.>"))]
        assert "x.hermes.instruction.dropped" not in [e["type"] for e in events], events
        assert "x.hermes.instruction.delivered" in [e["type"] for e in events], events
        # Counted and dead-lettered with the reason.
        assert "bridge.dlq.instance_conflict" in asyncio.run(dlq_subjects(url))
        assert "aep_bridge_gate_foreign_instance_total 1.0" in gate.metrics_text()

        # B's own finalize still ends it.
        role_hook(url, tmp_path, "shim-control", "gw-b", envelope("on_session_finalize", session=session, reason="shutdown"))
        wait_for(lambda: asyncio.run(control_entries(url, f"live.{token}"))[f"live.{token}"] is None, 10,
                 what="B's own finalize to end B's session")
        assert not [line for line in server["log"].read_text().splitlines() if "Violation" in line and "aep-gate" in line]
    finally:
        gate.terminate()
    assert "Traceback" not in gate.log(), gate.log()


def test_one_subject_speaks_for_one_instance(server: dict, tmp_path: Path) -> None:
    """The shim as several names of one token; the mapper (as aep-mapper) and pairing: every
    event's source names the one instance of the subject (before: aep://gw.1, aep://gw%201,
    aep://gw%2F1, aep://gw%401 and aep://gw_1, five instances from one subject)."""
    url = server["url"]
    mapper = Service("mapper", url, tmp_path, env=as_user("mapper")).start()
    pairing = Service("pairing", url, tmp_path, "--replica", "solo", env=as_user("pairing")).start()
    names = ["gw.1", "gw 1", "gw/1", "gw@1", "gw_1"]
    try:
        for i, name in enumerate(names):
            role_hook(url, tmp_path, "shim", name, envelope("on_session_start", session=f"s6c-{i}"))

        def sources() -> dict[str, str]:
            evs = [json.loads(m.data) for m in asyncio.run(read_as(url, "consumer", "AEP_EVENTS", "aep.hermes.>", 0.3))]
            return {e["session"]: e["source"] for e in evs if e["session"].startswith("s6c-")}

        wait_for(lambda: len(sources()) == len(names), 30, what=f"the sessions mapped:\n{mapper.log()}")
        got = sources()
        assert {s.split("/agent/")[0] for s in got.values()} == {"aep://gw_1"}, got
    finally:
        mapper.terminate()
        pairing.terminate()
