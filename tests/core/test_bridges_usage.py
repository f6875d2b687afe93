"""The AEP-0005 projections of the issue-40 events (contract shape: tests/support/api_calls.py).

* OTLP: a model call's LogRecord carries the model (`gen_ai.request.model`,
  `gen_ai.response.model`, `gen_ai.provider.name`) and the `gen_ai.usage.*` counts as
  attributes (§3.2: `gen_ai.*` payload members hoisted verbatim; integers as OTLP/JSON
  intValue), the rest (duration, finish reason, cost) in the body; a run end's totals likewise.
  Nothing of it above the exporter's ceiling.
* OCSF: no record. AEP-0005 §4.1 projects three families only and gives vendor `x.*` traffic
  no record by design; the pinned 1.8.0 subset carries `ai_model` (the `ai_operation` profile)
  only on Process Activity (1007), the tool class, and a model call is no process
  activity: projecting it there would be the mis-mapping §4.1 rules out.
* CloudEvents: as for any event (lossless within the ceiling, back to the same event).
"""

from __future__ import annotations

from bridge.core.bridges import from_cloudevent, project
from bridge.core.bridges.ocsf import CLASS_MAP
from bridge.core.bridges.otlp import export_logs_request, to_log_record
from bridge.core.ceiling import FULL, METADATA
from tests.support.aep_fixtures import ocsf_classes
from tests.support.api_calls import api_call, event

CALL = event("x.hermes.api.call", data=api_call(
    "fake-model", response_model="fake-model-2026-01", provider="openrouter", duration_ms=1234,
    cost={"currency": "USD", "total": 0.00425, "prompt": 0.0025, "completion": 0.00175},
    input=1000, output=175, cache_read=400, cache_write=64, reasoning=12))
FINISHED = event("run.finished", data={
    "duration_ms": 5000, "gen_ai.usage.input_tokens": 3000, "gen_ai.usage.output_tokens": 400,
    "gen_ai.usage.reasoning.output_tokens": 12, "model_calls": 3,
    "cost": {"currency": "USD", "total": 0.0115}})

USAGE_ATTRIBUTES = {
    "gen_ai.request.model": "fake-model",
    "gen_ai.response.model": "fake-model-2026-01",
    "gen_ai.provider.name": "openrouter",
    "gen_ai.usage.input_tokens": 1000,
    "gen_ai.usage.output_tokens": 175,
    "gen_ai.usage.cache_read.input_tokens": 400,
    "gen_ai.usage.cache_creation.input_tokens": 64,
    "gen_ai.usage.reasoning.output_tokens": 12,
}


def test_otlp_model_call_carries_model_and_usage_attributes() -> None:
    record = to_log_record(CALL)
    assert record["event_name"] == "dev.aep.x.hermes.api.call"
    attributes = record["attributes"]
    assert {k: v for k, v in attributes.items() if k.startswith("gen_ai.")} == USAGE_ATTRIBUTES
    assert attributes["aep.session_id"] == CALL["session"] and attributes["aep.run_id"] == CALL["run"]
    assert record["body"] == {"api_mode": "chat_completions", "duration_ms": 1234, "finish_reason": "stop",
                              "call_index": 1, "cost": CALL["data"]["cost"]}

    wire = export_logs_request([record])["resourceLogs"][0]["scopeLogs"][0]["logRecords"][0]
    by_key = {kv["key"]: kv["value"] for kv in wire["attributes"]}
    assert by_key["gen_ai.usage.input_tokens"] == {"intValue": "1000"}
    assert by_key["gen_ai.request.model"] == {"stringValue": "fake-model"}


def test_otlp_run_end_carries_its_totals() -> None:
    record = to_log_record(FINISHED)
    assert {k: v for k, v in record["attributes"].items() if k.startswith("gen_ai.")} == {
        "gen_ai.usage.input_tokens": 3000, "gen_ai.usage.output_tokens": 400,
        "gen_ai.usage.reasoning.output_tokens": 12}
    assert record["body"] == {"duration_ms": 5000, "model_calls": 3, "cost": {"currency": "USD", "total": 0.0115}}


def test_otlp_carries_nothing_of_it_above_the_ceiling() -> None:
    above = dict(CALL, capture="full")
    record = to_log_record(above, max_capture=METADATA)
    assert not [k for k in record["attributes"] if k.startswith("gen_ai.")] and "body" not in record
    assert to_log_record(above, max_capture=FULL)["attributes"]["gen_ai.usage.output_tokens"] == 175
    none = dict(CALL, capture="none")
    assert not [k for k in to_log_record(none)["attributes"] if k.startswith("gen_ai.")]


def test_ocsf_has_no_record_of_a_model_call_and_the_pinned_subset_offers_no_class_for_one() -> None:
    assert project("ocsf", CALL) is None
    assert project("ocsf", event("x.hermes.api.error", data={"gen_ai.request.model": "m", "status_code": 500})) is None
    assert project("ocsf", FINISHED) is None  # run events are outside §4.2 too

    classes = ocsf_classes()["classes"]  # the pinned subset: ai_model (ai_operation profile) rides Process Activity only
    assert [uid for uid, c in classes.items() if "ai_model" in c["attributes"]] == ["1007"]
    assert {cls for cls, *_ in CLASS_MAP.values()} == {3002, 1007, 2004}
    assert not [t for t in CLASS_MAP if t.startswith(("x.", "run."))]


def test_cloudevents_as_for_any_event() -> None:
    ce = project("cloudevents", CALL)
    assert ce is not None and ce["type"] == "dev.aep.x.hermes.api.call" and ce["data"] == CALL["data"]
    back, _ = from_cloudevent(ce)
    assert back == CALL
