"""Control through the relay (AEP-0004 on the AEP-0003 WebSocket), end to end as processes: a
real nats-server, the gate, mapper and pairing, the real shim holding a pre_tool_call the way
Hermes runs it, and the relay. An operator's `control.attention.respond` goes relay -> gate ->
shim; the gate's ack comes back to the sender once; the relay's own refusals are `error`
frames with `cause` that never enter the session's history."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

import aiohttp

from bridge.commands.control import build_command
from bridge.core import control as C
from bridge.core.aep import encode_event
from bridge.nats.subjects import HELLO_SUBJECT
from bridge.services.gate.config import COMMAND_DURABLE
from tests.support.plane import Plane, new_session, start_session
from tests.support.relay import ALL, CONSUMER, EMITTER as EMITTER_TOKEN, OPERATOR, RelayProcess, auth
from tests.support.services import wait_for
from tests.support.shim import envelope
from tests.support.streams import consumer_idle

HELLO = {"type": "hello", "versions": ["0.1"], "role": "consumer", "identity": {"agent": "op-console"}}


async def operator_socket(s: aiohttp.ClientSession, relay: RelayProcess, token: str = OPERATOR) -> tuple[Any, dict]:
    ws = await s.ws_connect(relay.ws_url, headers=auth(token))
    await ws.send_json(HELLO)
    hello = json.loads((await ws.receive(timeout=5)).data)
    return ws, hello


def command(session: str, request: str, option: str, cid: str | None = None) -> bytes:
    return encode_event(build_command(C.RESPOND, session, {"answer": {"option": option}}, sender="relay-test",
                                      subject=request, command_id=cid))


async def routed(ws: Any, session: str) -> None:
    """Before pausing the gate: the relay behind ``ws`` has the gate's hello (a paused gate
    keeps its last answer for 30 s, `HELLO_GRACE_S`) and lists ``session`` as a live claim
    with the gate's control block (its list of live sessions is at most 1 s old), so a
    command to it is routed, not refused."""
    got: dict[str, Any] = {}
    for _ in range(40):
        await ws.send_json({"type": "roster", "id": "routed"})
        got = json.loads((await ws.receive(timeout=10)).data)
        if any(e["session"] == session and e.get("control") for e in got.get("entries", ())):
            return
        await asyncio.sleep(0.25)
    raise AssertionError(f"the roster never listed {session} with the gate's control block: {got}")


def held_call(plane: Plane, call: str, option: str) -> tuple[str, Any, dict[str, Any], str, bytes]:
    """A new session with ``call`` held by a real shim: (session, the shim, its
    attention.requested, a command id, the command answering it with ``option``)."""
    session = new_session()
    start_session(plane, session)
    shim = plane.held(session, call)
    req = plane.request_of(session, call)
    cid = uuid.uuid4().hex.upper()[:26]
    return session, shim, req, cid, command(session, req["id"], option, cid)


def test_operator_answers_a_held_call_through_relay_gate_shim(relay_plane) -> None:
    plane, relay = relay_plane
    session, shim, req, cid, cmd = held_call(plane, "call-r1", "deny")

    async def go():
        async with aiohttp.ClientSession() as s:
            ws, hello = await operator_socket(s, relay)
            await ws.send_str(cmd.decode())
            await ws.send_str(cmd.decode())  # a retry under the same id: pending or decided, answered once
            ack = await ws.receive(timeout=15)
            await ws.send_json({"type": "ping", "t": 1})
            before_pong = []  # a retry read after the decision is re-answered (the next test)
            while (frame := (await ws.receive(timeout=5)).data) and json.loads(frame).get("type") != "pong":
                before_pong.append(frame)
            await ws.close()
            return hello, ack.data, before_pong, json.loads(frame)

    hello, ack, before_pong, nxt = asyncio.run(go())
    out, err = shim.communicate(timeout=15)
    assert set(hello["capabilities"]["control"]["accepts"]) == {C.RESPOND, C.INSTRUCT}  # the gate's, relayed
    answer = json.loads(out)
    assert answer["action"] == "block", answer  # the shim's answer to Hermes carries the decision
    evs = plane.wait(session, lambda e: "control.accepted" in [x["type"] for x in e], "control.accepted")
    stored_ack = next(e for e in evs if e["type"] == "control.accepted")
    assert json.loads(ack) == stored_ack and stored_ack["cause"] == cid
    stored_cmds = [e for e in evs if e["type"] == C.RESPOND]
    assert len(stored_cmds) == 1 and stored_cmds[0]["id"] == cid  # published once, byte-identically
    assert nxt == {"type": "pong", "t": 1}
    assert before_pong in ([], [ack])  # one decision: at most its recorded ack again, byte-identical
    acks = [e for e in plane.events(session) if e["type"] in ("control.accepted", "control.rejected")]
    assert [e["cause"] for e in acks] == [cid]


def test_a_retry_after_the_ack_gets_the_recorded_ack_and_enters_history_once(relay_plane, tmp_path) -> None:
    """AEP-0004 §2.3/§3: a retry is always answered, by the recorded ack re-emitted
    byte-identically, and never re-executed. The relay that routed the command answers a
    retry from the acks it remembers; another replica (or the same after a restart)
    publishes it under a message id of its (source, id), so it is not a second copy in the
    session's history, and reads the recorded ack back from that history (the gate's
    re-ack of it would be a duplicate the store drops). (Seen in a clean-clone CI run: an
    ack that beat the retry left the command stored twice and the retry unanswered.)"""
    plane, relay = relay_plane
    replica = RelayProcess(plane.url, tmp_path).start()
    session, shim, req, cid, cmd = held_call(plane, "call-r2", "allow")

    async def go():
        async with aiohttp.ClientSession() as s:
            ws, _ = await operator_socket(s, relay)
            await ws.send_str(cmd.decode())
            first = (await ws.receive(timeout=15)).data
            await ws.send_str(cmd.decode())  # after the decision: the lost-ack recovery path
            again = (await ws.receive(timeout=10)).data
            await ws.close()
            answers = []
            for where in (relay, replica, replica):  # another connection; another replica, twice
                other, _ = await operator_socket(s, where)
                await other.send_str(cmd.decode())
                answers.append((await other.receive(timeout=10)).data)
                await other.close()
            return first, again, answers

    try:
        first, again, answers = asyncio.run(go())
    finally:
        replica.stop()
    out, _ = shim.communicate(timeout=15)
    assert json.loads(out).get("action") != "block"  # allowed, once
    assert json.loads(first)["type"] == "control.accepted" and json.loads(first)["cause"] == cid
    assert again == first and answers == [first] * 3  # the recorded ack, byte-identical
    plane.wait(session, lambda e: "control.accepted" in [x["type"] for x in e], "control.accepted")
    # every copy the relay published is stored before its answer; the gate has taken and acked
    # them all (it acks a command after publishing its decision): a second decision would be stored
    wait_for(lambda: consumer_idle(plane.client, "AEP_EVENTS", COMMAND_DURABLE), 15, what="the gate's commands acked")
    evs = plane.events(session)
    assert [e["id"] for e in evs if e["type"] == C.RESPOND] == [cid]  # in history once
    assert [e["cause"] for e in evs if e["type"] in ("control.accepted", "control.rejected")] == [cid]  # one decision
    # the session ends: nothing routes to it any more, but a relay that remembers the
    # decision still answers a retry with it (a new command gets no-route)
    plane.hook(envelope("on_session_finalize", session=session, reason="shutdown"))
    plane.wait(session, lambda e: "session.ended" in [x["type"] for x in e], "session.ended")

    async def after_end() -> tuple[Any, Any]:
        async with aiohttp.ClientSession() as s:
            ws, _ = await operator_socket(s, relay)
            for _ in range(40):  # the gate's finalize and the relay's 1 s roster cache: eventually
                await ws.send_str(command(session, req["id"], "allow").decode())
                fresh = json.loads((await ws.receive(timeout=10)).data)
                if fresh.get("code") == "no-route":
                    break
                await asyncio.sleep(0.25)
            await ws.send_str(cmd.decode())
            return fresh, (await ws.receive(timeout=10)).data

    fresh, retried = asyncio.run(after_end())
    assert fresh["type"] == "error" and fresh["code"] == "no-route"
    assert retried == first


async def published(ws: Any, cmd: bytes, tag: str) -> None:
    """Send ``cmd`` and return once the relay has handled it (it handles a connection's frames
    in order, so the pong after it means the command is published and pending)."""
    await ws.send_str(cmd.decode())
    await ws.send_json({"type": "ping", "t": tag})
    assert json.loads((await ws.receive(timeout=5)).data) == {"type": "pong", "t": tag}


def test_a_retry_past_the_commands_duplicate_window_is_answered_from_history(relay_plane, tmp_path) -> None:
    """A retry that reaches a replica with no memory of the command after the command's
    duplicate window has closed is stored as a new copy; the gate re-acks it under the ack's
    own message id, which the store drops while the ack's window is open. The replica then
    answers from the session's history: the ack stored before its copy (AEP-0004 §2.3).
    Windows of 2 s; the gate is paused while the command waits, so the decision comes after
    the command's window closed. (A retry slower than the ack's window, on a loaded machine,
    is answered by the stored re-ack instead: the test is then weaker, never wrong.)"""
    from bridge.nats.bootstrap import bootstrap

    plane, relay = relay_plane
    session, shim, req, cid, cmd = held_call(plane, "call-r4", "allow")

    async def go(replica: RelayProcess) -> tuple[Any, Any]:
        async with aiohttp.ClientSession() as s:
            ws, _ = await operator_socket(s, relay)
            other, _ = await operator_socket(s, replica)
            await routed(ws, session)
            with plane.gate_paused():
                await published(ws, cmd, "1")
                await asyncio.sleep(2.5)  # the command's duplicate window closes
            first = (await ws.receive(timeout=15)).data
            await routed(other, session)
            await other.send_str(cmd.decode())  # no memory there: a new copy
            again = (await other.receive(timeout=10)).data
            return first, again

    plane.client.run(bootstrap(plane.client.js, None, replicas=1, duplicate_window_s=2.0))
    try:
        replica = RelayProcess(plane.url, tmp_path).start()  # reads the 2 s window at start
        try:
            first, again = asyncio.run(go(replica))
        finally:
            replica.stop()
    finally:
        plane.client.run(bootstrap(plane.client.js, None, replicas=1))  # the default window again
    shim.communicate(timeout=15)
    assert json.loads(first)["type"] == "control.accepted" and json.loads(first)["cause"] == cid
    assert again == first  # the recorded ack, byte-identical
    evs = plane.wait(session, lambda e: [x["id"] for x in e].count(cid) == 2, "the retry stored as a second copy")
    assert {e["id"] for e in evs if e["type"] in ("control.accepted", "control.rejected")} == {json.loads(first)["id"]}


def test_the_same_command_id_from_two_sources_gets_each_its_own_ack(relay_plane) -> None:
    """Two operators' commands under one id (ids are per source, AEP-0004 §2.3) pending at
    once for one session: each sender gets the gate's ack of its own command. The ack's
    `cause` is the id alone, so the relay tells them apart by the ack's id (it names the
    command's (source, id)). The gate is paused so both are pending when the acks come."""
    plane, relay = relay_plane
    session, shim, req, cid, _ = held_call(plane, "call-r3", "allow")
    first = encode_event(build_command(C.RESPOND, session, {"answer": {"option": "allow"}}, sender="console-a",
                                       subject=req["id"], command_id=cid))
    second = encode_event(build_command(C.RESPOND, session, {"answer": {"option": "deny"}}, sender="console-b",
                                        subject=req["id"], command_id=cid))

    async def go():
        async with aiohttp.ClientSession() as s:
            a, _ = await operator_socket(s, relay)
            b, _ = await operator_socket(s, relay)
            await routed(a, session)
            with plane.gate_paused():
                await published(a, first, "a")  # both pending when the gate wakes
                await published(b, second, "b")
            got_a = json.loads((await a.receive(timeout=15)).data)
            got_b = json.loads((await b.receive(timeout=15)).data)
            return got_a, got_b

    got_a, got_b = asyncio.run(go())
    out, _ = shim.communicate(timeout=15)
    assert json.loads(out).get("action") != "block"  # the first command decided the call
    evs = plane.wait(session, lambda e: [x["type"] for x in e].count("control.accepted")
                     + [x["type"] for x in e].count("control.rejected") == 2, "both acks")
    acks = {e["type"]: e for e in evs if e["type"] in ("control.accepted", "control.rejected")}
    assert got_a == acks["control.accepted"] and got_b == acks["control.rejected"], (got_a, got_b)
    assert got_b["data"]["reason"] == "refused" and got_a["id"] != got_b["id"]


