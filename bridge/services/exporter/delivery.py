"""What a sink sends for one AEP event: the projection, then the transport's framing.

`kafka_record` -> (key, value, headers) of one Kafka message, or None where the format has
no record for the event:

* ``cloudevents``: the CloudEvents Kafka protocol binding 1.0. Structured mode: the value
  is the event in the JSON format, ``content-type: application/cloudevents+json;
  charset=UTF-8``. Binary mode: every attribute but ``data`` as a ``ce_<name>`` header
  (its string form), ``content-type`` = ``datacontenttype``, the value = ``data`` as JSON
  (no value when the event has no data).
* ``ocsf``: the OCSF record as JSON, ``content-type: application/json``.
* ``otlp``: an OTLP ExportLogsServiceRequest of the one LogRecord in protobuf
  (``application/x-protobuf``), the Collector Kafka receiver's default encoding.

The key is the lane (the AEP_EVENTS subject's lane token), so every event of a session goes
to one partition, in order. Each message also carries ``aep-id`` (the event id: what a
consumer dedupes redeliveries on).

`otlp_request_proto` -> the protobuf ExportLogsServiceRequest of many LogRecords (the
OTLP/HTTP sink's body). Needs `opentelemetry-proto` (the ``export`` extra).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from bridge.core.bridges import project
from bridge.core.bridges.otlp import export_logs_request

STRUCTURED_CONTENT_TYPE = b"application/cloudevents+json; charset=UTF-8"
JSON_CONTENT_TYPE = b"application/json"
PROTOBUF_CONTENT_TYPE = b"application/x-protobuf"

Headers = list[tuple[str, bytes]]

_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
_encode = msgspec.json.Encoder().encode


def _json(value: Any) -> bytes:
    """Compact JSON: msgspec's encoder (a CloudEvents record in 11 us instead of 22 us with the
    stdlib's), the stdlib's for a string msgspec refuses (a lone surrogate)."""
    try:
        return _encode(value)
    except (UnicodeEncodeError, msgspec.EncodeError):
        return _dumps(value).encode("utf-8", "surrogatepass")


def _ce_header_value(value: Any) -> bytes:
    if isinstance(value, bool):  # CloudEvents boolean: "true" / "false"
        return b"true" if value else b"false"
    return str(value).encode("utf-8", "surrogatepass")


def kafka_record(fmt: str, event: dict[str, Any], lane: str, max_capture: int,
                 ce_mode: str = "structured") -> tuple[bytes, bytes | None, Headers] | None:
    """One Kafka message for ``event`` in sink format ``fmt`` (cloudevents | otlp | ocsf)."""
    key = lane.encode()
    ident: Headers = [("aep-id", event["id"].encode())] if isinstance(event.get("id"), str) else []
    if fmt == "cloudevents":
        ce = project("cloudevents", event, max_capture)
        assert ce is not None
        if ce_mode == "binary":
            headers: Headers = [("content-type", str(ce.get("datacontenttype", "application/json")).encode())]
            headers += [(f"ce_{name}", _ce_header_value(v)) for name, v in ce.items()
                        if name not in ("data", "datacontenttype")]
            return key, (_json(ce["data"]) if "data" in ce else None), headers + ident
        return key, _json(ce), [("content-type", STRUCTURED_CONTENT_TYPE), *ident]
    if fmt == "ocsf":
        record = project("ocsf", event, max_capture)
        if record is None:
            return None
        return key, _json(record), [("content-type", JSON_CONTENT_TYPE), *ident]
    if fmt == "otlp":
        log_record = project("otlp-json", event, max_capture)
        assert log_record is not None
        return key, otlp_request_proto([log_record]), [("content-type", PROTOBUF_CONTENT_TYPE), *ident]
    raise ValueError(f"unknown sink format {fmt!r}")


def otlp_request_proto(records: list[dict[str, Any]]) -> bytes:
    """LogRecords (`to_log_record` form) -> a serialized protobuf ExportLogsServiceRequest.

    Built from the OTLP/JSON request (`export_logs_request`) with protobuf's JSON parser,
    except the trace and span ids: OTLP/JSON writes them in hex, where protobuf's JSON
    mapping of `bytes` expects base64, so they are set from the hex afterwards."""
    from google.protobuf.json_format import ParseDict
    from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest

    request = export_logs_request(records)
    ids: list[tuple[str, str] | None] = []
    for resource_logs in request["resourceLogs"]:
        for scope_logs in resource_logs["scopeLogs"]:
            for wire in scope_logs["logRecords"]:
                if "traceId" in wire:
                    ids.append((wire.pop("traceId"), wire.pop("spanId")))
                else:
                    ids.append(None)
    message = ParseDict(request, ExportLogsServiceRequest())
    it = iter(ids)
    for resource_logs in message.resource_logs:
        for scope_logs in resource_logs.scope_logs:
            for log in scope_logs.log_records:
                pair = next(it)
                if pair is not None:
                    log.trace_id, log.span_id = bytes.fromhex(pair[0]), bytes.fromhex(pair[1])
    return bytes(message.SerializeToString())
