"""Routing of control commands (AEP-0004) to their one live claimant (the gate for a Hermes
session, a WebSocket emitter for its own sessions), and of the claimant's ack back to the
command's sender(s), once; a retry after the decision gets the recorded ack.

The rules come first, as pure functions (no I/O: ``tests/services/relay/test_relay_routing.py``
checks them alone); ``Router`` applies them with the hub, presence, claims and NATS.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import structlog

from bridge.core.ceiling import FULL
from bridge.core.downlevel import downlevel_fields
from bridge.core.control import is_ack_of
from bridge.core.lanes import lane_token
from bridge.runtime import subjects as subj
from bridge.services.relay import ingest
from bridge.services.relay.claims import Claimant, Claims
from bridge.services.relay.config import Principal
from bridge.services.relay.hub import Hub, Item, Subscription
from bridge.services.relay.presence import CONTROL_TYPES, Presence, StoreUnavailable
from bridge.services.relay.replicas import (
    CONN_HEADER,
    FORWARD_REQUEST_TIMEOUT_S,
    REPLICA_HEADER,
    REPLY_HEADER,
    SUBJECT_PREFIX,
    Remote,
    SharedClaims,
    SourceBindings,
    forward_subject,
    reply_subject,
)
from bridge.services.relay.replicas import StoreUnavailable as RelayStoreUnavailable

log = structlog.get_logger("aep_bridge.relay")

FORWARD_TIMEOUT_S = 5.0  # a WebSocket emitter that does not take a command within this is closed
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
    target: Claimant | Remote | None = None  # the WebSocket emitter it went to (here, or another replica's); None: the gate


Refusal = tuple[str, str]  # (AEP-0004 error code, detail)
DEFAULT_ACK_WINDOW_MS = 10_000
MAX_ACK_WINDOW_MS = 600_000
ACK_GRACE_S = 5.0  # a pending command is forgotten this long after its ack window


def shape_refusal(frame: dict[str, Any]) -> Refusal | None:
    """What a command must carry before it can be routed: a string id and source, a session."""
    cid, session = frame.get("id"), frame.get("session")
    if not isinstance(cid, str) or not cid or not isinstance(frame.get("source"), str):
        return ("unsupported", "a command is an AEP event with a string id and source")
    if not isinstance(session, str) or not session:
        return ("no-route", "a command names its session")
    return None


def claimant_refusal(emitters: int, hermes_live: bool) -> Refusal | None:
    """Exactly one live claimant, or a refusal: none is no-route, several are ambiguous. A
    live Hermes session is the gate's even when no gate answers: it shadows emitters' claims
    of its name (an emitter naming it must not block its operators)."""
    if hermes_live:
        return None
    if emitters == 0:
        return ("no-route", "no live claimant of this session is connected to the relay")
    if emitters > 1:
        return ("ambiguous", f"{emitters} live claimants of this session")
    return None


def emitter_refusal(ctype: str, target: Claimant | Remote) -> Refusal | None:
    """A WebSocket emitter takes the types its hello's ``control.accepts`` declares."""
    if not target.accepts(ctype):
        return ("unsupported", f"the claimant accepts {(target.control or {}).get('accepts', [])}")
    return None


def gate_refusal(ctype: str, hello: dict[str, Any] | None) -> Refusal | None:
    """The gate takes the types it declares in its hello, of those the relay routes to it;
    no hello (no gate answers) is no-route."""
    if hello is None:
        return ("no-route", "no gate answers: the Hermes session takes no command now")
    accepts = gate_control(hello).get("accepts") or []
    if ctype not in accepts or ctype not in CONTROL_TYPES:
        return ("unsupported", f"the gate accepts {accepts}")
    return None


def gate_control(hello: dict[str, Any]) -> dict[str, Any]:
    return (hello.get("capabilities") or {}).get("control") or {}


def ack_window_ms(declared: Any) -> int:
    """The claimant's declared ``ack_window_ms`` when sane (1 ms .. 10 min), else 10 s."""
    if isinstance(declared, int) and not isinstance(declared, bool) and 0 < declared <= MAX_ACK_WINDOW_MS:
        return declared
    return DEFAULT_ACK_WINDOW_MS


def late_retry(sent_time: Any, now: float, duplicate_window_s: float) -> bool:
    """A command sent (its ``time``) more than half the store's duplicate window before
    ``now``: a retry may reuse its bytes past the window (a first-time command is seconds
    old, so it costs no history read; half the window leaves room for the sender's clock).
    A time the platform cannot place: look anyway."""
    try:
        sent = datetime.datetime.fromisoformat(str(sent_time)).timestamp()
    except (ValueError, OverflowError, OSError):
        return True
    return now - sent > duplicate_window_s / 2


