"""Two relay replicas (two processes, two listen ports, one nats-server) behind one Service
(issue 25 item 4): a WebSocket emitter's claims are shared through the KV bucket aep_relay
(renewed while its socket lives, with a per-message TTL), and a command reaching the replica
without the claim is routed to the one holding it; the official SDK's ControlClient gets
exactly one ack from either replica. Claims end when the socket goes: at once when it
closes, within the claim TTL when its replica dies."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

import aep_sdk  # the official SDK (test extra: agenteventprotocol-sdk)
import aiohttp
import pytest

from tests.support.relay_ws import connect, emitter_hello, next_frame, roster, started
from tests.support.relay import EMITTER, OPERATOR, RelayProcess, encode, event
from tests.support.services import wait_for

CLAIM_TTL_S = "4"


@pytest.fixture
def replicas(nats_server, jetstream, tmp_path):  # type: ignore[no-untyped-def]
    env = {"AEP_BRIDGE_RELAY_CLAIM_TTL_S": CLAIM_TTL_S}
    a = RelayProcess(nats_server.url, tmp_path, env=env).start()
    b = RelayProcess(nats_server.url, tmp_path, env=env).start()
    try:
        yield a, b
    finally:
        a.stop()
        b.stop()


def sdk_send(relay: RelayProcess, session: str) -> tuple[dict[str, Any] | None, list[dict[str, Any]], str | None]:
    """The SDK's ControlClient on ``relay`` sends one command to ``session``: (its ack or
    None, every ack frame the client's connection received for it, the NackError's reason
    and detail)."""
    client = aep_sdk.ControlClient(relay.url, agent="sdk-operator",
                                   host="test-host", token=OPERATOR)
    client.connect()
    frames: list[dict[str, Any]] = []
    recv = client._duplex.recv_json  # type: ignore[union-attr]

    def recording() -> Any:
        msg = recv()
        if isinstance(msg, dict):
            frames.append(msg)
        return msg

    client._duplex.recv_json = recording  # type: ignore[union-attr]
    ack, reason = None, None
    try:
        ack = client.send("control.attention.respond", session, subject="req-1", data={"answer": {"option": "allow"}},
                          ack_window_ms=5_000, retries=0)
    except aep_sdk.NackError as exc:
        reason = f"{exc.reason}: {exc.detail}"  # the relay's codes outside the nack reasons: "invalid: <code>: ..."
    finally:
        time.sleep(0.5)  # a second ack, if one were sent, arrives meanwhile
        client.close()
    return ack, [f for f in frames if f.get("type") in ("control.accepted", "control.rejected")], reason


async def answering_emitter(s: aiohttp.ClientSession, relay: RelayProcess, session: str) -> tuple[Any, asyncio.Task]:
    """An emitter on ``relay`` claiming ``session``, answering every command with control.accepted."""
    ws = await connect(s, relay, emitter_hello("claimant"), EMITTER)
    await ws.send_str(encode(started(session)).decode())

    async def answer() -> None:
        n = 0
        while True:
            frame = await next_frame(ws, timeout=60)
            if frame.get("type") == "control.attention.respond":
                n += 1
                ack = {**event(session, 100 + n, "control.accepted", data={}), "agent": "claimant",
                       "cause": frame["id"], "id": f"ack-{frame['id']}"}
                await ws.send_str(encode(ack).decode())

    return ws, asyncio.create_task(answer())


async def listed(s: aiohttp.ClientSession, relay: RelayProcess, session: str) -> list[dict[str, Any]]:
    return [e for e in await roster(s, relay) if e["session"] == session]


async def until_listed(s: aiohttp.ClientSession, relay: RelayProcess, session: str, present: bool = True) -> None:
    """Until ``relay``'s roster lists ``session`` (or, ``present`` False, no longer does): at
    most 10 s; the caller asserts what it then sees."""
    for _ in range(100):
        if bool(await listed(s, relay, session)) == present:
            return
        await asyncio.sleep(0.1)


def test_a_command_reaches_the_claim_held_by_the_other_replica_once(replicas) -> None:
    a, b = replicas
    session = "r" + uuid.uuid4().hex[:10]

    async def go() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with aiohttp.ClientSession() as s:
            ws, task = await answering_emitter(s, a, session)
            await until_listed(s, b, session)
            out["roster_b"] = await listed(s, b, session)
            out["roster_a"] = await listed(s, a, session)
            out["via_b"] = await asyncio.to_thread(sdk_send, b, session)
            out["via_a"] = await asyncio.to_thread(sdk_send, a, session)
            await asyncio.sleep(2 * float(CLAIM_TTL_S))  # past the TTL: renewed while the socket lives
            out["renewed"] = await listed(s, b, session)
            task.cancel()
            await ws.close()
            await until_listed(s, b, session, present=False)
            out["after_b"] = await listed(s, b, session)
            out["after_send"] = await asyncio.to_thread(sdk_send, b, session)
        return out

    out = asyncio.run(go())
    entry = {"session": session, "agent": "claimant", "instance": "host-a/1",
             "control": {"accepts": ["control.attention.respond"], "ack_window_ms": 10_000}, "emits": ["session"]}
    assert out["roster_b"] == [entry] and out["roster_a"] == [entry]  # one claim, listed once by each replica
    for via in ("via_b", "via_a"):
        ack, acks, reason = out[via]
        assert reason is None and ack is not None and ack["type"] == "control.accepted", (via, out[via])
        assert len(acks) == 1 and acks[0]["cause"] == ack["cause"], (via, acks)  # exactly one ack
    assert out["renewed"] == [entry]
    assert out["after_b"] == []  # the socket closed: the shared claim went with it
    assert "no-route" in str(out["after_send"][2]), out["after_send"]


def test_a_claim_of_a_dead_replica_expires_with_its_ttl(replicas) -> None:
    a, b = replicas
    session = "r" + uuid.uuid4().hex[:10]

    async def claimed() -> list[dict[str, Any]]:
        async with aiohttp.ClientSession() as s:
            ws, task = await answering_emitter(s, a, session)
            await until_listed(s, b, session)
            before = await listed(s, b, session)
            a.stop(kill=True)  # no clean release: only the TTL ends the claim
            task.cancel()
            return before

    async def gone() -> bool:
        async with aiohttp.ClientSession() as s:
            return not await listed(s, b, session)

    assert len(asyncio.run(claimed())) == 1
    wait_for(lambda: asyncio.run(gone()), timeout=30, what="the dead replica's claim expired")
    assert json.dumps(asyncio.run(roster_b(b))).count(session) == 0


async def roster_b(b: RelayProcess) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as s:
        return await roster(s, b)