def test_relay_behalf_refusals_never_enter_history(relay_plane) -> None:
    plane, relay = relay_plane
    session = new_session()
    start_session(plane, session)
    plane.wait(session, lambda e: len(e) >= 1, "the session's first events")

    cancel = json.loads(command(session, "r", "allow"))
    cancel["type"] = "control.cancel"
    cancel["data"] = {"scope": "session"}
    no_session = json.loads(command(session, "r", "allow"))
    del no_session["session"]

    async def go():
        async with aiohttp.ClientSession() as s:
            ws, _ = await operator_socket(s, relay)
            out = []
            for frame in (cancel, no_session):
                await ws.send_json(frame)
                out.append(json.loads((await ws.receive(timeout=5)).data))
            cws, _ = await operator_socket(s, relay, token=CONSUMER)
            await cws.send_json(json.loads(command(session, "r", "allow", "CONSUMERCMD")))
            out.append(json.loads((await cws.receive(timeout=5)).data))
            return out

    unsupported, no_route, unauthorized = asyncio.run(go())
    assert unsupported == {"type": "error", "cause": cancel["id"], "code": "unsupported", "detail": unsupported["detail"]}
    assert no_route["code"] == "no-route" and no_route["cause"] == no_session["id"]
    assert unauthorized["code"] == "unauthorized" and unauthorized["cause"] == "CONSUMERCMD"
    # a command that passes is on AEP_EVENTS at once (the relay publishes before answering
    # anything): so a sentinel command sent after the refusals, and seen, closes the window
    sentinel = command(session, "no-such-request", "allow", "SENTINEL01")

    async def send_sentinel():
        async with aiohttp.ClientSession() as s:
            ws, _ = await operator_socket(s, relay)
            await ws.send_str(sentinel.decode())
            return json.loads((await ws.receive(timeout=15)).data)

    nack = asyncio.run(send_sentinel())
    assert nack["type"] == "control.rejected" and nack["cause"] == "SENTINEL01"  # the gate's own nack, in history
    after = plane.wait(session, lambda e: any(x["id"] == "SENTINEL01" for x in e), "the sentinel command")
    refused = {cancel["id"], no_session["id"], "CONSUMERCMD"}
    assert not any(e["id"] in refused or e.get("cause") in refused for e in after)  # nothing entered the history
    assert {e["type"] for e in after if e["type"].startswith("control.")} == {C.RESPOND, "control.rejected"}


