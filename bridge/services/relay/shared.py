"""What the relay's two bindings (HTTP/SSE in ``endpoints``, WebSocket in ``websocket``) share:
the AEP versions served, the resume limit, the metrics, and the bearer token of a request."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from typing import Any, Awaitable, Callable

import msgspec
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge

VERSIONS = ["0.1"]
MAX_FROM_POSITIONS = 256
# an HTTP request line's limit: a `from` of 256 positions of sessions up to 1,024 characters,
# URL-encoded (~300 KB), with room to spare; past it aiohttp answers a plain-text 400
MAX_REQUEST_LINE = 1 << 19
encode = msgspec.json.Encoder().encode
decode = msgspec.json.Decoder().decode


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry if registry is not None else CollectorRegistry()
        self.connections = Gauge("aep_bridge_relay_connections", "open SSE and WebSocket connections", ["binding"], registry=r)
        self.subscriptions = Gauge("aep_bridge_relay_subscriptions", "live subscriptions (an SSE stream is one)", registry=r)
        self.delivered = Counter("aep_bridge_relay_delivered_events_total", "events delivered", ["binding"], registry=r)
        self.bytes = Counter("aep_bridge_relay_delivered_bytes_total", "bytes of events delivered", ["binding"], registry=r)
        self.drops = Counter("aep_bridge_relay_dropped_events_total", "debug/info events dropped toward slow consumers", registry=r)
        self.disconnects = Counter("aep_bridge_relay_backpressure_disconnects_total",
                                   "subscriptions ended because a notice-or-above event found the queue full", registry=r)
        self.refusals = Counter("aep_bridge_relay_refusals_total", "requests and frames refused", ["code"], registry=r)
        self.exhausted = Counter("aep_bridge_relay_replay_exhausted_total", "resume positions older than the replay buffer", registry=r)
        self.ingested = Counter("aep_bridge_relay_ingested_events_total", "events from emitters (POST, WebSocket) stored (new)", registry=r)
        self.commands = Counter("aep_bridge_relay_commands_total", "control commands routed (to the gate or a WebSocket emitter)", registry=r)
        self.claims = Gauge("aep_bridge_relay_claims", "live claims of this replica's WebSocket emitters (sessions x connections)",
                            registry=r)
        self.resumes = Counter("aep_bridge_relay_resumes_total", "subscriptions that resumed (from, Last-Event-ID)", ["kind"], registry=r)
        self.replay_failures = Counter("aep_bridge_relay_replay_failures_total",
                                       "replays that could not complete: the subscription ended, resumable", registry=r)
        self.accept_failures = Counter("aep_bridge_relay_accept_failures_total",
                                       "connections the relay could not accept (no descriptor left)", registry=r)
        self.read_gaps = Counter("aep_bridge_relay_history_read_gaps_total",
                                 "history reads (replay, recorded acks) that lost a delivery and read again", registry=r)


class ConnectionCap:
    """At most ``per_client`` open connections per client address (0: no cap): one more is
    aborted as soon as it is accepted, before aiohttp reads a byte of it, so one address
    cannot take every descriptor of the relay (issue 44 item 5: ~20,100 half-sent requests
    used to lock every other client out). Installed on aiohttp's ``web.Server`` (its
    ``connection_made``/``connection_lost``, which every connection's protocol calls once);
    the HTTP protocol itself stays aiohttp's. Refusals are counted and logged at most once
    per ``LOG_EVERY_S`` (with how many)."""

    LOG_EVERY_S = 10.0

    def __init__(self, per_client: int, metrics: Metrics | None = None) -> None:
        self.per_client = per_client
        self.metrics = metrics
        self.open: dict[str, int] = {}
        self._peer: dict[Any, str] = {}
        self._refused = 0
        self._logged_at = -self.LOG_EVERY_S

    def install(self, server: web.Server) -> None:
        made, lost = server.connection_made, server.connection_lost

        def connection_made(handler: Any, transport: asyncio.Transport) -> None:
            made(handler, transport)
            peer = transport.get_extra_info("peername")
            addr = str(peer[0]) if isinstance(peer, (tuple, list)) and peer else ""
            n = self.open.get(addr, 0)
            if self.per_client and n >= self.per_client:
                self._refuse(addr)
                transport.abort()
                return
            self.open[addr] = n + 1
            self._peer[handler] = addr

        def connection_lost(handler: Any, exc: BaseException | None = None) -> None:
            addr = self._peer.pop(handler, None)
            if addr is not None:
                n = self.open.get(addr, 1) - 1
                if n > 0:
                    self.open[addr] = n
                else:
                    self.open.pop(addr, None)
            lost(handler, exc)

        server.connection_made = connection_made  # type: ignore[method-assign]
        server.connection_lost = connection_lost  # type: ignore[method-assign]

    def _refuse(self, addr: str) -> None:
        self._refused += 1
        if self.metrics is not None:
            self.metrics.refusals.labels("too-many-connections").inc()
        now = asyncio.get_running_loop().time()
        if now - self._logged_at >= self.LOG_EVERY_S:
            import structlog

            structlog.get_logger("aep_bridge.relay").warning("connections_refused", client=addr, refused=self._refused,
                                                  per_client=self.per_client)
            self._logged_at, self._refused = now, 0


class AcceptErrors:
    """The event loop's exception handler with its "socket.accept() out of system resource"
    reports (no descriptor left: asyncio logs each with a traceback, and retries every
    second) folded into one warning per LOG_EVERY_S with how many, and counted; every other
    report goes to the handler that was there."""

    LOG_EVERY_S = 10.0
    MESSAGE = "socket.accept() out of system resource"

    def __init__(self, loop: asyncio.AbstractEventLoop, metrics: Metrics | None = None) -> None:
        self.previous = loop.get_exception_handler()
        self.metrics = metrics
        self.failures = 0
        self._logged_at = -self.LOG_EVERY_S

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != self.MESSAGE:
            if self.previous is not None:
                self.previous(loop, context)
            else:
                loop.default_exception_handler(context)
            return
        self.failures += 1
        if self.metrics is not None:
            self.metrics.accept_failures.inc()
        now = loop.time()
        if now - self._logged_at >= self.LOG_EVERY_S:
            import structlog

            exc = context.get("exception")
            structlog.get_logger("aep_bridge.relay").warning("accept_failed", error=f"{type(exc).__name__}: {exc}" if exc else "",
                                                  failures=self.failures)
            self._logged_at, self.failures = now, 0


async def kv_scan(kv: Any, keys: str) -> list[tuple[str, bytes]]:
    """(key, value) of ``kv``'s live keys matching ``keys``, read through a watch (the bucket
    read the relay's NATS role has). A failure raises (unknown is not empty)."""
    out = []
    watcher = None
    try:
        watcher = await kv.watch(keys, ignore_deletes=True)
        async for entry in watcher:
            if entry is None:
                break
            if entry.value:
                out.append((entry.key, entry.value))
    finally:
        if watcher is not None:
            with contextlib.suppress(Exception):
                await watcher.stop()
    return out


