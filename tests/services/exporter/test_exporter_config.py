"""The exporter's sink configuration (bridge/core/sinks.py) and Kafka framing (bridge/services/exporter/delivery.py)."""

from __future__ import annotations

import json

import pytest

from bridge.services.exporter.delivery import kafka_record, otlp_request_proto
from bridge.core.bridges.otlp import to_log_record
from bridge.core.ceiling import METADATA
from bridge.core.sinks import SinkConfigError, sink_from_mapping, sink_from_url, sinks_from_document
from bridge.services.exporter.sinks import retry_after_seconds
from tests.support.aep_fixtures import golden


def test_kafka_url_with_format_filter_and_passthrough_settings():
    flt = json.dumps({"type": ["tool.*"], "severity": {"gte": "notice"}})
    s = sink_from_url(f"kafka://k1:9092,k2:9092/aep-ocsf?format=ocsf&max_capture=none&filter={flt}"
                      "&security.protocol=SASL_SSL&sasl.mechanisms=PLAIN", {"AEP_BRIDGE_KAFKA_SASL_PASSWORD": "pw"})
    assert (s.kind, s.bootstrap, s.topic, s.format, s.max_capture) == ("kafka", "k1:9092,k2:9092", "aep-ocsf", "ocsf", 0)
    assert s.kafka == {"security.protocol": "SASL_SSL", "sasl.mechanisms": "PLAIN", "sasl.password": "pw"}
    assert s.filter.matches({"type": "tool.denied", "severity": "warning"})
    assert not s.filter.matches({"type": "tool.denied"})
    assert s.durable == "export-kafka-aep-ocsf" and "pw" not in json.dumps(s.describe())


def test_otlp_url_defaults():
    s = sink_from_url("otlp+http://collector:4318/v1/logs")
    assert (s.kind, s.endpoint, s.format, s.max_capture) == ("otlp", "http://collector:4318/v1/logs", "otlp", METADATA)
    assert sink_from_url("otlp+https://c").endpoint == "https://c/v1/logs"


def test_document_form_and_its_errors():
    doc = {"sinks": [
        {"name": "siem", "url": "kafka://k:9092/t", "format": "ocsf", "filter": {"type": "tool.*"},
         "kafka": {"sasl.username": "u", "enable.ssl.certificate.verification": False}},
        {"name": "otel", "url": "otlp+http://c:4318/v1/logs", "headers": {"authorization": "Bearer x"}, "batch": 100},
    ]}
    siem, otel = sinks_from_document(doc)
    assert siem.kafka == {"sasl.username": "u", "enable.ssl.certificate.verification": "false"}
    assert otel.headers == {"authorization": "Bearer x"} and otel.batch == 100
    bad = [
        {"sinks": [{"url": "kafka://k:9092/t", "format": "xml"}]},
        {"sinks": [{"url": "kafka://k:9092/t", "filter": {"seq": 1}}]},
        {"sinks": [{"url": "kafka://k:9092/"}]},
        {"sinks": [{"url": "otlp+http://c", "format": "ocsf"}]},
        {"sinks": [{"url": "kafka://k:9092/t", "mode": "batched"}]},
        {"sinks": [{"url": "kafka://k:9092/t", "max_capture": "all"}]},
        {"sinks": [{"url": "http://c/v1/logs"}]},
        {"sinks": [{"url": "kafka://k:9092/t", "name": "a b"}]},
        {"sinks": [{"url": "kafka://k:9092/t", "name": "x"}, {"url": "kafka://k:9092/u", "name": "x"}]},
        {"sink": []},
    ]
    for d in bad:
        with pytest.raises(SinkConfigError):
            sinks_from_document(d)


def test_kafka_framing_structured_binary_ocsf_otlp():
    event = golden()[3]  # tool.completed
    key, value, headers = kafka_record("cloudevents", event, "lane1", METADATA)
    assert key == b"lane1" and json.loads(value)["id"] == event["id"]
    assert dict(headers) == {"content-type": b"application/cloudevents+json; charset=UTF-8", "aep-id": event["id"].encode()}
    key, value, headers = kafka_record("cloudevents", event, "lane1", METADATA, "binary")
    h = dict(headers)
    assert h["ce_id"] == event["id"].encode() and h["ce_type"] == b"dev.aep." + event["type"].encode()
    structured = json.loads(kafka_record("cloudevents", event, "l", METADATA)[1])
    assert h["content-type"] == b"application/json" and json.loads(value) == structured["data"]
    assert h["ce_aepsequence"] == str(structured["aepsequence"]).encode() and "ce_data" not in h
    assert kafka_record("ocsf", golden()[24], "l", METADATA) is None  # agent.presence: no OCSF record
    _, value, headers = kafka_record("otlp", event, "l", METADATA)
    from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest

    req = ExportLogsServiceRequest.FromString(value)
    log = req.resource_logs[0].scope_logs[0].log_records[0]
    pin = to_log_record(event)
    assert log.time_unix_nano == pin["time_unix_nano"] and log.event_name == pin["event_name"]
    assert log.trace_id.hex() == pin["trace_id"] and log.span_id.hex() == pin["span_id"]
    assert len(otlp_request_proto([pin, pin])) > len(value)