def test_no_gate_is_no_route(nats_server, jetstream, tmp_path) -> None:
    relay = RelayProcess(nats_server.url, tmp_path).start()
    try:
        async def go():
            async with aiohttp.ClientSession() as s:
                ws, hello = await operator_socket(s, relay)
                await ws.send_str(command("s-nogate", "r", "allow", "NOGATE1").decode())
                return hello, json.loads((await ws.receive(timeout=5)).data)

        hello, refused = asyncio.run(go())
        assert hello["capabilities"]["control"]["accepts"] == []
        assert refused["code"] == "no-route" and refused["cause"] == "NOGATE1"
    finally:
        relay.stop()


def test_roster_lists_the_live_hermes_sessions_with_the_gates_control_block(relay_plane) -> None:
    """A Hermes session is a live claim from the gate's first sight of it to its finalize,
    whether or not a call is held right now; the entry carries the gate's control block."""
    plane, relay = relay_plane
    session, shim, req, _, _ = held_call(plane, "call-roster", "allow")

    async def roster(token: str, role: str = "consumer") -> Any:
        async with aiohttp.ClientSession() as s:
            ws = await s.ws_connect(relay.ws_url, headers=auth(token))
            await ws.send_json({**HELLO, "role": role})
            hello = json.loads((await ws.receive(timeout=5)).data)
            await ws.send_json({"type": "roster", "id": "r-1"})
            answer = json.loads((await ws.receive(timeout=10)).data)
            await ws.send_json({"type": "ping"})
            alive = json.loads((await ws.receive(timeout=5)).data)
            return hello, answer, alive

    def mine(answer: dict[str, Any]) -> list[dict[str, Any]]:
        return [e for e in answer["entries"] if e["session"] == session]

    for _ in range(40):  # the relay reads the live sessions at most once a second: eventually
        hello, held, _ = asyncio.run(roster(CONSUMER))
        if mine(held):
            break
        time.sleep(0.25)
    gate_hello = plane_hello(plane)
    assert hello["capabilities"]["roster"] == {}
    assert held["type"] == "roster" and held["id"] == "r-1"
    claim = {"session": session, "agent": "hermes", "instance": plane.instance,
             "control": gate_hello["capabilities"]["control"]}  # verbatim, one entry per claim
    assert mine(held) == [claim]
    _, refused, alive = asyncio.run(roster(EMITTER_TOKEN, role="emitter"))
    assert refused["type"] == "error" and refused["code"] == "unauthorized" and refused["id"] == "r-1"
    assert alive == {"type": "pong"}  # the connection survives the refusal
    # answered: the shim lets go, the session is still live (and steerable)
    plane.respond(session, req["id"], {"option": "allow"})
    shim.communicate(timeout=15)
    _, after, _ = asyncio.run(roster(OPERATOR))
    assert mine(after) == [claim]
    # finalized: no live route any more, and a command to it is refused no-route
    plane.hook(envelope("on_session_end", session=session, turn_id=f"{session}:t:1", completed=True, interrupted=False))
    plane.hook(envelope("on_session_finalize", session=session, reason="shutdown"))
    plane.wait(session, lambda e: "session.ended" in [x["type"] for x in e], "session.ended")

    async def refused_after_end() -> dict[str, Any]:
        async with aiohttp.ClientSession() as s:
            ws, _ = await operator_socket(s, relay)
            await ws.send_str(command(session, req["id"], "allow", "ENDED1").decode())
            return json.loads((await ws.receive(timeout=5)).data)

    for _ in range(40):  # the gate's finalize and the relay's 1 s roster cache: eventually
        _, ended, _ = asyncio.run(roster(CONSUMER))
        if not mine(ended):
            break
        time.sleep(0.25)
    assert mine(ended) == []
    late = asyncio.run(refused_after_end())
    assert late["type"] == "error" and late["code"] == "no-route" and late["cause"] == "ENDED1"


