"""Resume when every event of a session after the asked position has left the replay window
(AEP-0003 §5: a position that predates the buffer MUST produce `replay-exhausted`), against a
real relay on a real nats-server, over SSE and WebSocket:

* a quiet session behind a busy fleet: its events are still on AEP_EVENTS, but the fleet's
  traffic pushed them out of the relay's window (here a window of 8, the issue's repro; with
  the default 10,000 the same happens to any quiet session);
* a session whose events the stream itself evicted (its limits; here a purge of the
  session's subjects) after the relay saw them live.

Each resume yields either every event after the position, or `replay-exhausted` followed by
what is held (here nothing, then the session's next event, live)."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import aiohttp
import nats
import pytest

from bridge.core.lanes import lane_token
from bridge.nats import streams as S
from bridge.nats.subjects import session_filter
from tests.support.relay import CONSUMER, RelayProcess, auth, event, publish, read_sse

HELLO = {"type": "hello", "versions": ["0.1"], "role": "consumer", "identity": {"agent": "test"}, "capabilities": {}}


def sid() -> str:
    return "r" + uuid.uuid4().hex[:12]


def run(coro):
    return asyncio.run(coro)


async def post(relay: RelayProcess, events: list[dict[str, Any]]) -> None:
    """Store ``events`` as the bridge's pipeline does (aep.hermes.>, their positions theirs:
    an emitter's posted seq is not a position, issue 44, and it may not post into a Hermes session)."""
    await publish(relay.env["AEP_BRIDGE_NATS_URL"], events)


async def sse_resume(relay: RelayProcess, session: str, seq: int) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s:
        return await read_sse(s, relay.url + "/stream", headers=auth(CONSUMER), params={
            "live": "0", "from": json.dumps([{"session": session, "epoch": 0, "seq": seq}])})


async def ws_resume(relay: RelayProcess, session: str, seq: int, then: list[dict[str, Any]]) -> list[Any]:
    """Subscribe to ``session`` from ``seq``, post ``then`` once subscribed, and return every
    frame up to the first event of ``then``."""
    async with aiohttp.ClientSession() as s:
        ws = await s.ws_connect(relay.ws_url, headers=auth(CONSUMER))
        await ws.send_json(HELLO)
        await ws.receive_json(timeout=5)
        await ws.send_json({"type": "subscribe", "id": "a", "filter": {"session": session},
                            "from": [{"session": session, "epoch": 0, "seq": seq}]})
        frames = [await ws.receive_json(timeout=5)]
        assert frames[0] == {"type": "subscribed", "id": "a"}
        await post(relay, then)
        while True:
            frame = await ws.receive_json(timeout=10)
            frames.append(frame)
            if frame.get("id") == then[0]["id"]:
                break
        await ws.close()
        return frames


def exhausted(session: str, seq: int) -> dict[str, Any]:
    return {"type": "replay-exhausted", "sub": "a", "session": session, "earliest": {"epoch": 0, "seq": seq}}


def check(relay: RelayProcess, a: str) -> None:
    """A's events 1..4 have all left the window (or the stream): a resume before 4 is
    exhausted, with nothing held and then A's next event; a resume from 4 is not."""
    for seq in (0, 2):
        got = run(sse_resume(relay, a, seq))
        assert got["status"] == 200 and got["events"] == []
        assert got["comments"][1:] == [f"replay-exhausted {a} 0:5", "replay-complete"], got["comments"]
    got = run(sse_resume(relay, a, 4))
    assert got["comments"][1:] == ["replay-complete"] and got["events"] == []  # nothing missed: no marker
    # the next events on a subject of their own, as when they were posted (`post`): a live
    # event on the subject of A's last evicted one hides it from the newest-per-subject read
    frames = run(ws_resume(relay, a, 0, [event(a, 5, "tool.completed")]))
    assert frames[1:] == [exhausted(a, 5), event(a, 5, "tool.completed")]
    frames = run(ws_resume(relay, a, 5, [event(a, 6, "tool.completed")]))
    assert frames[1:] == [event(a, 6, "tool.completed")]  # from the last position: no marker, the next event


