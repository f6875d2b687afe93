"""What every long-running service shares: logs, metrics/health HTTP, signals, drain.

* Logs: structlog, JSON lines on stderr by default (`AEP_BRIDGE_LOG_FORMAT=console`
  for people), one processor chain visible in `configure_logging`.
* HTTP (one port per service): `/metrics` (Prometheus text), `/healthz` (the
  process loop is alive and its NATS connection is not closed for good; `nats` says the
  connection's state), `/readyz` (connected to NATS and consuming). Served by
  the standard library's WSGI server in a daemon thread, so a busy event loop
  cannot make a liveness probe time out, with prometheus-client's own WSGI app.
* Signals: SIGTERM/SIGINT set `stopping`; the service stops fetching, finishes
  and acks the batch in hand, then exits 0.
* A NATS connection closed for good (nats-py never reconnects a connection the server
  closed with an error, e.g. after a credential rotation or a protocol violation) or
  refused its credentials while reconnecting: `watch_connection` stops the service the same
  way and it exits 1, so a supervisor (Kubernetes, `aep-bridge up`) starts it again on a
  new connection instead of leaving a process that consumes nothing and looks healthy.
* Allocation profiling (opt-in, `AEP_BRIDGE_TRACEMALLOC=<dir>`): started and stopped with
  the HTTP server; it lives in `bridge.services.profiling`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import structlog
from prometheus_client import CollectorRegistry, make_wsgi_app

from bridge.services.profiling import start_allocation_profiler, stop_allocation_profiler


OTHER = "other"


class BoundedLabel:
    """Label values that come from the wire (hook names, drift values, instances, DLQ
    reasons), bounded so no input can grow a metric's series without limit: a ``known``
    value is its own label; up to ``cap`` further values that fullmatch ``shape`` are
    admitted first come (``forget`` frees a slot); everything else is ``other``."""

    def __init__(self, known: Any = (), cap: int = 0, shape: str = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}") -> None:
        self.known = frozenset(known)
        self.cap = cap
        self.shape = re.compile(shape)
        self.admitted: set[str] = set()
        self._children: dict[tuple[int, str], Any] = {}

    def child(self, metric: Any, value: str) -> Any:
        """The child of ``metric`` (labelled by this label alone) for ``value``, cached per label
        (bounded like the labels): `labels()` costs ~2 us, on the per-event path."""
        label = self(value)
        key = (id(metric), label)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(label)
        return child

    def __call__(self, value: str) -> str:
        if value in self.known or value in self.admitted:
            return value
        if len(self.admitted) < self.cap and isinstance(value, str) and self.shape.fullmatch(value):
            self.admitted.add(value)
            return value
        return OTHER

    def forget(self, value: str) -> None:
        self.admitted.discard(value)


def configure_logging(fmt: str = "json", level: str = "info") -> None:
    renderer: Any = structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper(), logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


@dataclass
class Health:
    """Liveness and readiness, set by the service, read by the HTTP thread."""

    name: str
    ready: bool = False
    reason: str = "starting"
    heartbeat: float = field(default_factory=time.monotonic)
    #: the loop is considered dead when its heartbeat is older than this
    stall_after_s: float = 120.0
    info: dict[str, Any] = field(default_factory=dict)
    #: the service's NATS connection (nats-py Client), once connected: its state is reported
    connection: Any = None

    def beat(self) -> None:
        self.heartbeat = time.monotonic()

    def set_ready(self, ready: bool, reason: str = "") -> None:
        self.ready, self.reason = ready, reason or ("ready" if ready else "not ready")

    def nats_state(self) -> str:
        """``connected``, ``reconnecting`` (the server is away: nats-py retries), ``closed``
        (for good), ``connecting``, ``draining`` or ``none`` (not connected yet)."""
        nc = self.connection
        if nc is None:
            return "none"
        for state in ("closed", "reconnecting", "connected", "connecting", "draining"):
            if getattr(nc, f"is_{state}", False):
                return state
        return "disconnected"

    def alive(self) -> bool:
        return time.monotonic() - self.heartbeat < self.stall_after_s and self.nats_state() != "closed"

    def healthz(self) -> tuple[bool, dict[str, Any]]:
        nats = self.nats_state()
        ok = self.alive()
        status = "ok" if ok else ("nats_closed" if nats == "closed" else "stalled")
        return ok, {"status": status, "service": self.name, "nats": nats, **self.info}

    def readyz(self) -> tuple[bool, dict[str, Any]]:
        nats = self.nats_state()
        ok = self.ready and self.alive() and nats == "connected"
        reason = self.reason if nats in ("connected", "none") else f"nats {nats}"
        return ok, {"ready": ok, "reason": reason, "service": self.name, "nats": nats}


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass


class HttpServer:
    """`/metrics`, `/healthz`, `/readyz` on one port, in a daemon thread."""

    def __init__(self, health: Health, registry: CollectorRegistry, host: str = "0.0.0.0", port: int = 0) -> None:
        self.health = health
        metrics_app = make_wsgi_app(registry)

        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
            path = environ.get("PATH_INFO", "")
            if path == "/healthz":
                ok, body = health.healthz()
                return self._json(start_response, ok, body)
            if path == "/readyz":
                ok, body = health.readyz()
                return self._json(start_response, ok, body)
            if path in ("/metrics", "/metrics/"):
                return metrics_app(environ, start_response)  # type: ignore[no-any-return]
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found: try /metrics, /healthz, /readyz\n"]

        self._server: WSGIServer = make_server(host, port, app, handler_class=_QuietHandler)
        self.port = self._server.server_port
        self._thread = threading.Thread(target=self._server.serve_forever, name=f"{health.name}-http", daemon=True)

    @staticmethod
    def _json(start_response: Callable[..., Any], ok: bool, body: dict[str, Any]) -> list[bytes]:
        start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "application/json")])
        return [json.dumps(body).encode() + b"\n"]

    def start(self) -> "HttpServer":
        start_allocation_profiler(self.health.name, self.health)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        stop_allocation_profiler()


class Stopper:
    """SIGTERM / SIGINT -> an asyncio.Event the service's loop watches."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.signal: str | None = None

    def install(self) -> "Stopper":
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self.trigger, sig.name)
            except (NotImplementedError, RuntimeError):  # not the main thread (tests)
                pass
        return self

    def trigger(self, why: str = "requested") -> None:
        self.signal = why
        self.event.set()

    #: why the service must stop and exit non-zero (None: a requested stop, exit 0)
    failed: str | None = None

    def fail(self, why: str) -> None:
        if not self.event.is_set():
            self.failed = why
        self.trigger(why)

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0

    @property
    def stopping(self) -> bool:
        return self.event.is_set()

    async def sleep(self, seconds: float) -> bool:
        """Sleep unless asked to stop; True when stopping."""
        try:
            await asyncio.wait_for(self.event.wait(), timeout=seconds)
        except asyncio.TimeoutError:
            return False
        return True