def settles(key: tuple[str, str], entry: "Pending", event: dict[str, Any], target: Claimant | Remote | None) -> bool:
    """Whether the ack ``event`` from ``target`` (None: the gate) settles the command ``key``
    (source, id) routed as ``entry``: same session and the target it went to; the gate's ack
    also names its command's (source, id) (another source may use the same id)."""
    if entry.session != event.get("session") or entry.target != target:
        return False
    return target is not None or is_ack_of(event.get("id"), *key)


class Router:
    """The commands this relay routed and waits an ack for, and the gate's recent acks."""

    def __init__(self, js: Any, hub: Hub, claims: Claims, presence: Presence, metrics: Any, nc: Any = None,
                 replica: str = "", shared: SharedClaims | None = None, bindings: SourceBindings | None = None) -> None:
        self.js = js
        self.nc = nc
        self.replica = replica  # this replica's id: where other replicas forward commands (replicas.forward_subject)
        self.shared = shared  # the other replicas' claims
        self.bindings = bindings  # which operator token a command source belongs to
        self.hub = hub
        self.claims = claims
        self.presence = presence
        self.metrics = metrics
        self.pending: dict[tuple[str, str], Pending] = {}
        self.pending_by_cid: dict[str, list[tuple[str, str]]] = {}
        # (source, id) -> (session, the gate's ack, when): a retry after the decision is
        # answered from here; past it (another replica, a restart), from the history
        self.answered: collections.OrderedDict[tuple[str, str], tuple[str, Item, float]] = collections.OrderedDict()
        self._tasks: set[asyncio.Future] = set()

    async def command(self, raw: bytes, frame: dict[str, Any], who: Principal, send: Any,
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
        refusal = shape_refusal(frame)
        if refusal:
            return await refuse(*refusal)
        problem = ingest.command_problem(raw)
        if problem:
            return await refuse("unsupported", f"not an AEP command: {problem}")
        impostor = who.command_refusal(frame.get("agent"), frame["source"])
        if impostor:  # the approver on the stream is the token's identity, never the client's word
            return await refuse("unauthorized", impostor)
        if self.bindings is not None:  # a source is the first operator token's that used it
            try:
                owner = await self.bindings.owner(frame["source"], who.name)
            except RelayStoreUnavailable as exc:
                return await refuse("no-route", f"the relay could not read its bucket aep_relay: {exc}")
            if owner != who.name:
                return await refuse("unauthorized", "this source belongs to another operator token")
        recorded = self._answered((frame["source"], cid), session)
        if recorded is not None:  # a retry after the gate's decision: its recorded ack (§2.3, §3)
            self.metrics.commands.inc()
            return await send(recorded.data(who.max_capture))
        try:
            hermes = await self.presence.hermes_session(session)
        except StoreUnavailable:
            return await refuse("no-route", "the relay could not read the control bucket")
        hello = await self.presence.gate_hello() if hermes is not None else None
        remote: list[Remote] = []
        if hermes is None and self.shared is not None:
            try:
                remote = await self.shared.of(session)
            except RelayStoreUnavailable as exc:  # this replica's own claims still route
                log.warning("shared_claims_not_read", error=str(exc))
        # after the awaits: a claim made meanwhile counts; a live Hermes session shadows them all
        emitters: list[Claimant | Remote] = [] if hermes is not None else [*self.claims.of(session), *remote]
        if emitters:  # a Hermes session that is not live (ended, idle) is never an emitter's
            try:
                owned = await self.presence.hermes_owned(session)
            except StoreUnavailable:
                return await refuse("no-route", "the relay could not read AEP_EVENTS")
            if owned:
                return await refuse("no-route", "a Hermes session that is not live takes no command")
        target: Claimant | Remote | None = emitters[0] if emitters else None
        refusal = claimant_refusal(len(emitters), hermes is not None) or (
            emitter_refusal(ctype, target) if target is not None else gate_refusal(ctype, hello))
        if refusal:
            return await refuse(*refusal)
        window = ack_window_ms(((target.control if target is not None else gate_control(hello or {})) or {})
                               .get("ack_window_ms"))
        key = (frame["source"], cid)
        enlisted = self._enlist(key, session, target, (send, who.max_capture, subs), window)
        if enlisted is not True:  # a retry joined the pending command, or a refusal
            return await refuse(*enlisted) if enlisted else None
        if isinstance(target, Remote):  # another replica's emitter: that replica forwards it
            self._background(self._forward_remote(target, raw, key, refuse))
            return
        if target is not None:  # off the sender's read loop: a target that stops reading stalls no one
            self._background(self._forward(target, raw, session, ctype, key, refuse))
            return
        try:  # under its (source, id): a retry within the store's duplicate window is not a second copy
            stored = await self.js.publish(subj.command_subject(lane_token(session), ctype), raw,
                                           headers={"Nats-Msg-Id": ingest.msg_id(frame, "command")})
        except Exception as exc:  # noqa: BLE001 - NATS away: refused, the sender may retry
            log.warning("command_not_published", error=type(exc).__name__)
            self._forget(key)
            return await refuse("no-route", "the relay could not reach the event store")
        self.metrics.commands.inc()
        if not isinstance(stored.seq, int) or stored.seq <= 0:
            return
        if getattr(stored, "duplicate", False):  # the store holds the first copy: the gate never sees this one
            self._background(self._recorded_ack(key, session, begin=stored.seq + 1))
        elif late_retry(frame.get("time"), time.time(), self.hub.duplicate_window_s):  # a new copy, but the decision may be older
            self._background(self._recorded_ack(key, session, last=stored.seq - 1, recent=True))

    def _enlist(self, key: tuple[str, str], session: str, target: Claimant | Remote | None,
                sender: tuple[Any, int, dict], window: int) -> Refusal | bool:
        """Register the command ``key`` as pending for ``target`` (True), or add ``sender`` to
        it when it is pending already (False: a retry, the one ack answers it), or refuse."""
        waiting = self.pending.get(key)
        if waiting is not None:
            if all(sender[0] is not other for other, _, _ in waiting.senders):
                waiting.senders.append(sender)
            return False
        if target is not None and any(  # an emitter's ack names its command by id alone
                other[0] != key[0] and (e := self.pending.get(other)) is not None and e.session == session
                and e.target == target for other in self.pending_by_cid.get(key[1], ())):
            return ("ambiguous", "another source's command with this id is pending for this claimant: retry after its ack")
        self.pending[key] = Pending(session, [sender], asyncio.get_running_loop().time() + window / 1000 + ACK_GRACE_S,
                                    target)
        self.pending_by_cid.setdefault(key[1], []).append(key)
        return True

    # ------------------------------------------------------------ between replicas

    async def start_replica(self) -> None:
        """Take the commands other replicas forward to this one's emitters, and what those
        replicas' emitters answer to the commands this one forwarded (`replicas`)."""
        await self.nc.subscribe(forward_subject(self.replica), cb=self._forwarded)
        await self.nc.subscribe(reply_subject(self.replica), cb=self._replied)

    async def _forward_remote(self, target: Remote, raw: bytes, key: tuple[str, str], refuse: Any) -> None:
        """A command for another replica's emitter, sent to that replica; it answers at once
        (taken, or why not), the emitter's ack comes later on this replica's reply subject."""
        try:
            answer = await self.nc.request(forward_subject(target.replica), raw, timeout=FORWARD_REQUEST_TIMEOUT_S,
                                           headers={CONN_HEADER: target.conn, REPLY_HEADER: reply_subject(self.replica)})
            doc = _decode(answer.data)
        except Exception as exc:  # noqa: BLE001 - that replica is gone, or slow
            log.warning("command_not_forwarded", error=type(exc).__name__)
            doc = {"code": "no-route", "detail": "the relay replica holding the claim did not answer"}
        if isinstance(doc, dict) and doc.get("code"):
            self._forget(key)
            with contextlib.suppress(Exception):
                await refuse(str(doc["code"]), str(doc.get("detail", "")))
            return
        self.metrics.commands.inc()

    async def _forwarded(self, msg: Any) -> None:
        """A command another replica received for an emitter connected here: forwarded to it
        as a local one (its ack and any later refusal go back on the sender's reply subject)."""
        headers = msg.headers or {}
        conn, reply_to = headers.get(CONN_HEADER), headers.get(REPLY_HEADER)

        async def answer(doc: dict[str, Any]) -> None:
            with contextlib.suppress(Exception):
                await msg.respond(_encode(doc))

        try:
            frame = _decode(msg.data)
        except msgspec.DecodeError:
            frame = None
        if (not isinstance(frame, dict) or shape_refusal(frame) is not None or not isinstance(reply_to, str)
                or not reply_to.startswith(SUBJECT_PREFIX + ".") or not isinstance(frame.get("type"), str)):
            return await answer({"code": "unsupported", "detail": "not a forwarded command"})
        target = self.claims.by_conn.get(conn) if isinstance(conn, str) else None
        session, ctype, cid = frame["session"], frame["type"], frame["id"]
        if target is None or session not in target.sessions:
            return await answer({"code": "no-route", "detail": "the claim ended"})
        refusal = emitter_refusal(ctype, target)

        async def send(obj: Any) -> None:
            with contextlib.suppress(Exception):
                await self.nc.publish(reply_to, obj if isinstance(obj, bytes) else _encode(obj),
                                      headers={REPLICA_HEADER: self.replica, CONN_HEADER: target.conn})

        key = (frame["source"], cid)
        enlisted = refusal or self._enlist(key, session, target, (send, FULL, {}),
                                           ack_window_ms((target.control or {}).get("ack_window_ms")))
        if enlisted is not True and enlisted:
            return await answer({"code": enlisted[0], "detail": enlisted[1]})
        await answer({"ok": True})
        if enlisted is True:
            async def refuse(code: str, detail: str) -> None:
                await send({"type": "error", "cause": cid, "code": code, "detail": detail})

            self._background(self._forward(target, msg.data, session, ctype, key, refuse))

    async def _replied(self, msg: Any) -> None:
        """What another replica's emitter answered to a command this replica forwarded: its
        ack settles the command (once, as a local emitter's), a refusal ends it."""
        headers = msg.headers or {}
        try:
            event = _decode(msg.data)
        except msgspec.DecodeError:
            return
        if not isinstance(event, dict):
            return
        remote = Remote(str(headers.get(REPLICA_HEADER)), str(headers.get(CONN_HEADER)), {})
        if event.get("type") in ACK_TYPES:
            return self.settle(event, msg.data, remote)
        cause = event.get("cause")
        if event.get("type") != "error" or not isinstance(cause, str):
            return
        for key in list(self.pending_by_cid.get(cause, ())):
            entry = self.pending.get(key)
            if entry is not None and entry.target == remote:
                self._forget(key)
                for send, _, _ in entry.senders:
                    asyncio.ensure_future(self._deliver_ack(send, msg.data))

    def _background(self, coro: Any) -> None:
        """Off the sender's read loop (a forward or a history read must not hold up its next frames)."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

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
            item = await self.hub.first(subj.control_filter(lane_token(session)), recorded, begin=begin, since_ns=since,
                                        last=last)
        except Exception as exc:  # noqa: BLE001 - the hub's live ack still settles it, or the window ends
            log.warning("recorded_ack_not_read", error=type(exc).__name__)
            return
        if item is not None:
            self.settle(item.event, item, None, again=True)

    async def _forward(self, target: Claimant, raw: bytes, session: str, ctype: str, key: tuple[str, str],
                       refuse: Any) -> None:
        """A command to a WebSocket emitter: delivered first (a target that does not take it
        within FORWARD_TIMEOUT_S is closed: it stopped reading), then kept in the session's
        history (AEP-0004 §4 item 4)."""
        try:
            await asyncio.wait_for(target.send(raw), FORWARD_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - gone, or not reading
            log.warning("command_not_delivered", error=type(exc).__name__)
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
            await self.js.publish(subj.ingest_subject(lane_token(session), ctype), raw,
                                  headers={"Nats-Msg-Id": ingest.msg_id(_decode(raw))})
        except Exception as exc:  # noqa: BLE001 - delivered; only the history copy is missing
            log.warning("command_delivered_but_not_stored", error=type(exc).__name__)

    def _forget(self, key: tuple[str, str]) -> None:
        self.pending.pop(key, None)
        keys = self.pending_by_cid.get(key[1], [])
        if key in keys:
            keys.remove(key)
        if not keys:
            self.pending_by_cid.pop(key[1], None)

    def on_item(self, item: Item) -> None:
        """Hub listener: the gate's ack of a pending Hermes command goes to its sender(s),
        once. Only an ack stored under ``aep.hermes.>`` (which only the bridge writes) counts:
        one posted under ``aep.ingest.>`` with the same cause is somebody else's word."""
        if item.event.get("type") in ACK_TYPES and item.subject.startswith(subj.EVENTS_PREFIX + "."):
            self.settle(item.event, item, None)

    def settle(self, event: dict[str, Any], payload: Item | bytes, target: Claimant | Remote | None,
               again: bool = False) -> None:
        """The ack ``event`` from ``target`` (None: the gate) settles the commands routed to
        that target under its cause and session; the gate's, only the one command its id
        names (another source may use the same id). ``again``: a recorded ack read back for a
        retry, which no live subscription delivers a second time."""
        cause = event.get("cause")
        for key in list(self.pending_by_cid.get(cause, ()) if isinstance(cause, str) else ()):
            entry = self.pending.get(key)
            if entry is None or not settles(key, entry, event, target):
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

    async def expire(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = asyncio.get_running_loop().time()
            for key, entry in list(self.pending.items()):
                if entry.deadline < now:
                    self._forget(key)
