"""The WebSocket session (``/socket``, AEP-0003 §4): hello, subscribe / unsubscribe and their
pumps, roster, ping, an emitter's events, and an operator's commands (handed to ``routing``).

A mixin of ``service.Relay``: it works on the relay's hub, router, presence, claims and metrics."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import structlog
from aiohttp import WSMsgType, web

from bridge.core.attrmatch import InvalidFilter
from bridge.core.ceiling import level_rank
from bridge.runtime import subjects as subj
from bridge.services.relay import ingest
from bridge.services.relay.claims import MAX_DECLARATIONS_BYTES, Claimant
from bridge.services.relay.config import Principal
from bridge.services.relay.hub import Exhausted, Item, RefusedFrom, Subscription, intern_filter, parse_from
from bridge.services.relay.presence import StoreUnavailable
from bridge.services.relay.routing import ACK_TYPES
from bridge.services.relay.shared import MAX_FROM_POSITIONS, VERSIONS, decode as _decode, encode as _encode

log = structlog.get_logger("aep_bridge.relay")

MAX_SUBS_PER_CONNECTION = 64
WS_HEARTBEAT_S = 30.0


class WebSocketSessions:
    """``/socket`` and what one connection does; ``service.Relay`` provides the state."""

    instance: str
    js: Any
    hub: Any  # hub.Hub
    router: Any  # routing.Router
    presence: Any  # presence.Presence
    claims: Any  # claims.Claims
    shared: Any  # replicas.SharedClaims | None: the other replicas' claims
    metrics: Any  # shared.Metrics
    sockets: set[web.WebSocketResponse]
    socket_subs: dict[web.WebSocketResponse, dict[str, Subscription]]
    cfg: Any  # config.RelayConfig

    async def socket(self, request: web.Request) -> web.StreamResponse:
        who = self.principal(request)
        if who is None:
            return self.refuse(401, "unauthorized", "a bearer token is required")
        # heartbeat: a ping every WS_HEARTBEAT_S, closed without a pong in half of it (a peer
        # gone without a word: idle timeout; every AEP client library answers pings)
        ws = web.WebSocketResponse(max_msg_size=1 << 20, autoping=True, heartbeat=WS_HEARTBEAT_S)
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
            while True:
                try:  # the hello within the request timeout: a connection that says nothing is closed
                    msg = await ws.receive(timeout=None if role is not None else self.cfg.request_timeout_s)
                except asyncio.TimeoutError:
                    self.metrics.refusals.labels("hello-required").inc()
                    await send({"type": "error", "code": "hello-required",
                                "detail": f"no hello within {self.cfg.request_timeout_s:g} s"})
                    await ws.close()
                    break
                if msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED):
                    break
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
                        refusal = who.agent_refusal(claimant.agent) if claimant.agent is not None else None
                        if refusal:  # a roster entry shows the hello's identity: it is the token's
                            self.metrics.refusals.labels("unauthorized").inc()
                            await send({"type": "error", "code": "unauthorized", "detail": refusal})
                            await ws.close()
                            break
                        if claimant.declarations_size() > MAX_DECLARATIONS_BYTES:
                            self.metrics.refusals.labels("limit-exceeded").inc()
                            await send({"type": "error", "code": "limit-exceeded",
                                        "detail": f"an emitter's identity, control and emits: at most {MAX_DECLARATIONS_BYTES} bytes of JSON"})
                            await ws.close()
                            break
                    await send({"type": "hello", "versions": [chosen], "role": "both",
                                "identity": {"agent": "aep-bridge-relay", "instance": self.instance or "relay"},
                                "capabilities": self.capabilities(await self.presence.accepts())})
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
                        await self.router.command(raw, frame, who, send, subs)
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
                    if sub.end_reason == "backpressure":
                        self.metrics.disconnects.inc()
                    await self._close_socket(ws, sub.end_reason)
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
        refusal = await self.emit_refusal(who, event)
        if refusal:
            return await refuse(refusal[1], refusal[2])
        try:
            ack = await self.js.publish(subj.ingest_subject(ingest.lane_of(event), event["type"]), data,
                                        headers={"Nats-Msg-Id": ingest.msg_id(event)})
        except Exception as exc:  # noqa: BLE001 - NATS away: the emitter is told, nothing is claimed
            log.warning("event_not_stored", error=type(exc).__name__)
            return await refuse("unavailable", "the relay could not reach the event store")
        if not ack.duplicate:
            self.metrics.ingested.inc()
        session = event.get("session")
        if isinstance(session, str) and session and not self.claims.claim(claimant, session):
            self.metrics.refusals.labels("limit-exceeded").inc()
        if event["type"] in ACK_TYPES:
            self.router.settle(event, data, claimant)

    async def _roster(self, frame: dict[str, Any], who: Principal, role: str, send: Any) -> None:
        """AEP-0003 §4.1: a snapshot of the live claims this relay routes to, one entry per
        claim (`bridge.services.relay.claims`): the live Hermes sessions with the gate's
        declared control block verbatim (none without a gate: no route), then the sessions
        of every replica's WebSocket emitters with their own declarations verbatim, less
        those a live Hermes session shadows (its commands are the gate's)."""
        rid = frame.get("id")
        if rid is None:
            return  # a roster request carries an id; without one there is nothing to answer
        if not who.may_consume or role == "emitter":
            self.metrics.refusals.labels("unauthorized").inc()
            await send({"type": "error", "id": rid, "code": "unauthorized", "detail": "roster is watch-class"})
            return
        hello = await self.presence.gate_hello()
        entries: list[dict[str, Any]] = []
        try:
            live = await self.presence.hermes_sessions()
        except StoreUnavailable:
            live = []  # the control bucket unreadable: no Hermes session is reachable now
        if hello is not None:
            identity = hello.get("identity") if isinstance(hello.get("identity"), dict) else {}
            control = (hello.get("capabilities") or {}).get("control")
            for session, info in live:
                entry: dict[str, Any] = {"session": session}
                if isinstance(identity.get("agent"), str):
                    entry["agent"] = identity["agent"]
                if info.instance:
                    entry["instance"] = info.instance
                if isinstance(control, dict):
                    entry["control"] = control
                entries.append(entry)
        shadowed = {session for session, _ in live}
        remote = await self.shared.entries() if self.shared is not None else []
        # a live Hermes session's name is the gate's alone, and a Hermes session is never an emitter's
        entries.extend(e for e in (*self.claims.entries(), *remote)
                       if e.get("session") not in shadowed and not self.presence.known_hermes(e.get("session")))
        await send({"type": "roster", "id": rid, "entries": entries})