def to_the_end(handler: Callable[[web.Request], Awaitable[Any]]) -> Callable[[web.Request], Awaitable[Any]]:
    """``handler``, run to its end when its client leaves: what the client sent before it
    went (a POST's batch, a WebSocket's last frames) is still stored. The server cancels a
    handler whose client left (``Relay.start``), for SSE's sake; this one's work goes on in
    its own task, and the cancellation is raised once it is done."""

    @functools.wraps(handler)
    async def run(request: web.Request) -> Any:
        task = asyncio.ensure_future(handler(request))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            await asyncio.wait([task])
            raise

    return run


LOOPBACK_NAMES = frozenset(("localhost", "127.0.0.1", "::1"))


def _host_of(value: str) -> str:
    """The host of a ``Host`` header or an Origin's authority, without its port, lower case."""
    h = value.strip()
    if h.startswith("["):
        return h[1:h.find("]")].lower() if "]" in h else h.strip("[]").lower()
    return (h.rsplit(":", 1)[0] if ":" in h else h).lower()


def local_request_problem(host: str | None, origin: str | None, bound: str) -> str | None:
    """Why a request to a relay without tokens (loopback only) is not from this machine's own
    clients, or None. The rule of ``hermes dashboard`` (hermes_cli/web_server.py
    ``_is_accepted_host`` and its WebSocket Origin check): the ``Host`` names a loopback
    name or the address bound (a DNS-rebound name does not), and an ``Origin``, when sent
    (browsers always send it on a WebSocket and a cross-origin request), is an http(s)
    one on such a host. Unlike the dashboard, ``Origin: null`` and non-web origins are
    refused: with no token there is no credential behind them."""
    accepted = LOOPBACK_NAMES | {bound.lower()}
    if not host or _host_of(host) not in accepted:
        return "the Host header must name this machine (localhost, 127.0.0.1, [::1]) on a relay without tokens"
    if origin is None:
        return None
    scheme, sep, rest = origin.strip().partition("://")
    if not sep or scheme.lower() not in ("http", "https") or _host_of(rest.split("/", 1)[0]) not in accepted:
        return "a web page from another origin may not use a relay without tokens"
    return None


def bearer(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return request.query.get("access_token")
