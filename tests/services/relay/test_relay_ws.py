"""The relay's WebSocket binding (AEP-0003 §2, §3.5, §4, §6.5, §10) against a real relay process
on a real nats-server: hello first and version selection, in-band refusals from the closed
set with the connection surviving, unknown frames and capability keys ignored, ping/pong,
several subscriptions, capture ceiling at subscribe, resume, replay-exhausted, byte
identity across JSONL, SSE and WS, control gating."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import aiohttp

from tests.support.relay import CONSUMER, EMITTER, META_CONSUMER, RelayProcess, auth, encode, event, publish, read_sse

HELLO = {"type": "hello", "versions": ["0.1"], "role": "consumer", "identity": {"agent": "test"}, "capabilities": {}}
REFUSAL_CODES = {"invalid-filter", "unknown-dialect", "unauthorized", "limit-exceeded"}


def sid() -> str:
    return "w" + uuid.uuid4().hex[:12]


def run(coro):
    return asyncio.run(coro)


async def recv(ws: aiohttp.ClientWebSocketResponse, timeout: float = 5.0) -> Any:
    msg = await ws.receive(timeout=timeout)
    if msg.type != aiohttp.WSMsgType.TEXT:
        return msg.type
    return json.loads(msg.data)


async def recv_raw(ws: aiohttp.ClientWebSocketResponse, timeout: float = 5.0) -> str:
    msg = await ws.receive(timeout=timeout)
    assert msg.type == aiohttp.WSMsgType.TEXT, msg
    return msg.data


async def connected(s: aiohttp.ClientSession, relay: RelayProcess, token: str | None = CONSUMER,
                    hello: dict[str, Any] | None = HELLO) -> tuple[aiohttp.ClientWebSocketResponse, Any]:
    ws = await s.ws_connect(relay.ws_url, headers=auth(token))
    reply = None
    if hello is not None:
        await ws.send_json(hello)
        reply = await recv(ws)
    return ws, reply


def test_hello_first_and_version_selection(relay):
    async def go():
        async with aiohttp.ClientSession() as s:
            ws, _ = await connected(s, relay, hello=None)
            await ws.send_json({"type": "subscribe", "id": "x", "filter": {}})
            first = await recv(ws)
            closed = await recv(ws)
            ws2, no = await connected(s, relay, hello={**HELLO, "versions": ["9.0"]})
            closed2 = await recv(ws2)
            ws3, yes = await connected(s, relay, hello={**HELLO, "versions": ["1.0", "0.1"],
                                                        "capabilities": {"frobs": {"x": 1}, "filters": ["nope"]}})
            await ws3.send_json({"type": "ping", "t": 7})
            pong = await recv(ws3)
            await ws3.close()
            return first, closed, no, closed2, yes, pong

    first, closed, no, closed2, yes, pong = run(go())
    assert first["type"] == "error" and first["code"] == "hello-required"
    assert closed in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING)
    assert no == {"type": "error", "code": "version-unsupported", "versions": ["0.1"]}
    assert closed2 in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING)
    assert yes["type"] == "hello" and yes["versions"] == ["0.1"]  # exactly one version
    assert yes["capabilities"]["replay"]["all"] is True
    assert pong == {"type": "pong", "t": 7}


def test_refusals_in_band_connection_survives_unknown_frames_ignored(relay, nats_server):
    s_ = sid()

    async def go():
        async with aiohttp.ClientSession() as s:
            ws, _ = await connected(s, relay)
            answers = []
            for frame in (
                {"type": "subscribe", "id": "bad-key", "filter": {"time": "x"}},
                {"type": "subscribe", "id": "bad-from", "filter": {}, "from": [{"session": 3}]},
                {"type": "subscribe", "id": "bad-capture", "filter": {}, "capture": "everything"},
                {"type": "subscribe", "id": "too-many", "filter": {}, "from": [{"session": "a", "epoch": 0, "seq": i} for i in range(300)]},
                {"type": "subscribe", "id": "ok", "filter": {"session": s_}},
                {"type": "subscribe", "id": "ok", "filter": {"session": s_}},
            ):
                await ws.send_json(frame)
                await ws.send_json({"type": "frobnicate", "id": "zz", "payload": [1]})  # unknown: ignored
                answers.append(await recv(ws))
            raw = await publish(nats_server.url, [event(s_, 1)])
            delivered = await recv_raw(ws)
            await ws.send_json({"type": "unsubscribe", "id": "ok"})
            unsub = await recv(ws)
            await ws.close()
            return answers, raw, delivered, unsub

    answers, raw, delivered, unsub = run(go())
    codes = [(a["type"], a.get("id"), a.get("code")) for a in answers]
    assert codes == [("error", "bad-key", "invalid-filter"), ("error", "bad-from", "invalid-filter"),
                     ("error", "bad-capture", "invalid-filter"), ("error", "too-many", "limit-exceeded"),
                     ("subscribed", "ok", None), ("error", "ok", "invalid-filter")]
    assert all(a["code"] in REFUSAL_CODES for a in answers if a["type"] == "error")
    assert delivered.encode() == raw[0]  # the connection survived every refusal
    assert unsub == {"type": "unsubscribed", "id": "ok"}


def test_several_subscriptions_capture_ceiling_at_subscribe(relay, nats_server):
    a, b = sid(), sid()
    full = event(a, 1, capture="full", data={"content": "the words"})

    async def go():
        async with aiohttp.ClientSession() as s:
            ws, _ = await connected(s, relay)
            await ws.send_json({"type": "subscribe", "id": "A", "filter": {"session": a}, "capture": "metadata"})
            await ws.send_json({"type": "subscribe", "id": "B", "filter": {"session": b}})
            acks = [await recv(ws), await recv(ws)]
            raw = await publish(nats_server.url, [full, event(b, 1)])
            got = sorted([await recv_raw(ws), await recv_raw(ws)])
            # a consumer whose maximum is metadata, asking for full
            ws2, _ = await connected(s, relay, token=META_CONSUMER)
            await ws2.send_json({"type": "subscribe", "id": "C", "filter": {"session": a}, "capture": "full", "from": "all"})
            ack2 = await recv(ws2)
            capped = await recv(ws2)
            return acks, raw, got, ack2, capped

    acks, raw, got, ack2, capped = run(go())
    assert acks == [{"type": "subscribed", "id": "A"}, {"type": "subscribed", "id": "B"}]
    down = [json.loads(g) for g in got if json.loads(g)["session"] == a][0]
    assert down["capture"] == "metadata" and "data" not in down
    assert raw[1].decode() in got  # within the ceiling: the stored bytes
    assert ack2 == {"type": "subscribed", "id": "C"}
    assert capped["capture"] == "metadata" and "data" not in capped


def test_resume_with_from_gaps_duplicates_and_replay_exhausted(nats_server, jetstream, tmp_path):
    relay = RelayProcess(nats_server.url, tmp_path, env={"AEP_BRIDGE_RELAY_REPLAY_BUFFER": "6"}).start()
    try:
        s_ = sid()
        # a gap (no seq 4) and a duplicate (seq 6 twice, the same id: at-least-once)
        evs = [event(s_, i) for i in (1, 2, 3, 5, 6, 6, 7)]
        raw = run(publish(nats_server.url, evs))

        async def go():
            async with aiohttp.ClientSession() as s:
                ws, _ = await connected(s, relay)
                await ws.send_json({"type": "subscribe", "id": "r", "filter": {}, "from": [{"session": s_, "epoch": 0, "seq": 2}]})
                ack = await recv(ws)
                frames = [await recv_raw(ws) for _ in range(5)]
                ws2, _ = await connected(s, relay)
                await ws2.send_json({"type": "subscribe", "id": "q", "filter": {}, "from": [{"session": s_, "epoch": 0, "seq": 0}]})
                ack2 = await recv(ws2)
                exhausted = await recv(ws2)
                rest = [await recv_raw(ws2) for _ in range(6)]
                return ack, frames, ack2, exhausted, rest

        ack, frames, ack2, exhausted, rest = run(go())
        assert ack == {"type": "subscribed", "id": "r"}
        # window = the last 6 events: seq 2..7 held; resume after seq 2 is not exhausted
        assert "replay-exhausted" not in frames[0]
        assert [f.encode() for f in frames] == raw[2:]  # 3, 5, 6, 6, 7: the gap and the duplicate as stored
        assert exhausted == {"type": "replay-exhausted", "sub": "q", "session": s_, "earliest": {"epoch": 0, "seq": 2}}
        assert [f.encode() for f in rest[:6]] == raw[1:]
    finally:
        relay.stop()


def test_byte_identity_across_jsonl_sse_and_ws(relay, nats_server):
    s_ = sid()
    ev = event(s_, 1, data={"tool": {"name": "terminal"}, "text": "héllo ✓ \u2028 \"q\""}, severity="notice")
    jsonl_line = encode(ev)  # what a JSONL writer puts on one line

    async def go():
        async with aiohttp.ClientSession() as s:
            ws, _ = await connected(s, relay)
            await ws.send_json({"type": "subscribe", "id": "i", "filter": {"session": s_}})
            await recv(ws)
            sse = asyncio.create_task(read_sse(s, relay.url + "/stream", want=1, headers=auth(CONSUMER),
                                               params={"filter": json.dumps({"session": s_})}))
            await asyncio.sleep(0.5)
            stored = await publish(nats_server.url, [ev])
            frame = await recv_raw(ws)
            return stored, frame, await sse

    stored, frame, sse = run(go())
    assert stored[0] == jsonl_line
    assert frame.encode("utf-8") == jsonl_line
    assert sse["events"][0]["data"] == jsonl_line


def test_emitter_cannot_subscribe_and_control_is_gated(relay):
    command = {"aep": "0.1", "id": "cmd-1", "type": "control.attention.respond", "time": "2026-12-01T10:00:00Z",
               "source": "urn:test:operator", "agent": "operator", "session": "s-x", "data": {"request": "r", "answer": {"option": "allow"}}}

    async def go():
        async with aiohttp.ClientSession() as s:
            ws, _ = await connected(s, relay, token=EMITTER)
            await ws.send_json({"type": "subscribe", "id": "e", "filter": {}})
            refused = await recv(ws)
            ws2, _ = await connected(s, relay, token=CONSUMER)
            await ws2.send_json(command)
            consumer_control = await recv(ws2)
            await ws2.send_json({"type": "ping"})
            alive = await recv(ws2)
            async with s.get(relay.url + "/socket") as r:
                unauthenticated = r.status
            return refused, consumer_control, alive, unauthenticated

    refused, consumer_control, alive, unauthenticated = run(go())
    assert refused == {"type": "error", "id": "e", "code": "unauthorized", "detail": refused["detail"]}
    assert consumer_control["type"] == "error" and consumer_control["code"] == "unauthorized"
    assert consumer_control["cause"] == "cmd-1"  # AEP-0004 §4.2: the relay-behalf frame names the command
    assert alive == {"type": "pong"}
    assert unauthenticated == 401