def plane_hello(plane: Plane) -> dict[str, Any]:
    import nats

    async def ask() -> dict[str, Any]:
        nc = await nats.connect(plane.url)
        try:
            return json.loads((await nc.request(HELLO_SUBJECT, b"", timeout=2)).data)
        finally:
            await nc.close()

    return asyncio.run(ask())


def test_an_emitter_naming_a_live_hermes_session_does_not_block_its_operators(relay_plane) -> None:
    """Issue 25 item 3: one WebSocket emitter's session.started under a live Hermes session's
    name used to make that session's commands `ambiguous`. A live Hermes session shadows
    emitter claims of its name: the command goes to the gate, the emitter gets nothing, and
    the roster lists the Hermes session only."""
    plane, relay = relay_plane
    session, shim, req, cid, cmd = held_call(plane, "call-shadow", "deny")
    started = {"aep": "0.1", "id": f"{session}-imp", "type": "session.started", "time": "2026-12-01T10:00:00.000Z",
               "source": "urn:test:impostor", "agent": "impostor", "session": session, "seq": 0,
               "data": {"client": {"name": "impostor"}}}
    emitter_hello = {"type": "hello", "versions": ["0.1"], "role": "emitter", "identity": {"agent": "impostor"},
                     "capabilities": {"control": {"accepts": [C.RESPOND]}}}

    async def go():
        async with aiohttp.ClientSession() as s:
            imp = await s.ws_connect(relay.ws_url, headers=auth(EMITTER_TOKEN))
            await imp.send_json(emitter_hello)
            await imp.receive(timeout=5)
            await imp.send_str(json.dumps(started))
            await imp.send_json({"type": "ping"})
            refused = json.loads((await imp.receive(timeout=5)).data)  # issue 44: not its to post into, nor to claim
            assert refused["type"] == "error" and refused["code"] == "unauthorized", refused
            assert json.loads((await imp.receive(timeout=5)).data)["type"] == "pong"  # in order
            ws, _ = await operator_socket(s, relay)
            entries: list[dict[str, Any]] = []
            for _ in range(40):  # the relay's list of live Hermes sessions is at most 1 s old
                await ws.send_json({"type": "roster", "id": "shadow"})
                entries = [e for e in json.loads((await ws.receive(timeout=10)).data)["entries"]
                           if e["session"] == session]
                if any(e.get("agent") != "impostor" for e in entries):
                    break
                await asyncio.sleep(0.25)
            await ws.send_str(cmd.decode())
            ack = json.loads((await ws.receive(timeout=15)).data)
            try:
                got = (await imp.receive(timeout=1)).data
            except asyncio.TimeoutError:
                got = None
            return entries, ack, got

    entries, ack, got = asyncio.run(go())
    out, _ = shim.communicate(timeout=15)
    assert ack["type"] == "control.accepted" and ack["cause"] == cid, ack
    assert json.loads(out)["action"] == "block"
    assert got is None, "the command went to the impostor"
    assert len(entries) == 1 and entries[0].get("agent") != "impostor", entries  # the Hermes session's entry only


