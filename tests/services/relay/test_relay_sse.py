"""The relay's HTTP side (AEP-0003 §3.3, §3.4, §5, §6, §8.1) against a real relay process on a
real nats-server: discovery, auth, SSE live delivery, filter fail-closed, capture ceiling,
resume (from, Last-Event-ID), replay-all, replay-exhausted under real eviction."""

from __future__ import annotations

import asyncio
import json
import uuid

import aiohttp
import pytest

from tests.support.relay import (
    ALL, CONSUMER, EMITTER, META_CONSUMER, OPERATOR, RelayProcess, auth, event, publish, read_sse,
)


def sid() -> str:
    return "s" + uuid.uuid4().hex[:12]


def run(coro):
    return asyncio.run(coro)


def test_healthz_and_discovery_need_no_token(relay):
    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.get(relay.url + "/healthz") as r:
                assert r.status == 200
            docs = []
            for path in ("/events", "/.well-known/aep"):
                async with s.get(relay.url + path) as r:
                    assert r.status == 200 and r.content_type == "application/json"
                    docs.append(await r.json())
            return docs

    a, b = run(go())
    assert a == b
    assert a["aep"] == ["0.1"]
    assert a["endpoints"] == {"events": "/events", "stream": "/stream", "socket": "/socket"}
    caps = a["capabilities"]
    assert caps["filters"] == ["attr-match"]
    assert caps["replay"] == {"buffer": 10000, "all": True}
    assert caps["roster"] == {}  # the roster frame is implemented (test_relay_control.py)


@pytest.mark.parametrize("token,status", [(None, 401), ("wrong-token-0123456789", 401), (EMITTER, 403)])
def test_stream_refused_without_a_consuming_token(relay, token, status):
    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.get(relay.url + "/stream", headers=auth(token)) as r:
                return r.status, await r.json(), r.headers.get("WWW-Authenticate")

    code, body, challenge = run(go())
    assert code == status and body["error"] == "unauthorized"
    assert (challenge is not None) == (status == 401)


@pytest.mark.parametrize("token", [CONSUMER, OPERATOR, ALL])
def test_live_delivery_byte_identical_with_ids(relay, nats_server, token):
    s_ = sid()
    events = [event(s_, i) for i in range(1, 4)]

    async def go():
        async with aiohttp.ClientSession() as s:
            reader = asyncio.create_task(read_sse(s, relay.url + "/stream", want=3, headers=auth(token),
                                                  params={"filter": json.dumps({"session": s_})}))
            await asyncio.sleep(0.5)
            raw = await publish(nats_server.url, events)
            return raw, await reader

    raw, got = run(go())
    assert got["status"] == 200
    assert [e["data"] for e in got["events"]] == raw  # the stored bytes, unchanged
    assert [e["id"] for e in got["events"]] == [f"{s_}:0:{i}" for i in range(1, 4)]
    assert [e["event"] for e in got["events"]] == ["tool.called"] * 3


def test_access_token_query_works_and_no_token_is_ever_logged(relay, nats_server):
    s_ = sid()

    async def go():
        async with aiohttp.ClientSession() as s:
            got = await read_sse(s, relay.url + "/stream", params={"access_token": CONSUMER, "from": "all", "live": "0",
                                                                 "filter": json.dumps({"session": s_})})
            bad = await read_sse(s, relay.url + "/stream", params={"access_token": "not-a-real-token-xyz"})
            hdr = await read_sse(s, relay.url + "/stream", headers=auth(OPERATOR),
                                 params={"live": "0", "filter": json.dumps({"session": s_})})
            return got, bad, hdr

    run(publish(nats_server.url, [event(s_, 1)]))
    got, bad, hdr = run(go())
    assert got["status"] == 200 and len(got["events"]) == 1
    assert bad["status"] == 401 and hdr["status"] == 200
    logs = relay.logs()
    assert "/stream" in logs  # requests are logged...
    for secret in (CONSUMER, OPERATOR, ALL, META_CONSUMER, EMITTER, "not-a-real-token-xyz"):
        assert secret not in logs  # ...without a token


@pytest.mark.parametrize("flt", [{"time": "x"}, {"data": 1}, {"Bad Key!": 1}, {"type": "*"}, {"severity": {"gt": "info"}}, [1]])
def test_filter_fails_closed(relay, flt):
    async def go():
        async with aiohttp.ClientSession() as s:
            return await read_sse(s, relay.url + "/stream", headers=auth(CONSUMER), params={"filter": json.dumps(flt)})

    got = run(go())
    assert got["status"] == 400 and json.loads(got["body"])["error"] == "invalid-filter"


