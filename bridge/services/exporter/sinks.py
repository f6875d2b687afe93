"""The exporter's transports: Kafka (confluent-kafka) and OTLP/HTTP (protobuf, gzip).

`send(records)` answers one `Outcome` per record: delivered, retry (transient: the broker or
endpoint is down, busy or asked to wait) or failed (permanent, with a reason). The
`SinkWorker` (bridge/services/exporter/) acks, waits and dead-letters accordingly.

Kafka client: confluent-kafka (librdkafka), measured against aiokafka with
benchmarks/bench_kafka_clients.py on a Tansu broker (20,000 messages of 686 B, acks=all,
3 partitions, 2 rounds): confluent-kafka with the idempotent producer 34,262 / 17,735
msgs/s; aiokafka 23,775 / 20,234 msgs/s, and only without idempotence: its idempotent
producer cannot start on Tansu (InitProducerId answered with an error it does not handle).
The idempotent producer is what keeps a session's order and avoids duplicates when the
client itself retries, so confluent-kafka it is.
"""

from __future__ import annotations

import asyncio
import email.utils
import gzip
import importlib
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import structlog

from bridge.services.exporter.delivery import otlp_request_proto
from bridge.core.sinks import SinkConfig

log = structlog.get_logger("aep_bridge.exporter")


@dataclass(frozen=True)
class Outcome:
    ok: bool
    retry: bool = False
    reason: str = ""
    detail: str = ""
    retry_after_s: float | None = None


DELIVERED = Outcome(True)
#: a Kafka client error this recent (and after the last delivery) makes the sink `failing` on
#: /healthz; its log line repeats at most this often
FAILING_FOR_S = 30.0

#: what installs the sinks' client libraries
INSTALL_EXPORT = "pip install 'aep-bridge[export]'"
#: per sink kind: (a module it imports, the distribution that has it)
CLIENTS = {
    "kafka": ("confluent_kafka", "confluent-kafka"),
    "otlp": ("opentelemetry.proto.collector.logs.v1.logs_service_pb2", "opentelemetry-proto"),
}


class ClientMissing(RuntimeError):
    """A sink's client library cannot be imported (the `export` extra is not installed)."""


def require_clients(cfgs: list[SinkConfig]) -> None:
    """Import each configured kind's client library now: a missing one is a clear error at
    start, with the command that installs it (before: a Kafka sink's start died on a bare
    ModuleNotFoundError, which a supervisor restarts forever; an OTLP sink dead-lettered every
    event it could not encode)."""
    for kind in sorted({cfg.kind for cfg in cfgs}):
        module, dist = CLIENTS[kind]
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ClientMissing(f"{kind} sinks need {dist}, which cannot be imported ({type(exc).__name__}: {exc}); "
                                f"install it with: {INSTALL_EXPORT}") from exc