async def watch_connection(nc: Any, stopper: Stopper, health: Health, log: Any, every_s: float = 0.5) -> None:
    """Stop the service (exit 1) when its connection is unusable for good: closed (nats-py
    does not reconnect a connection the server closed with an error), or its credentials
    refused while reconnecting. A server that is merely away is retried by nats-py forever
    (`/readyz` is false meanwhile, `/healthz` says `reconnecting`)."""
    health.connection = nc
    while not stopper.stopping:
        why = None
        last = getattr(nc, "last_error", None)
        if nc.is_closed:
            why = f"NATS connection closed ({type(last).__name__}: {last})" if last else "NATS connection closed"
        elif nc.is_reconnecting and last is not None and "authoriz" in f"{type(last).__name__} {last}".lower():
            why = f"NATS refused the credentials while reconnecting ({type(last).__name__}: {last})"
        if why is not None:
            if not stopper.stopping:
                log.error("nats_connection_lost", error=why, action="exit 1: a supervisor starts the service again")
                stopper.fail(why)
            return
        if await stopper.sleep(every_s):
            return


async def close_connection(nc: Any) -> None:
    """Flush what is in flight (acks included), then close. Not `drain()`: with a pull
    subscription bound it can wait for its full timeout."""
    if nc is not None and not nc.is_closed:
        try:
            await nc.flush(timeout=3)
        except Exception:
            pass
        await nc.close()
