"""The activity metrics (bridge/runtime/activity.py) counted where pairing publishes to
AEP_EVENTS: the real `PairingService` on a real nats-server, mapped events of the issue-40
contract's shape on BRIDGE_MAPPED; its counters equal what the stream holds (model calls,
tokens, cost, durations, tools by outcome, approvals by choice, runs by outcome)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

import msgspec
import pytest

import nats
from bridge.core.aep import decode_event
from bridge.core.lanes import lane_token
from bridge.core.usage import Usage
from bridge.nats import streams as S
from bridge.nats import subjects as subj
from tests.support.api_calls import api_call, event
from tests.support.pairing_service import BOUND_S, bootstrapped, sample, service, until


@pytest.fixture
def url(nats_factory) -> str:  # type: ignore[no-untyped-def]
    return bootstrapped(nats_factory().url)


def turn(session: str, run: str, base_ns: int) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """One run: two model calls and an error, a tool that completes, one that fails, one denied, an approval."""
    where = {"instance": "gw-p", "session": session, "run": run}
    tool = lambda name, cid: {"tool": {"name": name, "call_id": cid}}  # noqa: E731
    specs = [
        ("run.started", {}, "pre_llm_call"),
        ("x.hermes.api.call", api_call(duration_ms=700, cost={"currency": "USD", "total": 0.25}, input=1000, output=40,
                                       cache_read=300), "post_api_request"),
        ("tool.requested", tool("terminal", f"{run}-t1"), "pre_tool_call"),
        ("tool.completed", tool("terminal", f"{run}-t1"), "post_tool_call"),
        ("tool.requested", tool("web", f"{run}-t2"), "pre_tool_call"),
        ("tool.failed", dict(tool("web", f"{run}-t2"), error={"type": "tool_error"}), "post_tool_call"),
        ("tool.requested", tool("rm", f"{run}-t3"), "pre_tool_call"),
        ("tool.denied", dict(tool("rm", f"{run}-t3"), by="policy"), "pre_tool_call"),
        ("attention.requested", {"kind": "permission", "prompt": "hermes requests permission"}, "pre_approval_request"),
        ("attention.answered", {"answer": {"option": "deny"}, "via": "oob"}, "post_approval_response"),
        ("x.hermes.api.call", api_call("other-model", duration_ms=2500, input=20, output=7, reasoning=5),
         "post_api_request"),
        ("x.hermes.api.error", {"gen_ai.request.model": "fake-model", "status_code": 500}, "api_request_error"),
        ("run.finished", {"gen_ai.usage.input_tokens": 1020, "gen_ai.usage.output_tokens": 47, "model_calls": 2},
         "post_llm_call"),
    ]
    out = []
    for i, (etype, data, hook) in enumerate(specs):
        ev = event(etype, **where, data=data)
        hints: dict[str, Any] = {"ts": base_ns + i * 1_000_000, "hook": hook}
        if etype.startswith("attention."):
            hints.update(session_key=session, pattern_key="rm -rf")
            ev["subject"] = "rm -rf"
        out.append((ev, hints))
    return out


async def publish_mapped(js: Any, items: list[tuple[dict[str, Any], dict[str, Any]]]) -> None:
    for ev, hints in items:
        subject = subj.mapped_subject(0, lane_token(ev["session"]))
        await js.publish(subject, msgspec.json.encode(ev),
                         headers={"Nats-Msg-Id": ev["id"], "Bridge-Hints": msgspec.json.encode(hints).decode()})


def test_pairing_counts_what_it_publishes(url: str) -> None:
    asyncio.run(asyncio.wait_for(scenario(url), BOUND_S))


async def scenario(url: str) -> None:
    nc = await nats.connect(url)
    js = nc.jetstream()
    svc = None
    try:
        base = time.time_ns()
        await publish_mapped(js, turn("sess-p1", "r1", base) + turn("sess-p2", "r1", base + 10**9))
        last = (await js.stream_info(S.BRIDGE_MAPPED)).state.last_seq
        svc = await service(url, "solo")
        await svc.maintain()
        part = svc.partitions[0]
        await until(lambda: part.position >= last)

        sub = await js.pull_subscribe(subj.events_filter(), stream=S.AEP_EVENTS)
        stored = [decode_event(m.data) for m in await sub.fetch(100, timeout=5)]
        types = Counter(e.type for e in stored)
        assert types["x.hermes.api.call"] == 4 and types["run.finished"] == 2, types

        m = lambda name, **labels: sample(svc, name, **labels)  # noqa: E731
        assert m("aep_bridge_model_calls_total", model="fake-model", outcome="ok") == 2
        assert m("aep_bridge_model_calls_total", model="other-model", outcome="ok") == 2
        assert m("aep_bridge_model_calls_total", model="fake-model", outcome="error") == types["x.hermes.api.error"] == 2
        assert m("aep_bridge_model_tokens_total", model="fake-model", kind="input") == 2000
        assert m("aep_bridge_model_tokens_total", model="fake-model", kind="cache_read") == 600
        assert m("aep_bridge_model_tokens_total", model="other-model", kind="reasoning") == 10
        assert m("aep_bridge_model_cost_total", model="fake-model", currency="USD") == 0.5
        assert m("aep_bridge_model_call_duration_seconds_sum", model="other-model") == 5.0
        assert m("aep_bridge_model_call_duration_seconds_bucket", model="fake-model", le="1.0") == 2
        for outcome in ("completed", "failed", "denied"):
            assert m("aep_bridge_tool_calls_total", outcome=outcome) == types[f"tool.{outcome}"] == 2, outcome
        assert m("aep_bridge_approvals_total", choice="deny") == types["attention.answered"] == 2
        assert m("aep_bridge_runs_total", outcome="finished") == 2

        # the same stream through `aep-bridge usage`'s sums: the metrics match them
        usage = Usage("model")
        for e in stored:
            usage.add(msgspec.to_builtins(e))
        for row in usage.rows():
            assert m("aep_bridge_model_calls_total", model=row["group"], outcome="ok") == row["calls"]
            assert m("aep_bridge_model_tokens_total", model=row["group"], kind="output") == row["output_tokens"]
    finally:
        if svc is not None:
            svc.stopper.trigger("test")
            for p in list(svc.partitions.values()):
                if p.task is not None:
                    await asyncio.wait([p.task], timeout=20)
            await svc.close()
        await nc.close()
