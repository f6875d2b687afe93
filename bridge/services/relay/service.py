"""The relay's HTTP surface (aiohttp): discovery, /healthz, /metrics, SSE /stream,
WebSocket /socket. Bindings and frames per AEP-0003; the fan-out is ``hub.Hub``.

Logging: aiohttp's access log is off (its line carries the query string, where an
EventSource client's ``access_token`` travels); the relay logs method, path and status
only, and never a header or a query string.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import json
import ssl
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import structlog
from aiohttp import WSMsgType, hdrs, web
from nats.errors import NoRespondersError
from nats.js.errors import BucketNotFoundError
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from bridge.config import Settings
from bridge.core.control import HELLO_SUBJECT, SessionInfo, is_ack_of
from bridge.core.lanes import lane_from_token, lane_token
from bridge.nats.streams import CONTROL_BUCKET
from bridge.nats.subjects import EVENTS_PREFIX, command_subject, control_filter, ingest_subject
from bridge.services.relay import ingest
from bridge.services.relay.claims import MAX_DECLARATIONS_BYTES, Claimant, Claims
from bridge.core.attrmatch import InvalidFilter
from bridge.core.capture import LEVELS, downlevel_fields, level_rank, payload_fields
from bridge.nats.connection import connect_service
from bridge.runtime import Health, Loop, Stopper, serve
from bridge.services.relay.config import Principal, RelayConfig
from bridge.services.relay.hub import (Exhausted, Hub, Item, RefusedFrom, Subscription, intern_filter, parse_from,
                                       parse_last_event_id)

# The gate's hello (`Relay.gate_hello`): an answer is kept HELLO_FRESH_S; "no gate" only
# HELLO_NONE_S, so a restarted gate is routed to again within a second. A gate that is
# subscribed but slow to answer (busy, paused) keeps its last answer HELLO_GRACE_S after it
# was given: a Hermes session's commands are durable on AEP_EVENTS, the gate takes them when
# it runs again. No responders means no gate, at once.
HELLO_FRESH_S = 5.0
HELLO_NONE_S = 1.0
HELLO_GRACE_S = 30.0
HELLO_TIMEOUT_S = 1.0

log = structlog.get_logger("relay")

VERSIONS = ["0.1"]
MAX_SUBS_PER_CONNECTION = 64
MAX_FROM_POSITIONS = 256
FORWARD_TIMEOUT_S = 5.0  # a WebSocket emitter that does not take a command within this is closed
LIVE_CACHE_S = 1.0  # the live Hermes sessions are read at most this often for rosters
DIRECT_BUFFER = 1 << 16  # bytes waiting in a connection's buffer past which SSE writes wait for the client
CONTROL_TYPES = ("control.attention.respond", "x.hermes.control.instruct")
ACK_TYPES = frozenset(("control.accepted", "control.rejected"))
ANSWERED_MAX = 10_000  # recorded gate acks kept for retries (each ~1 KiB with its Item)
ANSWERED_TTL_S = 600.0
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


@dataclass
class Pending:
    """A routed command waiting for its ack."""

    session: str
    senders: list[tuple[Any, int, dict]]  # (send, the sender's capture ceiling, its subscriptions)
    deadline: float
    target: Claimant | None = None  # the WebSocket emitter it went to; None: the gate


class StoreUnavailable(Exception):
    """The control bucket could not be read (NATS trouble): nothing is known, nothing routed."""


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
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


def bearer(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return request.query.get("access_token")


class Relay:
    """One relay process: the hub, the aiohttp application, the counters."""

    def __init__(self, cfg: RelayConfig, js: Any = None, nc: Any = None, instance: str = "") -> None:
        self.cfg = cfg
        self.js = js
        self.nc = nc
        self.instance = instance
        self.metrics = Metrics()
        self.hub = Hub(js, cfg.replay_buffer, self.metrics)
        self.sockets: set[web.WebSocketResponse] = set()
        self.socket_subs: dict[web.WebSocketResponse, dict[str, Subscription]] = {}
        self.stopping = asyncio.Event()
        self.pending: dict[tuple[str, str], Pending] = {}
        self.pending_by_cid: dict[str, list[tuple[str, str]]] = {}
        # (source, id) -> (session, the gate's ack, when): a retry after the decision is
        # answered from here; past it (another replica, a restart), from the history
        self.answered: collections.OrderedDict[tuple[str, str], tuple[str, Item, float]] = collections.OrderedDict()
        self._hello: tuple[float, dict[str, Any] | None] | None = None  # (asked at, what it means now)
        self._hello_answer: tuple[float, dict[str, Any]] | None = None  # (answered at, the gate's last answer)
        self.claims = Claims()
        self._tasks: set[asyncio.Future] = set()
        self._live_cache: tuple[float, asyncio.Future] | None = None
        self.hub.listeners.append(self._on_item)
        self.app = web.Application(client_max_size=cfg.max_body, middlewares=[self._logged])
        self.app.router.add_get("/healthz", self.healthz)
        self.app.router.add_get("/readyz", self.readyz)
        self.app.router.add_get("/metrics", self.metrics_page)
        self.app.router.add_get("/events", self.discovery)
        self.app.router.add_post("/events", self.ingest)
        self.app.router.add_get("/.well-known/aep", self.discovery)
        self.app.router.add_get("/stream", self.stream)
        self.app.router.add_get("/socket", self.socket)
        self.app.on_shutdown.append(self._on_shutdown)

    # ------------------------------------------------------------ plumbing

    @web.middleware
    async def _logged(self, request: web.Request, handler: Any) -> Any:
        try:
            resp = await handler(request)
        except web.HTTPException as exc:
            log.info("http", method=request.method, path=request.path, status=exc.status)
            raise
        if request.path not in ("/healthz", "/readyz", "/metrics"):
            log.info("http", method=request.method, path=request.path, status=getattr(resp, "status", 0))
        return resp

    async def accepts(self) -> list[str]:
        """What this relay routes: the gate's declared accepts (none without a gate)."""
        hello = await self.gate_hello()
        control = ((hello or {}).get("capabilities") or {}).get("control") or {}
        return [t for t in control.get("accepts") or [] if t in CONTROL_TYPES]

    def capabilities(self, accepts: list[str]) -> dict[str, Any]:
        return {
            "filters": ["attr-match"],
            "replay": {"buffer": self.cfg.replay_buffer, "all": True},
            "capture": list(LEVELS),
            "control": {"accepts": accepts},
            "roster": {},
            "experimental": {"x-aep-bridge": {"replay_buffer": "global count: the last N events of AEP_EVENTS"}},
        }

    def refuse(self, status: int, code: str, detail: str, **extra: Any) -> web.Response:
        self.metrics.refusals.labels(code).inc()
        headers = {"WWW-Authenticate": 'Bearer realm="aep"'} if status == 401 else None
        return web.json_response({"error": code, "detail": detail, **extra}, status=status, headers=headers)

    def principal(self, request: web.Request) -> Principal | None:
        return self.cfg.authenticate(bearer(request))

    # ------------------------------------------------------------ plain endpoints

    async def healthz(self, request: web.Request) -> web.Response:
        ok = self.nc is None or not self.nc.is_closed
        return web.json_response({"status": "ok" if ok else "nats closed", "position": self.hub.position}, status=200 if ok else 503)

    async def readyz(self, request: web.Request) -> web.Response:
        """Ready: connected to NATS and the hub consuming AEP_EVENTS."""
        ok = self.nc is not None and self.nc.is_connected and self.hub._sub is not None
        return web.json_response({"ready": ok}, status=200 if ok else 503)

    async def metrics_page(self, request: web.Request) -> web.Response:
        self.metrics.claims.set(sum(len(c) for c in self.claims.by_session.values()))
        return web.Response(body=generate_latest(self.metrics.registry), content_type="text/plain", charset="utf-8")

    async def discovery(self, request: web.Request) -> web.Response:
        return web.json_response({
            "aep": VERSIONS,
            "role": "collector",
            "endpoints": {"events": "/events", "stream": "/stream", "socket": "/socket"},
            "capabilities": self.capabilities(await self.accepts()),
        })

    # ------------------------------------------------------------ POST /events

    async def ingest(self, request: web.Request) -> web.Response:
        who = self.principal(request)
        if who is None:
            return self.refuse(401, "unauthorized", "posting events needs an emitter token")
        if not who.may_emit:
            return self.refuse(403, "unauthorized", f"role {who.role} may not emit")
        version = request.headers.get("AEP-Version", "")
        if version.split(".")[0] != "0" or version not in VERSIONS:
            self.metrics.refusals.labels("version").inc()
            return web.json_response({"versions": VERSIONS}, status=426)
        ctype = request.content_type
        if ctype not in ("application/json", "application/x-ndjson"):
            return self.refuse(415, "unsupported-media-type", "application/json or application/x-ndjson")
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return self.refuse(413, "too-large", f"at most {self.cfg.max_body} bytes per request")
        try:
            checked = ingest.check_lines(ingest.split_body(body, ctype == "application/x-ndjson"))
        except ingest.InvalidEvent as exc:
            self.metrics.refusals.labels("invalid-event").inc()
            return web.json_response({"error": "invalid-event", "detail": exc.detail, "line": exc.line}, status=400)
        if not checked:
            return self.refuse(400, "invalid-event", "no event in the body")
        new = dup = 0
        for raw, event in checked:
            ack = await self.js.publish(ingest_subject(ingest.lane_of(event), event["type"]), raw,
                                        headers={"Nats-Msg-Id": ingest.msg_id(event)})
            if ack.duplicate:
                dup += 1
            else:
                new += 1
        self.metrics.ingested.inc(new)
        return web.json_response({"accepted": new, "duplicates": dup}, status=202)

    # ------------------------------------------------------------ SSE

    async def stream(self, request: web.Request) -> web.StreamResponse:
        who = self.principal(request)
        if who is None:
            return self.refuse(401, "unauthorized", "a bearer token is required")
        if not who.may_consume:
            return self.refuse(403, "unauthorized", f"role {who.role} may not consume")
        q = request.query
        try:
            flt = intern_filter(json.loads(q["filter"]) if "filter" in q else {})
            ceiling = who.max_capture
            if "capture" in q:
                ceiling = min(ceiling, level_rank(q["capture"]))
            start: Any = None
            if "from" in q:
                start = "all" if q["from"] == "all" else parse_from(json.loads(q["from"]))
            elif request.headers.get("Last-Event-ID"):
                pos = parse_last_event_id(request.headers["Last-Event-ID"])
                if pos is None:
                    raise RefusedFrom("Last-Event-ID is {session}:{epoch}:{seq}")
                start = [pos]
        except (InvalidFilter, RefusedFrom, ValueError) as exc:
            return self.refuse(400, "invalid-filter", str(exc))
        if isinstance(start, list) and len(start) > MAX_FROM_POSITIONS:
            return self.refuse(400, "limit-exceeded", f"at most {MAX_FROM_POSITIONS} from positions")
        live = q.get("live", "1") != "0"
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        sub = Subscription(flt, ceiling, self.cfg.queue, on_drop=self.metrics.drops.inc)

        def exhausted(ex: Exhausted) -> None:
            self.metrics.exhausted.inc()
            sub.queue.append(f": replay-exhausted {ex.session} {ex.epoch}:{ex.seq}\n\n".encode())

        if start:
            sub.replaying = True
            self.metrics.resumes.labels("all" if start == "all" else "position").inc()
        self.hub.add(sub)
        self.metrics.connections.labels("sse").inc()
        self.metrics.subscriptions.inc()
        replay = asyncio.create_task(self._replay(sub, start, exhausted)) if start else None
        sent = delivered = 0
        loop = asyncio.get_running_loop()
        last_write = loop.time()
        transport = request.transport
        chunked = resp.headers.get(hdrs.TRANSFER_ENCODING, "").lower() == "chunked"

        def frames(items: list[Any]) -> bytes:
            nonlocal delivered, sent
            chunks = []
            for it in items:  # no sub.mark: an SSE client resumes from its own Last-Event-ID
                if isinstance(it, Item):
                    chunks.append(it.sse(ceiling))
                    delivered += 1
                else:
                    chunks.append(it)
            body = b"".join(chunks)
            sent += len(body)
            return body

        def direct(s: Subscription) -> bool:
            """Write what is queued now, on the connection itself (the response's headers went
            with the first write; the body is chunked by hand when aiohttp chunks it), unless
            the connection is closing or its buffer is full: then the task writes, through
            aiohttp, and waits for the client to drain."""
            nonlocal last_write
            if transport is None or transport.is_closing() or transport.get_write_buffer_size() > DIRECT_BUFFER:
                return False
            body = frames(s.take(len(s.queue)))
            transport.write(b"%x\r\n%b\r\n" % (len(body), body) if chunked else body)
            last_write = loop.time()
            return True

        try:
            await resp.write(b": aep-bridge relay\n\n")
            sub.direct = direct
            while not self.stopping.is_set():
                if sub.overflowed:
                    self.metrics.disconnects.inc()
                    break
                items = sub.take()
                if items:
                    await resp.write(frames(items))
                    last_write = loop.time()
                    continue
                if not live and (replay is None or replay.done()) and not sub.queue:
                    await resp.write(b": replay-complete\n\n")  # live=0: the replay is over
                    break
                sub.idle = True  # direct writes may go out while the task waits
                try:
                    async with asyncio.timeout(self.cfg.heartbeat_s):  # no task per wait, unlike wait_for
                        await sub.wake.wait()
                except TimeoutError:
                    if loop.time() - last_write >= self.cfg.heartbeat_s:  # silent that long: ping
                        await resp.write(b": ping\n\n")
                        last_write = loop.time()
                finally:
                    sub.idle = False
        except (ConnectionResetError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            sub.direct = None
            self.hub.remove(sub)
            if replay is not None and not replay.done():
                replay.cancel()
            self.metrics.connections.labels("sse").dec()
            self.metrics.subscriptions.dec()
            self.metrics.delivered.labels("sse").inc(delivered)
            self.metrics.bytes.labels("sse").inc(sent)
        return resp

    async def _replay(self, sub: Subscription, start: Any, exhausted: Any) -> None:
        try:
            await self.hub.replay(sub, start, exhausted)
        except Exception as exc:  # noqa: BLE001 - a replay that failed ends the subscription, resumable
            log.warning("replay failed", error=str(exc))
            sub.overflowed = True
        finally:
            sub.wake.set()

    # ------------------------------------------------------------ WebSocket

    async def socket(self, request: web.Request) -> web.StreamResponse:
        who = self.principal(request)
        if who is None:
            return self.refuse(401, "unauthorized", "a bearer token is required")
        ws = web.WebSocketResponse(max_msg_size=1 << 20, autoping=True)
        await ws.prepare(request)
        self.sockets.add(ws)
        subs: dict[str, Subscription] = {}
        self.socket_subs[ws] = subs
        tasks: dict[str, asyncio.Task] = {}
        lock = asyncio.Lock()
        self.metrics.connections.labels("ws").inc()
        role = None
        claimant: Claimant | None = None

        async def send(obj: Any) -> None:
            async with lock:
                await ws.send_frame(obj if isinstance(obj, bytes) else _encode(obj), WSMsgType.TEXT)

        try:
            async for msg in ws:
                if msg.type == WSMsgType.BINARY:
                    await send({"type": "error", "code": "invalid-frame", "detail": "binary frames are reserved in 0.1"})
                    await ws.close(code=1003)
                    break
                if msg.type != WSMsgType.TEXT:
                    continue
                try:
                    frame = _decode(msg.data)
                except msgspec.DecodeError:
                    frame = None
                if not isinstance(frame, dict) or not isinstance(frame.get("type"), str):
                    if role is None:
                        await send({"type": "error", "code": "hello-required", "detail": "the first frame is hello"})
                        await ws.close()
                        break
                    await send({"type": "error", "code": "invalid-frame", "detail": "a frame is a JSON object with a string type"})
                    continue
                ftype = frame["type"]
                if role is None:
                    if ftype != "hello":
                        self.metrics.refusals.labels("hello-required").inc()
                        await send({"type": "error", "code": "hello-required", "detail": "the first frame is hello"})
                        await ws.close()
                        break
                    versions = frame.get("versions")
                    chosen = next((v for v in versions if v in VERSIONS), None) if isinstance(versions, list) else None
                    if chosen is None:
                        self.metrics.refusals.labels("version-unsupported").inc()
                        await send({"type": "error", "code": "version-unsupported", "versions": VERSIONS})
                        await ws.close()
                        break
                    role = frame.get("role") if frame.get("role") in ("emitter", "consumer", "both") else "consumer"
                    if role in ("emitter", "both"):
                        claimant = Claimant.from_hello(send, frame, ws.close)
                        if claimant.declarations_size() > MAX_DECLARATIONS_BYTES:
                            self.metrics.refusals.labels("limit-exceeded").inc()
                            await send({"type": "error", "code": "limit-exceeded",
                                        "detail": f"an emitter's identity, control and emits: at most {MAX_DECLARATIONS_BYTES} bytes of JSON"})
                            await ws.close()
                            break
                    await send({"type": "hello", "versions": [chosen], "role": "both",
                                "identity": {"agent": "aep-bridge-relay", "instance": self.instance or "relay"},
                                "capabilities": self.capabilities(await self.accepts())})
                    continue
                if ftype == "subscribe":
                    await self._subscribe(frame, who, role, subs, tasks, send, ws)
                elif ftype == "unsubscribe":
                    sid = frame.get("id")
                    sub = subs.pop(sid, None) if isinstance(sid, str) else None
                    if sub is not None:
                        self.hub.remove(sub)
                        self.metrics.subscriptions.dec()
                        task = tasks.pop(sid, None)
                        if task:
                            task.cancel()
                    await send({"type": "unsubscribed", "id": sid})
                elif ftype == "roster":
                    await self._roster(frame, who, role, send)
                elif ftype == "ping":
                    await send({"type": "pong", **({"t": frame["t"]} if "t" in frame else {})})
                elif ftype == "closing":
                    await ws.close()
                    break
                elif "." in ftype:
                    raw = msg.data.encode("utf-8") if isinstance(msg.data, str) else msg.data
                    if ingest.is_command(ftype):
                        await self._event_in(raw, frame, who, send, subs)
                    else:
                        await self._emit_in(raw, frame, who, claimant, send)
                # any other frame type (and hello again, pong, roster...) is ignored: forward compatibility
        except (ConnectionResetError, ConnectionError):
            pass
        finally:
            for sid, sub in subs.items():
                self.hub.remove(sub)
                self.metrics.subscriptions.dec()
            for task in tasks.values():
                task.cancel()
            if claimant is not None:
                self.claims.release(claimant)
            self.sockets.discard(ws)
            self.socket_subs.pop(ws, None)
            self.metrics.connections.labels("ws").dec()
        return ws

    async def _subscribe(self, frame: dict[str, Any], who: Principal, role: str, subs: dict[str, Subscription],
                         tasks: dict[str, asyncio.Task], send: Any, ws: web.WebSocketResponse) -> None:
        sid = frame.get("id")

        async def refuse(code: str, detail: str) -> None:
            self.metrics.refusals.labels(code).inc()
            await send({"type": "error", "id": sid, "code": code, "detail": detail})

        if not isinstance(sid, str) or not sid:
            return await refuse("invalid-filter", "subscribe needs a string id")
        if not who.may_consume or role == "emitter":
            return await refuse("unauthorized", "this connection may not subscribe")
        if sid in subs:
            return await refuse("invalid-filter", f"subscription {sid!r} exists")
        if len(subs) >= MAX_SUBS_PER_CONNECTION:
            return await refuse("limit-exceeded", f"at most {MAX_SUBS_PER_CONNECTION} subscriptions per connection")
        try:
            flt = intern_filter(frame.get("filter", {}))
            ceiling = who.max_capture
            if "capture" in frame:
                if not isinstance(frame["capture"], str):
                    raise ValueError("capture is a level name")
                ceiling = min(ceiling, level_rank(frame["capture"]))
            start = parse_from(frame["from"]) if "from" in frame and frame["from"] is not None else None
        except (InvalidFilter, RefusedFrom, ValueError) as exc:
            return await refuse("invalid-filter", str(exc))
        if isinstance(start, list) and len(start) > MAX_FROM_POSITIONS:
            return await refuse("limit-exceeded", f"at most {MAX_FROM_POSITIONS} from positions")
        sub = Subscription(flt, ceiling, self.cfg.queue, sub_id=sid, on_drop=self.metrics.drops.inc)

        def exhausted(ex: Exhausted) -> None:
            self.metrics.exhausted.inc()
            sub.queue.append({"type": "replay-exhausted", "sub": sid, "session": ex.session,
                              "earliest": {"epoch": ex.epoch, "seq": ex.seq}})

        if start:
            sub.replaying = True
            self.metrics.resumes.labels("all" if start == "all" else "position").inc()
        subs[sid] = sub
        self.hub.add(sub)
        self.metrics.subscriptions.inc()
        await send({"type": "subscribed", "id": sid})
        tasks[sid] = asyncio.create_task(self._pump(sub, start, exhausted, send, ws, subs))

    async def _pump(self, sub: Subscription, start: Any, exhausted: Any, send: Any, ws: web.WebSocketResponse,
                    subs: dict[str, Subscription]) -> None:
        replay = asyncio.create_task(self._replay(sub, start, exhausted)) if start else None
        delivered = sent = 0
        try:
            while not ws.closed:
                if sub.overflowed:
                    self.metrics.disconnects.inc()
                    await self._close_socket(ws, "backpressure")
                    return
                items = sub.take()
                if not items:
                    await sub.wake.wait()
                    continue
                for it in items:
                    if isinstance(it, Item):
                        data = it.data(sub.ceiling)
                        await send(data)
                        sub.mark(it)
                        delivered += 1
                        sent += len(data)
                    else:
                        await send(it)
        except (ConnectionResetError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            if replay is not None and not replay.done():
                replay.cancel()
            self.metrics.delivered.labels("ws").inc(delivered)
            self.metrics.bytes.labels("ws").inc(sent)

    async def _close_socket(self, ws: web.WebSocketResponse, reason: str) -> None:
        subs = self.socket_subs.get(ws, {})
        delivered = [{"sub": sid, "session": session, "epoch": pos[0], "seq": pos[1]}
                     for sid, sub in subs.items() for session, pos in sub.delivered.items()]
        try:
            await ws.send_frame(_encode({"type": "closing", "reason": reason, "delivered": delivered}), WSMsgType.TEXT)
            await ws.close()
        except (ConnectionResetError, ConnectionError, RuntimeError):
            pass

    async def _emit_in(self, raw: bytes, frame: dict[str, Any], who: Principal, claimant: Claimant | None,
                       send: Any) -> None:
        """An Event from a WebSocket emitter (AEP-0003 §3.5 rule 3): checked and stored like a
        POST (``aep.ingest.>``, deduped on ``(source, id)``, the frame's bytes kept), and its
        session becomes a live claim of this connection (the roster, command routing). An ack
        (control.accepted / control.rejected) of a command routed to this very connection
        settles that command toward its sender."""
        eid = frame.get("id")

        async def refuse(code: str, detail: str) -> None:
            self.metrics.refusals.labels(code).inc()
            await send({"type": "error", "cause": eid if isinstance(eid, str) else None, "code": code,
                        "detail": detail})

        if claimant is None or not who.may_emit:
            return await refuse("unauthorized", "events are sent on an emitter connection with an emitter token")
        if claimant.agent is None:
            return await refuse("invalid-event", "the emitter's hello names no identity.agent (AEP-0003 §4 rule 3)")
        try:
            [(data, event)] = ingest.check_lines([raw])
        except ingest.InvalidEvent as exc:
            return await refuse("invalid-event", exc.detail)
        try:
            ack = await self.js.publish(ingest_subject(ingest.lane_of(event), event["type"]), data,
                                        headers={"Nats-Msg-Id": ingest.msg_id(event)})
        except Exception as exc:  # noqa: BLE001 - NATS away: the emitter is told, nothing is claimed
            log.warning("event not stored", error=type(exc).__name__)
            return await refuse("unavailable", "the relay could not reach the event store")
        if not ack.duplicate:
            self.metrics.ingested.inc()
        session = event.get("session")
        if isinstance(session, str) and session and not self.claims.claim(claimant, session):
            self.metrics.refusals.labels("limit-exceeded").inc()
        if event["type"] in ACK_TYPES:
            self._settle(event, data, claimant)

    async def _event_in(self, raw: bytes, frame: dict[str, Any], who: Principal, send: Any,
                        subs: dict[str, Subscription]) -> None:
        """A control command (AEP-0004), only from operator tokens (authentication
        unconditionally), routed to its one live claimant (`bridge.services.relay.claims`).
        The relay's refusals are `error` frames with ``cause`` = the command's id, never
        Events: they enter no session's history. A command for a Hermes session is published
        byte-identically to AEP_EVENTS, where the gate takes it (and where it stays, in the
        session's history); one for a WebSocket emitter's session is forwarded to that
        connection byte-identically, then stored under ``aep.ingest.>``. The target's ack
        comes back to the sender once: the gate's from ``aep.hermes.>`` through the hub, an
        emitter's from its own connection; an ack anyone else posts settles nothing."""
        cid = frame.get("id")

        async def refuse(code: str, detail: str) -> None:
            self.metrics.refusals.labels(code).inc()
            await send({"type": "error", "cause": cid, "code": code, "detail": detail})

        if not who.may_control:
            return await refuse("unauthorized", "control needs an operator token")
        ctype = frame["type"]
        session = frame.get("session")
        if not isinstance(cid, str) or not cid or not isinstance(frame.get("source"), str):
            return await refuse("unsupported", "a command is an AEP event with a string id and source")
        if not isinstance(session, str) or not session:
            return await refuse("no-route", "a command names its session")
        problem = ingest.command_problem(raw)
        if problem:
            return await refuse("unsupported", f"not an AEP command: {problem}")
        recorded = self._answered((frame["source"], cid), session)
        if recorded is not None:  # a retry after the gate's decision: its recorded ack (§2.3, §3)
            self.metrics.commands.inc()
            return await send(recorded.data(who.max_capture))
        try:
            hermes = await self.hermes_session(session)
        except StoreUnavailable:
            return await refuse("no-route", "the relay could not read the control bucket")
        hello = await self.gate_hello() if hermes is not None else None
        emitters = self.claims.of(session)  # after the awaits: a claim made meanwhile counts
        claimants = len(emitters) + (hermes is not None)
        if claimants == 0:
            return await refuse("no-route", "no live claimant of this session is connected to this relay")
        if claimants > 1:
            return await refuse("ambiguous", f"{claimants} live claimants of this session")
        target: Claimant | None = emitters[0] if emitters else None
        if target is not None:
            if not target.accepts(ctype):
                return await refuse("unsupported", f"the claimant accepts {(target.control or {}).get('accepts', [])}")
            window = (target.control or {}).get("ack_window_ms")
        else:
            if hello is None:
                return await refuse("no-route", "no gate answers: the Hermes session takes no command now")
            control = (hello.get("capabilities") or {}).get("control") or {}
            accepts = control.get("accepts") or []
            if ctype not in accepts or ctype not in CONTROL_TYPES:
                return await refuse("unsupported", f"the gate accepts {accepts}")
            window = control.get("ack_window_ms")
        key = (frame["source"], cid)
        waiting = self.pending.get(key)
        if waiting is not None:  # a retry while the decision is pending: the one ack answers it
            if all(send is not other for other, _, _ in waiting.senders):
                waiting.senders.append((send, who.max_capture, subs))
            return
        if target is not None and any(  # an emitter's ack names its command by id alone
                other[0] != key[0] and (e := self.pending.get(other)) is not None and e.session == session
                and e.target is target for other in self.pending_by_cid.get(cid, ())):
            return await refuse("ambiguous", "another source's command with this id is pending for this claimant: "
                                             "retry after its ack")
        window = window if isinstance(window, int) and 0 < window <= 600_000 else 10_000
        entry = Pending(session, [(send, who.max_capture, subs)],
                        asyncio.get_running_loop().time() + window / 1000 + 5, target)
        self.pending[key] = entry
        self.pending_by_cid.setdefault(cid, []).append(key)
        if target is not None:  # off the sender's read loop: a target that stops reading stalls no one
            self._background(self._forward(target, raw, session, ctype, key, refuse))
            return
        try:  # under its (source, id): a retry within the store's duplicate window is not a second copy
            stored = await self.js.publish(command_subject(lane_token(session), ctype), raw,
                                           headers={"Nats-Msg-Id": ingest.msg_id(frame, "command")})
        except Exception as exc:  # noqa: BLE001 - NATS away: refused, the sender may retry
            log.warning("command not published", error=type(exc).__name__)
            self._forget(key)
            return await refuse("no-route", "the relay could not reach the event store")
        self.metrics.commands.inc()
        if not isinstance(stored.seq, int) or stored.seq <= 0:
            return
        if getattr(stored, "duplicate", False):  # the store holds the first copy: the gate never sees this one
            self._background(self._recorded_ack(key, session, begin=stored.seq + 1))
        elif self._maybe_late_retry(frame):  # a new copy, but the decision may be older
            self._background(self._recorded_ack(key, session, last=stored.seq - 1, recent=True))

    def _background(self, coro: Any) -> None:
        """Off the sender's read loop (a forward or a history read must not hold up its next frames)."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _maybe_late_retry(self, frame: dict[str, Any]) -> bool:
        """A command sent (its ``time``) more than half AEP_EVENTS' duplicate window ago: a
        retry may reuse its bytes past the window (a first-time command is seconds old, so it
        costs no history read; half the window leaves room for the sender's clock)."""
        try:
            sent = datetime.datetime.fromisoformat(str(frame.get("time"))).timestamp()
        except (ValueError, OverflowError, OSError):  # not a time the platform can place: look anyway
            return True
        return time.time() - sent > self.hub.duplicate_window_s / 2

    def _answered(self, key: tuple[str, str], session: str) -> Item | None:
        hit = self.answered.get(key)
        if hit is None:
            return None
        if asyncio.get_running_loop().time() - hit[2] > ANSWERED_TTL_S:
            self.answered.pop(key, None)
            return None
        return hit[1] if hit[0] == session else None

    def _remember(self, key: tuple[str, str], session: str, ack: Item) -> None:
        self.answered[key] = (session, ack, asyncio.get_running_loop().time())
        self.answered.move_to_end(key)
        while len(self.answered) > ANSWERED_MAX:
            self.answered.popitem(last=False)

    async def _recorded_ack(self, key: tuple[str, str], session: str, begin: int = 1, last: int | None = None,
                            recent: bool = False) -> None:
        """A retry whose decision is already recorded (AEP-0004 §2.3) gets the recorded ack,
        read from the session's history and re-sent byte-identically (§3). Two cases:
        - the store held the retry (a duplicate of the copy at ``begin - 1``): the gate never
          sees it, and its re-ack would be a duplicate the store drops too; read from ``begin``;
        - ``recent``: the retry came after the command's duplicate window (a new copy at
          ``last + 1``): the gate re-acks it, but the store drops that while the ack's own
          window is open, so an ack stored in the last window before the copy answers it
          (an older one's re-ack is stored and comes live, once).
        Not there: the decision is pending (or this is no retry) and the hub delivers the
        one ack when it comes (the entry was registered before the publish)."""
        source, cid = key

        def recorded(item: Item) -> bool:
            ev = item.event
            return (ev.get("type") in ACK_TYPES and ev.get("cause") == cid and ev.get("session") == session
                    and is_ack_of(ev.get("id"), source, cid))

        try:
            since = None
            if recent:
                await self.hub.window()  # the duplicate window now
                since = time.time_ns() - int(self.hub.duplicate_window_s * 1e9)
            item = await self.hub.first(control_filter(lane_token(session)), recorded, begin=begin, since_ns=since,
                                        last=last)
        except Exception as exc:  # noqa: BLE001 - the hub's live ack still settles it, or the window ends
            log.warning("recorded ack not read", error=type(exc).__name__)
            return
        if item is not None:
            self._settle(item.event, item, None, again=True)

    async def _forward(self, target: Claimant, raw: bytes, session: str, ctype: str, key: tuple[str, str],
                       refuse: Any) -> None:
        """A command to a WebSocket emitter: delivered first (a target that does not take it
        within FORWARD_TIMEOUT_S is closed: it stopped reading), then kept in the session's
        history (AEP-0004 §4 item 4)."""
        try:
            await asyncio.wait_for(target.send(raw), FORWARD_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - gone, or not reading
            log.warning("command not delivered", error=type(exc).__name__)
            self._forget(key)
            self.claims.release(target)
            if target.close is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(target.close(), 1.0)
            with contextlib.suppress(Exception):
                await refuse("no-route", "the claimant did not take the command")
            return
        self.metrics.commands.inc()
        try:
            await self.js.publish(ingest_subject(lane_token(session), ctype), raw,
                                  headers={"Nats-Msg-Id": ingest.msg_id(_decode(raw))})
        except Exception as exc:  # noqa: BLE001 - delivered; only the history copy is missing
            log.warning("command delivered but not stored", error=type(exc).__name__)

    def _forget(self, key: tuple[str, str]) -> None:
        self.pending.pop(key, None)
        keys = self.pending_by_cid.get(key[1], [])
        if key in keys:
            keys.remove(key)
        if not keys:
            self.pending_by_cid.pop(key[1], None)

    def _on_item(self, item: Item) -> None:
        """Hub listener: the gate's ack of a pending Hermes command goes to its sender(s),
        once. Only an ack stored under ``aep.hermes.>`` (which only the bridge writes) counts:
        one posted under ``aep.ingest.>`` with the same cause is somebody else's word."""
        if item.event.get("type") in ACK_TYPES and item.subject.startswith(EVENTS_PREFIX + "."):
            self._settle(item.event, item, None)

    def _settle(self, event: dict[str, Any], payload: Item | bytes, target: Claimant | None,
                again: bool = False) -> None:
        """The ack ``event`` from ``target`` (None: the gate) settles the commands routed to
        that target under its cause and session; the gate's, only the one command its id
        names (another source may use the same id). ``again``: a recorded ack read back for a
        retry, which no live subscription delivers a second time."""
        cause = event.get("cause")
        for key in list(self.pending_by_cid.get(cause, ()) if isinstance(cause, str) else ()):
            entry = self.pending.get(key)
            if entry is None or entry.session != event.get("session") or entry.target is not target:
                continue
            if target is None and not is_ack_of(event.get("id"), *key):
                continue
            self._forget(key)
            if target is None and isinstance(payload, Item):
                self._remember(key, entry.session, payload)
            for send, ceiling, subs in entry.senders:
                if not again and any(sub.filter.matches(event) for sub in subs.values()):
                    continue  # a subscription of the sender's delivers it: once, not twice
                if isinstance(payload, Item):
                    data = payload.data(ceiling)
                else:
                    shown = downlevel_fields(event, ceiling)
                    data = payload if shown is event else _encode(shown)
                asyncio.ensure_future(self._deliver_ack(send, data))

    async def _deliver_ack(self, send: Any, data: bytes) -> None:
        try:
            await send(data)
        except (ConnectionResetError, ConnectionError, RuntimeError):
            pass

    async def _roster(self, frame: dict[str, Any], who: Principal, role: str, send: Any) -> None:
        """AEP-0003 §4.1: a snapshot of the live claims this relay routes to, one entry per
        claim (`bridge.services.relay.claims`): the live Hermes sessions with the gate's
        declared control block verbatim (none without a gate: no route), then the sessions
        of this replica's WebSocket emitters with their own declarations verbatim."""
        rid = frame.get("id")
        if rid is None:
            return  # a roster request carries an id; without one there is nothing to answer
        if not who.may_consume or role == "emitter":
            self.metrics.refusals.labels("unauthorized").inc()
            await send({"type": "error", "id": rid, "code": "unauthorized", "detail": "roster is watch-class"})
            return
        hello = await self.gate_hello()
        entries: list[dict[str, Any]] = []
        if hello is not None:
            identity = hello.get("identity") if isinstance(hello.get("identity"), dict) else {}
            control = (hello.get("capabilities") or {}).get("control")
            try:
                live = await self.hermes_sessions()
            except StoreUnavailable:
                live = []  # the control bucket unreadable: no Hermes session is reachable now
            for session, info in live:
                entry: dict[str, Any] = {"session": session}
                if isinstance(identity.get("agent"), str):
                    entry["agent"] = identity["agent"]
                if info.instance:
                    entry["instance"] = info.instance
                if isinstance(control, dict):
                    entry["control"] = control
                entries.append(entry)
        entries.extend(self.claims.entries())
        await send({"type": "roster", "id": rid, "entries": entries})

    async def _kv_scan(self, keys: str) -> list[tuple[str, bytes]]:
        """(key, value) of the control bucket's live keys matching ``keys``, read through a
        watch (the one bucket read the relay's NATS role has). No bucket: nothing (no gate
        ever ran); any other failure: StoreUnavailable."""
        try:
            kv = await self.js.key_value(CONTROL_BUCKET.bucket)
        except BucketNotFoundError:
            return []
        except Exception as exc:  # noqa: BLE001
            raise StoreUnavailable(type(exc).__name__) from exc
        out = []
        watcher = None
        try:
            watcher = await kv.watch(keys, ignore_deletes=True)
            async for entry in watcher:
                if entry is None:
                    break
                if entry.value:
                    out.append((entry.key, entry.value))
        except Exception as exc:  # noqa: BLE001 - NATS trouble mid-scan: unknown, not empty
            raise StoreUnavailable(type(exc).__name__) from exc
        finally:
            if watcher is not None:
                with contextlib.suppress(Exception):
                    await watcher.stop()
        return out

    @staticmethod
    def _live(token: str, value: bytes) -> tuple[str, SessionInfo] | None:
        try:
            info = msgspec.json.decode(value, type=SessionInfo)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        if info.ended:
            return None
        session = info.session
        if not session:
            try:
                session = lane_from_token(token)
            except ValueError:  # a hashed token from a record older than SessionInfo.session
                return None
        return (session, info) if lane_token(session) == token else None

    async def hermes_sessions(self) -> list[tuple[str, SessionInfo]]:
        """The live Hermes sessions (the gate's ``live.*`` keys: seen, not finalized), read at
        most once a second however many consumers ask."""
        now = asyncio.get_running_loop().time()
        cached = self._live_cache
        if cached is None or now - cached[0] > LIVE_CACHE_S:
            cached = self._live_cache = (now, asyncio.ensure_future(self._scan_live()))
        try:
            return await asyncio.shield(cached[1])
        except StoreUnavailable:
            self._live_cache = None
            raise

    async def _scan_live(self) -> list[tuple[str, SessionInfo]]:
        out = []
        for key, value in await self._kv_scan("live.*"):
            live = self._live(key[5:], value)
            if live is not None:
                out.append(live)
        return out

    async def hermes_session(self, session: str) -> SessionInfo | None:
        """The gate's record of ``session`` if it is a live Hermes session, else None."""
        token = lane_token(session)
        for _, value in await self._kv_scan(f"live.{token}"):
            live = self._live(token, value)
            if live is not None and live[0] == session:
                return live[1]
        return None

    async def gate_hello(self) -> dict[str, Any] | None:
        """The gate's capabilities document, or None when no gate answers (see HELLO_*)."""
        now = asyncio.get_running_loop().time()
        if self._hello is not None and now - self._hello[0] < (HELLO_FRESH_S if self._hello[1] else HELLO_NONE_S):
            return self._hello[1]
        doc = None
        if self.nc is not None:
            try:
                doc = _decode((await self.nc.request(HELLO_SUBJECT, b"", timeout=HELLO_TIMEOUT_S)).data)
            except NoRespondersError:
                doc = None
            except Exception:  # noqa: BLE001 - a timeout: the gate is there but slow, its last word holds a while
                last = self._hello_answer
                doc = last[1] if last is not None and now - last[0] < HELLO_GRACE_S else None
            else:
                if isinstance(doc, dict):
                    self._hello_answer = (now, doc)
        self._hello = (now, doc if isinstance(doc, dict) else None)
        return self._hello[1]

    async def _expire(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = asyncio.get_running_loop().time()
            for key, entry in list(self.pending.items()):
                if entry.deadline < now:
                    self._forget(key)

    async def _on_shutdown(self, app: web.Application) -> None:
        self.stopping.set()
        for ws in list(self.sockets):
            await self._close_socket(ws, "shutdown")

    # ------------------------------------------------------------ life

    async def start(self) -> web.AppRunner:
        payload_fields("session.started")  # the field-level table (~50 ms to build): now, not on a subscriber's first event
        if self.js is not None:
            await self.hub.start()
        self._expirer = asyncio.ensure_future(self._expire())
        runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await runner.setup()
        ctx = None
        if self.cfg.tls_cert:
            ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ctx.load_cert_chain(self.cfg.tls_cert, self.cfg.tls_key)
        site = web.TCPSite(runner, self.cfg.host, self.cfg.port, ssl_context=ctx, shutdown_timeout=2.0)
        await site.start()
        if self.cfg.port == 0:  # an ephemeral port (tests): the one bound
            self.cfg.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return runner


async def run_relay(settings: Settings, cfg: RelayConfig) -> int:
    """The relay under the services' runtime (signals, the connection watched, exit codes); its
    HTTP port is its own (aiohttp: /healthz, /readyz, /metrics beside the AEP bindings)."""
    relay: Relay | None = None
    runner: web.AppRunner | None = None

    async def start() -> list[Loop]:
        nonlocal relay, runner
        nc = await connect_service(settings, name=f"aep-bridge-relay-{settings.instance}", role="relay")
        relay = Relay(cfg, nc.jetstream(), nc, settings.instance)
        runner = await relay.start()
        log.info("relay listening", url=cfg.url, auth="tokens" if cfg.auth_required else "none (loopback)",
                 replay_buffer=cfg.replay_buffer)
        return []

    async def stop() -> None:
        if relay is not None:
            await relay.hub.stop()
        if runner is not None:
            await runner.cleanup()

    return await serve("relay", settings, start, health=Health("relay"), stopper=Stopper(),
                       connection=lambda: relay.nc if relay is not None else None, stop=stop)
