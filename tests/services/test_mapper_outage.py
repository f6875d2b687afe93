"""A message whose publish meets an outage is retried, never dead-lettered.

Found by the cluster suite (`test_kill_9_the_leaders_in_turn`, a clean-clone run): while a
leader was killed, 11 well-formed raw messages met "no response from stream" (a 503: the
stream had no leader yet) on 5 deliveries in about 30 s, and the mapper dead-lettered them as
`max_deliver`. The verifier counted them as accounted for in the DLQ; only an approval whose
request was one of them showed it (`x.hermes.attention.unmatched`). An outage is not the
message's fault: the mapper naks it with a short delay for as long as the outage lasts, and
the consumer's own `max_deliver` is a backstop of over an hour of such retries.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import nats
import nats.errors
import nats.js.errors
import pytest
from prometheus_client import CollectorRegistry

from bridge.config import Settings
from bridge.core.ceiling import CapturePolicy
from bridge.nats import streams as S
from bridge.nats.bootstrap import bootstrap
from bridge.nats.connection import outage
from bridge.services.mapper import OUTAGE_RETRY_MAX_S, Mapper


class Msg:
    """What `retry_or_dead_letter` reads of a raw message, and what it does to it."""

    def __init__(self, delivered: int) -> None:
        self.metadata = SimpleNamespace(num_delivered=delivered, sequence=SimpleNamespace(stream=7))
        self.naks: list[float] = []
        self.acks = 0

    async def nak(self, delay: float | None = None) -> None:
        self.naks.append(delay or 0.0)

    async def ack(self) -> None:
        self.acks += 1


def mapper(registry: CollectorRegistry | None = None) -> Mapper:
    m = Mapper(Settings(nats_url="nats://127.0.0.1:1", instance="t"), CapturePolicy(), registry=registry or CollectorRegistry())
    m.letters = []  # type: ignore[attr-defined]

    async def dead_letter(msg: Any, reason: str, error: Any) -> asyncio.Future:
        m.letters.append(reason)  # type: ignore[attr-defined]
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut

    m.dead_letter = dead_letter  # type: ignore[method-assign]
    return m


OUTAGES = [nats.js.errors.NoStreamResponseError(), nats.errors.NoRespondersError(), nats.errors.TimeoutError(),
           TimeoutError("publish ack timed out"), nats.errors.ConnectionClosedError(),
           nats.errors.ConnectionReconnectingError(), nats.js.errors.ServiceUnavailableError()]


@pytest.mark.parametrize("error", OUTAGES, ids=lambda e: type(e).__name__)
def test_an_outage_past_max_deliver_is_retried_not_dead_lettered(error: BaseException) -> None:
    registry = CollectorRegistry()

    async def run() -> tuple[list[str], Msg]:
        m = mapper(registry)
        msg = Msg(delivered=S.MAPPER_MAX_DELIVER + 3)
        await m.retry_or_dead_letter(msg, error)
        return m.letters, msg  # type: ignore[attr-defined]

    letters, msg = asyncio.run(run())
    assert letters == [] and msg.acks == 0
    assert registry.get_sample_value("aep_bridge_mapper_outage_retries_total") == 1.0
    assert len(msg.naks) == 1 and 0 < msg.naks[0] <= OUTAGE_RETRY_MAX_S


def test_a_failure_of_the_message_itself_is_still_dead_lettered_at_max_deliver() -> None:
    async def run() -> tuple[list[str], Msg]:
        m = mapper()
        msg = Msg(delivered=S.MAPPER_MAX_DELIVER)
        await m.retry_or_dead_letter(msg, RuntimeError("a bug in mapping this message"))
        return m.letters, msg  # type: ignore[attr-defined]

    letters, msg = asyncio.run(run())
    assert letters == ["max_deliver"] and msg.acks == 1 and msg.naks == []


def test_outage_tells_an_election_from_a_refusal() -> None:
    assert all(outage(e) for e in OUTAGES)
    assert not outage(RuntimeError("boom"))
    assert not outage(nats.js.errors.APIError(code=400, err_code=10054, description="message size exceeds maximum"))
    assert not outage(nats.js.errors.ServiceUnavailableError(code=503, err_code=10039, description="jetstream not enabled"))
    # a full bucket or stream with discard-new, and insufficient resources: 503s about what was sent
    assert not outage(nats.js.errors.ServiceUnavailableError(code=503, err_code=10077, description="maximum bytes exceeded"))
    assert not outage(nats.js.errors.ServiceUnavailableError(code=503, err_code=10023, description="insufficient resources"))
    assert outage(nats.js.errors.ServiceUnavailableError(code=503, err_code=10008, description="JetStream system temporarily unavailable"))


def test_the_mapper_durable_drops_a_message_itself_only_as_a_backstop(nats_server_fn) -> None:  # type: ignore[no-untyped-def]
    """The consumer's max_deliver is the backstop (over an hour of outage retries), and a
    durable made by an older release (7) is brought to it when a mapper binds."""
    async def run() -> tuple[int, int]:
        nc = await nats.connect(nats_server_fn.url)
        js = nc.jetstream()
        await bootstrap(js, None, replicas=1)
        old = S.mapper_consumer_config()
        old.max_deliver = S.MAPPER_MAX_DELIVER + 2
        await js.add_consumer(S.HERMES_RAW, config=old)
        before = (await js.consumer_info(S.HERMES_RAW, S.MAPPER_DURABLE)).config.max_deliver
        m = Mapper(Settings(nats_url=nats_server_fn.url, instance="t"), CapturePolicy(), registry=CollectorRegistry())
        await m.connect()
        await m.bind()
        after = (await js.consumer_info(S.HERMES_RAW, S.MAPPER_DURABLE)).config.max_deliver
        await m.close()
        await nc.close()
        return before, after

    before, after = asyncio.run(run())
    assert before == S.MAPPER_MAX_DELIVER + 2
    assert after == S.MAPPER_MAX_DELIVER_BACKSTOP >= 720  # 5 s apart: an hour
