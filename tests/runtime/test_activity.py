"""`ActivityMetrics`: what the fleet does and spends, counted from published events of the
issue-40 contract's shape (docs/notes: x.hermes.api.call with flat `gen_ai.usage.*`)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from bridge.core.aep import Event
from bridge.runtime import ActivityMetrics
from bridge.runtime.activity import MAX_MODELS, MODEL_LABEL_LEN


def event(etype: str, data: dict[str, Any] | None = None, n: int = 0) -> Event:
    return Event(aep="0.1", id=f"01JTEST{n:019d}", type=etype, time="2026-12-07T02:00:00Z", source="hermes://gw/s",
                 agent="hermes", session="s1", run="s1:r1", seq=n, capture="metadata",
                 **({"data": data} if data is not None else {}))


def api_call(model: str | None, n: int = 0, **members: Any) -> Event:
    data: dict[str, Any] = {"gen_ai.provider.name": "fake", "api_mode": "chat_completions", "call_index": 1}
    if model is not None:
        data["gen_ai.request.model"] = model
    data.update(members)
    return event("x.hermes.api.call", data, n)


def value(reg: CollectorRegistry, name: str, **labels: str) -> float | None:
    return reg.get_sample_value(name, labels)


def test_model_calls_tokens_duration_and_cost_by_model() -> None:
    reg = CollectorRegistry()
    m = ActivityMetrics(reg)
    m.seen(api_call("fake-model", 1, **{
        "gen_ai.response.model": "fake-model-2026", "duration_ms": 1200, "finish_reason": "stop",
        "gen_ai.usage.input_tokens": 1000, "gen_ai.usage.output_tokens": 50,
        "gen_ai.usage.cache_read.input_tokens": 400, "gen_ai.usage.cache_creation.input_tokens": 100,
        "gen_ai.usage.reasoning.output_tokens": 20,
        "cost": {"currency": "USD", "total": 0.0031, "prompt": 0.0025, "completion": 0.0005},
    }))
    m.seen(api_call("fake-model", 2, **{"duration_ms": 300, "gen_ai.usage.input_tokens": 7,
                                        "cost": {"currency": "USD", "total": 0.5}}))
    m.seen(api_call(None, 3, **{"gen_ai.response.model": "served-model", "gen_ai.usage.output_tokens": 9}))
    m.seen(event("x.hermes.api.error", {"gen_ai.request.model": "fake-model", "status_code": 429, "duration_ms": 80}, 4))
    m.seen(event("x.hermes.api.error", {"status_code": 500}, 5))

    assert value(reg, "aep_bridge_model_calls_total", model="fake-model", outcome="ok") == 2
    assert value(reg, "aep_bridge_model_calls_total", model="fake-model", outcome="error") == 1
    assert value(reg, "aep_bridge_model_calls_total", model="served-model", outcome="ok") == 1
    assert value(reg, "aep_bridge_model_calls_total", model="unknown", outcome="error") == 1
    tokens = {k: value(reg, "aep_bridge_model_tokens_total", model="fake-model", kind=k)
              for k in ("input", "output", "cache_read", "cache_write", "reasoning")}
    assert tokens == {"input": 1007, "output": 50, "cache_read": 400, "cache_write": 100, "reasoning": 20}
    assert value(reg, "aep_bridge_model_tokens_total", model="served-model", kind="output") == 9
    assert value(reg, "aep_bridge_model_call_duration_seconds_count", model="fake-model") == 2
    assert value(reg, "aep_bridge_model_call_duration_seconds_sum", model="fake-model") == 1.5
    assert value(reg, "aep_bridge_model_call_duration_seconds_bucket", model="fake-model", le="0.5") == 1
    assert value(reg, "aep_bridge_model_call_duration_seconds_bucket", model="fake-model", le="2.0") == 2
    # an error's duration is not a model's answer time
    assert value(reg, "aep_bridge_model_call_duration_seconds_count", model="unknown") is None
    assert value(reg, "aep_bridge_model_cost_total", model="fake-model", currency="USD") == 0.5031


def test_bad_members_are_not_counted_and_the_rest_is() -> None:
    reg = CollectorRegistry()
    m = ActivityMetrics(reg)
    m.seen(api_call("m", 1, **{"gen_ai.usage.input_tokens": -5, "gen_ai.usage.output_tokens": True,
                               "gen_ai.usage.reasoning.output_tokens": "12", "duration_ms": float("nan"),
                               "gen_ai.usage.cache_read.input_tokens": 2**60, "cost": {"total": 3.0},
                               "gen_ai.usage.cache_creation.input_tokens": 4}))
    m.seen(api_call("m", 2, cost={"currency": "USD", "total": -1}))
    m.seen(event("x.hermes.api.call", None, 3))  # no payload at all (capture none)
    assert value(reg, "aep_bridge_model_calls_total", model="m", outcome="ok") == 2
    assert value(reg, "aep_bridge_model_calls_total", model="unknown", outcome="ok") == 1
    assert value(reg, "aep_bridge_model_tokens_total", model="m", kind="cache_write") == 4
    for kind in ("input", "output", "reasoning", "cache_read"):
        assert value(reg, "aep_bridge_model_tokens_total", model="m", kind=kind) is None, kind
    assert value(reg, "aep_bridge_model_call_duration_seconds_count", model="m") is None
    assert "aep_bridge_model_cost_total{" not in generate_latest(reg).decode()


def test_the_model_label_is_bounded_in_number_and_length() -> None:
    reg = CollectorRegistry()
    m = ActivityMetrics(reg)
    for i in range(MAX_MODELS + 30):
        m.seen(api_call(f"model-{i}", i, **{"gen_ai.usage.input_tokens": 1}))
    m.seen(api_call("x" * 500, 900, **{"gen_ai.usage.input_tokens": 1}))
    m.seen(api_call("evil\"} 1\nmodel{", 901, **{"gen_ai.usage.input_tokens": 1}))
    m.seen(api_call("anthropic/claude-sonnet-4.5:beta", 902))
    text = generate_latest(reg).decode()
    models = {line.split('model="', 1)[1].split('"', 1)[0] for line in text.splitlines()
              if line.startswith("aep_bridge_model_calls_total{")}
    assert len(models) == MAX_MODELS + 1, len(models)  # the first 50 seen, and other
    assert "model-0" in models and "model-49" in models and "model-50" not in models
    assert value(reg, "aep_bridge_model_calls_total", model="other", outcome="ok") == 30 + 3
    assert value(reg, "aep_bridge_model_tokens_total", model="other", kind="input") == 32
    assert all(len(x) <= MODEL_LABEL_LEN for x in models)

    roomy = ActivityMetrics(CollectorRegistry())  # with room left: a long name is cut, an odd one is other
    assert roomy.model({"gen_ai.request.model": "y" * 500}) == "y" * MODEL_LABEL_LEN
    assert roomy.model({"gen_ai.request.model": "a b"}) == "other"
    assert roomy.model({"gen_ai.request.model": "anthropic/claude-sonnet-4.5:beta"}) == "anthropic/claude-sonnet-4.5:beta"
    assert roomy.model({"gen_ai.request.model": 7, "gen_ai.response.model": "r"}) == "r"


def test_tools_approvals_and_runs_by_outcome() -> None:
    reg = CollectorRegistry()
    m = ActivityMetrics(reg)
    tool = {"tool": {"name": "terminal", "call_id": "c1"}}
    for i, etype in enumerate(["tool.completed", "tool.completed", "tool.failed", "tool.denied", "tool.requested"]):
        m.seen(event(etype, dict(tool, **({"by": "policy"} if etype == "tool.denied" else {})), i))
    for i, option in enumerate(["once", "deny", "deny", "always", "session", "Unknown!"]):
        m.seen(event("attention.answered", {"answer": {"option": option}, "via": "oob"}, 10 + i))
    m.seen(event("attention.answered", {"answer": {"values": {"1": "2"}}, "via": "oob"}, 20))  # a clarify form: no approval
    for i, etype in enumerate(["run.finished", "run.finished", "run.cancelled", "run.failed", "run.started"]):
        m.seen(event(etype, {"reason": "x"} if etype == "run.failed" else {}, 30 + i))
    assert {o: value(reg, "aep_bridge_tool_calls_total", outcome=o) for o in ("completed", "failed", "denied")} == \
        {"completed": 2, "failed": 1, "denied": 1}
    assert {c: value(reg, "aep_bridge_approvals_total", choice=c) for c in ("once", "session", "always", "deny", "other")} == \
        {"once": 1, "session": 1, "always": 1, "deny": 2, "other": 1}
    assert {o: value(reg, "aep_bridge_runs_total", outcome=o) for o in ("finished", "cancelled", "failed")} == \
        {"finished": 2, "cancelled": 1, "failed": 1}
    text = generate_latest(reg).decode()
    assert "session=" not in text and "run=" not in text and "call_id" not in text
