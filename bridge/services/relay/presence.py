"""Presence: what the relay knows of the Hermes side. The gate's hello (its capabilities
document, cached: ``HELLO_*``) and the live Hermes sessions (the gate's ``live.*`` records
in the control bucket, read through a watch, less those the gate has not seen for the idle
TTL: ``SessionInfo.seen``)."""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any

import msgspec
from nats.errors import NoRespondersError
from nats.js.errors import BucketNotFoundError

from bridge.core.control import SessionInfo, is_idle
from bridge.core.lanes import lane_from_token, lane_token
from bridge.runtime import streams as S
from bridge.runtime import subjects as subj
from bridge.services.relay.shared import kv_scan

# The gate's hello (`Presence.gate_hello`): an answer is kept HELLO_FRESH_S; "no gate" only
# HELLO_NONE_S, so a restarted gate is routed to again within a second. A gate that is
# subscribed but slow to answer (busy, paused) keeps its last answer HELLO_GRACE_S after it
# was given: a Hermes session's commands are durable on AEP_EVENTS, the gate takes them when
# it runs again. No responders means no gate, at once.
HELLO_FRESH_S = 5.0
HELLO_NONE_S = 1.0
HELLO_GRACE_S = 30.0
HELLO_TIMEOUT_S = 1.0

LIVE_CACHE_S = 1.0  # the live Hermes sessions are read at most this often for rosters
HERMES_KNOWN_MAX = 65_536  # sessions remembered as Hermes's (the bridge's pipeline wrote them)
NOT_HERMES_S = 2.0  # "no Hermes event of this session on AEP_EVENTS" is trusted this long
CONTROL_TYPES = ("control.attention.respond", "x.hermes.control.instruct")
_decode = msgspec.json.Decoder().decode


class StoreUnavailable(Exception):
    """The control bucket could not be read (NATS trouble): nothing is known, nothing routed."""


class Presence:
    """The gate's hello and the live Hermes sessions, as one relay process sees them."""

    def __init__(self, js: Any = None, nc: Any = None, idle_ttl_s: float = 1800.0) -> None:
        self.js = js
        self.nc = nc
        self.idle_ttl_s = idle_ttl_s  # AEP_BRIDGE_SESSION_IDLE_TTL_S: a session the gate has not seen this long is not live
        self._hello: tuple[float, dict[str, Any] | None] | None = None  # (asked at, what it means now)
        self._hello_answer: tuple[float, dict[str, Any]] | None = None  # (answered at, the gate's last answer)
        self._live_cache: tuple[float, asyncio.Future] | None = None
        # sessions of the bridge's own pipeline (aep.hermes.> on AEP_EVENTS), and when a
        # session was last found not to be one (`hermes_owned`)
        self._hermes: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._not_hermes: dict[str, float] = {}

    def note_hermes(self, session: str) -> None:
        """``session`` has an event under aep.hermes.> (the hub saw it live)."""
        self._hermes[session] = None
        self._hermes.move_to_end(session)
        if len(self._hermes) > HERMES_KNOWN_MAX:
            self._hermes.popitem(last=False)
        self._not_hermes.pop(session, None)

    def known_hermes(self, session: str) -> bool:
        """What this process already knows, without asking NATS."""
        return session in self._hermes

    async def check_hermes(self, sessions: set[str], at_once: int = 32) -> None:
        """Ask about several sessions at once (a POST's batch), ``at_once`` requests in
        flight, so that `hermes_owned` answers each from what it learnt; a failure here is
        met again there."""
        gate = asyncio.Semaphore(at_once)

        async def one(session: str) -> None:
            async with gate:
                try:
                    await self.hermes_owned(session)
                except StoreUnavailable:
                    pass

        await asyncio.gather(*(one(s) for s in sessions))

    async def hermes_owned(self, session: str) -> bool:
        """Whether ``session`` is a Hermes session: the bridge's pipeline (or the gate, or an
        operator's command for it) wrote an event of it under aep.hermes.> that AEP_EVENTS
        still holds. Its positions are the pipeline's, its commands the gate's: no emitter
        token posts into it or is handed its commands. StoreUnavailable when the
        stream cannot be asked (unknown is not "no")."""
        if session in self._hermes:
            self._hermes.move_to_end(session)
            return True
        now = time.monotonic()
        checked = self._not_hermes.get(session)
        if checked is not None and now - checked < NOT_HERMES_S:
            return False
        try:
            info = await self.js.stream_info(S.AEP_EVENTS, subjects_filter=f"{subj.EVENTS_PREFIX}.{lane_token(session)}.>")
        except Exception as exc:  # noqa: BLE001
            raise StoreUnavailable(type(exc).__name__) from exc
        if info.state.subjects:
            self.note_hermes(session)
            return True
        if len(self._not_hermes) > HERMES_KNOWN_MAX:
            self._not_hermes = {k: t for k, t in self._not_hermes.items() if now - t < NOT_HERMES_S}
        self._not_hermes[session] = now
        return False

    async def accepts(self) -> list[str]:
        """What this relay routes: the gate's declared accepts (none without a gate)."""
        hello = await self.gate_hello()
        control = ((hello or {}).get("capabilities") or {}).get("control") or {}
        return [t for t in control.get("accepts") or [] if t in CONTROL_TYPES]

    async def _kv_scan(self, keys: str) -> list[tuple[str, bytes]]:
        """(key, value) of the control bucket's live keys matching ``keys``, read through a
        watch (the one bucket read the relay's NATS role has). No bucket: nothing (no gate
        ever ran); any other failure: StoreUnavailable."""
        try:
            kv = await self.js.key_value(S.CONTROL_BUCKET.bucket)
        except BucketNotFoundError:
            return []
        except Exception as exc:  # noqa: BLE001
            raise StoreUnavailable(type(exc).__name__) from exc
        try:
            return await kv_scan(kv, keys)
        except Exception as exc:  # noqa: BLE001 - NATS trouble mid-scan: unknown, not empty
            raise StoreUnavailable(type(exc).__name__) from exc

    def _live(self, token: str, value: bytes) -> tuple[str, SessionInfo] | None:
        try:
            info = msgspec.json.decode(value, type=SessionInfo)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        if info.ended or is_idle(info, time.time(), self.idle_ttl_s):  # finalized, or crashed (silent)
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
                doc = _decode((await self.nc.request(subj.HELLO_SUBJECT, b"", timeout=HELLO_TIMEOUT_S)).data)
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