def test_capture_ceiling_down_levels_never_up_and_consumer_maximum_is_enforced(relay, nats_server):
    s_ = sid()
    full = event(s_, 1, capture="full", data={"tool": {"name": "terminal"}, "content": "secret text"})
    meta = event(s_, 2, capture="metadata")
    none = event(s_, 3, capture="none", data={})

    async def read(token, capture=None):
        params = {"from": "all", "live": "0", "filter": json.dumps({"session": s_})}
        if capture:
            params["capture"] = capture
        async with aiohttp.ClientSession() as s:
            return await read_sse(s, relay.url + "/stream", headers=auth(token), params=params)

    raw = run(publish(nats_server.url, [full, meta, none]))
    as_stored = run(read(CONSUMER))
    assert [e["data"] for e in as_stored["events"]] == raw
    for got in (run(read(CONSUMER, "metadata")), run(read(META_CONSUMER)), run(read(META_CONSUMER, "full"))):
        first = json.loads(got["events"][0]["data"])
        assert first["capture"] == "metadata" and "data" not in first  # above the ceiling, a type without field levels: envelope only
        assert {k: v for k, v in first.items() if k not in ("capture",)} == {k: v for k, v in full.items() if k not in ("capture", "data")}
        assert [e["data"] for e in got["events"][1:]] == raw[1:]  # within it: unchanged, never up-levelled
    got = run(read(CONSUMER, "none"))
    assert [json.loads(e["data"])["capture"] for e in got["events"]] == ["none", "none", "none"]
    assert got["events"][2]["data"] == raw[2]


def test_capture_ceiling_down_levels_field_by_field(relay, nats_server):
    """conformance/live.js `capture-downlevel`: a redacted run.started at a metadata ceiling keeps
    its metadata fields, loses the redacted one and says `capture: metadata` (AEP-0001 §8.2)."""
    s_ = sid()
    ev = event(s_, 1, "run.started", capture="redacted", data={"trigger": "user", "prompt": "CANARY free text"})

    async def read(capture):
        params = {"from": "all", "live": "0", "filter": json.dumps({"session": s_}), "capture": capture}
        async with aiohttp.ClientSession() as s:
            return await read_sse(s, relay.url + "/stream", headers=auth(CONSUMER), params=params)

    raw = run(publish(nats_server.url, [ev]))
    down = json.loads(run(read("metadata"))["events"][0]["data"])
    assert down == {k: v for k, v in ev.items() if k != "data"} | {"capture": "metadata", "data": {"trigger": "user"}}
    assert run(read("redacted"))["events"][0]["data"] == raw[0]  # within the ceiling: the stored bytes


def test_resume_from_positions_last_event_id_and_live0(relay, nats_server):
    a, b = sid(), sid()
    raw = run(publish(nats_server.url, [event(a, i) for i in range(1, 6)] + [event(b, i) for i in range(1, 4)]))

    async def go():
        async with aiohttp.ClientSession() as s:
            both = await read_sse(s, relay.url + "/stream", headers=auth(CONSUMER), params={
                "live": "0", "from": json.dumps([{"session": a, "epoch": 0, "seq": 3}, {"session": b, "epoch": 0, "seq": 0}])})
            lei = await read_sse(s, relay.url + "/stream", headers={**auth(CONSUMER), "Last-Event-ID": f"{a}:0:4"},
                                 params={"live": "0"})
            # `from` wins over Last-Event-ID
            both2 = await read_sse(s, relay.url + "/stream", headers={**auth(CONSUMER), "Last-Event-ID": f"{a}:0:4"},
                                   params={"live": "0", "from": json.dumps([{"session": a, "epoch": 0, "seq": 1}])})
            bad = await read_sse(s, relay.url + "/stream", headers=auth(CONSUMER), params={"from": json.dumps([{"session": a}])})
            return both, lei, both2, bad

    both, lei, both2, bad = run(go())
    assert sorted(e["data"] for e in both["events"]) == sorted(raw[3:5] + raw[5:8])
    assert [e["data"] for e in lei["events"]] == raw[4:5]
    assert [e["data"] for e in both2["events"]] == raw[1:5]
    assert not any(c.startswith("replay-exhausted") for c in both["comments"] + lei["comments"])
    assert bad["status"] == 400 and json.loads(bad["body"])["error"] == "invalid-filter"


def test_replay_all_then_live(relay, nats_server):
    s_ = sid()
    raw = run(publish(nats_server.url, [event(s_, i) for i in range(1, 4)]))

    async def go():
        async with aiohttp.ClientSession() as s:
            reader = asyncio.create_task(read_sse(s, relay.url + "/stream", want=5, headers=auth(CONSUMER),
                                                  params={"from": "all", "filter": json.dumps({"session": s_})}))
            await asyncio.sleep(1.0)
            more = await publish(nats_server.url, [event(s_, i) for i in range(4, 6)])
            return more, await reader

    more, got = run(go())
    assert [e["data"] for e in got["events"]] == raw + more  # replay, then live: no gap, no duplicate
    assert not any(c.startswith("replay-exhausted") for c in got["comments"])