def test_a_commands_source_is_bound_to_the_operator_token_that_first_used_it(relay_plane) -> None:
    """Issue 25 item 3: a second operator token reusing another's (source, id) used to read
    its decision (the gate's recorded ack). A source belongs to the first token that sent a
    command under it: another token's command under that source is refused `unauthorized`
    before anything is routed or read; the owner's commands still go through."""
    plane, relay = relay_plane
    session, shim, req, cid, _ = held_call(plane, "call-bound", "deny")
    sender = f"console-{uuid.uuid4().hex[:8]}"
    first = encode_event(build_command(C.RESPOND, session, {"answer": {"option": "deny"}}, sender=sender,
                                       subject=req["id"], command_id=cid))

    async def go():
        async with aiohttp.ClientSession() as s:
            owner, _ = await operator_socket(s, relay)
            await owner.send_str(first.decode())
            ack = json.loads((await owner.receive(timeout=15)).data)
            other, _ = await operator_socket(s, relay, token=ALL)  # another token with control rights
            await other.send_str(first.decode())  # the same (source, id): would read the decision
            stolen = json.loads((await other.receive(timeout=10)).data)
            await owner.send_str(first.decode())  # the owner's retry: its recorded ack
            again = json.loads((await owner.receive(timeout=10)).data)
            return ack, stolen, again

    ack, stolen, again = asyncio.run(go())
    shim.communicate(timeout=15)
    assert ack["type"] == "control.accepted" and ack["cause"] == cid
    assert stolen["type"] == "error" and stolen["code"] == "unauthorized" and stolen["cause"] == cid, stolen
    assert again == ack
