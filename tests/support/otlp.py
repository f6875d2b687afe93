"""An OTLP/HTTP logs endpoint for tests: it decodes each request's protobuf with
opentelemetry-proto and records it; it can answer the first requests with an error."""

from __future__ import annotations

import gzip
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


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


def to_id(record) -> str:
    _, log = record
    return next(kv.value.string_value for kv in log.attributes if kv.key == "aep.event_id")


def event_ids(rx: Receiver) -> set[str]:
    return {to_id(r) for r in rx.records()}
