"""The relay's fan-out: one ordered consumer on AEP_EVENTS per relay process, every event
decoded once and serialized once per capture ceiling, handed to every subscription in
process; replay from JetStream (AEP_EVENTS is the replay buffer) per subscription.

A subscription (an SSE stream, or one `subscribe` of a WebSocket) has an attr-match filter,
a capture ceiling and a bounded queue. Delivery order within a subscription is stream
order. Replay and live meet without a gap or a duplicate: the subscription is registered
with the hub before its replay starts, live events that arrive meanwhile wait in
``pending``; the replay reads up to the stream's last sequence at its start (which is at
least the hub's position), then ``pending`` is offered, minus what the replay covered.

Backpressure (AEP-0003 §8.4): a full queue drops `debug`/`info` events (counted), and on
a `notice`-or-above event marks the subscription ``overflowed``: its binding ends it
(SSE: the stream ends; WS: a `closing` frame with positions, then close) so the consumer
resumes exactly. Nothing of severity notice or above is ever dropped silently.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import json
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec
import structlog
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from bridge.core.attrmatch import Filter, compile_filter
from bridge.core.ceiling import FULL
from bridge.core.downlevel import downlevel_fields, event_capture
from bridge.core.lanes import UNKNOWN, lane_token
from bridge.runtime import ordered_subscribe
from bridge.runtime import streams as S
from bridge.runtime import subjects as subj

log = structlog.get_logger("aep_bridge.relay")

_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode
LOW_SEVERITY = frozenset(("debug", "info"))
STREAM_FILTER = "aep.>"
READ_AGAIN = 3  # a history read that lost a delivery reads again from where it stopped, this many times


class ReadIncomplete(RuntimeError):
    """A history read that could not get every event its consumer counted."""
NEWEST_MAX = 65_536  # sessions whose live positions the hub remembers (replay-exhausted; ~16 MiB + names)
# The hub remembers the positions of the events it saw live over the last two windows
# (2 x replay_buffer stream sequences), at most this many in all; what it forgets of a session
# is summed up in one (sequence, position) per session (`Track`).
TRACKED_MAX = 1 << 17  # ~41 MB (tracemalloc: ~316 B per event tracked)


class Track:
    """What the hub saw live of one session: (stream sequence, position) of its recent
    events in stream order, and of those it let go (``gone_seq``: the highest sequence,
    ``gone_high``: the highest position), so that it can tell which positions of the session
    were stored before any window start it is asked about (`Hub.missed`)."""

    __slots__ = ("recent", "gone_seq", "gone_high", "high")

    def __init__(self) -> None:
        self.recent: collections.deque[tuple[int, tuple[int, int]]] = collections.deque()
        self.gone_seq = 0
        self.gone_high: tuple[int, int] | None = None
        self.high: tuple[int, int] | None = None  # the highest position seen

    @property
    def newest(self) -> tuple[int, tuple[int, int]]:
        """(stream sequence of its newest event seen, highest position seen)."""
        seq = self.recent[-1][0] if self.recent else self.gone_seq
        return seq, self.high  # type: ignore[return-value]

    def let_go(self) -> None:
        seq, pos = self.recent.popleft()
        self.gone_seq = seq
        if self.gone_high is None or pos > self.gone_high:
            self.gone_high = pos


class Item:
    """One event of AEP_EVENTS: its stream sequence, its exact bytes, the decoded event,
    and its serializations per ceiling and binding, made on first use and shared. What every
    subscription asks of it (session, position, severity) is worked out once, here."""

    __slots__ = ("seq", "raw", "event", "subject", "session", "position", "low_severity", "_data", "_sse")

    def __init__(self, seq: int, raw: bytes, event: dict[str, Any], subject: str = "") -> None:
        self.seq = seq
        self.raw = raw
        self.event = event
        self.subject = subject  # where it was stored: aep.hermes.> (the bridge's own) or aep.ingest.>
        s = event.get("session")
        self.session: str | None = s if isinstance(s, str) else None
        q = event.get("seq")
        if self.session is None or not isinstance(q, int):
            self.position: tuple[int, int] | None = None
        else:
            epoch = event.get("epoch", 0)
            self.position = (epoch if isinstance(epoch, int) else 0, q)
        self.low_severity: bool = event.get("severity", "info") in LOW_SEVERITY
        self._data: dict[int, bytes] = {}
        self._sse: dict[int, bytes] = {}

    def data(self, ceiling: int) -> bytes:
        """The event's bytes under ``ceiling``: the stored bytes themselves when within it
        (byte identity across bindings), else the down-levelled event (AEP-0001 §8.2)."""
        try:
            level = event_capture(self.event)
        except ValueError:  # an unknown capture level: above every ceiling
            level = FULL + 1
        if level <= ceiling:
            return self.raw
        out = self._data.get(ceiling)
        if out is None:  # field by field for the types with known levels, else the envelope alone
            out = self._data[ceiling] = _encode(downlevel_fields(self.event, ceiling))
        return out

    def sse(self, ceiling: int) -> bytes:
        out = self._sse.get(ceiling)
        if out is None:
            etype = self.event.get("type")
            head = b"event: " + str(etype).encode() + b"\n" if isinstance(etype, str) and "\n" not in etype else b""
            pos = self.position
            if pos is not None and "\n" not in (self.session or "") and "\r" not in (self.session or ""):
                head += f"id: {self.session}:{pos[0]}:{pos[1]}\n".encode()
            out = self._sse[ceiling] = head + b"data: " + self.data(ceiling) + b"\n\n"
        return out


@dataclass
class Exhausted:
    session: str
    epoch: int
    seq: int


@dataclass(eq=False)
class Subscription:
    """One filtered, capture-gated, bounded stream of items for one consumer."""

    filter: Filter
    ceiling: int = FULL
    limit: int = 10000
    sub_id: str = ""
    queue: collections.deque = field(default_factory=collections.deque)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    replaying: bool = False
    pending: list[Item] = field(default_factory=list)
    overflowed: bool = False  # ended by the relay: its binding closes it, resumable (``end_reason``)
    end_reason: str = "backpressure"  # or "replay-failed" (a history read that could not complete)
    closed: bool = False
    drops: int = 0
    delivered: dict[str, tuple[int, int]] = field(default_factory=dict)  # session -> last position handed out
    on_drop: Callable[[], None] | None = None
    # Direct writes (SSE): while its task is parked (``idle``), the binding's ``direct`` writes
    # what is queued at once, from the hub's one flush per batch of events, instead of waking
    # one task per subscription per event; it answers False when it cannot (a slow or closing
    # connection), and the task takes over.
    direct: Callable[["Subscription"], bool] | None = None
    idle: bool = False
    dirty: bool = False
    ready: Callable[["Subscription"], None] | None = None  # set by Hub.add

    def offer(self, item: Item, matched: bool | None = None) -> None:
        """Hand ``item`` over; ``matched``: the filter's verdict, when the caller knows it."""
        if self.closed or self.overflowed:
            return
        if self.replaying:
            self.pending.append(item)
            if len(self.pending) > self.limit * 4 and not self.overflowed:
                self.overflowed = True
                self.wake.set()
            return
        self._put(item, matched)

    def _put(self, item: Item, matched: bool | None = None) -> None:
        if not (self.filter.matches(item.event) if matched is None else matched):
            return
        if len(self.queue) >= self.limit:
            if item.low_severity:
                self.drops += 1
                if self.on_drop:
                    self.on_drop()
                return
            self.overflowed = True  # deliver-or-disconnect: the binding ends the stream
            self.wake.set()
            return
        self.queue.append(item)
        if self.idle and self.direct is not None and self.ready is not None:
            self.ready(self)
        else:
            self.wake.set()

    def mark(self, item: Item) -> None:
        if item.position is not None:
            self.delivered[item.session or ""] = item.position

    def take(self, most: int = 256) -> list[Any]:
        out = []
        while self.queue and len(out) < most:
            out.append(self.queue.popleft())
        if not self.queue:
            self.wake.clear()
        return out


