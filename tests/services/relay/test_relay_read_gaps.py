"""A history read of the relay that loses a delivery reads again; one it cannot complete says so.

The relay reads AEP_EVENTS' history (a resume's replay, a session's newest event before the
window, a command's recorded ack) with ephemeral consumers that take no acks, as pairing reads
its partitions: the server moves on once it has sent a message, so a delivery lost with a
connection or route torn down by a node's restart is never sent again. The read went on past
it and the replay was silently short one event; a fetch that timed out while events were
still counted ended the read as if it were complete. Issue 23's pairing fix
(`tests/services/test_pairing_gaps.py`) found the cause; the relay had the same reader.

Now a jump of the consumer sequence, or a read that stalls before its count, reads again from
the message after the last one taken (READ_AGAIN times), then raises `ReadIncomplete`: the
replay fails, and the relay ends the subscription, which its consumer resumes.
"""

from __future__ import annotations

import asyncio
from typing import Any

import nats
import pytest

from bridge.nats.bootstrap import bootstrap
from bridge.services.relay import hub as H

N = 40


class LossyJs:
    """The relay's JetStream context, whose pull consumers lose the deliveries of ``lose``
    (stream sequences) the first ``times`` times they are fetched."""

    def __init__(self, js: Any, lose: set[int], times: int = 1) -> None:
        self.js, self.lose, self.times = js, lose, times
        self.lost: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.js, name)

    async def pull_subscribe(self, *args: Any, **kwargs: Any) -> Any:
        psub = await self.js.pull_subscribe(*args, **kwargs)
        fetch = psub.fetch

        async def lossy_fetch(batch: int = 1, timeout: float = 5.0) -> list[Any]:
            msgs = await fetch(batch, timeout=timeout)
            kept = []
            for m in msgs:
                seq = m.metadata.sequence.stream
                if seq in self.lose and self.lost.count(seq) < self.times:
                    self.lost.append(seq)
                    continue
                kept.append(m)
            return kept

        psub.fetch = lossy_fetch
        return psub


def events(session: str) -> list[bytes]:
    return [(f'{{"aep":"0.1","id":"{session}-{i:04d}","type":"x.test.event","time":"2026-12-04T00:00:00Z",'
             f'"source":"aep://t/{session}","session":"{session}","seq":{i},"epoch":1}}').encode() for i in range(1, N + 1)]


async def stored(url: str, session: str) -> tuple[Any, list[int]]:
    nc = await nats.connect(url)
    js = nc.jetstream()
    await bootstrap(js, None, replicas=1)
    seqs = [(await js.publish(f"aep.hermes.{session}.x.test.event", body)).seq for body in events(session)]
    return nc, seqs


def read_all(url: str, session: str, times: int) -> tuple[list[int], list[int], list[int]]:
    async def run() -> tuple[list[int], list[int], list[int]]:
        nc, seqs = await stored(url, session)
        lossy = LossyJs(nc.jetstream(), {seqs[N // 2]}, times=times)
        hub = H.Hub(js=lossy, replay_buffer=1000)
        got: list[int] = []
        try:
            await hub._read(f"aep.hermes.{session}.>", seqs[0], seqs[-1], lambda it: got.append(it.seq))
        finally:
            await nc.close()
        return seqs, got, lossy.lost

    return asyncio.run(run())


def test_a_delivery_lost_in_a_history_read_is_read_again(nats_server) -> None:  # type: ignore[no-untyped-def]
    seqs, got, lost = read_all(nats_server.url, "gap-once", times=1)
    assert lost == [seqs[N // 2]], "the test lost one delivery"
    assert got == seqs, "every stored event, in order, none twice"


def test_a_read_that_keeps_losing_says_so(nats_server) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(H.ReadIncomplete):
        read_all(nats_server.url, "gap-always", times=100)


def test_a_replay_that_cannot_complete_ends_the_subscription(nats_server) -> None:  # type: ignore[no-untyped-def]
    """What the SSE and WebSocket doors see: `replay` raises, and the relay's `_replay` marks
    the subscription overflowed (ended, resumable), never a short replay that looks whole."""
    async def run() -> None:
        nc, seqs = await stored(nats_server.url, "gap-replay")
        hub = H.Hub(js=LossyJs(nc.jetstream(), {seqs[N // 2]}, times=100), replay_buffer=10_000)
        sub = H.Subscription(H.intern_filter({"session": "gap-replay"}))
        sub.replaying = True
        try:
            with pytest.raises(H.ReadIncomplete):
                await hub.replay(sub, [("gap-replay", 1, 0)], lambda e: None)
        finally:
            await nc.close()

    asyncio.run(run())


def test_the_newest_of_each_subject_is_read_again_from_the_start(nats_server) -> None:  # type: ignore[no-untyped-def]
    """`_newest_before`'s read (the last event of each subject) has no sequence to go on from:
    a lost delivery reads it all again (its `take` keeps the highest position)."""
    async def run() -> tuple[list[int], list[int], list[int]]:
        nc, seqs = await stored(nats_server.url, "gap-newest")
        lossy = LossyJs(nc.jetstream(), {seqs[-1]}, times=1)  # one subject: its last event is all it reads
        got: list[int] = []
        try:
            await H.Hub(js=lossy, replay_buffer=1000)._read("aep.hermes.gap-newest.>", seqs[0], seqs[-1],
                                                            lambda it: got.append(it.seq), last_per_subject=True)
        finally:
            await nc.close()
        return seqs, got, lossy.lost

    seqs, got, lost = asyncio.run(run())
    assert lost == [seqs[-1]] and got == [seqs[-1]]


def test_a_failed_replay_ends_the_subscription_as_such_not_as_backpressure() -> None:
    """The relay's `_replay`: the subscription ends with reason "replay-failed" (the WebSocket's
    closing frame says it; the slow-consumer counter does not count it)."""
    from bridge.services.relay.config import RelayConfig
    from bridge.services.relay.service import Relay

    async def run() -> tuple[Any, Any]:
        relay = Relay(RelayConfig(), js=None, nc=None)

        async def failing(sub: Any, start: Any, exhausted: Any) -> None:
            raise H.ReadIncomplete("lost")

        relay.hub.replay = failing  # type: ignore[method-assign]
        sub = H.Subscription(H.intern_filter({}))
        await relay._replay(sub, "all", lambda e: None)
        return sub, relay.metrics

    sub, metrics = asyncio.run(run())
    assert sub.overflowed and sub.end_reason == "replay-failed"
    assert metrics.registry.get_sample_value("aep_bridge_relay_replay_failures_total") == 1.0
    assert metrics.registry.get_sample_value("aep_bridge_relay_backpressure_disconnects_total") == 0.0
