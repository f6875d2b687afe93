"""The mapper's per-message histograms, now filled once per batch (`observe_many`, issue 24):
one mapping time per raw message mapped, one receive -> mapped time per raw message acked, and
the events on the subjects `map` gives (the subject looked up once per lane)."""

from __future__ import annotations

import asyncio
import json

import nats
from prometheus_client import CollectorRegistry

from bridge.config import Settings
from bridge.core.ceiling import CapturePolicy
from bridge.core.lanes import event_lane_token, partition_of
from bridge.nats import streams as S
from bridge.nats import subjects as subj
from bridge.nats.bootstrap import bootstrap
from bridge.nats.pull import Puller
from bridge.services.mapper import Mapper
from tests.corpus import records
from tests.support.services import publish_all, raw_records


async def run(url: str, envelopes: list[dict], settings: Settings | None = None) -> tuple[Mapper, dict[str, tuple[str, dict]]]:
    nc = await nats.connect(url)
    js = nc.jetstream()
    await bootstrap(js, None, replicas=1)
    await publish_all(js, raw_records(envelopes, instance="metrics"))
    mapper = Mapper(settings or Settings(nats_url=url, instance="m-metrics"), CapturePolicy(), registry=CollectorRegistry())
    await mapper.connect()
    puller, done = Puller(await mapper.bind()), 0
    while done < len(envelopes):
        msgs = await puller.fetch(16, timeout=5)  # several batches
        await mapper.process_batch(msgs)
        done += len(msgs)
    subjects: dict[str, tuple[str, dict]] = {}
    sub = await js.pull_subscribe("bridge.mapped.>", stream=S.BRIDGE_MAPPED)
    try:
        while True:
            try:
                got = await sub.fetch(256, timeout=0.5)
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                break
            for m in got:
                event = json.loads(m.data)
                subjects[event["id"]] = (m.subject, event)
    finally:
        await nc.close()
        await mapper.close()
    return mapper, subjects


def test_each_raw_message_is_counted_once_in_each_histogram_and_filed_on_its_lane(nats_server_fn):
    envelopes = [r["envelope"] for r in records()][:120]
    mapper, subjects = asyncio.run(run(nats_server_fn.url, envelopes))
    value = mapper.registry.get_sample_value
    assert value("aep_bridge_mapper_latency_seconds_count") == len(envelopes)
    assert value("aep_bridge_mapper_receive_to_mapped_seconds_count") == len(envelopes)
    assert 0 < value("aep_bridge_mapper_latency_seconds_sum") < len(envelopes)  # seconds, not ns
    assert value("aep_bridge_mapper_receive_to_mapped_seconds_bucket", {"le": "+Inf"}) == len(envelopes)
    assert subjects, "nothing mapped"
    # Each event on its own lane's subject (the subject cached per lane is the one for that lane).
    for event_id, (subject, event) in subjects.items():
        unknown = event.get("lane") == "unknown"
        token = event_lane_token(event["session"], unknown)
        assert subject == subj.mapped_subject(partition_of(token, mapper.settings.partitions), token), event_id
    assert len({s for s, _ in subjects.values()}) > 1


def test_unpriced_models_and_bad_counts_are_counted_and_the_calls_flow(nats_server_fn, tmp_path):
    """Issue 40: with a price table, a call of a model it does not name has no cost and counts
    aep_bridge_model_unpriced_total{model}; a bad token count is left out and counts
    aep_bridge_usage_invalid_total{field}; every call is still mapped."""
    import copy
    from pathlib import Path

    calls = [r["envelope"] for r in records() if r["envelope"]["hook_event_name"] == "post_api_request"][:3]
    other, bad, fine = (copy.deepcopy(c) for c in calls)
    other["extra"]["model"] = other["extra"]["response_model"] = "mystery-model"
    bad["extra"]["usage"]["output_tokens"] = -5
    table = Path(__file__).resolve().parents[1] / "fixtures" / "prices.yaml"
    settings = Settings(nats_url=nats_server_fn.url, instance="m-metrics", price_table=str(table))
    mapper, subjects = asyncio.run(run(nats_server_fn.url, [other, bad, fine], settings))
    value = mapper.registry.get_sample_value
    assert value("aep_bridge_model_unpriced_total", {"model": "mystery-model"}) == 1
    assert value("aep_bridge_usage_invalid_total", {"field": "output_tokens"}) == 1
    events = sorted((e for _, e in subjects.values()), key=lambda e: e["seq"])
    assert [e["type"] for e in events] == ["x.hermes.api.call"] * 3
    assert "cost" not in events[0]["data"] and events[0]["data"]["gen_ai.request.model"] == "mystery-model"
    assert "cost" not in events[1]["data"] and "gen_ai.usage.output_tokens" not in events[1]["data"]
    assert events[2]["data"]["cost"]["currency"] == "USD"
