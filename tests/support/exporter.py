"""AEP events straight into AEP_EVENTS, as pairing publishes them, and Kafka topic counts:
for exporter tests and benchmarks/bench_exporter.py."""

from __future__ import annotations

import asyncio
from typing import Any, Iterable

from bridge.core.aep import encode_event
from bridge.nats.subjects import events_subject, token
from tests.support.services import expected_events, raw_records


def aep_messages(envelopes: Iterable[dict[str, Any]], n: int | None = None, instance: str = "bench") -> list[tuple[str, bytes, str]]:
    """(subject aep.hermes.<lane>.<type>, body, event id) of the events the mapping makes of
    ``envelopes`` (the first ``n`` when given)."""
    raws = raw_records(envelopes, instance=instance)
    events = expected_events([(i + 1, body) for i, (_, body, _) in enumerate(raws)], epoch=0)
    out = []
    for e in events[:n] if n is not None else events:
        lane = e.session if isinstance(e.session, str) else "_"
        out.append((events_subject(token(lane), e.type), encode_event(e), e.id))
    return out


def sim_messages(n: int, seed: int = 1) -> list[tuple[str, bytes, str]]:
    """``n`` AEP events of bridge/sim's realistic sessions."""
    from bridge.sim.sessions import realistic_envelopes

    return aep_messages(realistic_envelopes(int(n * 1.1) + 100, seed=seed), n, instance=f"sim{seed}")


async def load(js: Any, msgs: list[tuple[str, bytes, str]]) -> None:
    futures = []
    for subject, body, eid in msgs:
        futures.append(await js.publish_async(subject, body, headers={"Nats-Msg-Id": eid}))
        if len(futures) >= 2048:
            await asyncio.gather(*futures)
            futures = []
    await asyncio.gather(*futures)


def topic_count(bootstrap: str, topic: str, partitions: int) -> int:
    """Messages in the topic now (the sum of its partitions' high watermarks)."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "aep-count", "enable.auto.commit": False})
    try:
        return sum(c.get_watermark_offsets(TopicPartition(topic, p), timeout=5)[1] for p in range(partitions))
    finally:
        c.close()
