"""An approval's answer mapped long before its request (a mapper replica holding the request
through an outage) is not released unmatched: the ticks carry the mapper's floor (rule 3).

Cluster fault run (test_sigstop_one_node_for_20_s, 2026-12-07): mapper-0, on a SIGSTOPped node,
held raw messages 1984-2317 (the approval's request among them) for 20 s, retrying its publishes;
mapper-1 mapped the answer (raw 2112) at once. The ticks passed the answer's hold, it went out
``x.hermes.attention.unmatched``, and its request came 13 s later (``attention.resolved
{answered}``, no ``attention.answered``). Here the real mapper (in-process, on the real durable)
maps the answer and holds the request unacked, as the stopped replica did; the real pairing
service ticks every 0.3 s with a 1 s hold, for several holds; then the request is mapped."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from bridge.nats import streams as S
from tests.corpus import envelopes
from tests.natsfixture import JetStreamClient
from tests.support.services import raw_records, publish_all

HOLD_S = 1.0
TICK_S = 0.3


def approval_pair() -> list[dict[str, Any]]:
    es = envelopes()
    i = next(i for i, e in enumerate(es) if e["hook_event_name"] == "pre_approval_request"
             and es[i + 1]["hook_event_name"] == "post_approval_response"
             and es[i + 1]["extra"].get("turn_id") == e["extra"].get("turn_id"))
    return [es[i], es[i + 1]]


async def events_on(js: Any) -> list[dict[str, Any]]:
    info = await js.stream_info(S.AEP_EVENTS)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        try:
            out.append(json.loads((await js.get_msg(S.AEP_EVENTS, seq)).data))
        except Exception:
            pass
    return out


async def ticks_after(js: Any, after_ns: int) -> int:
    """Ticks in BRIDGE_MAPPED whose time is past ``after_ns``."""
    n = 0
    info = await js.stream_info(S.BRIDGE_MAPPED)
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        msg = await js.get_msg(S.BRIDGE_MAPPED, seq)
        if msg.subject.endswith(".__tick__") and json.loads(msg.data)["now"] > after_ns:
            n += 1
    return n


def test_an_answer_mapped_before_its_held_up_request_is_paired_not_released(nats_server_fn, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from prometheus_client import CollectorRegistry

    from bridge.config import Settings
    from bridge.core.ceiling import CapturePolicy
    from bridge.services import pairing as P
    from bridge.services.mapper import Mapper

    client = JetStreamClient(nats_server_fn.url)
    client.bootstrap()
    client.run(publish_all(client.js, raw_records(approval_pair(), instance="floor")))
    settings = Settings(nats_url=nats_server_fn.url, instance="p", pairing_hold_s=HOLD_S)

    async def run() -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, int]]:
        mapper = Mapper(settings, CapturePolicy())
        await mapper.connect()
        sub = await mapper.bind()
        request, answer = await sub.fetch(2, timeout=5)
        assert (request.metadata.sequence.stream, answer.metadata.sequence.stream) == (1, 2)
        pairing = P.PairingService(settings, replica="floor", registry=CollectorRegistry(), tick_s=TICK_S)
        await pairing.connect()
        loops = [asyncio.create_task(pairing.maintain_loop()), asyncio.create_task(pairing.tick_loop())]
        try:
            await mapper.process_batch([answer])  # mapped and acked; the request stays unacked (floor 0)
            start = time.time_ns()  # after the answer reached BRIDGE_MAPPED
            for _ in range(100):  # ticks well past the answer's hold (its arrival + 1 s)
                await asyncio.sleep(0.1)
                if await ticks_after(client.js, start + int(3 * HOLD_S * 1e9)) >= 2:
                    break
            assert await ticks_after(client.js, start + int(3 * HOLD_S * 1e9)) >= 2, "no ticks past the hold"
            await asyncio.sleep(2 * TICK_S)  # (the last tick read and folded)
            before = await events_on(client.js)
            await mapper.process_batch([request])  # the replica is back: the request, far past the hold
            after: list[dict[str, Any]] = before
            for _ in range(100):
                await asyncio.sleep(0.1)
                after = await events_on(client.js)
                if any(e["type"] == "attention.requested" for e in after) and len(after) >= 3:
                    break
            counters: dict[str, int] = {}
            for part in pairing.partitions.values():
                for k, v in part.state.counters.items():
                    counters[k] = counters.get(k, 0) + v
            return before, after, counters
        finally:
            pairing.stopper.trigger()
            for t in loops:
                await t
            await pairing.stop()
            await pairing.nc.close()
            await mapper.close()

    try:
        before, after, counters = client.run(run())
    finally:
        client.close()
    assert [e["type"] for e in before] == [], f"published before its request came: {before}"
    types = [e["type"] for e in after]
    assert "x.hermes.attention.unmatched" not in types, after
    assert types == ["attention.requested", "attention.answered", "attention.resolved"], after
    request, answer, resolved = after
    assert answer["subject"] == request["id"] and resolved["subject"] == request["id"]
    assert resolved["data"]["resolution"] == "answered"
    assert counters.get("floor.held_waits") == 1 and counters.get("floor.held_paired") == 1, counters


def test_the_floor_a_round_of_ticks_carries(nats_server_fn) -> None:  # type: ignore[no-untyped-def]
    """No mapper durable: no floor (the ticks as before). The durable's ack floor below a message
    taken and not acked; every message acked and none pending: the last delivered one. The epoch is
    HERMES_RAW's (the events' ``epoch``)."""
    from prometheus_client import CollectorRegistry

    from bridge.config import Settings
    from bridge.nats.lanes import epoch_of
    from bridge.services import pairing as P

    client = JetStreamClient(nats_server_fn.url)
    client.bootstrap()

    async def run() -> list[Any]:
        pairing = P.PairingService(Settings(nats_url=nats_server_fn.url, instance="p"), replica="f",
                                   registry=CollectorRegistry(), tick_s=3600)
        await pairing.connect()
        try:
            got: list[Any] = [await pairing.mapper_floor(), pairing.metrics.floor_unknown._value.get()]
            await publish_all(client.js, raw_records(approval_pair() * 2, instance="floor2"))
            await client.js.add_consumer(S.HERMES_RAW, config=S.mapper_consumer_config())
            sub = await client.js.pull_subscribe(S.RAW_SUBJECTS, durable=S.MAPPER_DURABLE, stream=S.HERMES_RAW)
            msgs = await sub.fetch(4, timeout=5)
            for m in msgs[1:]:
                await m.ack_sync()
            got.append(await pairing.mapper_floor())  # raw 1 unacked
            await msgs[0].ack_sync()
            got.append(await pairing.mapper_floor())
            got.append(epoch_of((await client.js.stream_info(S.HERMES_RAW)).created))
            return got
        finally:
            await pairing.nc.close()

    try:
        none, unknown, held_back, all_acked, epoch = client.run(run())
    finally:
        client.close()
    assert none is None and unknown == 1
    assert held_back == (epoch, 0)
    assert all_acked == (epoch, 4)
