"""The relay process: ``Relay`` wires the hub (``hub``), presence (``presence``), routing
(``routing``), the HTTP endpoints with SSE (``endpoints``) and the WebSocket session
(``websocket``) into one aiohttp application; ``RelayService`` is the relay's side of the
services' one shape (`bridge.runtime.Service`), which `serve` runs. Bindings and frames per
AEP-0003; the fan-out is ``hub.Hub``.
"""

from __future__ import annotations

import asyncio
import math
import ssl
from typing import Any

import structlog
from aiohttp import web

from prometheus_client import CollectorRegistry

from bridge.core.ceiling import LEVELS
from bridge.core.downlevel import payload_fields
from bridge.runtime import Health, Loop, Service, Settings, SettingError, Stopper, connect_service, follow
from bridge.runtime import streams as S
from bridge.runtime import subjects as subj
from bridge.services.relay.claims import Claims
from bridge.services.relay.config import Principal, RelayConfig
from bridge.services.relay.endpoints import HttpEndpoints
from bridge.services.relay.hub import Hub, Item, Subscription
from bridge.services.relay.presence import Presence, StoreUnavailable
from bridge.services.relay.replicas import SharedClaims, SourceBindings, new_id
from bridge.services.relay.routing import Router
from bridge.services.relay.shared import (MAX_REQUEST_LINE, AcceptErrors, ConnectionCap, Metrics, bearer,
                                          local_request_problem, to_the_end)
from bridge.services.relay.websocket import WebSocketSessions

log = structlog.get_logger("aep_bridge.relay")
BACKLOG = 1024  # connections the kernel queues before the relay accepts them (aiohttp's default 128)


class Relay(HttpEndpoints, WebSocketSessions):
    """One relay process: the hub, presence, the router, the aiohttp application, the counters."""

    def __init__(self, cfg: RelayConfig, js: Any = None, nc: Any = None, instance: str = "",
                 health: Health | None = None, registry: CollectorRegistry | None = None) -> None:
        self.cfg = cfg
        self.js = js
        self.nc = nc
        self.instance = instance
        #: what /healthz answers: the runtime's view (the connection's state, a failure it found)
        self.health = health if health is not None else relay_health()
        self.health.connection = nc
        self.metrics = Metrics(registry)
        self.hub = Hub(js, cfg.replay_buffer, self.metrics)
        self.sockets: set[web.WebSocketResponse] = set()
        self.socket_subs: dict[web.WebSocketResponse, dict[str, Subscription]] = {}
        self.stopping = asyncio.Event()
        self.replica = new_id()  # this process among the relay replicas (`replicas`)
        self.shared = SharedClaims(js, nc, self.replica, cfg.claim_ttl_s) if js is not None and nc is not None else None
        self.claims = Claims(self.shared)
        self.presence = Presence(js, nc, cfg.idle_ttl_s)
        self.router = Router(js, self.hub, self.claims, self.presence, self.metrics, nc=nc, replica=self.replica,
                             shared=self.shared, bindings=SourceBindings(js) if js is not None else None)
        self.hub.listeners.append(self.router.on_item)
        self.hub.listeners.append(self._note_hermes)
        self.app = web.Application(client_max_size=cfg.max_body, middlewares=[self._logged, self._same_machine])
        self.app.router.add_get("/healthz", self.healthz)
        self.app.router.add_get("/readyz", self.readyz)
        self.app.router.add_get("/metrics", self.metrics_page)
        self.app.router.add_get("/events", self.discovery)
        self.app.router.add_post("/events", to_the_end(self.ingest))
        self.app.router.add_get("/.well-known/aep", self.discovery)
        self.app.router.add_get("/stream", self.stream)
        self.app.router.add_get("/socket", to_the_end(self.socket))
        self.app.on_shutdown.append(self._on_shutdown)

    # ------------------------------------------------------------ what both bindings use

    def capabilities(self, accepts: list[str]) -> dict[str, Any]:
        return {
            "filters": ["attr-match"],
            "replay": {"buffer": self.cfg.replay_buffer, "all": True},
            "capture": list(LEVELS),
            "control": {"accepts": accepts},
            "roster": {},
            "experimental": {"x-aep-bridge": {
                "replay_buffer": "global count: the last N events of AEP_EVENTS",
                # a Hermes session with no raw message this long leaves the roster and takes no command
                "session_idle_ttl_s": int(self.cfg.idle_ttl_s),
            }},
        }

    def refuse(self, status: int, code: str, detail: str, **extra: Any) -> web.Response:
        self.metrics.refusals.labels(code).inc()
        headers = {"WWW-Authenticate": 'Bearer realm="aep"'} if status == 401 else None
        return web.json_response({"error": code, "detail": detail, **extra}, status=status, headers=headers)

    @web.middleware
    async def _same_machine(self, request: web.Request, handler: Any) -> Any:
        """Without tokens (a loopback development relay) every request, the WebSocket's
        upgrade included, comes from this machine's own clients: Host and Origin checked
        (`shared.local_request_problem`; issue 44 item 5)."""
        if not self.cfg.auth_required:
            problem = local_request_problem(request.headers.get("Host"), request.headers.get("Origin"), self.cfg.host)
            if problem:
                return self.refuse(403, "unauthorized", problem)
        return await handler(request)

    def principal(self, request: web.Request) -> Principal | None:
        return self.cfg.authenticate(bearer(request))

    async def emit_refusal(self, who: Principal, event: dict[str, Any]) -> tuple[int, str, str] | None:
        """Why ``who`` may not store ``event`` (status, code, detail), or None: its agent and
        source must be the token's (`config.Principal`), and its session not a Hermes
        session, whatever the token (its positions and commands are the bridge's pipeline's
        and the gate's: `Presence.hermes_owned`)."""
        refusal = who.emit_refusal(event)
        if refusal:
            return 403, "unauthorized", refusal
        session = event.get("session")
        if isinstance(session, str) and session:
            try:
                hermes = await self.presence.hermes_owned(session)
            except StoreUnavailable as exc:
                return 503, "unavailable", f"the relay could not read AEP_EVENTS: {exc}"
            if hermes:
                return 403, "unauthorized", "this session is a Hermes session: its events are the bridge's pipeline's"
        return None

    def _note_hermes(self, item: Item) -> None:
        """Hub listener: a session with an event under aep.hermes.> is the bridge's."""
        if item.session and item.subject.startswith(subj.EVENTS_PREFIX + "."):
            self.presence.note_hermes(item.session)

    async def _replay(self, sub: Subscription, start: Any, exhausted: Any) -> None:
        try:
            await self.hub.replay(sub, start, exhausted)
        except Exception as exc:  # noqa: BLE001 - a replay that failed ends the subscription, resumable
            log.warning("replay_failed", error=f"{type(exc).__name__}: {exc}")
            self.metrics.replay_failures.inc()
            sub.end_reason, sub.overflowed = "replay-failed", True
        finally:
            sub.wake.set()

    async def _on_shutdown(self, app: web.Application) -> None:
        self.stopping.set()
        for ws in list(self.sockets):
            await self._close_socket(ws, "shutdown")
        if self.shared is not None:
            await self.shared.stop()

    # ------------------------------------------------------------ life

    async def start(self) -> web.AppRunner:
        payload_fields("session.started")  # the field-level table (~50 ms to build): now, not on a subscriber's first event
        if self.js is not None:
            await self.hub.start()
        if self.shared is not None:
            self.shared.start()
            await self.router.start_replica()
            log.info("relay_replica", replica=self.replica)
        self._expirer = asyncio.ensure_future(self.router.expire())
        # handler_cancellation: a client that closes its connection ends its handler at once
        # (an SSE stream that waits for events would notice only at its next write or
        # heartbeat, and stay in the fan-out and the gauges until then); POST /events and
        # the WebSocket run to their end all the same (`to_the_end`). max_line_size: a
        # `from` of MAX_FROM_POSITIONS positions fits an SSE request line (aiohttp's 8,190
        # bytes would answer a plain-text 400 before the relay can say limit-exceeded).
        # keepalive_timeout: aiohttp closes a connection whose handler waits for a request this
        # long, from the connection's start (headers sent slowly, or none) and between requests;
        # lingering_time: how long it reads the rest of a body the handler did not (a 408 on a
        # body sent slowly, a 413) before it closes
        runner = web.AppRunner(self.app, access_log=None, handle_signals=False, handler_cancellation=True,
                               max_line_size=MAX_REQUEST_LINE, keepalive_timeout=self.cfg.request_timeout_s,
                               lingering_time=self.cfg.request_timeout_s)
        await runner.setup()
        assert runner.server is not None
        ConnectionCap(self.cfg.max_connections_per_client, self.metrics).install(runner.server)
        ctx = None
        if self.cfg.tls_cert:
            ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ctx.load_cert_chain(self.cfg.tls_cert, self.cfg.tls_key)
        site = web.TCPSite(runner, self.cfg.host, self.cfg.port, ssl_context=ctx, shutdown_timeout=2.0, backlog=BACKLOG)
        try:
            await site.start()
        except OSError as exc:  # taken, or not an address here: a setting (exit 2, not a restart loop)
            await runner.cleanup()
            raise SettingError(f"AEP_BRIDGE_RELAY_LISTEN (--listen): cannot listen on {self.cfg.host}:{self.cfg.port}: "
                               f"{exc.strerror or exc}") from None
        if self.cfg.port == 0:  # an ephemeral port (tests): the one bound
            self.cfg.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return runner




