"""`aep-bridge exporter` to an OTLP/HTTP logs endpoint: a receiver here decodes the protobuf
with opentelemetry-proto; a 503 with Retry-After is honoured and nothing is lost."""

from __future__ import annotations

import gzip
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from bridge.core.bridges.otlp import to_log_record
from bridge.core.ceiling import METADATA
from tests.natsfixture import JetStreamClient
from tests.support.services import Service, publish_all, raw_records, wait_for
from tests.corpus import envelopes
from tests.services.test_pairing import quiet


class Receiver:
    """OTLP/HTTP logs on /v1/logs. The first `refuse` requests get 503 with Retry-After."""

    def __init__(self, refuse: int = 0, retry_after: str | None = "2", status: int = 503) -> None:
        self.requests: list[dict] = []  # {"t": arrival, "status": answered, "records": [...]}
        self.refuse = refuse
        self.status = status
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # noqa: ANN002
                pass

            def do_POST(self):  # noqa: N802
                from google.protobuf.json_format import MessageToDict
                from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import (
                    ExportLogsServiceRequest,
                    ExportLogsServiceResponse,
                )

                body = self.rfile.read(int(self.headers["Content-Length"]))
                entry = {"t": time.monotonic(), "path": self.path, "type": self.headers["Content-Type"],
                         "encoding": self.headers.get("Content-Encoding")}
                if outer.refuse > 0:
                    outer.refuse -= 1
                    entry["status"] = outer.status
                    outer.requests.append(entry)
                    self.send_response(outer.status)
                    if retry_after is not None:
                        self.send_header("Retry-After", retry_after)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if entry["encoding"] == "gzip":
                    body = gzip.decompress(body)
                request = ExportLogsServiceRequest.FromString(body)
                entry["status"] = 200
                entry["records"] = [
                    (MessageToDict(rl.resource), log)
                    for rl in request.resource_logs for sl in rl.scope_logs for log in sl.log_records
                ]
                outer.requests.append(entry)
                out = ExportLogsServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "Receiver":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:  # noqa: ANN002
        self.server.shutdown()
        self.server.server_close()

    def records(self) -> list:
        return [r for q in self.requests if q["status"] == 200 for r in q["records"]]


def any_value(v):
    kind = v.WhichOneof("value")
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in v.kvlist_value.values}
    if kind == "array_value":
        return [any_value(x) for x in v.array_value.values]
    if kind is None:
        return None
    return getattr(v, kind)


def as_pin(resource: dict, log) -> dict:
    """A decoded protobuf LogRecord in the projection's form (to_log_record)."""
    out = {
        "time_unix_nano": log.time_unix_nano,
        "event_name": log.event_name,
        "severity_text": log.severity_text,
        "severity_number": log.severity_number,
        "resource": {a["key"]: a["value"]["stringValue"] for a in resource.get("attributes", [])},
        "attributes": {kv.key: any_value(kv.value) for kv in log.attributes},
    }
    if log.trace_id:
        out["trace_id"], out["span_id"], out["flags"] = log.trace_id.hex(), log.span_id.hex(), log.flags
    if log.HasField("body"):
        out["body"] = any_value(log.body)
    return out


def test_every_event_arrives_as_its_log_record_and_a_503_retry_after_is_honoured(nats_server_fn, tmp_path):
    from bridge.sim.sessions import realistic_envelopes

    client = JetStreamClient(nats_server_fn.url)
    client.bootstrap()
    records = raw_records(list(envelopes()) + list(realistic_envelopes(300, seed=5)), instance="otlp")
    client.run(publish_all(client.js, records))
    mapper = Service("mapper", nats_server_fn.url, tmp_path).start()
    (tmp_path / "p").mkdir()
    pairing = Service("pairing", nats_server_fn.url, tmp_path / "p", "--replica", "solo").start()
    with Receiver(refuse=2, retry_after="2") as rx:
        (tmp_path / "e").mkdir()
        exporter = Service("exporter", nats_server_fn.url, tmp_path / "e",
                           "--sink", f"otlp+http://127.0.0.1:{rx.port}/v1/logs?name=otel&batch=200")
        try:
            quiet(client, "BRIDGE_MAPPED")
            quiet(client, "AEP_EVENTS")
            stored = [json.loads(m.data) for m in client.fetch("aep.hermes.>", stream="AEP_EVENTS")]
            exporter.start()
            wait_for(lambda: len({to_id(r) for r in rx.records()}) >= len(stored), 90,
                     what=f"{len(stored)} events at the receiver")
            got: dict[str, dict] = {}
            for resource, log in rx.records():
                pin = as_pin(resource, log)
                event_id = pin["attributes"]["aep.event_id"]
                assert got.setdefault(event_id, pin) == pin, "a duplicate is a same-id redelivery"
            # Every event, as exactly the LogRecord the projection defines at max_capture metadata.
            assert set(got) == {e["id"] for e in stored}
            by_id = {e["id"]: e for e in stored}
            for event_id, pin in got.items():
                assert pin == to_log_record(by_id[event_id], METADATA)
            # The two 503s were honoured: the next request came no sooner than Retry-After said.
            answered = rx.requests
            assert [q["status"] for q in answered[:3]] == [503, 503, 200]
            assert answered[1]["t"] - answered[0]["t"] >= 1.9 and answered[2]["t"] - answered[1]["t"] >= 1.9
            assert all(q["path"] == "/v1/logs" and q["type"] == "application/x-protobuf" and q["encoding"] == "gzip"
                       for q in answered)
            assert max(len(q.get("records", [])) for q in answered) > 1, "batched"
        finally:
            exporter.terminate()
            pairing.terminate()
            mapper.terminate()
            client.close()