def test_replay_exhausted_under_real_eviction(nats_server, jetstream, tmp_path):
    relay = RelayProcess(nats_server.url, tmp_path, env={"AEP_BRIDGE_RELAY_REPLAY_BUFFER": "5"}).start()
    try:
        s_ = sid()
        raw = run(publish(nats_server.url, [event(s_, i) for i in range(1, 13)]))

        async def go():
            async with aiohttp.ClientSession() as s:
                async with s.get(relay.url + "/events") as r:
                    doc = await r.json()
                got = await read_sse(s, relay.url + "/stream", headers=auth(CONSUMER), params={
                    "live": "0", "from": json.dumps([{"session": s_, "epoch": 0, "seq": 2}])})
                return doc, got

        doc, got = run(go())
        assert doc["capabilities"]["replay"]["buffer"] == 5
        assert got["comments"][1] == f"replay-exhausted {s_} 0:8"  # [0] is the relay's greeting
        assert [e["data"] for e in got["events"]] == raw[7:]  # from the earliest held position
    finally:
        relay.stop()


@pytest.mark.parametrize("header", ["s1:0:-5", "s1:-1:3"])
def test_a_negative_last_event_id_is_refused_as_a_negative_from_is(relay, header):
    async def go():
        async with aiohttp.ClientSession() as s:
            lei = await read_sse(s, relay.url + "/stream", headers={**auth(CONSUMER), "Last-Event-ID": header},
                                 params={"live": "0"})
            session, epoch, seq = header.rsplit(":", 2)
            frm = await read_sse(s, relay.url + "/stream", headers=auth(CONSUMER), params={
                "live": "0", "from": json.dumps([{"session": session, "epoch": int(epoch), "seq": int(seq)}])})
            return lei, frm

    lei, frm = run(go())
    assert frm["status"] == 400 and json.loads(frm["body"])["error"] == "invalid-filter"
    assert lei["status"] == 400 and json.loads(lei["body"])["error"] == "invalid-filter"


def test_from_with_the_most_positions_fits_an_sse_request_and_one_more_is_limit_exceeded(relay, nats_server):
    a = sid()
    raw = run(publish(nats_server.url, [event(a, 1)]))
    positions = [{"session": a, "epoch": 0, "seq": 0}] + [{"session": sid(), "epoch": 0, "seq": i} for i in range(255)]

    async def go(ps):
        async with aiohttp.ClientSession() as s:
            return await read_sse(s, relay.url + "/stream", headers=auth(CONSUMER),
                                  params={"live": "0", "from": json.dumps(ps)})

    most = run(go(positions))  # ~20 KB of request line, past aiohttp's default 8,190 bytes
    assert most["status"] == 200 and [e["data"] for e in most["events"]] == raw
    over = run(go(positions + [{"session": sid(), "epoch": 0, "seq": 0}]))
    assert over["status"] == 400 and json.loads(over["body"])["error"] == "limit-exceeded"


async def gauge(s: aiohttp.ClientSession, relay: RelayProcess, line: str) -> float | None:
    async with s.get(relay.url + "/metrics") as r:
        for row in (await r.text()).splitlines():
            if row.startswith(line + " "):
                return float(row.split()[-1])
    return None


async def until(s: aiohttp.ClientSession, relay: RelayProcess, line: str, value: float, wait: float = 30.0) -> float | None:
    """Poll the gauge ``line`` until it shows ``value`` (or ``wait`` seconds passed); what it showed last."""
    seen = None
    for _ in range(int(wait / 0.2)):
        seen = await gauge(s, relay, line)
        if seen == value:
            break
        await asyncio.sleep(0.2)
    return seen


def test_a_closed_sse_client_is_dropped_at_once_not_at_the_next_heartbeat(nats_server, jetstream, tmp_path):
    """With a 30 s heartbeat (the most), clients that leave are off the gauges (and out of the fan-out:
    their subscriptions gone) well before it: the relay notices the closed connection."""
    relay = RelayProcess(nats_server.url, tmp_path, env={"AEP_BRIDGE_RELAY_HEARTBEAT_S": "30"}).start()
    conns, subs = 'aep_bridge_relay_connections{binding="sse"}', "aep_bridge_relay_subscriptions"
    try:
        async def go():
            async with aiohttp.ClientSession() as s:
                clients = [aiohttp.ClientSession() for _ in range(5)]
                streams = [await c.get(relay.url + "/stream", headers=auth(CONSUMER),
                                       params={"filter": json.dumps({"session": sid()})}) for c in clients]
                opened = await until(s, relay, conns, 5.0)
                for r, c in zip(streams, clients):
                    r.close()
                    await c.close()
                # a wait on the gauge, well short of the heartbeat: without notice it shows 5 for 30 s
                return opened, await until(s, relay, conns, 0.0, wait=15.0), await until(s, relay, subs, 0.0, wait=15.0)

        opened, after, after_subs = run(go())
        assert opened == 5.0
        assert after == 0.0 and after_subs == 0.0
    finally:
        relay.stop()
