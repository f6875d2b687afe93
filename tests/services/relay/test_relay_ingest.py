"""POST /events on the relay (AEP-0003 §3.2) from emitter tokens: status codes, schema check
(a bad line rejects the whole batch, nothing stored), dedupe on (source, id), storage under
aep.ingest.> (never aep.hermes.>), byte identity of a posted line over SSE and WS."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import aiohttp
import pytest

from bridge.services.relay.hub import relay_position
from tests.support.relay import ALL, CONSUMER, EMITTER, OPERATOR, RelayProcess, auth, encode, event, read_sse

V = {"AEP-Version": "0.1"}


def post(relay, body: bytes, *, token=EMITTER, ctype="application/x-ndjson", headers=V):
    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.post(relay.url + "/events", data=body, headers={**auth(token), **headers, "Content-Type": ctype}) as r:
                text = await r.text()
                return r.status, (json.loads(text) if text.startswith("{") else text)

    return asyncio.run(go())


def sid() -> str:
    return "i" + uuid.uuid4().hex[:12]


@pytest.mark.parametrize("token,status", [(None, 401), ("unknown-token-0123456789", 401), (CONSUMER, 403), (OPERATOR, 403)])
def test_only_emitter_tokens_post(relay, token, status):
    code, body = post(relay, encode(event(sid(), 1)), token=token, ctype="application/json")
    assert code == status and body["error"] == "unauthorized"


def test_status_codes(relay, jetstream):
    ev = encode(event(sid(), 1))
    assert post(relay, ev, headers={"AEP-Version": "1.0"}) == (426, {"versions": ["0.1"]})
    assert post(relay, ev, headers={}) == (426, {"versions": ["0.1"]})
    assert post(relay, ev, ctype="text/plain")[0] == 415
    assert post(relay, b"x" * (5 * 1024 * 1024))[0] == 413
    s_ = sid()
    good, bad = encode(event(s_, 1)), json.loads(encode(event(s_, 2)))
    del bad["id"]
    code, body = post(relay, good + b"\n" + encode(bad) + b"\n")
    assert code == 400 and body["error"] == "invalid-event" and body["line"] == 1
    no_seq = json.loads(encode(event(s_, 3)))
    del no_seq["seq"]
    assert post(relay, encode(no_seq), ctype="application/json")[1]["error"] == "invalid-event"
    stored = jetstream.fetch(f"aep.ingest.{s_}.>", stream="AEP_EVENTS", expected=0, timeout=0.5)
    assert stored == []  # nothing of a rejected batch is stored


def test_batch_stored_in_order_in_its_own_space_deduped_and_byte_identical(relay, jetstream, nats_server):
    """Stored as posted; delivered with the relay's position (the stream sequence, epoch 0),
    the same bytes on SSE and WS (issue 44: a posted seq moves no one's resume point)."""
    s_ = sid()
    lines = [encode(event(s_, 1000 + i, data={"text": "é ✓"}, epoch=3)) for i in range(1, 4)]

    async def go():
        async with aiohttp.ClientSession() as s:
            sse = asyncio.create_task(read_sse(s, relay.url + "/stream", want=3, headers=auth(CONSUMER),
                                               params={"filter": json.dumps({"session": s_})}))
            ws = await s.ws_connect(relay.ws_url, headers=auth(CONSUMER))
            await ws.send_json({"type": "hello", "versions": ["0.1"], "role": "consumer"})
            await ws.receive(timeout=5)
            await ws.send_json({"type": "subscribe", "id": "i", "filter": {"session": s_}})
            await ws.receive(timeout=5)
            await asyncio.sleep(0.5)
            async with s.post(relay.url + "/events", data=b"\n".join(lines) + b"\n",
                              headers={**auth(EMITTER), **V, "Content-Type": "application/x-ndjson"}) as r:
                first = (r.status, await r.json())
            async with s.post(relay.url + "/events", data=lines[1],
                              headers={**auth(ALL), **V, "Content-Type": "application/json"}) as r:
                again = (r.status, await r.json())
            frames = [(await ws.receive(timeout=5)).data for _ in range(3)]
            return first, again, frames, await sse

    first, again, frames, sse = asyncio.run(go())
    assert first == (202, {"accepted": 3, "duplicates": 0})
    assert again == (202, {"accepted": 0, "duplicates": 1})  # the same (source, id): absorbed
    stored = jetstream.fetch("aep.>", stream="AEP_EVENTS")
    mine = [m for m in stored if json.loads(m.data).get("session") == s_]
    assert [m.data for m in mine] == lines  # once each, in batch order, the posted bytes
    assert {m.subject for m in mine} == {f"aep.ingest.{s_}.tool.called"}  # never aep.hermes.>
    delivered = [relay_position(json.loads(m.data), m.seq) for m in mine]  # seq: the stream's; epoch 0
    assert [json.loads(d)["seq"] for d in delivered] == [m.seq for m in mine] and b'"epoch"' not in delivered[0]
    assert [e["data"] for e in sse["events"]] == delivered
    assert [e["id"] for e in sse["events"]] == [f"{s_}:0:{m.seq}" for m in mine]
    assert [f.encode() for f in frames] == delivered


def test_posted_standard_types_we_do_not_emit_are_down_levelled_field_by_field(relay):
    """Events another emitter posts, of standard types the bridge never emits, reach a
    `metadata` subscription with the metadata-level fields their AEP payload schema declares
    (AEP-0001 §8.2); a vendor type keeps its envelope alone."""
    s_ = sid()
    status = event(s_, 1, "progress.status", capture="full", data={"phase": "build", "percent": 40, "message": "CANARY text"})
    error = event(s_, 2, "error.raised", capture="redacted", data={"error": {"type": "Timeout", "message": "CANARY"}, "fatal": False})
    vendor = event(s_, 3, "x.foo.progress.status", capture="full", data={"phase": "build"})
    lines = [encode(e) for e in (status, error, vendor)]
    assert post(relay, b"\n".join(lines) + b"\n")[0] == 202

    async def read(capture):
        async with aiohttp.ClientSession() as s:
            return await read_sse(s, relay.url + "/stream", want=3, headers=auth(CONSUMER), params={
                "from": "all", "live": "0", "filter": json.dumps({"session": s_}), "capture": capture})

    full = asyncio.run(read("full"))["events"]
    seqs = [json.loads(e["data"])["seq"] for e in full]  # the relay's positions (stream sequences)
    got = [json.loads(e["data"]) for e in asyncio.run(read("metadata"))["events"]]
    envelope = [{k: v for k, v in e.items() if k not in ("capture", "data")} | {"seq": q}
                for e, q in zip((status, error, vendor), seqs)]
    assert got == [envelope[0] | {"capture": "metadata", "data": {"phase": "build", "percent": 40}},
                   envelope[1] | {"capture": "metadata", "data": {"error": {"type": "Timeout"}, "fatal": False}},
                   envelope[2] | {"capture": "metadata"}]
    assert [json.loads(e["data"]) for e in asyncio.run(read("none"))["events"]] == \
        [env | {"capture": "none"} for env in envelope]
    # within the ceiling: the posted event, at the relay's position
    assert [e["data"] for e in full] == [encode({**e, "seq": q}) for e, q in zip((status, error, vendor), seqs)]


def test_a_relay_without_tokens_is_a_loopback_development_relay(nats_server, jetstream, tmp_path):
    relay = RelayProcess(nats_server.url, tmp_path, tokens=False).start()
    try:
        s_ = sid()
        code, body = post(relay, encode(event(s_, 1)), token=None, ctype="application/json")
        assert (code, body) == (202, {"accepted": 1, "duplicates": 0})

        async def control():
            async with aiohttp.ClientSession() as s:
                ws = await s.ws_connect(relay.ws_url)
                await ws.send_json({"type": "hello", "versions": ["0.1"], "role": "consumer"})
                await ws.receive(timeout=5)
                await ws.send_json({**event(s_, 2, type_="control.attention.respond"), "id": "CMD-ANON"})
                return json.loads((await ws.receive(timeout=5)).data)

        refused = asyncio.run(control())
        assert refused["code"] == "unauthorized" and refused["cause"] == "CMD-ANON"  # control never without a token
    finally:
        relay.stop()
    env = {"AEP_BRIDGE_RELAY_LISTEN": "0.0.0.0:0"}
    out = subprocess.run([str(Path(sys.executable).with_name("aep-bridge")), "relay"], capture_output=True, text=True,
                         env={**os.environ, "AEP_BRIDGE_NATS_URL": nats_server.url, **env}, timeout=30)
    assert out.returncode == 2 and "off loopback" in out.stderr  # never open to the network without a token


async def stored(relay, session: str, want: int, wait: float = 15.0) -> int:
    """How many events of ``session`` the relay replays, polled until ``want`` (or ``wait`` s)."""
    got = 0
    for _ in range(int(wait / 0.25)):
        async with aiohttp.ClientSession() as s:
            out = await read_sse(s, relay.url + "/stream", headers=auth(CONSUMER),
                                 params={"from": "all", "live": "0", "filter": json.dumps({"session": session})})
        got = len(out["events"])
        if got >= want:
            break
        await asyncio.sleep(0.25)
    return got


def test_what_a_websocket_emitter_sent_before_it_left_is_stored(relay):
    """An emitter that sends its events and goes (its connection closed right after its last
    frame, no close handshake): the relay stores every frame it received. The relay ends a
    handler when its client leaves (so an SSE stream leaves the fan-out at once), but not the
    WebSocket's (nor POST /events': a batch read is stored to its end; a POST whose client
    leaves before its body is read is lost, and unanswered, as before)."""
    sent, n = sid(), 200

    async def go():
        s = aiohttp.ClientSession()
        ws = await s.ws_connect(relay.ws_url, headers=auth(EMITTER))
        await ws.send_json({"type": "hello", "versions": ["0.1"], "role": "emitter", "identity": {"agent": "leaver"},
                            "capabilities": {}})
        await ws.receive_json(timeout=5)
        for i in range(1, n + 1):
            await ws.send_str(encode(event(sent, i)).decode())
        await s.close()  # the connection closed under the socket, no close frame
        return await stored(relay, sent, n)

    assert asyncio.run(go()) == n
