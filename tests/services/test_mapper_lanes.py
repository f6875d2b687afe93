"""A session-less event racing its session's first event across mapper replicas.

An approval (`session_id: ""`) names its session in its `turn_id` prefix: it is filed
there at once, whatever the KV holds (issue 17). A tool called inside `execute_code`
carries only `task_id`; its lane is a task alias "already seen", i.e. seen EARLIER IN
HERMES_RAW. With two replicas, the replica holding the session's first event may not
have written the alias to the lanes KV yet when the other one maps the inner call. The
test plays that slow replica itself: it takes the first raw message from the shared
durable consumer and holds it, unacked, while a real `Mapper` maps the second one. For
an inner call the mapper must wait for it (the consumer's ack floor), not file the call
under `unknown`; and when the holder never answers, give up after its bounded wait and
say so in its metrics. An approval never waits.
"""

from __future__ import annotations

import asyncio
import json

import nats
from prometheus_client import CollectorRegistry

from bridge.config import Settings
from bridge.core.ceiling import CapturePolicy
from bridge.core.lanes import lane_token
from bridge.nats import streams as S
from bridge.nats.bootstrap import bootstrap
from bridge.services.mapper import Mapper
from tests.support.lanes import SESSION, TASK, envelopes
from tests.support.services import publish_all, raw_records


async def mapped_events(js, timeout: float = 0.3) -> list[dict]:
    sub = await js.pull_subscribe("bridge.mapped.>", stream=S.BRIDGE_MAPPED)
    out: list[dict] = []
    try:
        while True:
            try:
                msgs = await sub.fetch(64, timeout=timeout)
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                return out
            for m in msgs:
                out.append(json.loads(m.data))
                await m.ack()
    finally:
        await sub.unsubscribe()


async def race(url: str, lane_wait_ms: int, holder_answers: bool, second: str = "inner") -> tuple[list[dict], Mapper]:
    nc = await nats.connect(url)
    js = nc.jetstream()
    await bootstrap(js, None, replicas=1)
    await publish_all(js, raw_records(envelopes(second), instance="race"))
    # The "slow replica": the session's first event, taken from the mappers' shared consumer and held.
    slow = await js.pull_subscribe(S.RAW_SUBJECTS, durable=S.MAPPER_DURABLE, stream=S.HERMES_RAW,
                                   config=S.mapper_consumer_config())
    [held] = await slow.fetch(1, timeout=5)
    assert json.loads(held.data)["envelope"]["hook_event_name"] == "pre_llm_call"

    settings = Settings(nats_url=url, instance="m-race", lane_wait_ms=lane_wait_ms)
    mapper = Mapper(settings, CapturePolicy(), registry=CollectorRegistry())
    await mapper.connect()
    sub = await mapper.bind()
    [second_msg] = await sub.fetch(1, timeout=5)  # the only message not held
    batch = asyncio.create_task(mapper.process_batch([second_msg]))
    if holder_answers:
        # The mapper read the consumer's ack floor twice: it saw the earlier message unsettled
        # and looked again (a call filed at once would have finished without a second read).
        for _ in range(1000):
            if batch.done() or counter(mapper, "aep_bridge_mapper_ack_floor_reads_total") >= 2:
                break
            await asyncio.sleep(0.01)
        assert not batch.done(), "the inner call must wait for the earlier raw message, not be filed at once"
        assert counter(mapper, "aep_bridge_mapper_ack_floor_reads_total") >= 2, "the mapper never read the ack floor"
        # The slow replica finishes: it learns the session and its task (KV), then acks, as the mapper does.
        kv = await js.key_value(S.LANES_BUCKET)
        await kv.put("s." + lane_token(SESSION), b"1")
        await kv.put("t." + lane_token(TASK), SESSION.encode())
        await held.ack_sync()
    await asyncio.wait_for(batch, timeout=30)
    events = await mapped_events(js)
    await mapper.close()
    await nc.close()
    return events, mapper


