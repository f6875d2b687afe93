"""Liveness and readiness (`Health`) and the `/metrics`, `/healthz`, `/readyz` port (`HttpServer`)."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from bridge.nats import follow


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
    #: why the service is stopping with a failure (e.g. its credentials refused): /healthz is 503
    failed: str | None = None
    #: why the first connection has not been made yet (the service retries it meanwhile)
    nats_error: str | None = None
    #: /healthz keys computed when asked (from the HTTP thread), e.g. pairing's partitions: true at
    #: every moment, not as of the service's last round
    live: dict[str, Callable[[], Any]] = field(default_factory=dict)

    def beat(self) -> None:
        self.heartbeat = time.monotonic()

    def set_ready(self, ready: bool, reason: str = "") -> None:
        self.ready, self.reason = ready, reason or ("ready" if ready else "not ready")

    def nats_state(self) -> str:
        """``connected``, ``reconnecting`` (the server is away: nats-py retries), ``closed``
        (for good), ``connecting``, ``draining`` or ``none`` (not connected yet)."""
        nc = self.connection
        if nc is None:
            return "connecting" if self.nats_error else "none"
        for state in ("closed", "reconnecting", "connected", "connecting", "draining"):
            if getattr(nc, f"is_{state}", False):
                return state
        return "disconnected"

    def alive(self) -> bool:
        return (self.failed is None and time.monotonic() - self.heartbeat < self.stall_after_s
                and self.nats_state() != "closed")

    def healthz(self) -> tuple[bool, dict[str, Any]]:
        nats = self.nats_state()
        ok = self.alive()
        status = "ok" if ok else ("nats_closed" if nats == "closed" else "failed" if self.failed else "stalled")
        failed = {"error": self.failed} if self.failed else {}
        if self.nats_error and nats == "connecting":
            failed["nats_error"] = self.nats_error
        f = follow.of(self.connection)  # the server it is on, and its moves (issue 42)
        server = f.stats() if f is not None else {}
        live = {}
        for k, f in list(self.live.items()):
            try:
                live[k] = f()
            except Exception as exc:  # never a 500 for a view: say it could not be read
                live[k] = f"unreadable: {type(exc).__name__}"
        return ok, {"status": status, "service": self.name, "nats": nats, **server, **failed, **self.info, **live}

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
        try:  # aep_bridge_nats_server_moves_total (bridge.nats.follow)
            registry.register(follow.MovesCollector(lambda: health.connection))
        except ValueError:  # a second port on one registry (tests)
            pass
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
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
