"""The HTTP endpoints: discovery (``GET /events``, ``/.well-known/aep``), ``/healthz``,
``/readyz``, ``/metrics``, ``POST /events`` (``ingest``) and the SSE binding (``GET /stream``).

A mixin of ``service.Relay``: it works on the relay's hub, presence and metrics.

Logging: aiohttp's access log is off (its line carries the query string, where an
EventSource client's ``access_token`` travels); the relay logs method, path and status
only, and never a header or a query string.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import structlog
from aiohttp import hdrs, web
from prometheus_client import generate_latest

from bridge.core.attrmatch import InvalidFilter
from bridge.core.ceiling import level_rank
from bridge.runtime import subjects as subj
from bridge.services.relay import ingest
from bridge.services.relay.config import RelayConfig
from bridge.services.relay.hub import (Exhausted, Item, RefusedFrom, Subscription, intern_filter, parse_from,
                                       parse_last_event_id)
from bridge.services.relay.shared import MAX_FROM_POSITIONS, VERSIONS

log = structlog.get_logger("aep_bridge.relay")

DIRECT_BUFFER = 1 << 16  # bytes waiting in a connection's buffer past which SSE writes wait for the client


class HttpEndpoints:
    """The plain endpoints and SSE; ``service.Relay`` provides the state."""

    cfg: RelayConfig
    nc: Any
    health: Any  # bridge.runtime.Health
    js: Any
    hub: Any  # hub.Hub
    presence: Any  # presence.Presence
    claims: Any  # claims.Claims
    metrics: Any  # shared.Metrics
    stopping: asyncio.Event

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


    # ------------------------------------------------------------ plain endpoints

    async def healthz(self, request: web.Request) -> web.Response:
        """The runtime's Health: ``nats`` is the connection's state (``reconnecting`` while the
        server is away); 503 once it is closed or found unusable (credentials refused)."""
        ok, body = self.health.healthz()
        return web.json_response({**body, "position": self.hub.position}, status=200 if ok else 503)

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
            "capabilities": self.capabilities(await self.presence.accepts()),
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
            async with asyncio.timeout(self.cfg.request_timeout_s):  # a body sent slowly holds a connection: not past this
                body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return self.refuse(413, "too-large", f"at most {self.cfg.max_body} bytes per request")
        except TimeoutError:
            resp = self.refuse(408, "timeout", f"the body did not arrive within {self.cfg.request_timeout_s:g} s")
            resp.force_close()
            return resp
        try:
            checked = ingest.check_lines(ingest.split_body(body, ctype == "application/x-ndjson"))
        except ingest.InvalidEvent as exc:
            self.metrics.refusals.labels("invalid-event").inc()
            return web.json_response({"error": "invalid-event", "detail": exc.detail, "line": exc.line}, status=400)
        if not checked:
            return self.refuse(400, "invalid-event", "no event in the body")
        sessions = {e["session"] for _, e in checked if isinstance(e.get("session"), str) and e["session"]}
        if len(sessions) > 1:  # whether each is a Hermes session: asked together, not one by one
            await self.presence.check_hermes(sessions)
        for line, (_, event) in enumerate(checked):  # one refused line refuses the batch: nothing stored
            refusal = await self.emit_refusal(who, event)
            if refusal:
                return self.refuse(*refusal, line=line)
        new = dup = 0
        for raw, event in checked:
            ack = await self.js.publish(subj.ingest_subject(ingest.lane_of(event), event["type"]), raw,
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
                    raise RefusedFrom("Last-Event-ID is {session}:{epoch}:{seq}, integer epoch and seq >= 0")
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
                    if sub.end_reason == "backpressure":
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
