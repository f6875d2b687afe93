"""The gate's shared state and helpers: per-session locks, KV records, seqs, publishing,
session info, command records and acks. Cards, commands and steering build on it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, AsyncIterator

import msgspec
import structlog
from nats.js.errors import KeyDeletedError, KeyNotFoundError
from prometheus_client import CollectorRegistry

from bridge.core.aep import Event, decode_event, encode_event
from bridge.core.control import (
    GATE_SLOT,
    CmdRecord,
    Command,
    Position,
    Reject,
    SessionInfo,
    Where,
    ack_id,
    ack_payload,
    build_event,
    hello,
    next_seq,
    restamp,
)
from bridge.runtime import Health, Service, Settings, Stopper
from bridge.runtime import streams as S
from bridge.runtime import subjects as subj
from bridge.services.gate.config import GateConfig, GateMetrics

log = structlog.get_logger("aep_bridge.gate")


class GateBase(Service):
    """State shared by the gate's parts (connection, buckets, open cards, locks); the gate's
    side of the `Service` shape (its start and loops: `service.Gate`)."""

    def __init__(self, settings: Settings, config: GateConfig | None = None, registry: CollectorRegistry | None = None) -> None:
        self.settings = settings
        self.config = config or GateConfig.from_env()
        self.registry = registry or CollectorRegistry()
        self.metrics = GateMetrics(self.registry)
        self.health = Health("gate")
        self.stopper = Stopper()
        self.hello = hello(self.config.accepts, self.config.ack_window_ms, settings.instance, subj.control_where())
        self.health.info.update(control=self.hello["capabilities"]["control"], hello=self.hello)
        self.nc: Any = None
        self.js: Any = None
        self.kv: Any = None  # aep_control
        self.queues: Any = None  # aep_instruct
        self.lanes: Any = None
        self.epoch = 0
        self.cards: dict[str, tuple[str, int]] = {}  # open/releasing card id -> (lane token, expires ns): swept
        self._locks: dict[str, asyncio.Lock] = {}
        self._last_probe = 0.0

    @contextlib.asynccontextmanager
    async def lane(self, token: str) -> AsyncIterator[None]:
        """Serialise everything done for one session (cards, commands, queue, seq)."""
        lock = self._locks.get(token)
        if lock is None:
            lock = self._locks[token] = asyncio.Lock()
        async with lock:
            yield
        if not lock.locked() and not getattr(lock, "_waiters", None):
            self._locks.pop(token, None)

    async def kv_get(self, bucket: Any, key: str, tp: Any) -> tuple[Any, int]:
        try:
            entry = await bucket.get(key)
        except (KeyNotFoundError, KeyDeletedError):
            return None, 0
        if entry is None or not entry.value:
            return None, int(entry.revision or 0) if entry else 0
        return msgspec.json.decode(entry.value, type=tp), int(entry.revision or 0)

    async def kv_put(self, bucket: Any, key: str, value: Any, revision: int | None = None) -> int:
        """put; ``revision=0`` creates (fails when the key exists), a revision compares-and-sets."""
        data = msgspec.json.encode(value)
        if revision is None:
            return int(await bucket.put(key, data))
        if revision == 0:
            return int(await bucket.create(key, data))
        return int(await bucket.update(key, data, last=revision))

    async def raw_last_seq(self) -> int:
        info = await self.js.stream_info(S.HERMES_RAW)
        return int(info.state.last_seq or 0)

    async def alloc(self, token: str, n: int, anchor: int | None = None, slot: int = GATE_SLOT) -> list[int]:
        """``n`` consecutive seqs of the session (caller holds the lane lock). ``anchor``: the raw
        stream position to sort after (default: the raw stream's last sequence now)."""
        if n <= 0:
            return []
        if anchor is None:
            anchor = await self.raw_last_seq()
        last, _ = await self.kv_get(self.kv, f"seq.{token}", Position)
        first = next_seq(last, self.epoch, anchor, slot)
        seqs = list(range(first, first + n))
        if not last or last.epoch != self.epoch or seqs[-1] > last.seq:
            await self.kv_put(self.kv, f"seq.{token}", Position(epoch=self.epoch, seq=seqs[-1]))
        return seqs

    async def publish(self, events: list[Event] | list[bytes]) -> None:
        for ev in events:
            if isinstance(ev, bytes):
                data, ev = ev, decode_event(ev)
            else:
                data = encode_event(ev)
            subject = subj.event_subject(ev)
            await self.js.publish(subject, data, headers={"Nats-Msg-Id": ev.id})

    async def session_info(self, token: str, lane: str) -> SessionInfo | None:
        """What the gate knows of a session (it saw its raw events); else the source of the
        session's last turn or start on AEP_EVENTS (the gate started after the session did).
        A command on the stream proves nothing: anyone can address any session."""
        info, _ = await self.kv_get(self.kv, f"sess.{token}", SessionInfo)
        if info is not None:
            return info
        for etype in ("run.started", "session.started"):
            try:
                msg = await self.js.get_last_msg(S.AEP_EVENTS, subj.events_subject(token, etype))
                return SessionInfo(source=decode_event(msg.data).source)
            except Exception:
                continue
        return None

    async def learn(self, token: str, source: str, instance: str, ended: bool = False, session: str = "") -> None:
        info, _ = await self.kv_get(self.kv, f"sess.{token}", SessionInfo)
        new = SessionInfo(source=source, instance=instance, ended=ended, session=session, seen=time.time())
        if restamp(info, new, self.config.idle_ttl_s):  # seen: the relay's idle rule (AEP_BRIDGE_SESSION_IDLE_TTL_S)
            await self.kv_put(self.kv, f"sess.{token}", new)
            # live.<token>: the sessions a command can reach now, the relay's roster (a scan of
            # the live ones, not of every session the bucket keeps for 7 days)
            if ended:
                await self.kv.delete(f"live.{token}")
            else:
                await self.kv_put(self.kv, f"live.{token}", new)

    async def record(self, cmd: Command, token: str, card: str, ack: Event, events: list[Event],
                     stream_seq: int | None) -> None:
        old, rev = await self.kv_get(self.kv, f"cmd.{cmd.key}", CmdRecord)
        rec = CmdRecord(
            state="done", id=cmd.id, lane=token, card=card,
            stream_seq=stream_seq if stream_seq is not None else (old.stream_seq if old else 0),
            ack=encode_event(ack).decode(), events=[encode_event(e).decode() for e in events],
        )
        await self.kv_put(self.kv, f"cmd.{cmd.key}", rec, revision=rev if old else 0)

    def ack_event(self, where: Where, cmd: Command, seq: int, now: int, reject: Reject | None) -> Event:
        etype, payload = ack_payload(self.config.policy, "rejected" if reject else "accepted", reject)
        eid = ack_id(cmd.key, now // 1_000_000)  # names (source, id): the relay tells acks apart by it
        return build_event(self.config.policy, etype, payload, where=where, event_id=eid, seq=seq, time_ns=now,
                             cause=cmd.id)