def counter(mapper: Mapper, name: str) -> float:
    return mapper.registry.get_sample_value(name) or 0.0


def test_an_approval_is_filed_under_its_turn_id_session_at_once_while_its_session_is_held_elsewhere(nats_server_fn):
    """Issue 17: the replica holding the session's first event never answers (as after a kill -9),
    and the lane wait is long: the approval still lands on its session at once, with no wait."""
    events, mapper = asyncio.run(race(nats_server_fn.url, lane_wait_ms=30_000, holder_answers=False, second="approval"))
    [requested] = [e for e in events if e["type"] == "attention.requested"]
    assert requested["session"] == SESSION and "lane" not in requested
    assert counter(mapper, "aep_bridge_mapper_lane_waits_total") == 0
    assert counter(mapper, "aep_bridge_mapper_unknown_lane_total") == 0


def test_an_inner_call_waits_for_its_task_alias_mapped_by_another_replica(nats_server_fn):
    events, mapper = asyncio.run(race(nats_server_fn.url, lane_wait_ms=30_000, holder_answers=True))
    [requested] = [e for e in events if e["type"] == "tool.requested"]
    assert requested["session"] == SESSION and "lane" not in requested
    assert counter(mapper, "aep_bridge_mapper_lane_waits_total") == 1
    assert counter(mapper, "aep_bridge_mapper_lane_wait_timeouts_total") == 0
    assert counter(mapper, "aep_bridge_mapper_unknown_lane_total") == 0


def test_the_wait_is_bounded_when_the_earlier_message_never_settles(nats_server_fn):
    events, mapper = asyncio.run(race(nats_server_fn.url, lane_wait_ms=200, holder_answers=False))
    [requested] = [e for e in events if e["type"] == "tool.requested"]
    assert requested["session"] == "unknown" and requested["lane"] == "unknown"
    assert counter(mapper, "aep_bridge_mapper_lane_wait_timeouts_total") == 1
    assert counter(mapper, "aep_bridge_mapper_unknown_lane_total") >= 1


def test_the_lane_caches_are_bounded_to_a_working_set(nats_server_fn):
    """The mapper's lane cache and its negative cache stop at their bounds however many
    sessions a fleet starts (issue 8: at 100,000 entries they grew the mapper for ~26 min)."""
    from bridge.core.lanes import Learned
    from bridge.core.mapping import MapResult
    from bridge.nats import lanes as L
    from bridge.nats.publish import AckPublisher

    async def run() -> tuple[int, int, int, int]:
        nc = await nats.connect(nats_server_fn.url)
        js = nc.jetstream()
        await bootstrap(js, None, replicas=1)
        lanes = L.KvLanes(await js.key_value(S.LANES_BUCKET))
        publisher = await AckPublisher(nc).start()
        n = L.LANE_CACHE_ENTRIES + 2000
        for i in range(n):
            result = MapResult(events=[], lane=f"s{i}", learned=Learned(session=f"s{i}", task_id=f"t{i}"))
            futures = await lanes.learn(result, publisher.publish)
            if i % 1000 == 999:
                await asyncio.gather(*futures)
        for i in range(L.NEGATIVE_MAX + 500):
            assert await lanes._get(f"s.never-{i}") is None
        kv_has_oldest = (await lanes.kv.get("s.s0")).value == b"1"
        await nc.close()
        return len(lanes.cache.sessions), len(lanes.cache.tasks), len(lanes._missing), int(kv_has_oldest)

    sessions, tasks, missing, kv_has_oldest = asyncio.run(run())
    assert sessions == tasks == 8192
    # Misses also expire after NEGATIVE_TTL_S, so on a slow machine fewer than the cap remain.
    assert 0 < missing <= L.NEGATIVE_MAX
    assert kv_has_oldest, "what the cache forgets stays in the KV bucket"