_filters: "weakref.WeakValueDictionary[str, Filter]" = weakref.WeakValueDictionary()


def intern_filter(spec: Any) -> Filter:
    """`compile_filter` (InvalidFilter on a bad one), with equal filters sharing one `Filter`
    while a subscription holds it, so the hub matches an event once per distinct filter."""
    flt = compile_filter(spec)
    key = json.dumps(spec, sort_keys=True, separators=(",", ":"))
    return _filters.setdefault(key, flt)


class RefusedFrom(ValueError):
    """A `from` that cannot be honoured (malformed)."""


def parse_from(value: Any) -> str | list[tuple[str, int, int]]:
    """``"all"`` or a list of (session, epoch, seq); RefusedFrom otherwise."""
    if value == "all":
        return "all"
    if not isinstance(value, list):
        raise RefusedFrom("`from` is an array of {session, epoch, seq} or the string \"all\"")
    out = []
    for p in value:
        if not isinstance(p, dict):
            raise RefusedFrom("each `from` position is an object {session, epoch, seq}")
        s, e, q = p.get("session"), p.get("epoch", 0), p.get("seq")
        if not isinstance(s, str) or not s or type(e) is not int or type(q) is not int or e < 0 or q < 0:
            raise RefusedFrom("a `from` position needs a string session and integer epoch and seq >= 0")
        out.append((s, e, q))
    return out