def to_id(record) -> str:
    _, log = record
    return next(kv.value.string_value for kv in log.attributes if kv.key == "aep.event_id")


def event_ids(rx: Receiver) -> set[str]:
    return {to_id(r) for r in rx.records()}


def test_a_stuck_sink_never_stalls_another_and_catches_up_and_a_refusal_is_dead_lettered(nats_server_fn, tmp_path):
    """Three sinks from one AEP_BRIDGE_EXPORT_CONFIG file: `stuck` answers 503 (no Retry-After) for
    a long time, `fast` (filtered to tool.*) answers at once, `strict` refuses its first request
    with 400. `fast` gets all its events while `stuck` holds; `stuck` then gets everything;
    `strict`'s refused batch is in the DLQ with the reason, and the rest reaches it."""
    client = JetStreamClient(nats_server_fn.url)
    client.bootstrap()
    client.run(publish_all(client.js, raw_records(list(envelopes()), instance="iso")))
    mapper = Service("mapper", nats_server_fn.url, tmp_path).start()
    (tmp_path / "p").mkdir()
    pairing = Service("pairing", nats_server_fn.url, tmp_path / "p", "--replica", "solo").start()
    with Receiver(refuse=10**6, retry_after=None) as stuck, Receiver() as fast, \
            Receiver(refuse=1, retry_after=None, status=400) as strict:
        config = tmp_path / "export.yaml"
        config.write_text(f"""
sinks:
  - name: stuck
    url: otlp+http://127.0.0.1:{stuck.port}/v1/logs
  - name: fast
    url: otlp+http://127.0.0.1:{fast.port}/v1/logs
    filter: {{type: ["tool.*"]}}
    batch: 20
  - name: strict
    url: otlp+http://127.0.0.1:{strict.port}/v1/logs
    batch: 10
""")
        (tmp_path / "e").mkdir()
        exporter = Service("exporter", nats_server_fn.url, tmp_path / "e", env={"AEP_BRIDGE_EXPORT_CONFIG": str(config)})
        try:
            quiet(client, "AEP_EVENTS")
            stored = [json.loads(m.data) for m in client.fetch("aep.hermes.>", stream="AEP_EVENTS")]
            tools = {e["id"] for e in stored if e["type"].startswith("tool.")}
            exporter.start()
            wait_for(lambda: event_ids(fast) >= tools, 60, what="the fast sink's events")
            assert event_ids(fast) == tools and len(stuck.requests) >= 1 and not stuck.records()
            assert exporter.alive()
            stuck.refuse = 0  # the stuck endpoint recovers: backoff retries deliver everything
            wait_for(lambda: event_ids(stuck) == {e["id"] for e in stored}, 90, what="the stuck sink to catch up")

            wait_for(lambda: len(event_ids(strict)) >= len(stored) - 10, 60, what="the strict sink")
            dlq = client.fetch("bridge.dlq.>", stream="BRIDGE_DLQ")
            assert {m.headers["Bridge-Dlq-Reason"] for m in dlq} == {"export_otlp_400"}
            refused = {m.headers["Bridge-Event-Id"] for m in dlq}  # the letter names the event (no content at the sink's metadata ceiling)
            assert all(json.loads(m.data)["original"]["id"] == m.headers["Bridge-Event-Id"] and "content" not in json.loads(m.data) for m in dlq)
            assert len(refused) == 10 and all(m.headers["Bridge-Stage"] == "exporter:strict" for m in dlq)
            assert event_ids(strict) | refused == {e["id"] for e in stored} and not event_ids(strict) & refused
        finally:
            exporter.terminate()
            pairing.terminate()
            mapper.terminate()
            client.close()
