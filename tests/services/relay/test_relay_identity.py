"""Who a relay token may speak as (issue 44 items 2 and 6a), as processes on a real nats-server:

* an emitter token cannot pass as a Hermes session: agent ``hermes``, a Hermes instance's
  source, or a Hermes session's name are refused (POST and WebSocket) unless the token is
  granted them (``agents``/``sources`` in the tokens file);
* the relay, not the client, decides an ingested event's position: a posted ``seq`` moves no
  subscriber's resume point;
* the roster and control routing never hand a Hermes session to an emitter, live or ended;
* an operator token answers only as its own identity (``agents``), so the approver on the
  stream is the token's, and the real owner of a name is never locked out by an impostor."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import aiohttp
import pytest

from bridge.commands.control import build_command
from bridge.core import control as C
from bridge.core.aep import encode_event
from bridge.core.identity import source_uri
from bridge.services.relay.config import RelayConfigError, parse_tokens
from tests.support.plane import new_session, start_session
from tests.support.relay import (ALICE, CONSUMER, EMITTER, HERMES_EMITTER, OPERATOR, auth, encode, event, publish,
                                 read_sse)
from tests.support.relay_ws import CONTROL, emitter_hello
from tests.support.shim import envelope

V = {"AEP-Version": "0.1"}


def sid() -> str:
    return "id" + uuid.uuid4().hex[:10]


def hermes_event(session: str, seq: int, instance: str = "gw-a", type_: str = "tool.completed") -> dict[str, Any]:
    return {**event(session, seq, type_), "agent": "hermes", "source": source_uri(instance, session)}


async def post(s: aiohttp.ClientSession, relay: Any, events: list[dict[str, Any]], token: str = EMITTER) -> tuple[int, Any]:
    async with s.post(relay.url + "/events", data=b"\n".join(encode(e) for e in events) + b"\n",
                      headers={**auth(token), **V, "Content-Type": "application/x-ndjson"}) as r:
        return r.status, await r.json()


async def emitter_socket(s: aiohttp.ClientSession, relay: Any, hello: dict[str, Any], token: str = EMITTER) -> tuple[Any, dict]:
    ws = await s.ws_connect(relay.ws_url, headers=auth(token))
    await ws.send_json(hello)
    return ws, json.loads((await ws.receive(timeout=5)).data)


async def sent(ws: Any, ev: dict[str, Any]) -> dict[str, Any] | None:
    """Send ``ev`` on an emitter socket: its error frame, or None (stored: the ping's pong came first)."""
    await ws.send_str(encode(ev).decode())
    await ws.send_json({"type": "ping"})
    frame = json.loads((await ws.receive(timeout=5)).data)
    if frame["type"] == "pong":
        return None
    assert json.loads((await ws.receive(timeout=5)).data)["type"] == "pong"
    return frame


# ---------------------------------------------------------------- the tokens file (no I/O)


def test_token_bindings_and_their_defaults() -> None:
    toks = {p.name: p for _, p in parse_tokens({"tokens": [
        {"name": "ci", "token": "x" * 16, "role": "emitter"},
        {"name": "ci2", "token": "y" * 16, "role": "emitter", "agents": ["ci-*"], "sources": ["urn:ci:*", "*"]},
        {"name": "gw-b", "token": "z" * 16, "role": "emitter", "agents": ["hermes"], "sources": ["aep://gw-b/agent/hermes/*"]},
        {"name": "alice", "token": "a" * 16, "role": "operator"},
        {"name": "bob", "token": "b" * 16, "role": "operator", "agents": ["bob", "bob-bot"]},
    ]}, "t")}
    ci, ci2, gwb, alice, bob = toks["ci"], toks["ci2"], toks["gw-b"], toks["alice"], toks["bob"]
    # an emitter's default: anything but Hermes's
    assert ci.emit_refusal({"agent": "ci", "source": "urn:x"}) is None
    assert "hermes" in ci.emit_refusal({"agent": "Hermes", "source": "urn:x"})
    assert "Hermes" in ci.emit_refusal({"agent": "ci", "source": "aep://gw-a/agent/hermes/session/s"})
    assert ci.emit_refusal({"agent": "ci", "source": "aep://gw-a/agent/ci/session/s"}) is None
    # patterns: `*` grants neither hermes nor a Hermes source
    assert ci2.emit_refusal({"agent": "ci-7", "source": "urn:ci:7"}) is None
    assert ci2.emit_refusal({"agent": "ops", "source": "urn:ci:7"}) is not None
    assert ci2.emit_refusal({"agent": "ci-7", "source": "aep://gw-a/agent/hermes/session/s"}) is not None
    # granted by name: that instance's sources only
    assert gwb.emit_refusal({"agent": "hermes", "source": "aep://gw-b/agent/hermes/session/s"}) is None
    assert gwb.emit_refusal({"agent": "hermes", "source": "aep://gw-c/agent/hermes/session/s"}) is not None
    assert gwb.emit_refusal({"agent": "ci", "source": "aep://gw-b/agent/hermes/session/s"}) is not None
    # an operator commands as its own name by default, as its agents when listed; an agent-form
    # source names one of them
    assert alice.command_refusal("alice", "aep://h/agent/alice/user/u") is None
    assert alice.command_refusal("alice-ciso", "aep://h/agent/alice-ciso") is not None
    assert alice.command_refusal("alice", "aep://h/agent/bob") is not None
    assert alice.command_refusal("alice", "urn:console:1") is None  # first-use bound (SourceBindings)
    assert bob.command_refusal("bob-bot", "aep://h/agent/bob") is None and bob.command_refusal("alice", "urn:x")
    for bad in ({"agents": []}, {"agents": "x"}, {"sources": ["urn:x"], "role": "operator"}, {"agents": ["x"], "role": "consumer"}):
        with pytest.raises(RelayConfigError):
            parse_tokens([{"name": "b", "token": "c" * 16, "role": "emitter", **bad}], "t")


# ---------------------------------------------------------------- item 2: emitters


def test_an_emitter_token_cannot_pass_as_a_hermes_session(relay, nats_server, jetstream) -> None:
    """Agent hermes, a Hermes instance's source, a Hermes session's name: 403 on POST (a
    batch with one such line stores nothing), an `unauthorized` error on the WebSocket (a
    hello naming agent hermes is refused and closed); a token granted one instance posts as
    that instance only. Before: all were 202 and reached the session's subscribers."""
    victim, own = sid(), sid()
    asyncio.run(publish(nats_server.url, [hermes_event(victim, i) for i in (1, 2)]))  # the pipeline's

    async def go() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with aiohttp.ClientSession() as s:
            out["agent"] = await post(s, relay, [{**event(own, 1), "agent": "hermes"}])
            out["source"] = await post(s, relay, [{**event(own, 1), "source": source_uri("gw-a", own)}])
            out["session"] = await post(s, relay, [{**event(victim, 10**15, "attention.answered", data={}),
                                                    "agent": "ci", "source": "urn:ci"}])
            out["batch"] = await post(s, relay, [event(own, 1), hermes_event(own, 2)])
            ws, out["hello"] = await emitter_socket(s, relay, emitter_hello("hermes"))
            out["hello_closed"] = (await ws.receive(timeout=5)).type
            ws, _ = await emitter_socket(s, relay, emitter_hello("ci"))
            out["ws_agent"] = await sent(ws, {**event(own, 3), "agent": "hermes"})
            out["ws_source"] = await sent(ws, {**event(own, 3), "source": source_uri("gw-a", own)})
            out["ws_session"] = await sent(ws, {**event(victim, 3), "agent": "ci"})
            out["ws_own"] = await sent(ws, {**event(own, 4), "agent": "ci"})
            await ws.close()
            granted = sid()
            out["granted"] = await post(s, relay, [hermes_event(granted, 1, "gw-b")], token=HERMES_EMITTER)
            out["granted_other"] = await post(s, relay, [hermes_event(granted, 2, "gw-c")], token=HERMES_EMITTER)
        return out

    out = asyncio.run(go())
    for case in ("agent", "source", "session"):
        assert out[case][0] == 403 and out[case][1]["error"] == "unauthorized", (case, out[case])
    assert out["batch"][0] == 403 and out["batch"][1]["line"] == 1
    assert out["hello"]["code"] == "unauthorized" and out["hello_closed"] in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
    for case in ("ws_agent", "ws_source", "ws_session"):
        assert out[case] is not None and out[case]["code"] == "unauthorized", (case, out[case])
    assert out["ws_own"] is None
    assert out["granted"][0] == 202 and out["granted_other"][0] == 403
    stored = [m.json() for m in jetstream.fetch("aep.ingest.>", stream="AEP_EVENTS")]
    assert not [e for e in stored if e["session"] == victim], "an emitter's event reached the Hermes session"
    assert [(e["session"], e["agent"]) for e in stored if e["session"] == own] == [(own, "ci")]  # ws_own only


def test_a_posted_seq_moves_no_resume_point(relay) -> None:
    """The relay decides an ingested event's position (its stream sequence, epoch 0): a
    posted `seq: 10**15` becomes no one's Last-Event-ID, and a resume from the id a
    subscriber saw (SSE) or the body's position (the SDKs' `from`) gets what came after.
    Before: the resume point was (0, 10**15) and the resume returned nothing."""
    own = sid()

    async def go() -> tuple[dict, dict, dict]:
        async with aiohttp.ClientSession() as s:
            live = asyncio.create_task(read_sse(s, relay.url + "/stream", want=1, headers=auth(CONSUMER),
                                                params={"filter": json.dumps({"session": own})}))
            await asyncio.sleep(0.5)
            assert (await post(s, relay, [{**event(own, 10**15), "epoch": 7}]))[0] == 202
            first = await live
            assert (await post(s, relay, [event(own, 2)]))[0] == 202
            last_id = first["events"][0]["id"]
            by_id = await read_sse(s, relay.url + "/stream", headers={**auth(CONSUMER), "Last-Event-ID": last_id},
                                   params={"live": "0"})
            body = json.loads(first["events"][0]["data"])
            by_from = await read_sse(s, relay.url + "/stream", headers=auth(CONSUMER), params={
                "live": "0", "from": json.dumps([{"session": own, "epoch": body.get("epoch", 0), "seq": body["seq"]}])})
            return first, by_id, by_from

    first, by_id, by_from = asyncio.run(go())
    ev = json.loads(first["events"][0]["data"])
    assert ev["seq"] < 10**15 and "epoch" not in ev and first["events"][0]["id"] == f"{own}:0:{ev['seq']}"
    assert [json.loads(e["data"])["id"] for e in by_id["events"]] == [f"{own}-2"], by_id
    assert [json.loads(e["data"])["id"] for e in by_from["events"]] == [f"{own}-2"], by_from


def test_the_roster_and_routing_never_hand_a_hermes_session_to_an_emitter(relay_plane) -> None:
    """An emitter claims a session name before Hermes runs a session of that name (it
    guessed the id); the session starts and ends. Then: the emitter is not the roster's
    entry for it and gets none of its commands (no-route); no emitter, not even one granted
    a Hermes identity, may post into it now; a hello claiming `identity {agent: hermes}`
    is refused. Before: once the Hermes session ended, the emitter's claim was listed as
    that session and took the operator's instruct text."""
    plane, relay = relay_plane
    session = new_session()
    cmd = encode_event(build_command(C.INSTRUCT, session, {"text": "rotate the keys"}, sender="relay-test"))
    control = {"accepts": [C.INSTRUCT, C.RESPOND], "ack_window_ms": 10_000}
    hello = emitter_hello("hermes", control=control)
    hello["identity"]["instance"] = plane.instance

    async def claim(s: aiohttp.ClientSession) -> tuple[Any, dict | None]:
        early, _ = await emitter_socket(s, relay, emitter_hello("claimant", control=control))
        return early, await sent(early, {**event(session, 1, "session.started", data={"client": {"name": "x"}}),
                                         "agent": "claimant"})

    async def after(s: aiohttp.ClientSession, early: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        _, out["impostor_hello"] = await emitter_socket(s, relay, hello)
        late, _ = await emitter_socket(s, relay, emitter_hello("claimant", control=control))
        out["late"] = await sent(late, {**event(session, 2, "tool.completed"), "agent": "claimant"})
        granted, _ = await emitter_socket(s, relay, {**hello, "identity": {"agent": "hermes", "instance": "gw-b"}},
                                          token=HERMES_EMITTER)
        out["granted"] = await sent(granted, hermes_event(session, 3, "gw-b"))
        op = await s.ws_connect(relay.ws_url, headers=auth(OPERATOR))
        await op.send_json({"type": "hello", "versions": ["0.1"], "role": "consumer"})
        await op.receive(timeout=5)
        for _ in range(3):  # the relay's live set is at most 1 s old
            await op.send_json({"type": "roster", "id": "r"})
            out["roster"] = [e for e in json.loads((await op.receive(timeout=10)).data)["entries"] if e["session"] == session]
            await asyncio.sleep(0.5)
        await op.send_str(cmd.decode())
        out["answer"] = json.loads((await op.receive(timeout=10)).data)
        try:
            out["delivered"] = (await early.receive(timeout=1)).data
        except asyncio.TimeoutError:
            out["delivered"] = None
        return out

    async def go() -> tuple[dict | None, dict[str, Any]]:
        async with aiohttp.ClientSession() as s:
            early, claimed = await claim(s)
            await asyncio.to_thread(start_session, plane, session)
            plane.hook(envelope("on_session_finalize", session=session, reason="shutdown"))
            await asyncio.to_thread(plane.wait, session, lambda e: "session.ended" in [x["type"] for x in e], "session.ended")
            return claimed, await after(s, early)

    claimed, out = asyncio.run(go())
    assert claimed is None  # a name no one had used yet: its claim
    assert out["roster"] == [], out["roster"]  # the early claim is not listed as the session
    assert out["answer"]["type"] == "error" and out["answer"]["code"] == "no-route", out["answer"]
    assert out["delivered"] is None, "the operator's instruct reached an emitter"
    assert out["impostor_hello"]["type"] == "error" and out["impostor_hello"]["code"] == "unauthorized"
    assert out["late"] is not None and out["late"]["code"] == "unauthorized"  # a Hermes session now
    assert out["granted"] is not None and out["granted"]["code"] == "unauthorized"  # not even with hermes granted


# ---------------------------------------------------------------- item 6a: operators


def test_an_operator_token_answers_only_as_its_own_identity(relay_plane) -> None:
    """The oncall token sends a deny as `alice-ciso`: refused `unauthorized`, nothing routed.
    Alice's own token then answers as herself and the stream records her as the approver.
    Before: the impostor's deny was accepted as alice-ciso's, and the real alice was refused
    (the source was bound to the oncall token)."""
    plane, relay = relay_plane
    session = new_session()
    start_session(plane, session)
    shim = plane.held(session, "call-alice")
    req = plane.request_of(session, "call-alice")

    def as_alice(option: str) -> bytes:
        return encode_event(build_command(C.RESPOND, session, {"answer": {"option": option}}, sender="alice-ciso",
                                          subject=req["id"]))

    async def go() -> tuple[dict, dict, dict]:
        async with aiohttp.ClientSession() as s:
            answers = []
            for token, option in ((OPERATOR, "allow"), (ALICE, "deny")):
                ws = await s.ws_connect(relay.ws_url, headers=auth(token))
                await ws.send_json({"type": "hello", "versions": ["0.1"], "role": "consumer"})
                await ws.receive(timeout=5)
                await ws.send_str(as_alice(option).decode())
                answers.append(json.loads((await ws.receive(timeout=15)).data))
                await ws.close()
            ws = await s.ws_connect(relay.ws_url, headers=auth(ALICE))
            await ws.send_json({"type": "hello", "versions": ["0.1"], "role": "consumer"})
            await ws.receive(timeout=5)
            spoofed = json.loads(as_alice("deny"))
            spoofed["source"] = spoofed["source"].replace("/agent/alice-ciso/", "/agent/oncall/")
            await ws.send_str(json.dumps(spoofed))
            answers.append(json.loads((await ws.receive(timeout=10)).data))
            return answers[0], answers[1], answers[2]

    impostor, alice, wrong_source = asyncio.run(go())
    out, _ = shim.communicate(timeout=15)
    assert impostor["type"] == "error" and impostor["code"] == "unauthorized", impostor
    assert alice["type"] == "control.accepted", alice
    assert json.loads(out)["action"] == "block"  # alice's deny, not the impostor's allow
    assert wrong_source["type"] == "error" and wrong_source["code"] == "unauthorized", wrong_source
    evs = plane.wait(session, lambda e: "attention.resolved" in [x["type"] for x in e], "attention.resolved")
    assert [e["agent"] for e in evs if e["type"] == C.RESPOND] == ["alice-ciso"]  # one command stored: hers
