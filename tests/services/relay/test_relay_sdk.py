"""The official Python SDK (`agenteventprotocol-sdk`, `aep_sdk`) as a real client of the relay.

Real Hermes sessions (../shared/hermes/observed_envelopes.jsonl) go through the real shim,
mapper, pairing and the relay, as processes on a real nats-server; `aep_sdk.subscribe` (sync)
and `aep_sdk.aio.subscribe` receive them; the relay is killed mid-stream and restarted, and
the subscriptions resume with no loss (dedupe on (source, id)); `aep_sdk.project_state` over
what they received reports no violations; `aep_sdk.ControlClient` answers a held
pre_tool_call through relay -> gate -> shim, and the shim's answer to Hermes carries it."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import aep_sdk  # the official SDK (test extra: agenteventprotocol-sdk)
from aep_sdk import aio as sdk_aio

from bridge.nats.streams import MAPPER_DURABLE
from tests.support.plane import Plane, new_session, start_session
from tests.support.relay import CONSUMER, OPERATOR
from tests.support.services import wait_for
from tests.support.shim import dumps, run_hook

OBSERVED = Path(__file__).resolve().parents[4] / "shared" / "hermes" / "observed_envelopes.jsonl"
if not OBSERVED.exists():  # the worktree sits next to shared/
    OBSERVED = Path("/work/shared/hermes/observed_envelopes.jsonl")


def observed() -> list[dict[str, Any]]:
    return [json.loads(line)["envelope"] for line in OBSERVED.read_text().splitlines() if line.strip()]


def stored(plane: Plane) -> list[dict[str, Any]]:
    return [m.json() for m in plane.client.fetch("aep.>", stream="AEP_EVENTS")]


def key(ev: dict[str, Any]) -> tuple[str, str]:
    return ev["source"], ev["id"]


def settled(plane: Plane) -> Any:
    """A poll: the number of events on AEP_EVENTS once the mapper has acked every raw
    message and the count has not moved since the previous poll (pairing caught up), else 0."""
    last = {"n": -1}

    def poll() -> int:
        mapper = plane.client.run(plane.client.js.consumer_info("HERMES_RAW", MAPPER_DURABLE))
        n = len(stored(plane))
        still, last["n"] = n == last["n"], n
        return n if still and not mapper.num_pending and not mapper.num_ack_pending else 0

    return poll


def test_sdk_subscribers_receive_real_sessions_and_resume_across_a_relay_restart(relay_plane) -> None:
    plane, relay = relay_plane
    # Kill the relay mid-session: each session's first half before, its second half after
    # (a resuming consumer names the sessions it knows; a session that starts while it is
    # away is for `from: "all"` or a history store, AEP-0003 §5).
    envelopes = observed()
    per: dict[str, list[dict[str, Any]]] = {}
    for e in envelopes:
        per.setdefault(str(e.get("session_id")), []).append(e)
    before = [e for group in per.values() for e in group[: max(1, len(group) // 2)]]
    after = [e for group in per.values() for e in group[max(1, len(group) // 2):]]
    got_sync: list[dict[str, Any]] = []
    lock = threading.Lock()

    def on_event(ev: dict[str, Any]) -> None:
        with lock:
            got_sync.append(ev)

    sub = aep_sdk.subscribe(relay.url, on_event, token=CONSUMER, backoff_initial_ms=200, backoff_max_ms=1000)
    got_aio: list[dict[str, Any]] = []
    loop = asyncio.new_event_loop()
    started = threading.Event()
    handle: dict[str, Any] = {}

    async def consume() -> None:
        asub = await sdk_aio.subscribe(relay.url, token=CONSUMER, backoff_initial_ms=200, backoff_max_ms=1000)
        handle["sub"] = asub
        started.set()
        async for ev in asub:
            got_aio.append(ev)

    def run_loop() -> None:
        try:
            loop.run_until_complete(consume())
        except Exception:  # noqa: BLE001 - closed at the end of the test
            pass

    thread = threading.Thread(target=run_loop, daemon=True)
    thread.start()
    assert started.wait(15)
    time.sleep(0.5)
    try:
        env = plane.env()
        for e in before:
            assert run_hook(dumps(e), env).returncode == 0
        # the first half is through when the pipeline is idle (see `settled`) and both have it
        # all: a count that merely matches can be mid-backlog, and a session the subscribers
        # never saw before the kill is not theirs to resume
        quiet = settled(plane)

        def first_half_through() -> bool:
            n = quiet()
            return n > 0 and len({key(x) for x in got_sync}) == n and len({key(x) for x in got_aio}) == n

        wait_for(first_half_through, 60, interval=0.5, what="the first half through the relay")
        seen_before = {key(x) for x in stored(plane)}
        relay.stop(kill=True)  # mid-stream: the rest is written while the relay is down
        for e in after:
            assert run_hook(dumps(e), env).returncode == 0
        time.sleep(1.0)
        relay.start()
        # What a resume can bring back: every event of the known sessions that has a position
        # (session, epoch, seq). Events without one (agent-scoped, x.hermes.kanban.*) written
        # while the relay was down are not resumable positions (AEP-0003 §3.3.2): not expected.
        every: set[tuple[str, str]] = set()

        quiet = settled(plane)

        def caught_up() -> bool:
            idle = quiet() > 0  # the second half is all stored
            every.update(key(x) for x in stored(plane) if key(x) in seen_before or "seq" in x)
            return idle and {key(x) for x in got_sync} >= every and {key(x) for x in got_aio} >= every

        try:
            wait_for(caught_up, 60, interval=0.5, what="both SDK subscriptions to resume after the relay restart")
        except AssertionError:
            missing = {"sync": every - {key(x) for x in got_sync}, "aio": every - {key(x) for x in got_aio}}
            types = {k: sorted({(x["type"], x.get("session"), x.get("seq"), any(y.get("session") == x.get("session") for y in got_sync))
                                for x in stored(plane) if key(x) in v}) for k, v in missing.items()}
            raise AssertionError(f"missing after the restart: { {k: len(v) for k, v in missing.items()} } {types}") from None
    finally:
        sub.close()
        if "sub" in handle:
            loop.call_soon_threadsafe(handle["sub"].close)
        thread.join(5)
    assert len(every) > 100  # the real sessions, mapped and paired
    for got in (got_sync, got_aio):
        assert {key(x) for x in got} >= every  # no loss
        state = aep_sdk.project_state({key(x): x for x in got}.values())
        assert state["violations"] == []
        assert len(state["sessions"]) >= 5


def test_sdk_control_client_answers_a_held_call_through_relay_gate_shim(relay_plane) -> None:
    plane, relay = relay_plane
    session = new_session()
    start_session(plane, session)
    shim = plane.held(session, "call-sdk")
    req = plane.request_of(session, "call-sdk")
    client = aep_sdk.ControlClient(relay.url, agent="sdk-operator", host="test-host", token=OPERATOR)
    client.connect()
    try:
        ack = client.send("control.attention.respond", session, subject=req["id"], cause=req["id"],
                          data={"answer": {"option": "deny"}})
    finally:
        client.close()
    out, err = shim.communicate(timeout=15)
    assert ack["type"] == "control.accepted"
    assert json.loads(out)["action"] == "block"  # Hermes is told: blocked
    evs = plane.wait(session, lambda e: "attention.resolved" in [x["type"] for x in e], "attention.resolved")
    cmd = next(e for e in evs if e["type"] == "control.attention.respond")
    assert ack["cause"] == cmd["id"] and cmd["agent"] == "sdk-operator"