def relay_health() -> Health:
    """The relay's Health. No loop of its own beats it (aiohttp answering is its liveness): it is
    never stalled, but red once its connection is closed or the runtime found it unusable."""
    return Health("relay", stall_after_s=math.inf)


class RelayService(Service):
    """The relay under the services' runtime (`serve`: signals, the connection watched, exit
    codes). Its HTTP port is its own (aiohttp: /healthz, /readyz, /metrics of its registry
    beside the AEP bindings, on AEP_BRIDGE_RELAY_LISTEN), so it has no `default_port`; its
    loops are aiohttp's and the hub's (`start` returns none)."""

    name = "relay"
    default_port = None

    def __init__(self, settings: Settings, cfg: RelayConfig) -> None:
        self.settings = settings
        self.cfg = cfg
        self.health = relay_health()
        self.stopper = Stopper()
        self.registry = CollectorRegistry()
        self.relay: Relay | None = None
        self.runner: web.AppRunner | None = None

    def starting(self) -> dict[str, Any]:
        return {"listen": self.cfg.url}

    async def start(self) -> list[Loop]:
        self.nc = await connect_service(self.settings, name=f"aep-bridge-relay-{self.settings.instance}", role="relay")
        if (follower := follow.of(self.nc)) is not None:
            follower.lead(S.AEP_EVENTS)  # a server that cannot reach its leader is left (bridge.nats.follow)
        self.relay = Relay(self.cfg, self.nc.jetstream(), self.nc, self.settings.instance, health=self.health,
                           registry=self.registry)
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(AcceptErrors(loop, self.relay.metrics))
        self.runner = await self.relay.start()
        log.info("relay_listening", url=self.cfg.url, auth="tokens" if self.cfg.auth_required else "none (loopback)",
                 replay_buffer=self.cfg.replay_buffer)
        return []

    async def stop(self) -> None:
        if self.relay is not None:
            await self.relay.hub.stop()
        if self.runner is not None:
            await self.runner.cleanup()