class KafkaSink:
    """One idempotent producer per sink, on its topic. A poll thread serves the delivery
    reports; `send` produces the batch in order and waits for every report."""

    #: librdkafka settings the sink sets (the config's pass-through settings win, except these)
    FIXED = {"enable.idempotence": "true", "acks": "all"}

    def __init__(self, cfg: SinkConfig) -> None:
        self.cfg = cfg
        self.producer: Any = None
        self._poller: threading.Thread | None = None
        self._stop = threading.Event()
        self._fatal: str | None = None
        self._reset: str | None = None  # why the next send starts with a new producer
        #: the client's last error (monotonic time, text) and the last delivery's time: `failing`
        self.client_error: tuple[float, str] | None = None
        self.delivered_at = 0.0
        self._logged_at = -FAILING_FOR_S  # kafka_client_error: one line per FAILING_FOR_S at most
        self._unlogged = 0

    def conf(self) -> dict[str, Any]:
        conf: dict[str, Any] = {
            "bootstrap.servers": self.cfg.bootstrap,
            "client.id": f"aep-bridge-exporter-{self.cfg.name}",
            "linger.ms": 5,
            # a report within this time, else the worker retries the record (and backs off)
            "message.timeout.ms": 30000,
            "reconnect.backoff.max.ms": 2000,
            # librdkafka's own lines on stderr (a dead broker: ~12 a second); its errors reach
            # `_on_error`, which logs them at most once per FAILING_FOR_S
            "log_level": 2,
        }
        conf.update(self.cfg.kafka)
        conf.update(self.FIXED)
        conf["error_cb"] = self._on_error
        return conf

    def _on_error(self, err: Any) -> None:
        if err.fatal():
            self._fatal = str(err)
        now = time.monotonic()
        self.client_error = (now, str(err))
        if err.fatal() or now - self._logged_at >= FAILING_FOR_S:
            log.warning("kafka_client_error", sink=self.cfg.name, error=str(err), fatal=err.fatal(),
                        **({"repeated": self._unlogged} if self._unlogged else {}))
            self._logged_at, self._unlogged = now, 0
        else:
            self._unlogged += 1

    def failing(self) -> str | None:
        """The client's last error when it came in the last FAILING_FOR_S and after the last
        delivery (a dead broker, before any event or after the last one), else None."""
        if self.client_error is None:
            return None
        at, error = self.client_error
        return error if at > self.delivered_at and time.monotonic() - at < FAILING_FOR_S else None

    async def start(self) -> None:
        self._open()

    def _open(self) -> None:
        from confluent_kafka import Producer

        self._fatal = None
        self.producer = Producer(self.conf())
        self._stop.clear()
        producer = self.producer

        def poll() -> None:
            while not self._stop.is_set():
                producer.poll(0.1)

        self._poller = threading.Thread(target=poll, name=f"kafka-{self.cfg.name}", daemon=True)
        self._poller.start()

    def _close_producer(self) -> None:
        self._stop.set()
        if self._poller is not None:
            self._poller.join(5)
        if self.producer is not None:
            try:
                self.producer.purge()
                self.producer.flush(0)
            except Exception:
                pass
        self.producer = None

    async def send(self, records: list[tuple[bytes, bytes | None, list[tuple[str, bytes]]]]) -> list[Outcome]:
        from confluent_kafka import KafkaError, KafkaException

        # After a fatal error, or records that timed out (a broker down, or one that came back
        # without our producer id, e.g. a fresh broker: librdkafka then waits on
        # UNKNOWN_PRODUCER_ID), a new producer: a new producer id, sequences from 0.
        why = self._fatal or self._reset
        if why is not None:
            log.warning("kafka_producer_reset", sink=self.cfg.name, reason=why)
            await asyncio.to_thread(self._close_producer)
            self._open()
            self._reset = None
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[Outcome]] = []

        def report(fut: asyncio.Future[Outcome]) -> Any:
            def on_delivery(err: Any, _msg: Any) -> None:
                if err is None:
                    self.delivered_at = time.monotonic()
                    outcome = DELIVERED
                elif err.fatal():
                    outcome = Outcome(False, retry=True, reason="kafka_fatal", detail=str(err))
                elif err.retriable() or err.code() in (KafkaError._MSG_TIMED_OUT, KafkaError._TIMED_OUT,
                                                        KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN,
                                                        KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT,
                                                        KafkaError.UNKNOWN_TOPIC_OR_PART):
                    outcome = Outcome(False, retry=True, reason="kafka_unavailable", detail=str(err))
                else:
                    outcome = Outcome(False, reason=f"kafka_{err.name().lower().lstrip('_')}", detail=str(err))
                loop.call_soon_threadsafe(_settle, fut, outcome)
            return on_delivery

        for key, value, headers in records:
            fut: asyncio.Future[Outcome] = loop.create_future()
            futures.append(fut)
            while True:
                try:
                    self.producer.produce(self.cfg.topic, value=value, key=key, headers=headers, on_delivery=report(fut))
                    break
                except BufferError:  # the local queue is full: wait for reports
                    await asyncio.sleep(0.05)
                except KafkaException as exc:  # refused locally: too large, unknown topic, ...
                    err = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
                    if err is not None and not err.retriable() and not err.fatal():
                        outcome = Outcome(False, reason=f"kafka_{err.name().lower().lstrip('_')}", detail=str(exc))
                    else:
                        outcome = Outcome(False, retry=True, reason="kafka_produce", detail=str(exc))
                    _settle(fut, outcome)
                    break
        outcomes = list(await asyncio.gather(*futures))
        failed = next((o for o in outcomes if o.retry), None)
        if failed is not None:
            self._reset = f"{failed.reason}: {failed.detail}"
        return outcomes

    async def close(self) -> None:
        if self.producer is not None:
            # no wait for a broker that is not there (Ctrl-C of `up` took 20 s): what is not
            # confirmed stays unacked on NATS and comes back
            await asyncio.to_thread(self.producer.flush, 0 if self.failing() else 5)
            await asyncio.to_thread(self._close_producer)


