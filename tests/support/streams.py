"""Waiting on JetStream streams in tests."""

from __future__ import annotations

import time

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