def parse_last_event_id(value: str) -> tuple[str, int, int] | None:
    """``{session}:{epoch}:{seq}`` with epoch and seq >= 0 (as a `from` position), else None."""
    session, sep, rest = value.rpartition(":")
    session, sep2, epoch = session.rpartition(":")
    if not sep or not sep2 or not session:
        return None
    try:
        e, q = int(epoch), int(rest)
    except ValueError:
        return None
    return (session, e, q) if e >= 0 and q >= 0 else None


class Hub:
    """The one live consumer of this relay process and the subscriptions it feeds."""

    def __init__(self, js: Any, replay_buffer: int, metrics: Any = None) -> None:
        self.js = js
        self.replay_buffer = replay_buffer
        self.metrics = metrics
        self.subs: set[Subscription] = set()
        self.position = 0  # stream sequence of the last live event seen
        self.duplicate_window_s = 120.0  # AEP_EVENTS' duplicate window, read at start and by window()
        self.listeners: list[Callable[[Item], None]] = []
        # session -> what it saw of it live (`Track`), the least recently active forgotten
        # first: a resume learns from it whether events after its position left the window
        # (`missed`), or, when the window holds nothing of the session, that events after its
        # position were there (replay())
        self.newest: collections.OrderedDict[str, Track] = collections.OrderedDict()
        self.tracked: collections.deque[tuple[int, str]] = collections.deque()  # (seq, session) of every Track.recent entry
        self.started = 0  # the stream's last sequence when the live consumer started: the hub saw none up to it
        self.forgotten = 0  # the highest sequence of a session's events the hub forgot (NEWEST_MAX)
        self._sub: Any = None
        self._dirty: list[Subscription] = []
        self._flushing = False

    async def start(self) -> None:
        info = await self.js.stream_info(S.AEP_EVENTS)
        self.position = self.started = info.state.last_seq
        self.duplicate_window_s = float(info.config.duplicate_window or self.duplicate_window_s)
        cfg = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=self.position + 1)
        self._sub = await ordered_subscribe(self.js, STREAM_FILTER, S.AEP_EVENTS, config=cfg,  # by name (issue 44)
                                            cb=self._on_msg, pending_msgs_limit=-1, pending_bytes_limit=-1)

    async def stop(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # noqa: BLE001 - a closed connection: nothing left to stop
                pass

    async def _on_msg(self, msg: Any) -> None:
        item = make_item(msg)
        if item is None:
            return
        self.position = item.seq
        if item.position is not None:
            self._note(item)
        for listener in self.listeners:
            listener(item)
        # one verdict per distinct filter, not per subscription: equal filters are one
        # object (intern_filter), so a hundred dashboards on one filter cost one match
        verdicts: dict[int, bool] = {}
        event = item.event
        for sub in tuple(self.subs):
            key = id(sub.filter)
            matched = verdicts.get(key)
            if matched is None:
                matched = verdicts[key] = sub.filter.matches(event)
            sub.offer(item, matched)

    def _note(self, item: Item) -> None:
        newest, session, pos = self.newest, item.session or "", item.position
        track = newest.get(session)
        if track is None:
            track = newest[session] = Track()
        else:
            newest.move_to_end(session)
        track.recent.append((item.seq, pos))  # type: ignore[arg-type]
        if track.high is None or pos > track.high:  # type: ignore[operator]
            track.high = pos
        tracked = self.tracked
        tracked.append((item.seq, session))
        # let go of what is older than two windows (a replay's window start lags the live
        # position by what arrived meanwhile), summed up per session
        keep_from = item.seq - 2 * self.replay_buffer + 1
        while tracked and (tracked[0][0] < keep_from or len(tracked) > TRACKED_MAX):
            seq, name = tracked.popleft()
            old = newest.get(name)
            if old is not None and old.recent and old.recent[0][0] == seq:
                old.let_go()
        if len(newest) > NEWEST_MAX:
            _, gone = newest.popitem(last=False)
            self.forgotten = max(self.forgotten, gone.newest[0])

    def missed(self, session: str, after: tuple[int, int], begin: int, first: int) -> bool | None:
        """Whether an event of ``session`` past ``after`` was stored before the window start
        ``begin`` (has left the replay buffer), from what the hub saw live; None when it
        cannot tell (it started, or forgot the session, after such events were stored)."""
        track = self.newest.get(session)
        known_from = max(self.started, self.forgotten) + 1  # the hub saw every event from here on
        high = None
        if track is not None:
            for seq, pos in track.recent:
                if seq >= begin:
                    break
                if high is None or pos > high:
                    high = pos
            if track.gone_high is not None:
                if track.gone_seq < begin:
                    high = track.gone_high if high is None or track.gone_high > high else high
                elif track.gone_high > after:  # some of them may be in the window, some not
                    return None
        if high is not None and high > after:
            return True
        if high is not None or known_from <= first:
            # (a session's positions grow along the stream: what the hub did not see of it
            # came before what it saw, at lower positions)
            return False
        return None

    async def _missed_in_stream(self, session: str, subject: str, after: tuple[int, int], begin: int, first: int) -> bool:
        """`missed` from the stream: an event of ``session`` past ``after`` stored from
        ``first`` to ``begin`` - 1 (read on the session's subjects up to the first one found)."""
        found: list[bool] = []

        def take(it: Item) -> bool:
            if it.session == session and it.position is not None and it.position > after:
                found.append(True)
                return True
            return False

        await self._read(subject, first, begin - 1, take)
        return bool(found)

    def add(self, sub: Subscription) -> None:
        sub.ready = self._ready
        self.subs.add(sub)

    def _ready(self, sub: Subscription) -> None:
        """``sub`` has items for a direct write: flush once the current batch is offered."""
        if not sub.dirty:
            sub.dirty = True
            self._dirty.append(sub)
            if not self._flushing:
                self._flushing = True
                asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flushing = False
        dirty, self._dirty = self._dirty, []
        for sub in dirty:
            sub.dirty = False
            if not sub.queue or sub.closed:
                continue
            try:
                done = not sub.overflowed and sub.idle and sub.direct is not None and sub.direct(sub)
            except Exception as exc:  # noqa: BLE001 - what it took may be lost: end the stream, resumable
                log.warning("direct_write_failed", error=str(exc))
                sub.overflowed = True
                done = False
            if not done:
                sub.wake.set()

    def remove(self, sub: Subscription) -> None:
        sub.closed = True
        self.subs.discard(sub)

    async def window(self) -> tuple[int, int, int]:
        """(first sequence the relay replays, last sequence, stream's first sequence)."""
        info = await self.js.stream_info(S.AEP_EVENTS)
        self.duplicate_window_s = float(info.config.duplicate_window or self.duplicate_window_s)
        first, last = info.state.first_seq, info.state.last_seq
        return max(first, last - self.replay_buffer + 1, 1), last, first

    async def replay(self, sub: Subscription, start: str | list[tuple[str, int, int]] | None,
                     on_exhausted: Callable[[Exhausted], None]) -> None:
        """Replay into ``sub`` (already registered, ``replaying``) then hand it to live."""

        covered_all = start == "all"
        covered: set[str] = set()
        last = 0
        try:
            if start:
                # what the hub saw of each session before the window is read: all of it at
                # most the window's last sequence (events after go to ``pending``)
                seen = {p[0]: self.newest[p[0]].newest for p in start if p[0] in self.newest} if isinstance(start, list) else {}
                begin, last, first = await self.window()
                if covered_all:
                    await self._read(STREAM_FILTER, begin, last, lambda it: sub._put(it))
                else:
                    for session, epoch, seq in start:  # type: ignore[union-attr]
                        covered.add(session)
                        state: dict[str, Any] = {"first": True, "ask": None}

                        def take(it: Item, session: str = session, after: tuple[int, int] = (epoch, seq),
                                 state: dict = state) -> bool:
                            if it.session != session:
                                return False
                            pos = it.position
                            if state["first"]:
                                state["first"] = False
                                # Past the position + 1: a gap (the bridge's positions jump from
                                # one raw message's events to the next), or something missed.
                                # Missed only if an event past the position left the window.
                                if pos is not None and pos > (after[0], after[1] + 1):
                                    missed = self.missed(session, after, begin, first)
                                    if missed is None and subject != STREAM_FILTER and begin > first:
                                        state["ask"] = it  # the stream tells (below), then the read goes on
                                        return True
                                    if missed:
                                        on_exhausted(Exhausted(session, pos[0], pos[1]))
                            if pos is None or pos > after:
                                sub._put(it)
                            return False

                        try:
                            # the unknown lane is filed under `_unknown` (session "unknown", lane
                            # "unknown"), a real session named so under `unknown`: read the window
                            subject = STREAM_FILTER if session == UNKNOWN else subj.session_filter(lane_token(session))
                        except ValueError:
                            subject = STREAM_FILTER
                        await self._read(subject, begin, last, take)
                        held = state["ask"]
                        if held is not None:
                            if await self._missed_in_stream(session, subject, (epoch, seq), begin, first):
                                on_exhausted(Exhausted(session, held.position[0], held.position[1]))
                            sub._put(held)
                            await self._read(subject, held.seq + 1, last, take)
                        if state["first"]:  # nothing of it held: did it have events after the position?
                            newest = await self._newest_before(session, subject, begin, first, seen.get(session))
                            if newest is not None and newest > (epoch, seq):
                                on_exhausted(Exhausted(session, newest[0], newest[1] + 1))
        finally:
            sub.replaying = False
            for it in sub.pending:
                if it.seq > last or (not covered_all and it.session not in covered):
                    sub._put(it)
            sub.pending.clear()

    async def _newest_before(self, session: str, subject: str, begin: int, first: int,
                             seen: tuple[int, tuple[int, int]] | None) -> tuple[int, int] | None:
        """The highest position of ``session``'s events stored before the window start
        ``begin``: from what the hub saw live (``seen``, its ``newest`` entry when the replay
        began: covers what the stream itself evicted since this relay started) and from the
        stream's last event per subject of the session (covers what this relay never saw
        live: it started later, or forgot)."""
        best = None
        if seen is not None and seen[0] < begin:
            best = seen[1]
        if begin > first and subject != STREAM_FILTER:
            found: list[tuple[int, int]] = []

            def take(it: Item) -> None:
                if it.session == session and it.position is not None and it.seq < begin:
                    found.append(it.position)

            await self._read(subject, first, begin - 1, take, last_per_subject=True)
            best = max(found + ([best] if best is not None else []), default=None)
        return best

    async def first(self, subject: str, match: Callable[[Item], bool], begin: int = 1,
                    since_ns: int | None = None, last: int | None = None) -> Item | None:
        """The first stored event on ``subject`` from sequence ``begin`` (or stored since
        ``since_ns``) to ``last`` (else the stream's last) that ``match``es, or None (a
        short read: a command's recorded ack)."""
        if last is None:
            last = (await self.js.stream_info(S.AEP_EVENTS)).state.last_seq
        found: list[Item] = []

        def take(item: Item) -> bool:
            if match(item):
                found.append(item)
                return True  # enough
            return False

        await self._read(subject, begin, last, take, since_ns)
        return found[0] if found else None

    async def _read(self, subject: str, begin: int, last: int, take: Callable[[Item], bool | None],
                    since_ns: int | None = None, last_per_subject: bool = False) -> None:
        """``take`` each stored event on ``subject`` from ``begin`` (or stored since
        ``since_ns``; or only the last one of each subject, ``last_per_subject``) to
        ``last``, in order and once each, until it answers True.

        The consumer takes no acks, so a delivery lost on the way (a connection or route torn
        down by a node's restart) is never sent again: a jump of the consumer sequence, or a
        fetch that times out before the consumer's count, reads again from the message after
        the last one taken, at most READ_AGAIN times; then `ReadIncomplete` (a replay fails and
        its subscription ends, resumable; never a short history that looks whole)."""
        if last < begin:
            return
        start: dict[str, Any] = {"deliver_policy": DeliverPolicy.BY_START_SEQUENCE, "opt_start_seq": begin}
        if since_ns is not None:
            start = {"deliver_policy": DeliverPolicy.BY_START_TIME,
                     "opt_start_time": datetime.datetime.fromtimestamp(since_ns / 1e9, tz=datetime.timezone.utc)}
        if last_per_subject:
            start = {"deliver_policy": DeliverPolicy.LAST_PER_SUBJECT}
        for attempt in range(READ_AGAIN + 1):
            stopped = await self._read_once(subject, start, last, take)
            if stopped is None:
                return
            if self.metrics is not None:
                self.metrics.read_gaps.inc()
            log.warning("history_read_gap", subject=subject, after_seq=stopped, attempt=attempt + 1)
            if last_per_subject:
                continue  # the newest of each subject again, from the start: its `take` keeps the highest
            if stopped:  # go on after the last message taken (nothing taken: the same start again)
                start = {"deliver_policy": DeliverPolicy.BY_START_SEQUENCE, "opt_start_seq": stopped + 1}
        raise ReadIncomplete(f"history of {subject} up to {last}: a delivery lost {READ_AGAIN + 1} times")

    async def _read_once(self, subject: str, start: dict[str, Any], last: int,
                         take: Callable[[Item], bool | None]) -> int | None:
        """One consumer's read for `_read`: None when complete (or ``take`` had enough), else
        the stream sequence of the last message taken (0: none) where a delivery went
        missing. The ephemeral consumer is deleted after (unsubscribing leaves it on the
        server until its inactivity threshold)."""
        cfg = ConsumerConfig(ack_policy=AckPolicy.NONE, inactive_threshold=30.0, max_ack_pending=-1, **start)
        psub = await self.js.pull_subscribe(subject, durable=None, stream=S.AEP_EVENTS, config=cfg)
        name = ""
        taken = delivered = 0
        try:
            info = await psub.consumer_info()
            name = info.name
            remaining = info.num_pending
            while remaining > 0:
                try:
                    msgs = await psub.fetch(min(remaining, 512), timeout=5.0)
                except asyncio.TimeoutError:
                    return taken  # counted, not delivered: lost, or removed by the limits meanwhile
                for msg in msgs:
                    if msg.metadata.sequence.consumer != delivered + 1:
                        return taken
                    delivered += 1
                    remaining -= 1
                    item = make_item(msg)
                    taken = msg.metadata.sequence.stream
                    if item is None:
                        continue
                    if item.seq > last or take(item):
                        return None
                await asyncio.sleep(0)
            return None
        finally:
            try:
                await psub.unsubscribe()
            except Exception:  # noqa: BLE001
                pass
            if name:
                with contextlib.suppress(Exception):
                    await self.js.delete_consumer(S.AEP_EVENTS, name)


def make_item(msg: Any) -> Item | None:
    try:
        seq = msg.metadata.sequence.stream
        event = _decode(msg.data)
    except Exception:  # noqa: BLE001 - not an AEP event: nothing to relay
        return None
    if not isinstance(event, dict):
        return None
    raw = bytes(msg.data)
    if msg.subject.startswith(subj.INGEST_PREFIX + ".") and "seq" in event and isinstance(event.get("session"), str):
        raw = relay_position(event, seq)
    return Item(seq, raw, event, msg.subject)


def relay_position(event: dict[str, Any], stream_seq: int) -> bytes:
    """An event another emitter posted (``aep.ingest.>``) takes its position from the stream,
    not from its sender: ``seq`` = its AEP_EVENTS sequence, epoch 0 (``event`` is changed in
    place; the bytes delivered are returned). So a posted ``seq`` cannot move anyone's resume
    point (issue 44): positions of one session name are the stream's order, whoever posts
    into it, and an emitter cannot post into a Hermes session (`Presence.hermes_owned`).
    What is stored stays as posted; every binding delivers these bytes."""
    event["seq"] = stream_seq
    event.pop("epoch", None)
    return _encode(event)
