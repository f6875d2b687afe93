"""AEP events of the issue-40 contract's shape, built by hand (docs: the usage contract):
`x.hermes.api.call` with its flat `gen_ai.*` members, `duration_ms`, `cost`; `x.hermes.api.error`;
and the run/tool/approval events the activity metrics count. Published onto AEP_EVENTS (or
BRIDGE_MAPPED) as the pipeline would."""

from __future__ import annotations

import itertools
from typing import Any

import msgspec

from bridge.core.identity import source_uri
from bridge.core.lanes import lane_token

_ids = itertools.count(1)

USAGE_MEMBERS = {
    "input": "gen_ai.usage.input_tokens",
    "output": "gen_ai.usage.output_tokens",
    "cache_read": "gen_ai.usage.cache_read.input_tokens",
    "cache_write": "gen_ai.usage.cache_creation.input_tokens",
    "reasoning": "gen_ai.usage.reasoning.output_tokens",
}


def event(etype: str, *, instance: str = "gw-a", session: str = "sess-a", time: str = "2026-12-06T10:00:00.000Z",
          data: dict[str, Any] | None = None, run: str | None = "r1", capture: str = "metadata") -> dict[str, Any]:
    n = next(_ids)
    out: dict[str, Any] = {
        "aep": "0.1", "id": f"01JXSAGE{n:018d}", "type": etype, "time": time,
        "source": source_uri(instance, session), "agent": "hermes", "session": session,
    }
    if run is not None:
        out["run"] = f"{session}:{run}"
    out["seq"] = n
    out["severity"] = "info"
    out["capture"] = capture
    if data is not None:
        out["data"] = data
    return out


def api_call(model: str | None = "fake-model", *, duration_ms: int | None = None, cost: dict[str, Any] | None = None,
             response_model: str | None = None, provider: str = "fake", **tokens: Any) -> dict[str, Any]:
    """The payload of one `x.hermes.api.call`; ``tokens`` by kind (input=, output=, cache_read=, ...)."""
    data: dict[str, Any] = {}
    if model is not None:
        data["gen_ai.request.model"] = model
    if response_model is not None:
        data["gen_ai.response.model"] = response_model
    data["gen_ai.provider.name"] = provider
    data["api_mode"] = "chat_completions"
    if duration_ms is not None:
        data["duration_ms"] = duration_ms
    data["finish_reason"] = "stop"
    data["call_index"] = 1
    for kind, value in tokens.items():
        data[USAGE_MEMBERS[kind]] = value
    if cost is not None:
        data["cost"] = cost
    return data


def subject(ev: dict[str, Any]) -> str:
    return f"aep.hermes.{lane_token(ev['session'])}.{ev['type']}"


async def publish_events(js: Any, events: list[dict[str, Any]]) -> None:
    """Onto AEP_EVENTS, as pairing publishes them (subject by lane and type, Nats-Msg-Id = id)."""
    for ev in events:
        await js.publish(subject(ev), msgspec.json.encode(ev), headers={"Nats-Msg-Id": ev["id"]})
