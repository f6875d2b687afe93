"""WebSocket clients of a relay under test (AEP-0003 §4): an emitter's hello, its first event,
an operator's command, a connection after its hello, the roster, the next frame."""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from tests.support.relay import CONSUMER, auth, encode, event


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
