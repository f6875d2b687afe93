"""AEP -> OpenTelemetry LogRecord (AEP-0005 §3).

`to_log_record` returns the LogRecord in the JSON encoding of the OTLP data model that
the AEP-0005 pins use: snake_case field names, `resource` and `attributes` as flat maps,
`trace_id`/`span_id` as lowercase hex, `body` as the map it is. One record per event:

* `time_unix_nano` from `time` (exact integer nanoseconds);
* `event_name` = ``dev.aep.<type>`` (the CloudEvents type: one exported identity);
* `severity_text`/`severity_number` from the §3.4 table (`SEVERITY`);
* `trace_id`, `span_id`, `flags` parsed from `traceparent`;
* resource `service.name` = `agent` (or the caller's override, for shared relays);
* attributes `aep.*` from the envelope (`capture` and `severity` defaults applied);
* the members of the surviving payload named ``gen_ai.*`` hoisted verbatim into the
  attributes, the rest as `body` (absent when empty). The payload is what survives the
  exporter's `max_capture` (`downlevel.exported_payload`): nothing above the ceiling, and
  nothing at all for `capture: none`.
"""

from __future__ import annotations

from typing import Any

from bridge.core.bridges.common import TRACEPARENT, TYPE_ROOT, check_event, time_ns
from bridge.core.ceiling import METADATA
from bridge.core.downlevel import exported_payload

#: AEP-0005 §3.4: AEP severity -> (severity_text, severity_number).
SEVERITY: dict[str, tuple[str, int]] = {
    "debug": ("DEBUG", 5),
    "info": ("INFO", 9),
    "notice": ("INFO2", 10),
    "warning": ("WARN", 13),
    "error": ("ERROR", 17),
    "critical": ("FATAL", 21),
}

#: §3.4 inverse: the lowest OTLP severity number of each AEP bucket, highest first.
_BUCKETS = ((21, "critical"), (17, "error"), (13, "warning"), (10, "notice"), (9, "info"), (1, "debug"))

#: §3.2: envelope attribute -> LogRecord attribute (after aep.agent_id, aep.event_id, aep.capture, aep.source).
_ATTRIBUTES = (
    ("session", "aep.session_id"),
    ("run", "aep.run_id"),
    ("step", "aep.step"),
    ("seq", "aep.sequence"),
    ("epoch", "aep.epoch"),
    ("cause", "aep.causation_id"),
    ("subject", "aep.subject"),
)

GEN_AI_PREFIX = "gen_ai."


def severity_from_number(number: int) -> str:
    """An OTLP severity number (1-24) -> the AEP level of its bucket (§3.4 inverse)."""
    if not 1 <= number <= 24:
        raise ValueError(f"OTLP severity number {number} is outside 1..24")
    return next(level for low, level in _BUCKETS if number >= low)


def to_log_record(event: dict[str, Any], max_capture: int = METADATA, service_name: str | None = None) -> dict[str, Any]:
    """One AEP event -> its LogRecord (a JSON object), after the ceiling."""
    check_event(event)
    text, number = SEVERITY[event.get("severity", "info")]
    attributes: dict[str, Any] = {
        "aep.agent_id": event["agent"],
        "aep.event_id": event["id"],
        "aep.capture": event.get("capture", "metadata"),
        "aep.source": event["source"],
    }
    for name, attribute in _ATTRIBUTES:
        if name in event:
            attributes[attribute] = event[name]
    record: dict[str, Any] = {
        "time_unix_nano": time_ns(event["time"]),
        "event_name": TYPE_ROOT + event["type"],
        "severity_text": text,
        "severity_number": number,
        "resource": {"service.name": service_name or event["agent"]},
        "attributes": attributes,
    }
    if "traceparent" in event:
        m = TRACEPARENT.fullmatch(event["traceparent"])
        assert m is not None  # check_event
        record["trace_id"], record["span_id"], record["flags"] = m.group(2), m.group(3), int(m.group(4), 16)
    body: dict[str, Any] = {}
    for name, value in (exported_payload(event, max_capture) or {}).items():
        if name.startswith(GEN_AI_PREFIX):
            attributes[name] = value
        else:
            body[name] = value
    if body:
        record["body"] = body
    return record


# ---------------------------------------------------------------- OTLP/JSON on the wire


def any_value(value: Any) -> dict[str, Any]:
    """A JSON value as an OTLP/JSON AnyValue (int64 as a decimal string, per the proto3 JSON mapping)."""
    if isinstance(value, str):
        return {"stringValue": value}
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        if -(2**63) <= value < 2**63:
            return {"intValue": str(value)}
        return {"stringValue": str(value)}  # past int64 (a foreign emitter's): no intValue can hold it
    if isinstance(value, float):
        return {"doubleValue": value}
    if isinstance(value, list):
        return {"arrayValue": {"values": [any_value(v) for v in value]}}
    if isinstance(value, dict):
        return {"kvlistValue": {"values": key_values(value)}}
    return {}  # null: the empty AnyValue


def key_values(mapping: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"key": k, "value": any_value(v)} for k, v in mapping.items()]


def export_logs_request(records: list[dict[str, Any]], scope: str = "aep-bridge") -> dict[str, Any]:
    """LogRecords of `to_log_record` -> one OTLP/JSON ExportLogsServiceRequest (the body of an
    OTLP/HTTP JSON export, and a line of the Collector's `otlpjsonfile` receiver), grouped by
    resource in first-seen order."""
    groups: dict[tuple[tuple[str, Any], ...], list[dict[str, Any]]] = {}
    resources: dict[tuple[tuple[str, Any], ...], dict[str, Any]] = {}
    for record in records:
        key = tuple(sorted(record["resource"].items()))
        resources.setdefault(key, record["resource"])
        wire: dict[str, Any] = {
            "timeUnixNano": str(record["time_unix_nano"]),
            "severityNumber": record["severity_number"],
            "severityText": record["severity_text"],
            "eventName": record["event_name"],
            "attributes": key_values(record["attributes"]),
        }
        if "body" in record:
            wire["body"] = any_value(record["body"])
        if "trace_id" in record:
            wire["traceId"], wire["spanId"], wire["flags"] = record["trace_id"], record["span_id"], record["flags"]
        groups.setdefault(key, []).append(wire)
    return {
        "resourceLogs": [
            {
                "resource": {"attributes": key_values(resources[key])},
                "scopeLogs": [{"scope": {"name": scope}, "logRecords": logs}],
            }
            for key, logs in groups.items()
        ]
    }
