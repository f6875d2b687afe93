"""WebSocket emitters on the relay (AEP-0003 §3.5, §4.1; AEP-0004 §4): events sent over an
emitter connection are stored like POSTed ones, the sessions they name become that
connection's live claims (the roster lists them with the hello's declarations verbatim), and
an operator's command reaches exactly one live claimant: forwarded byte-identically, answered
by the claimant's ack, refused `unsupported`, `ambiguous` or `no-route` otherwise."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from typing import Any

import aiohttp
import msgspec

from bridge.core.control import SessionInfo
from bridge.core.lanes import lane_token
from bridge.nats.streams import CONTROL_BUCKET
from bridge.services.relay.claims import MAX_CLAIM_SESSION_CHARS, MAX_DECLARATIONS_BYTES, Claimant, Claims
from bridge.services.relay.routing import FORWARD_TIMEOUT_S
from tests.support.relay import ALL, CONSUMER, EMITTER, OPERATOR, auth, encode, event, read_sse
from tests.support.relay_ws import CONTROL, connect, emitter_hello, next_frame, respond, roster, started


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
    got = [json.loads(e["data"]) for e in seen["sse"]["events"]]
    assert [{**e, "seq": 0} for e in got] == [json.loads(ev)]  # stored once; at the relay's position (issue 44)
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


# ---------------------------------------------------------------- hostile claimants and emitters


async def _claimed(s: aiohttp.ClientSession, relay: Any, session: str) -> None:
    for _ in range(50):
        if [e for e in await roster(s, relay) if e["session"] == session]:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{session} never claimed")


async def claim_then_command(s: aiohttp.ClientSession, relay: Any, agent: str, session: str, cid: str,
                             control: dict[str, Any] | None = CONTROL) -> tuple[Any, Any]:
    """An emitter ``agent`` claims ``session``; an operator then sends it a command ``cid``.
    Returns (the emitter's socket, the operator's)."""
    claimant = await connect(s, relay, emitter_hello(agent, control=control), EMITTER)
    await claimant.send_str(encode(started(session)).decode())
    await _claimed(s, relay, session)
    op = await connect(s, relay, {"type": "hello", "versions": ["0.1"], "role": "consumer"}, OPERATOR)
    await op.send_str(respond(session, cid).decode())
    return claimant, op


def test_an_ack_posted_by_a_third_party_settles_nothing(relay) -> None:
    """Only the target's own ack settles a command: an emitter posting control.accepted with
    the command's cause (ids are visible on the stream) is somebody else's word."""
    session = "w" + uuid.uuid4().hex[:10]
    cid = uuid.uuid4().hex[:26].upper()

    async def go() -> tuple[Any, dict]:
        async with aiohttp.ClientSession() as s:
            target, op = await claim_then_command(s, relay, "claimant", session, cid)
            await target.receive(timeout=5)  # the target has it, and decides slowly
            forged = {**event(session, 7, "control.accepted", data={}), "agent": "impostor",
                      "source": "urn:evil", "cause": cid, "id": "forged-ack"}
            for via_ws in (False, True):
                if via_ws:
                    other = await connect(s, relay, emitter_hello("impostor"), EMITTER)
                    await other.send_str(encode({**forged, "id": "forged-ack-ws"}).decode())
                else:
                    async with s.post(relay.url + "/events", data=encode(forged),
                                      headers={**auth(EMITTER), "AEP-Version": "0.1", "Content-Type": "application/json"}) as r:
                        assert r.status == 202
            try:
                early = await next_frame(op, timeout=1.5)
            except asyncio.TimeoutError:
                early = None
            real = {**event(session, 8, "control.accepted", data={}), "agent": "claimant", "cause": cid, "id": "real-ack"}
            await target.send_str(encode(real).decode())
            return early, await next_frame(op, timeout=10)

    early, answer = asyncio.run(go())
    assert early is None, f"a forged ack settled the command: {early}"
    assert answer["id"] == "real-ack" and answer["cause"] == cid


def test_an_emitter_that_stops_reading_stalls_no_operator(relay) -> None:
    """The target of a command never reads again: the operator's connection keeps working,
    the target is closed once a command cannot reach it, and later commands are no-route."""
    session = "w" + uuid.uuid4().hex[:10]
    control = {"accepts": ["control.attention.respond"], "ack_window_ms": 600_000}

    async def go() -> dict[str, Any]:
        async with aiohttp.ClientSession() as s:
            target = await connect(s, relay, emitter_hello("claimant", control=control), EMITTER)
            await target.send_str(encode(started(session)).decode())
            await _claimed(s, relay, session)
            op = await connect(s, relay, {"type": "hello", "versions": ["0.1"], "role": "consumer"}, OPERATOR)
            big = "x" * 900_000
            for i in range(30):  # ~27 MB toward a socket nobody reads
                cmd = json.loads(respond(session, f"BIG{i}"))
                cmd["data"]["answer"]["text"] = big
                await op.send_str(json.dumps(cmd))
            await op.send_json({"type": "ping", "t": 1})
            frames = []
            while True:
                f = await next_frame(op, timeout=30)
                if f["type"] == "pong":
                    break
                frames.append(f)
            await asyncio.sleep(FORWARD_TIMEOUT_S + 1)
            await op.send_str(respond(session, "AFTER").decode())
            while True:
                f = await next_frame(op, timeout=10)
                if f.get("cause") == "AFTER":
                    return {"frames": frames, "after": f, "entries": [e for e in await roster(s, relay)
                                                                        if e["session"] == session]}

    out = asyncio.run(go())
    assert out["after"]["code"] == "no-route"  # the stuck target was closed, its claim released
    assert out["entries"] == []


def test_an_emitters_declarations_are_bounded(relay) -> None:
    """A roster entry repeats its claimant's declarations per claim: a hello declaring more
    than MAX_DECLARATIONS_BYTES is refused, so a roster stays claims x a few KB."""
    fat = {"accepts": ["control.attention.respond"] + ["x.v.control.p%06d" % i for i in range(20_000)]}

    async def go() -> tuple[dict, bool]:
        async with aiohttp.ClientSession() as s:
            ws = await s.ws_connect(relay.ws_url, headers=auth(EMITTER))
            await ws.send_json(emitter_hello("claimant", control=fat))
            refused = await next_frame(ws)
            closed = (await ws.receive(timeout=5)).type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED,
                                                            aiohttp.WSMsgType.CLOSING)
            return refused, closed

    refused, closed = asyncio.run(go())
    assert refused["code"] == "limit-exceeded" and str(MAX_DECLARATIONS_BYTES) in refused["detail"] and closed


def test_a_live_hermes_session_is_never_diverted_to_an_impostor(relay, jetstream) -> None:
    """A live Hermes session (the gate's live. record) and a WebSocket emitter claiming the
    same name: the Hermes session shadows the emitter's claim (issue 25 item 3), so the
    command is the gate's (here no gate answers: no-route), never delivered to the emitter,
    and the roster does not list the shadowed claim."""
    session = "h" + uuid.uuid4().hex[:10]

    async def put() -> None:
        js = jetstream.js if hasattr(jetstream, "js") else jetstream.nc.jetstream()
        try:
            kv = await js.key_value(CONTROL_BUCKET.bucket)
        except Exception:  # noqa: BLE001 - no gate ran on this server yet
            kv = await js.create_key_value(bucket=CONTROL_BUCKET.bucket)
        await kv.put(f"live.{lane_token(session)}", msgspec.json.encode(
            SessionInfo(source="aep://hermes-a/x", instance="hermes-a", session=session)))

    jetstream.run(put())
    cid = uuid.uuid4().hex[:26].upper()

    async def go() -> tuple[Any, dict]:
        async with aiohttp.ClientSession() as s:
            imp = await connect(s, relay, emitter_hello("impostor"), EMITTER)
            await imp.send_str(encode(started(session)).decode())
            await imp.send_json({"type": "ping"})
            assert (await next_frame(imp))["type"] == "pong"  # frames are handled in order: claimed
            op = await connect(s, relay, {"type": "hello", "versions": ["0.1"], "role": "consumer"}, OPERATOR)
            await op.send_str(respond(session, cid).decode())
            answer = await next_frame(op)
            try:
                got = (await imp.receive(timeout=1)).data
            except asyncio.TimeoutError:
                got = None
            return got, answer, [e for e in await roster(s, relay) if e["session"] == session]

    got, answer, entries = asyncio.run(go())
    assert got is None, "the command for a live Hermes session went to an impostor WebSocket emitter"
    assert answer["code"] == "no-route" and answer["cause"] == cid and "gate" in answer["detail"], answer
    assert entries == []


def test_commands_are_not_ingested_and_claims_are_bounded(relay, monkeypatch) -> None:
    """POST /events refuses commands (they reach history only through routing); an emitter
    without identity.agent may not emit; a session name past MAX_CLAIM_SESSION_CHARS is
    stored, not claimed."""
    session = "w" + uuid.uuid4().hex[:10]
    long_session = "L" * (MAX_CLAIM_SESSION_CHARS + 1)

    async def go() -> tuple[int, dict, dict, list]:
        async with aiohttp.ClientSession() as s:
            async with s.post(relay.url + "/events", data=respond(session, "POSTED"),
                              headers={**auth(EMITTER), "AEP-Version": "0.1", "Content-Type": "application/json"}) as r:
                status, body = r.status, await r.json()
            anon = await connect(s, relay, {**emitter_hello("x"), "identity": {"instance": "i"}}, EMITTER)
            await anon.send_str(encode(started(session)).decode())
            no_agent = await next_frame(anon)
            ws = await connect(s, relay, emitter_hello("claimant"), EMITTER)
            await ws.send_str(encode(started(long_session)).decode())
            await ws.send_json({"type": "ping"})
            await next_frame(ws)
            entries = [e for e in await roster(s, relay) if e["session"] in (session, long_session)]
            return status, body, no_agent, entries

    status, body, no_agent, entries = asyncio.run(go())
    assert status == 400 and body["error"] == "invalid-event" and "command" in body["detail"]
    assert no_agent["code"] == "invalid-event" and "identity.agent" in no_agent["detail"]
    assert entries == []
    # the registry's own bounds
    claims = Claims()
    who = Claimant.from_hello(None, emitter_hello("a"))
    assert not claims.claim(who, long_session)
    monkeypatch.setattr("bridge.services.relay.claims.MAX_CLAIMS_PER_CONNECTION", 2)
    assert claims.claim(who, "a") and claims.claim(who, "b") and not claims.claim(who, "c") and claims.count == 2
    claims.release(who)
    assert claims.count == 0 and claims.entries() == []


def test_a_subscribed_sender_gets_the_emitters_ack_once(relay) -> None:
    """An operator subscribed to the session gets the ack through its subscription, not a
    second time as the command's answer."""
    session = "w" + uuid.uuid4().hex[:10]
    cid = uuid.uuid4().hex[:26].upper()

    async def go() -> list[dict[str, Any]]:
        async with aiohttp.ClientSession() as s:
            target = await connect(s, relay, emitter_hello("claimant"), EMITTER)
            await target.send_str(encode(started(session)).decode())
            await _claimed(s, relay, session)
            op = await connect(s, relay, {"type": "hello", "versions": ["0.1"], "role": "both"}, OPERATOR)
            await op.send_json({"type": "subscribe", "id": "mine", "filter": {"session": session}})
            assert (await next_frame(op))["type"] == "subscribed"
            await op.send_str(respond(session, cid).decode())
            await target.receive(timeout=5)
            ack = {**event(session, 1, "control.accepted", data={}), "agent": "claimant", "cause": cid, "id": "ack-1"}
            await target.send_str(encode(ack).decode())
            frames = []
            with contextlib.suppress(asyncio.TimeoutError):
                while True:
                    frames.append(await next_frame(op, timeout=2))
            return frames

    frames = asyncio.run(go())
    assert [f["id"] for f in frames if f.get("cause") == cid] == ["ack-1"]


def test_the_same_id_from_a_second_source_while_one_is_pending_is_ambiguous(relay) -> None:
    """An emitter's ack names its command by `cause` alone: with two sources' commands under
    one id pending for one claimant, its first ack would answer both. The second is refused
    `ambiguous` (never delivered, never stored) until the first is settled; then it routes."""
    session = "w" + uuid.uuid4().hex[:10]
    cid = uuid.uuid4().hex[:26].upper()
    other_source = json.loads(respond(session, cid)) | {"source": "urn:test:operator-b"}

    async def go() -> dict[str, Any]:
        async with aiohttp.ClientSession() as s:
            claimant, op = await claim_then_command(s, relay, "claimant", session, cid)
            first = await next_frame(claimant)
            op_b = await connect(s, relay, {"type": "hello", "versions": ["0.1"], "role": "consumer"}, OPERATOR)
            await op_b.send_json(other_source)
            refused = await next_frame(op_b)
            ack = {**event(session, 1, "control.accepted", data={}), "agent": "claimant", "cause": cid, "id": f"{session}-a"}
            await claimant.send_str(encode(ack).decode())
            answer = await next_frame(op)
            await op_b.send_json(other_source)  # settled: now it is the only one of its id
            second = await next_frame(claimant)
            await claimant.send_str(encode({**ack, "id": f"{session}-b", "seq": 2}).decode())
            answer_b = await next_frame(op_b)
            return {"first": first, "refused": refused, "answer": answer, "second": second, "answer_b": answer_b}

    out = asyncio.run(go())
    assert out["first"]["source"] == "urn:test:operator" and out["answer"]["id"].endswith("-a")
    assert out["refused"]["type"] == "error" and out["refused"]["code"] == "ambiguous" and out["refused"]["cause"] == cid
    assert out["second"]["source"] == "urn:test:operator-b" and out["answer_b"]["id"].endswith("-b")
