"""The relay's view of the gate (`Presence.gate_hello`), on a real nats-server with a hello
responder the test controls. Commands for a Hermes session are durable on AEP_EVENTS, so a
gate that is slow to answer its hello (busy, paused) still takes them: the relay keeps its
last answer for a grace. A gate that is gone (no responders) is gone at once, and a refusal
is not remembered longer than a second, so a restarted gate is routed to again quickly."""

from __future__ import annotations

import asyncio
import json

import nats

from bridge.nats.subjects import HELLO_SUBJECT
from bridge.services.relay import presence
from bridge.services.relay.config import RelayConfig
from bridge.services.relay.service import Relay

DOC = {"type": "hello", "capabilities": {"control": {"accepts": ["control.attention.respond"]}}}


def test_a_gate_slow_to_answer_keeps_its_last_hello_for_a_grace_and_a_gone_gate_is_gone(nats_server, monkeypatch):
    monkeypatch.setattr(presence, "HELLO_FRESH_S", 0.0)  # ask on every call
    monkeypatch.setattr(presence, "HELLO_NONE_S", 0.0)
    monkeypatch.setattr(presence, "HELLO_TIMEOUT_S", 0.2)
    answering = True

    async def go() -> None:
        nonlocal answering
        nc = await nats.connect(nats_server.url)

        async def respond(msg) -> None:  # type: ignore[no-untyped-def]
            if answering:
                await msg.respond(json.dumps(DOC).encode())

        sub = await nc.subscribe(HELLO_SUBJECT, cb=respond)
        await nc.flush()
        relay = Relay(RelayConfig(), js=None, nc=nc)
        try:
            assert await relay.presence.gate_hello() == DOC
            answering = False  # subscribed, silent: the request times out
            assert await relay.presence.gate_hello() == DOC, "a paused gate still takes durable commands"
            monkeypatch.setattr(presence, "HELLO_GRACE_S", 0.0)
            assert await relay.presence.gate_hello() is None, "past the grace a silent gate routes nothing"
            monkeypatch.setattr(presence, "HELLO_GRACE_S", 30.0)
            answering = True
            assert await relay.presence.gate_hello() == DOC, "a gate answering again is routed to"
            await sub.unsubscribe()
            await nc.flush()
            assert await relay.presence.gate_hello() is None, "no responders: no gate, whatever it said before"
        finally:
            await nc.close()

    asyncio.run(go())


def test_a_refusal_is_remembered_briefly_and_an_answer_longer(nats_server, monkeypatch):
    """With the real cache times: no gate is asked again after a second, a gate's answer
    is kept for seconds (one request per few seconds, not per command)."""
    asked = 0

    async def go() -> None:
        nonlocal asked
        nc = await nats.connect(nats_server.url)
        relay = Relay(RelayConfig(), js=None, nc=nc)
        try:
            assert await relay.presence.gate_hello() is None  # nobody listens yet

            async def respond(msg) -> None:  # type: ignore[no-untyped-def]
                nonlocal asked
                asked += 1
                await msg.respond(json.dumps(DOC).encode())

            await nc.subscribe(HELLO_SUBJECT, cb=respond)
            await nc.flush()
            await asyncio.sleep(presence.HELLO_NONE_S + 0.1)
            assert await relay.presence.gate_hello() == DOC, "a gate that came up is seen a second later"
            for _ in range(5):
                assert await relay.presence.gate_hello() == DOC
            assert asked == 1, "an answer is cached"
        finally:
            await nc.close()

    asyncio.run(go())
