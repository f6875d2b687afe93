"""A Hermes session's liveness (issue 25 item 5): a crashed Hermes session never sends its
on_session_finalize, and used to stay in the relay's roster (and take commands) for the
control bucket's 7-day TTL. A session with no raw message for the idle TTL
(AEP_BRIDGE_SESSION_IDLE_TTL_S, short here) leaves the live set; its next raw message brings
it back. The relay says the TTL in /.well-known/aep."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from bridge.commands.control import build_command
from bridge.core import control as C
from bridge.core.aep import encode_event
from tests.support.plane import Plane, new_session, start_plane, start_session, stop_plane
from tests.support.relay import CONSUMER, OPERATOR, RelayProcess, auth
from tests.support.services import wait_for
from tests.support.shim import envelope

IDLE_TTL_S = "3"
HELLO = {"type": "hello", "versions": ["0.1"], "role": "consumer", "identity": {"agent": "op-console"}}


@pytest.fixture(scope="module")
def idle_plane(nats_backend: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Plane, RelayProcess]]:
    if nats_backend == "external":
        pytest.skip("the control-plane tests start servers of their own")
    tmp = tmp_path_factory.mktemp("idle-plane")
    env = {"AEP_HERMES_CONTROL": "1", "AEP_BRIDGE_SESSION_IDLE_TTL_S": IDLE_TTL_S}
    plane, services = start_plane(nats_backend, tmp, env)
    relay = RelayProcess(plane.url, tmp, env={"AEP_BRIDGE_SESSION_IDLE_TTL_S": IDLE_TTL_S}).start()
    try:
        yield plane, relay
    finally:
        relay.stop()
        stop_plane(plane, services)


async def _roster(relay: RelayProcess) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as s:
        ws = await s.ws_connect(relay.ws_url, headers=auth(CONSUMER))
        await ws.send_json(HELLO)
        await ws.receive(timeout=5)
        await ws.send_json({"type": "roster", "id": "r"})
        return json.loads((await ws.receive(timeout=10)).data)["entries"]


def listed(relay: RelayProcess, session: str) -> bool:
    return any(e["session"] == session for e in asyncio.run(_roster(relay)))


async def _command(relay: RelayProcess, session: str) -> dict[str, Any]:
    cmd = encode_event(build_command(C.RESPOND, session, {"answer": {"option": "allow"}}, sender="idle-test",
                                     subject="req-none", command_id="IDLE1"))
    async with aiohttp.ClientSession() as s:
        ws = await s.ws_connect(relay.ws_url, headers=auth(OPERATOR))
        await ws.send_json(HELLO)
        await ws.receive(timeout=5)
        await ws.send_str(cmd.decode())
        return json.loads((await ws.receive(timeout=10)).data)


def test_a_session_silent_for_the_idle_ttl_leaves_the_live_set(idle_plane) -> None:
    plane, relay = idle_plane
    with urllib.request.urlopen(relay.url + "/.well-known/aep", timeout=5) as r:
        doc = json.loads(r.read())
    # vendor fields live under experimental (the roster object is the spec's)
    assert doc["capabilities"]["experimental"]["x-aep-bridge"]["session_idle_ttl_s"] == int(IDLE_TTL_S)

    session = new_session()
    start_session(plane, session)
    wait_for(lambda: listed(relay, session), 10, what="the new session in the roster")
    wait_for(lambda: not listed(relay, session), 30, what="the silent session to leave the roster")
    refused = asyncio.run(_command(relay, session))
    assert refused["type"] == "error" and refused["code"] == "no-route" and refused["cause"] == "IDLE1", refused
    plane.hook(envelope("pre_llm_call", session=session, turn_id=f"{session}:t:9"))  # it speaks again
    wait_for(lambda: listed(relay, session), 10, what="the session back in the roster")
