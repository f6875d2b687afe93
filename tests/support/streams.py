"""Waiting on JetStream streams in tests, and reading what they hold."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import nats

from bridge.nats import streams as S

from tests.natsfixture import JetStreamClient


def count(client: JetStreamClient, stream: str) -> int:
    return client.stream_info(stream).state.messages


def quiet(client: JetStreamClient, stream: str, settle: float = 1.5, timeout: float = 60) -> int:
    """Wait until the stream stops growing; return its message count."""
    deadline = time.monotonic() + timeout
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        n = count(client, stream)
        if n != last:
            last, since = n, time.monotonic()
        elif time.monotonic() - since > settle and n > 0:
            return n
        time.sleep(0.2)
    raise AssertionError(f"{stream} did not settle within {timeout}s")


def consumer_idle(client: JetStreamClient, stream: str, durable: str) -> bool:
    """The durable consumer has taken and acked everything it matches so far: nothing left
    to deliver, nothing delivered and unacked (so nothing will be redelivered either)."""
    info = client.run(client.js.consumer_info(stream, durable))
    return info.num_pending == 0 and info.num_ack_pending == 0


#: a probe the redelivery tests publish to prove a duplicate window passed; stored_ids leaves it out
PROBE_SUBJECT = "bridge.mapped.0.window-probe"


async def stored_ids(js, stream: str = S.BRIDGE_MAPPED, subjects: str = "bridge.mapped.>",  # type: ignore[no-untyped-def]
                     probe: str = PROBE_SUBJECT, field: str = "id") -> list[tuple[str, Any]]:
    """(subject, event id) of every event in BRIDGE_MAPPED in stream order, the window probe
    left out (another stream, probe subject or event field when asked)."""
    sub = await js.pull_subscribe(subjects, stream=stream)
    out = []
    try:
        while True:
            try:
                msgs = await sub.fetch(256, timeout=0.3)
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                return out
            for m in msgs:
                if m.subject != probe:
                    out.append((m.subject, json.loads(m.data)[field]))
                await m.ack()
    finally:
        await sub.unsubscribe()


def on_scratch_stream(url: str, name: str, body, **stream_config) -> None:  # type: ignore[no-untyped-def]
    """Run ``await body(js, nc, stream, subject_prefix)`` on a fresh connection and a stream of
    its own (``<name>_<ns>`` on ``<name>_<ns>.>``, lower case), deleted afterwards."""
    async def main() -> None:
        nc = await nats.connect(url)
        js = nc.jetstream()
        stream = f"{name}_{time.time_ns()}"
        await js.add_stream(name=stream, subjects=[f"{stream.lower()}.>"], **stream_config)
        try:
            await body(js, nc, stream, stream.lower())
        finally:
            try:
                await js.delete_stream(stream)
            except Exception:
                pass
            await nc.close()

    asyncio.run(main())