def test_retry_after_header_forms():
    assert retry_after_seconds("3") == 3.0
    assert retry_after_seconds(None) is None and retry_after_seconds("soon") is None
    assert retry_after_seconds("Wed, 02 Dec 2026 00:00:10 GMT", now=1796169600.0) == 10.0
    # a broken or hostile collector cannot park the sink for years
    assert retry_after_seconds("999999999") == retry_after_seconds("9" * 400) == 300.0
    assert retry_after_seconds("Fri, 31 Dec 9999 23:59:59 GMT", now=1796169600.0) == 300.0


def test_a_lone_surrogate_in_a_payload_still_frames():
    event = dict(golden()[3], capture="full", data={**golden()[3]["data"], "result": "half \ud800 pair"})
    _, value, _ = kafka_record("cloudevents", event, "l", 3)  # at full: the text is exported
    assert b"half \\ud800 pair" in value or "half \ud800 pair".encode("utf-8", "surrogatepass") in value


def test_kafka_sink_outcomes_without_a_broker():
    """A record librdkafka refuses locally (larger than message.max.bytes) is a permanent
    failure (dead-lettered), not retried for ever; a record no broker confirms in time is
    a transient one (retried)."""
    import asyncio

    from bridge.core.sinks import sink_from_url
    from bridge.services.exporter.sinks import KafkaSink
    from tests.support.cli import free_port

    async def run():
        sink = KafkaSink(sink_from_url(f"kafka://127.0.0.1:{free_port()}/t?message.max.bytes=1000&message.timeout.ms=500"))
        await sink.start()
        try:
            big, small = (b"k", b"x" * 5000, []), (b"k", b"y", [])
            return await sink.send([big, small])
        finally:
            await sink.close()

    big, small = asyncio.run(run())
    assert not big.ok and not big.retry and big.reason == "kafka_msg_size_too_large", big
    assert not small.ok and small.retry and small.reason == "kafka_unavailable", small


def test_no_user_info_of_a_sink_url_reaches_its_name_logs_or_healthz():
    """describe() feeds the start log and /healthz; the default name a metric label."""
    otlp = sink_from_url("otlp+https://user:S3CRET@collector:4318/v1/logs", {})
    kafka = sink_from_mapping({"url": "kafka://svc:S3CRET@k1:9092/aep", "format": "ocsf"}, {})
    for sink in (otlp, kafka):
        assert "S3CRET" not in json.dumps(sink.describe()) and "S3CRET" not in sink.name, sink.describe()
    assert otlp.describe()["to"] == "https://collector:4318/v1/logs" and kafka.describe()["to"] == "k1:9092/aep"


def test_replicas_and_headers_from_the_environment():
    shared = sink_from_url("kafka://k:9092/t?name=wide&replicas=3")
    assert shared.replicas == 3 and shared.partitioned and shared.partition_durable(2) == "export-wide-p2"
    assert not sink_from_url("kafka://k:9092/t").partitioned
    for bad in ("0", "13", "x"):
        with pytest.raises(SinkConfigError, match="replicas"):
            sink_from_url(f"kafka://k:9092/t?replicas={bad}")
    spec = {"name": "otel", "url": "otlp+http://c:4318/v1/logs", "headers": {"x-tenant": "a"},
            "headers_from_env": {"authorization": "OTEL_AUTH"}}
    otel = sink_from_mapping(spec, {"OTEL_AUTH": "Bearer s3cret"})
    assert otel.headers == {"x-tenant": "a", "authorization": "Bearer s3cret"}
    assert "s3cret" not in json.dumps(otel.describe())
    with pytest.raises(SinkConfigError, match=r"authorization.*OTEL_AUTH.*not set"):
        sink_from_mapping(spec, {})
