"""Backpressure (AEP-0003 §8.4) of the relay's subscriptions, on the real `hub.Subscription`:
a full queue drops debug/info events and counts them; a notice-or-above event that finds it
full is never dropped silently: the subscription is marked overflowed (its binding then ends
it with positions, SSE: the stream ends, WS: a `closing` frame) so the consumer resumes
exactly. And the same end to end: a relay whose queue holds 1 event, a WebSocket subscriber
that stops reading, a flood: the relay closes it with `closing` and its positions."""

from __future__ import annotations

import asyncio
import json
import uuid

import aiohttp

from bridge.core.attrmatch import MATCH_ALL
from bridge.services.relay.hub import Item, Subscription
from tests.support.relay import CONSUMER, RelayProcess, auth, encode, event, publish


def item(seq: int, severity: str) -> Item:
    ev = event("bp", seq, severity=severity)
    return Item(seq, encode(ev), ev)


def test_low_severity_is_dropped_and_counted_notice_and_above_overflow():
    async def go():
        drops = []
        sub = Subscription(MATCH_ALL, limit=2, on_drop=lambda: drops.append(1))
        sub.offer(item(1, "info"))
        sub.offer(item(2, "debug"))
        sub.offer(item(3, "info"))  # full: dropped, counted
        sub.offer(item(4, "debug"))  # full: dropped, counted
        assert not sub.overflowed and [i.seq for i in sub.queue] == [1, 2] and len(drops) == 2 == sub.drops
        sub.offer(item(5, "notice"))  # full: never dropped silently
        assert sub.overflowed and [i.seq for i in sub.queue] == [1, 2]
        for severity in ("warning", "error", "critical"):
            s2 = Subscription(MATCH_ALL, limit=1)
            s2.offer(item(1, "info"))
            s2.offer(item(2, severity))
            assert s2.overflowed and s2.drops == 0

    asyncio.run(go())


def test_a_stalled_websocket_subscriber_gets_closing_with_positions(nats_server, jetstream, tmp_path):
    relay = RelayProcess(nats_server.url, tmp_path, env={"AEP_BRIDGE_RELAY_QUEUE": "1"}).start()
    s_ = "bp" + uuid.uuid4().hex[:10]
    try:
        async def go():
            async with aiohttp.ClientSession() as s:
                ws = await s.ws_connect(relay.ws_url, headers=auth(CONSUMER), max_msg_size=0)
                await ws.send_json({"type": "hello", "versions": ["0.1"], "role": "consumer"})
                await ws.receive(timeout=5)
                await ws.send_json({"type": "subscribe", "id": "slow", "filter": {"session": s_}})
                await ws.receive(timeout=5)
                big = "x" * 200_000  # fills the socket buffers quickly while the client does not read
                await publish(nats_server.url, [event(s_, i, severity="warning", data={"big": big}) for i in range(1, 80)])
                frames = []
                while True:
                    msg = await ws.receive(timeout=30)
                    if msg.type != aiohttp.WSMsgType.TEXT:
                        break
                    frames.append(json.loads(msg.data))
                return frames

        frames = asyncio.run(go())
    finally:
        relay.stop()
    events = [f for f in frames if "." in f["type"]]
    closing = frames[-1]
    assert closing["type"] == "closing" and closing["reason"] == "backpressure"
    assert 0 < len(events) < 79  # it was cut off, not fed forever
    last = events[-1]
    assert closing["delivered"] == [{"sub": "slow", "session": s_, "epoch": 0, "seq": last["seq"]}]  # resume exactly here
    assert [e["seq"] for e in events] == list(range(1, last["seq"] + 1))  # nothing skipped before the cut


def test_a_stalled_sse_subscriber_is_cut_off_in_order(nats_server, jetstream, tmp_path):
    """SSE writes go straight to the connection while it takes them; a client that stops
    reading fills it, the writes fall back to waiting for the client, the queue (1) fills and
    the stream ends: cut off, in order, nothing skipped, not fed forever."""
    relay = RelayProcess(nats_server.url, tmp_path, env={"AEP_BRIDGE_RELAY_QUEUE": "1"}).start()
    s_ = "bs" + uuid.uuid4().hex[:10]
    try:
        async def go():
            async with aiohttp.ClientSession() as s:
                async with s.get(relay.url + "/stream", params={"filter": json.dumps({"session": s_})},
                                 headers=auth(CONSUMER), timeout=aiohttp.ClientTimeout(total=None)) as resp:
                    assert await resp.content.readline() == b": aep-bridge relay\n"  # subscribed
                    await publish(nats_server.url, [event(s_, 1, severity="warning")])
                    first = b""
                    while b"\n\n" not in first.split(b"id: ", 1)[-1]:  # the first event, read: delivery works
                        first += await asyncio.wait_for(resp.content.readline(), 30)
                    big = "x" * 200_000  # now stall
                    await publish(nats_server.url, [event(s_, i, severity="warning", data={"big": big})
                                                    for i in range(2, 80)])
                    await asyncio.sleep(1.0)  # the relay takes the last events while nobody reads
                    return first + await asyncio.wait_for(resp.content.read(), 60)  # to the stream's end

        body = asyncio.run(go())
    finally:
        relay.stop()
    seqs = [int(line.rsplit(b":", 1)[1]) for line in body.split(b"\n") if line.startswith(b"id: ")]
    assert 0 < len(seqs) < 79  # it was cut off, not fed forever
    assert seqs == list(range(1, len(seqs) + 1))  # nothing skipped before the cut