def _settle(fut: asyncio.Future[Outcome], outcome: Outcome) -> None:
    if not fut.done():
        fut.set_result(outcome)


#: OTLP/HTTP: the status codes a client retries (OTLP specification, "Retryable Response Codes")
OTLP_RETRYABLE = frozenset((429, 502, 503, 504))


def retry_after_seconds(value: str | None, now: float | None = None) -> float | None:
    """A Retry-After header (delay-seconds or an HTTP date) in seconds, None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return min(float(value[:12]), RETRY_AFTER_MAX_S)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return min(RETRY_AFTER_MAX_S, max(0.0, when.timestamp() - (time.time() if now is None else now)))


#: a collector's Retry-After is honoured up to this (a hostile or broken one must not park the sink for years)
RETRY_AFTER_MAX_S = 300.0


class OtlpHttpSink:
    """POST ExportLogsServiceRequest (protobuf, gzip) to the endpoint, one request per batch."""

    def __init__(self, cfg: SinkConfig, timeout_s: float = 10.0) -> None:
        self.cfg = cfg
        self.timeout_s = timeout_s
        parts = urlsplit(cfg.endpoint)
        self.https = parts.scheme == "https"
        self.host = parts.hostname or "localhost"
        self.port = parts.port or (443 if self.https else 80)
        self.path = (parts.path or "/v1/logs") + (f"?{parts.query}" if parts.query else "")

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def _post(self, body: bytes) -> tuple[int, dict[str, str], bytes]:
        import http.client

        conn_cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        conn = conn_cls(self.host, self.port, timeout=self.timeout_s)
        try:
            headers = {"Content-Type": "application/x-protobuf", "Content-Encoding": "gzip",
                       "User-Agent": "aep-bridge-exporter", **self.cfg.headers}
            conn.request("POST", self.path, body=body, headers=headers)
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    async def send(self, records: list[dict[str, Any]]) -> list[Outcome]:
        body = gzip.compress(otlp_request_proto(records), compresslevel=5)
        import http.client

        try:
            status, headers, payload = await asyncio.to_thread(self._post, body)
        except (OSError, http.client.HTTPException) as exc:  # refused, reset, timed out, garbled: transient
            return [Outcome(False, retry=True, reason="otlp_unreachable", detail=f"{type(exc).__name__}: {exc}")] * len(records)
        if 200 <= status < 300:
            rejected = _rejected(payload)
            if rejected:  # partial success: the server dropped some and says not to retry them
                log.warning("otlp_partial_success", sink=self.cfg.name, rejected=rejected)
            return [DELIVERED] * len(records)
        detail = f"HTTP {status}: {payload[:300]!r}"
        if status in OTLP_RETRYABLE:
            return [Outcome(False, retry=True, reason=f"otlp_{status}", detail=detail,
                            retry_after_s=retry_after_seconds(headers.get("retry-after")))] * len(records)
        return [Outcome(False, reason=f"otlp_{status}", detail=detail)] * len(records)


def _rejected(payload: bytes) -> int:
    if not payload:
        return 0
    try:
        from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceResponse

        response = ExportLogsServiceResponse()
        response.ParseFromString(payload)
        return int(response.partial_success.rejected_log_records)
    except Exception:
        return 0


def make_sink(cfg: SinkConfig) -> Any:
    return KafkaSink(cfg) if cfg.kind == "kafka" else OtlpHttpSink(cfg)
