"""One hostile event never stops a sink (issue 13's rule, applied to the exporter): an event no
projection or framing can take is dead-lettered, and the rest of its batch is delivered."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from prometheus_client import CollectorRegistry

from bridge.core.bridges.otlp import any_value, to_log_record
from bridge.core.ceiling import configure
from bridge.core.sinks import sink_from_url
from bridge.runtime import Stopper
from bridge.services.exporter import ExporterMetrics, SinkWorker
from bridge.services.exporter.delivery import otlp_request_proto
from bridge.services.exporter.sinks import DELIVERED
from tests.support.aep_fixtures import golden


class Msg:
    def __init__(self, event: dict[str, Any], seq: int) -> None:
        self.data = json.dumps(event).encode()
        self.subject = f"aep.hermes.{event.get('session', 's')}.{event['type']}"
        self.acked = False
        self.metadata = type("M", (), {"sequence": type("S", (), {"stream": seq})()})()

    async def ack(self) -> None:
        self.acked = True

    async def in_progress(self) -> None:
        pass


class FramingSink:
    """Frames the whole batch first, as the OTLP/HTTP sink does, then 'delivers' it; its
    encoder refuses any record carrying MARK (as protobuf refused an int past int64)."""

    def __init__(self) -> None:
        self.delivered: list[dict[str, Any]] = []

    async def send(self, records: list[dict[str, Any]]) -> list[Any]:
        if any(MARK in json.dumps(r) for r in records):
            raise ValueError("the encoder refuses this record")
        otlp_request_proto(records)
        self.delivered += records
        return [DELIVERED] * len(records)


MARK = "refused_by_the_encoder"


class Service:
    def __init__(self) -> None:
        self.metrics = ExporterMetrics(CollectorRegistry())
        self.letters: list[tuple[str, bytes, dict[str, str]]] = []
        service = self

        class JS:
            async def publish(self, subject: str, body: bytes, headers: dict[str, str]) -> None:
                service.letters.append((subject, body, headers))

        self.js = JS()
        self.stopper = Stopper()  # the worker races a send against its stop
        self.dlq_policy = configure(None, None)[0]


def test_an_unframable_record_is_dead_lettered_and_its_batch_delivered() -> None:
    service = Service()
    worker = SinkWorker(service, sink_from_url("otlp+http://127.0.0.1:1/v1/logs", {}))  # type: ignore[arg-type]
    worker.sink = FramingSink()
    good = [e for e in golden() if e.get("capture", "metadata") == "metadata" and isinstance(e.get("data"), dict)][:3]
    bad = {**good[0], "id": "01KAV9FT00K84RXAFWNG73R0PG", "type": "x.hermes." + MARK}
    msgs = [Msg(e, i + 1) for i, e in enumerate([good[0], bad, good[1], good[2]])]
    asyncio.run(worker.handle(msgs))
    assert [m.acked for m in msgs] == [True, True, True, True]
    assert len(worker.sink.delivered) == 3
    (letter,) = service.letters
    assert letter[0] == "bridge.dlq.export_unsendable" and letter[2]["Bridge-Event-Id"] == bad["id"]
    assert letter[2]["Bridge-Dlq-Capture"] == "metadata" and "content" not in json.loads(letter[1])


def test_an_exporters_dead_letter_keeps_no_more_than_the_bridges_lowest_ceiling() -> None:
    """A sink at `max_capture=full` must not put content into BRIDGE_DLQ that the bridge's
    own ceiling keeps out of every dead letter (metadata at the default posture)."""
    service = Service()
    worker = SinkWorker(service, sink_from_url("otlp+http://127.0.0.1:1/v1/logs?max_capture=full", {}))  # type: ignore[arg-type]
    event = {**golden()[0], "capture": "full", "data": {"text": "CANARY-EXPORT-DLQ"}}
    asyncio.run(worker.dead_letter([Msg(event, 5)], "export_otlp_400", "refused"))
    ((_, body, headers),) = service.letters
    assert b"CANARY" not in body and headers["Bridge-Dlq-Capture"] == "metadata"


def test_an_exporters_dead_letter_log_keeps_no_more_than_the_letter() -> None:
    """The warning logged with a dead letter carries the error as the letter holds it: a refusal's
    detail (a sink's or a projection's message may quote the event) only where the ceiling lets
    it through, never at the default metadata posture."""
    from structlog.testing import capture_logs

    service = Service()
    worker = SinkWorker(service, sink_from_url("otlp+http://127.0.0.1:1/v1/logs?max_capture=full", {}))  # type: ignore[arg-type]
    event = {**golden()[0], "capture": "full", "data": {"text": "CANARY-EXPORT-LOG"}}
    with capture_logs() as logs:
        asyncio.run(worker.dead_letter([Msg(event, 5)], "export_unprojectable", "ValueError: 'CANARY-EXPORT-LOG'"))
    (entry,) = [e for e in logs if e["event"] == "dead_letter"]
    assert "CANARY" not in json.dumps(entry, default=str), entry
    assert entry["events_seq"] == 5 and entry["bytes"] == len(Msg(event, 5).data)


def test_integers_past_int64_stay_representable() -> None:
    assert any_value(2**64 - 1) == {"stringValue": str(2**64 - 1)}
    assert any_value(-(2**63)) == {"intValue": str(-(2**63))}
    event = {**golden()[0], "data": {"n": 2**70}}
    otlp_request_proto([to_log_record(event, 3)])  # frames
