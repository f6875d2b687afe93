"""WebSocket emitters on the relay (AEP-0003 §3.5, §4.1; AEP-0004 §4): events sent over an
emitter connection are stored like POSTed ones, the sessions they name become that
connection's live claims (the roster lists them with the hello's declarations verbatim), and
an operator's command reaches exactly one live claimant: forwarded byte-identically, answered
by the claimant's ack, refused `unsupported`, `ambiguous` or `no-route` otherwise."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import aiohttp

from bridge.services.relay.claims import Claimant, Claims
from tests.support.relay import ALL, CONSUMER, EMITTER, OPERATOR, auth, encode, event, read_sse

CONTROL = {"accepts": ["control.attention.respond"], "ack_window_ms": 10_000}


def emitter_hello(agent: str, control: dict[str, Any] | None = CONTROL, **caps: Any) -> dict[str, Any]:
    capabilities: dict[str, Any] = {"emits": ["session"], **caps}
    if control is not None:
        capabilities["control"] = control
    return {"type": "hello", "versions": ["0.1"], "role": "emitter",
            "identity": {"agent": agent, "instance": "host-a/1"}, "capabilities": capabilities}


def started(session: str) -> dict[str, Any]:
    return {**event(session, 0, "session.started", data={"client": {"name": "relay-test"}}), "agent": "claimant"}


def respond(session: str, cid: str) -> bytes:
    return encode({"aep": "0.1", "id": cid, "type": "control.attention.respond", "time": "2026-12-01T10:00:00.000Z",
                   "source": "urn:test:operator", "agent": "operator", "session": session,
                   "data": {"subject": "req-1", "answer": {"option": "allow"}}})


async def connect(s: aiohttp.ClientSession, relay: Any, hello: dict[str, Any], token: str) -> Any:
    ws = await s.ws_connect(relay.ws_url, headers=auth(token))
    await ws.send_json(hello)
    assert json.loads((await ws.receive(timeout=5)).data)["type"] == "hello"
    return ws


async def roster(s: aiohttp.ClientSession, relay: Any, token: str = CONSUMER) -> list[dict[str, Any]]:
    ws = await connect(s, relay, {"type": "hello", "versions": ["0.1"], "role": "consumer"}, token)
    await ws.send_json({"type": "roster", "id": "r"})
    reply = json.loads((await ws.receive(timeout=5)).data)
    await ws.close()
    assert reply["type"] == "roster" and reply["id"] == "r"
    return reply["entries"]


async def next_frame(ws: Any, timeout: float = 5.0) -> dict[str, Any]:
    return json.loads((await ws.receive(timeout=timeout)).data)


def test_an_emitters_events_are_stored_and_its_sessions_are_live_claims(relay) -> None:
    session = "w" + uuid.uuid4().hex[:10]
    ev = encode(started(session))

    async def go() -> tuple[list, list, dict, list]:
        async with aiohttp.ClientSession() as s:
            ws = await connect(s, relay, emitter_hello("claimant"), EMITTER)
            await ws.send_str(ev.decode())
            await ws.send_str(ev.decode())  # a retry: stored once
            for _ in range(50):
                during = [e for e in await roster(s, relay) if e["session"] == session]
                if during:
                    break
                await asyncio.sleep(0.1)
            sse = await read_sse(s, relay.url + "/stream", headers=auth(CONSUMER), want=1, timeout=3,
                                 params={"from": "all", "live": "0", "filter": json.dumps({"session": session})})
            await ws.send_str("{not json")  # a bad frame: refused in-band, the claim survives
            bad = await next_frame(ws)
            still = [e for e in await roster(s, relay) if e["session"] == session]
            async with s.get(relay.url + "/metrics") as r:
                gauge = [ln for ln in (await r.text()).splitlines() if ln.startswith("aep_bridge_relay_claims ")]
            await ws.close()
            await asyncio.sleep(0.3)
            after = [e for e in await roster(s, relay) if e["session"] == session]
            return during, still, {"sse": sse, "bad": bad, "gauge": gauge}, after

    during, still, seen, after = asyncio.run(go())
    entry = {"session": session, "agent": "claimant", "instance": "host-a/1", "control": CONTROL, "emits": ["session"]}
    assert during == [entry]  # the hello's declarations, verbatim
    assert still == [entry]
    assert [e["data"] for e in seen["sse"]["events"]] == [ev]  # stored once, byte-identical
    assert seen["bad"]["type"] == "error" and seen["bad"]["code"] == "invalid-frame"
    assert seen["gauge"] == ["aep_bridge_relay_claims 1.0"]
    assert after == []  # the connection closed: the claim is gone


def test_invalid_events_and_non_emitter_connections_are_refused_in_band(relay) -> None:
    session = "w" + uuid.uuid4().hex[:10]

    async def go() -> tuple[dict, dict, dict, list]:
        async with aiohttp.ClientSession() as s:
            ws = await connect(s, relay, emitter_hello("claimant"), EMITTER)
            await ws.send_str(encode({**started(session), "seq": "one"}).decode())
            invalid = await next_frame(ws)
            await ws.send_json({"type": "ping"})
            alive = await next_frame(ws)
            consumer = await connect(s, relay, {"type": "hello", "versions": ["0.1"], "role": "consumer"}, ALL)
            await consumer.send_str(encode(started(session)).decode())
            refused = await next_frame(consumer)
            entries = [e for e in await roster(s, relay) if e["session"] == session]
            return invalid, alive, refused, entries

    invalid, alive, refused, entries = asyncio.run(go())
    assert invalid["type"] == "error" and invalid["code"] == "invalid-event" and invalid["cause"] == f"{session}-0"
    assert alive == {"type": "pong"}
    assert refused["code"] == "unauthorized" and refused["cause"] == f"{session}-0"  # a consumer connection emits nothing
    assert entries == []


def test_a_command_reaches_its_one_claimant_and_its_ack_comes_back(relay) -> None:
    session = "w" + uuid.uuid4().hex[:10]
    cid = uuid.uuid4().hex[:26].upper()
    cmd = respond(session, cid)

    async def go() -> dict[str, Any]:
        async with aiohttp.ClientSession() as s:
            target = await connect(s, relay, emitter_hello("claimant"), EMITTER)
            await target.send_str(encode(started(session)).decode())
            for _ in range(50):
                if [e for e in await roster(s, relay) if e["session"] == session]:
                    break
                await asyncio.sleep(0.1)
            op = await connect(s, relay, {"type": "hello", "versions": ["0.1"], "role": "consumer"}, OPERATOR)
            await op.send_str(cmd.decode())
            got = await target.receive(timeout=5)
            ack = {**event(session, 1, "control.accepted", data={}), "agent": "claimant", "cause": cid,
                   "id": f"{session}-ack"}
            await target.send_str(encode(ack).decode())
            answer = await next_frame(op, timeout=10)
            # undeclared type: refused on the claimant's behalf
            pause = json.loads(cmd) | {"id": cid + "P", "type": "control.pause", "data": {}}
            await op.send_str(json.dumps(pause))
            unsupported = await next_frame(op)
            # a second claimant of the same name: ambiguous, never a guess
            other = await connect(s, relay, emitter_hello("other"), EMITTER)
            await other.send_str(encode({**started(session), "source": "urn:test:other"}).decode())
            await asyncio.sleep(0.3)
            await op.send_str(respond(session, cid + "A").decode())
            ambiguous = await next_frame(op)
            await target.close()
            await other.close()
            await asyncio.sleep(0.3)
            await op.send_str(respond(session, cid + "N").decode())
            no_route = await next_frame(op)
            sse = await read_sse(s, relay.url + "/stream", headers=auth(CONSUMER), want=3, timeout=3,
                                 params={"from": "all", "live": "0", "filter": json.dumps({"session": session})})
            return {"got": got.data, "answer": answer, "unsupported": unsupported, "ambiguous": ambiguous,
                    "no_route": no_route, "history": [json.loads(e["data"])["type"] for e in sse["events"]]}

    out = asyncio.run(go())
    assert out["got"] == cmd.decode()  # forwarded byte-identically
    assert out["answer"]["type"] == "control.accepted" and out["answer"]["cause"] == cid
    assert out["unsupported"] == {"type": "error", "cause": cid + "P", "code": "unsupported",
                                  "detail": "the claimant accepts ['control.attention.respond']"}
    assert out["ambiguous"]["code"] == "ambiguous" and out["ambiguous"]["cause"] == cid + "A"
    assert out["no_route"]["code"] == "no-route" and out["no_route"]["cause"] == cid + "N"
    # the command persisted in the session's history with its ack; no refusal ever did
    assert sorted(out["history"]) == ["control.accepted", "control.attention.respond", "session.started"]


def test_claims_registry_one_entry_per_claim_and_release() -> None:
    claims = Claims()
    a = Claimant.from_hello(None, emitter_hello("a"))
    b = Claimant.from_hello(None, emitter_hello("b", control=None))
    assert claims.claim(a, "s1") and claims.claim(a, "s1") and claims.claim(b, "s1") and claims.claim(a, "s2")
    assert claims.of("s1") == [a, b]
    assert sorted((e["session"], e["agent"], "control" in e) for e in claims.entries()) == [
        ("s1", "a", True), ("s1", "b", False), ("s2", "a", True)]
    assert a.accepts("control.attention.respond") and not a.accepts("control.pause") and not b.accepts("control.pause")
    claims.release(a)
    assert claims.of("s1") == [b] and claims.of("s2") == [] and claims.entries() == [b.entry("s1")]
    junk = Claimant.from_hello(None, {"type": "hello", "identity": "x", "capabilities": [1]})
    assert junk.entry("s") == {"session": "s"}  # nothing declared, nothing synthesized


def test_a_type_too_long_for_a_subject_is_refused_not_a_crash(relay) -> None:
    """A type the envelope pattern admits but no subject may carry (over 128 characters):
    400 on POST, an in-band error on the WebSocket, and both keep serving."""
    session = "w" + uuid.uuid4().hex[:10]
    long_type = "x.vendor." + "a" * 200 + ".b"
    ev = encode({**event(session, 1, long_type), "agent": "claimant"})

    async def go() -> tuple[int, dict, dict, int]:
        async with aiohttp.ClientSession() as s:
            async with s.post(relay.url + "/events", data=ev, headers={**auth(EMITTER), "AEP-Version": "0.1",
                                                                        "Content-Type": "application/json"}) as r:
                posted, body = r.status, await r.json()
            ws = await connect(s, relay, emitter_hello("claimant"), EMITTER)
            await ws.send_str(ev.decode())
            refused = await next_frame(ws)
            await ws.send_json({"type": "ping"})
            alive = await next_frame(ws)
            async with s.post(relay.url + "/events", data=encode({**event(session, 2), "agent": "claimant"}),
                              headers={**auth(EMITTER), "AEP-Version": "0.1", "Content-Type": "application/json"}) as r:
                after = r.status
            return posted, body, {"refused": refused, "alive": alive}, after

    posted, body, ws, after = asyncio.run(go())
    assert posted == 400 and body["error"] == "invalid-event" and "type" in body["detail"]
    assert ws["refused"]["code"] == "invalid-event" and ws["refused"]["cause"] == f"{session}-1"
    assert ws["alive"] == {"type": "pong"}
    assert after == 202