@pytest.mark.parametrize("restart", [False, True], ids=["relay-saw-them", "relay-started-after"])
def test_a_quiet_session_behind_a_busy_fleet_is_exhausted(nats_server, jetstream, tmp_path, restart):
    env = {"AEP_BRIDGE_RELAY_REPLAY_BUFFER": "8"}
    relay = RelayProcess(nats_server.url, tmp_path, env=env)
    if not restart:
        relay.start()
    try:
        a = sid()
        run(publish(nats_server.url, [event(a, i) for i in range(1, 5)]))
        run(publish(nats_server.url, [event(sid(), 1) for _ in range(20)]))  # the fleet
        if restart:
            relay.start()
        check(relay, a)
    finally:
        relay.stop()


def test_a_session_the_stream_evicted_is_exhausted(nats_server, jetstream, tmp_path):
    relay = RelayProcess(nats_server.url, tmp_path, env={"AEP_BRIDGE_RELAY_REPLAY_BUFFER": "8"}).start()
    try:
        a = sid()
        run(post(relay, [event(a, i) for i in range(1, 5)]))
        run(post(relay, [event(sid(), i) for i in range(1, 21)]))

        async def evict() -> None:  # what the stream's age or size limit does to A's events
            nc = await nats.connect(nats_server.url)
            try:
                await nc.jetstream().purge_stream(S.AEP_EVENTS, subject=session_filter(lane_token(a)))
            finally:
                await nc.close()

        got = run(sse_resume(relay, a, 0))  # still on the stream, outside the window
        assert got["comments"][1:] == [f"replay-exhausted {a} 0:5", "replay-complete"], got["comments"]
        run(evict())
        check(relay, a)
    finally:
        relay.stop()


# The bridge's positions: raw sequence x 1024 + the event's slot in its raw message.
P0, P1, P2 = 1 * 1024 + 512, 2 * 1024 + 512, 3 * 1024 + 512  # 1536, 2560, 3584


@pytest.mark.parametrize("restart", [False, True], ids=["relay-saw-them", "relay-started-after"])
def test_a_gap_between_raw_messages_is_not_exhaustion(nats_server, jetstream, tmp_path, restart):
    """Issue 39 item 3. Window 8: A's p0 and p1, then 7 events of other sessions, then A's p2.
    A client that saw p1 missed nothing: p2 follows p1 (the jump 2560 -> 3584 is the normal
    gap between two raw messages' events), so no `replay-exhausted`, although p2 is past
    p1 + 1 and p1 has left the window. A client that saw only p0 missed p1, which left the
    window: `replay-exhausted` with the earliest held position, p2. Whether the relay saw
    them live or started after (then it reads the stream)."""
    relay = RelayProcess(nats_server.url, tmp_path, env={"AEP_BRIDGE_RELAY_REPLAY_BUFFER": "8"})
    if not restart:
        relay.start()
    try:
        a = sid()
        run(publish(nats_server.url, [event(a, P0), event(a, P1)] + [event(sid(), 1) for _ in range(7)] + [event(a, P2)]))
        if restart:
            relay.start()
        got = run(sse_resume(relay, a, P1))
        assert got["comments"][1:] == ["replay-complete"], got["comments"]  # nothing missed: no marker
        assert [json.loads(e["data"])["seq"] for e in got["events"]] == [P2]
        got = run(sse_resume(relay, a, P0))  # p1 has left the window: missed
        assert got["comments"][1:] == [f"replay-exhausted {a} 0:{P2}", "replay-complete"], got["comments"]
        assert [json.loads(e["data"])["seq"] for e in got["events"]] == [P2]
        frames = run(ws_resume(relay, a, P1, [event(a, P2 + 1024)]))
        assert [f.get("type") for f in frames[1:]] == ["tool.called", "tool.called"]  # p2, then live: no marker
        frames = run(ws_resume(relay, a, P0, [event(a, P2 + 2048)]))
        assert frames[1] == exhausted(a, P2)
    finally:
        relay.stop()