def test_silent_instances_are_forgotten_by_the_last_seen_gauge() -> None:
    """Per-instance series must not grow forever with a churning fleet: an instance silent for
    INSTANCE_FORGET_S loses its series; one still talking keeps it."""
    from bridge.services.mapper import INSTANCE_FORGET_S, MapperMetrics

    registry = CollectorRegistry()
    m = MapperMetrics(registry)
    name = "aep_bridge_mapper_hermes_instance_last_seen_timestamp_seconds"
    for i in range(100):
        m.instance_seen(f"gw-{i}", 1_764_000_000.0 + i, now=1000.0)
    m.instance_seen("gw-0", 1_764_000_500.0, now=1000.0 + INSTANCE_FORGET_S - 10)
    assert m.forget_silent_instances(1000.0 + INSTANCE_FORGET_S - 5) == []  # nobody silent long enough
    assert m.forget_silent_instances(1000.0 + INSTANCE_FORGET_S + 1) == []  # checked at most once a minute
    gone = m.forget_silent_instances(1000.0 + INSTANCE_FORGET_S + 61)
    assert sorted(gone) == sorted(f"gw-{i}" for i in range(1, 100))
    assert registry.get_sample_value(name, {"hermes_instance": "gw-0"}) == 1_764_000_500.0
    assert registry.get_sample_value(name, {"hermes_instance": "gw-1"}) is None
    m.instance_seen("gw-1", 1_764_001_000.0, now=1000.0 + INSTANCE_FORGET_S + 70)  # back: a new series
    assert registry.get_sample_value(name, {"hermes_instance": "gw-1"}) == 1_764_001_000.0


def test_one_replica_never_asks_the_server_for_the_floor_it_moved_itself(nats_server_fn):
    """A replica knows the messages it finished: with one replica every earlier raw message is
    its own, so a lane wait is settled without a consumer-info round trip (bench_mapper paid
    2,061 of them per 50,000 messages: session-less events whose session is never seen). The
    answer is the same: each inner call of an unseen task in `unknown`, each of a seen one on it."""
    sessions = [f"20261201_1010{i:02d}_abcdef" for i in range(40)]
    envs = []
    for i, sid in enumerate(sessions):
        start, inner = envelopes("inner")
        start = {**start, "session_id": sid, "extra": {**start["extra"], "task_id": f"task-{i}"}}
        # every other inner call names a task nobody started: it waits, then goes to unknown
        task = f"task-{i}" if i % 2 else f"gone_{i}"
        inner = {**inner, "extra": {**inner["extra"], "task_id": task}}
        envs += [start, inner]

    async def run() -> tuple[list[dict], Mapper]:
        nc = await nats.connect(nats_server_fn.url)
        js = nc.jetstream()
        await bootstrap(js, None, replicas=1)
        await publish_all(js, raw_records(envs, instance="solo"))
        mapper = Mapper(Settings(nats_url=nats_server_fn.url, instance="m-solo", lane_wait_ms=2000), CapturePolicy(),
                        registry=CollectorRegistry())
        await mapper.connect()
        sub = await mapper.bind()
        done = 0
        while done < len(envs):
            msgs = await sub.fetch(5, timeout=5)  # small batches: most earlier messages are in an earlier one
            await mapper.process_batch(msgs)
            done += len(msgs)
        events = await mapped_events(js)
        await mapper.close()
        await nc.close()
        return events, mapper

    events, mapper = asyncio.run(run())
    requested = sorted(e["session"] for e in events if e["type"] == "tool.requested")
    assert requested == sorted(["unknown"] * 20 + sessions[1::2])
    assert counter(mapper, "aep_bridge_mapper_lane_waits_total") == 20
    assert counter(mapper, "aep_bridge_mapper_ack_floor_reads_total") == 0
    assert counter(mapper, "aep_bridge_mapper_lane_wait_timeouts_total") == 0
