"""The pairing state machine: mapped events in, final AEP events out (pure, deterministic).

One `PairingState` owns one partition of lanes. It is fed, in stream order, every
message of its partition of ``BRIDGE_MAPPED`` (``process``) and the tick messages
the service writes into the same stream (``tick``), and it returns the events to
publish to ``AEP_EVENTS``, in order. Every transition lives in this file: the rule
tables (``ROLES``, ``RULES``, ``LINKS``, ``INSERT_AFTER``, the slot table below), the
few rules that are code next to them, and the invariants here.

Theory of operation
-------------------
A *pair* is a start waiting for its terminal, of one of four kinds. ``ROLES`` says
which event type starts or ends which kind, ``RULES`` how each kind behaves:

==========  ===========================================  =========  ==========  =====  ===========
kind        key (within the lane = the AEP session)      closes     stray term  swept  bridge ends
==========  ===========================================  =========  ==========  =====  ===========
run         ``run`` (Hermes turn_id)                     oldest     link        yes    orphaned
tool        (run, tool_call_id); no tool_call_id         oldest     hold first  yes    orphaned
            (``execute_code``): (run, task_id, tool
            name, args_digest), FIFO
card        approvals: (session_key, pattern_key),       nearest    link if     yes    dismissed
            tool_call_id must match when both have      earlier    bridge      (after
            one; clarify: (run, tool_call_id)                       closed      hold_ns)
subagent    child_session_id (``subject``)               oldest     link        grace  orphaned
==========  ===========================================  =========  ==========  =====  ===========

1. A terminal closes an OPEN start of its key whose seq is lower than its own
   (within an epoch): a matching tool_call_id first, then the oldest (FIFO) or, for
   cards, the nearest earlier request (approval prompts are sequential, so a reused
   key's answer belongs to the last request before it, also under reordering) whose
   tool_call_id is the answer's (a request of another call is never taken). It
   is *linked* (``LINKS``): ``cause`` = the start's id; attention follow-ups also get
   ``subject`` = the request's id, ``attention.timeout`` gets ``after_ms`` and
   ``attention.resolved`` ``latency_ms``; ``attention.answered`` is followed by an
   inserted ``attention.resolved {answered, latency_ms}`` (cause = the answer).
   Never across a session end (runs, tools, cards): a start below a session end and a
   terminal above it belong to different lives of a resumed session, and in stream
   order the end's sweep closes the start first.
2. A terminal with no open start may be a late terminal of a start that was just
   closed: runs, subagents and tools with a real ``tool_call_id`` link to it at once
   (their keys are never reused;
   a run that already has its terminal gets ``x.hermes.run.closed``); cards only
   if the bridge closed the card (swept or TTL): an answered card's key being
   reused means the follow-up's own request is still on its way. Not across a
   session end either: such a terminal is held (3) first.
3. Otherwise the terminal is *held* for ``hold_ns`` of stream time from its arrival (the
   stream clock then, at most ``hold_ns`` after its own ts; not from its own ts: the fault that delays a start often delays its
   terminal too, which would otherwise arrive with its hold spent): the mapper runs
   as replicas, so a start can reach us after its terminal (one ``ack_wait`` late
   after a mapper crash). When a start of its key arrives, the held terminals are
   tried in seq order; those it does not take go back, keeping their deadline.
   The hold expires at a tick past the deadline, and only once the mapper's floor that
   ticks carry (``mapped``: every raw message up to it mapped, its events in the stream
   before the tick) reaches the raw message right before the terminal's (``seq >> 10``)
   in its epoch: the mapper retries a message's publishes for as long as an outage lasts,
   far past ``hold_ns``, so a start still inside a mapper replica is waited for (cluster
   fault run, a node SIGSTOPped 20 s: an answer went out unmatched 13 s before its
   request). At most ``floor_wait_ns`` past the deadline (counted ``floor.held_capped``);
   no floor known (ticks of a release before, no mapper durable) or another epoch's: as
   before. When the hold expires the terminal is linked to a recently closed start of its
   key (a tool's repeated terminal: Hermes reported it) or released unchanged
   (no cause, no subject rewrite; counted ``unmatched.<kind>``), except an attention
   follow-up: with no request it has no id for ``subject`` (AEP-0002 §7.1), so it goes
   out as ``x.hermes.attention.unmatched {follow_up, pattern_key, tool_call_id, choice}``
   (same id and seq, no subject): never an ``attention.*`` that names no request. A
   start arriving after its terminal was released passes through without opening a
   pair; a request then gets an inserted ``attention.resolved`` (answered or
   dismissed) after it.
4. ``session.ended`` first sweeps (slots BEFORE it) the session's open runs and tools
   (``x.hermes.pairing.orphaned {reason: session_end}``) whose seq is below its own.
   Its open cards get ``hold_ns`` more from the end's arrival (``due``): their answer may be behind the
   finalize (a mapper replica killed holding it redelivers it one ``ack_wait`` later),
   and a request is never dismissed when its answer exists in the stream: nor while the
   mapper's floor (3) is below the raw message before the end (the answer may be inside
   a mapper replica; at most ``floor_wait_ns`` more, counted ``floor.card_capped``; a late
   card's ``hold_ns`` TTL likewise); a card still
   open then is closed ``attention.resolved {dismissed}`` at a tick, with its seq right
   after the request (before the end in (epoch, seq) order; after it in stream order).
   With ``hold_ns`` 0 cards are swept with the rest. Subagents stay open for
   ``subagent_grace_ns`` (a ``subagent_stop`` may come after the parent ended); held
   terminals stay held (their start may be behind the finalize); a start arriving
   after the end with a lower seq (overtaken by the finalize) opens *late*: its TTL is
   ``hold_ns`` and its closure says ``session_end``. Every end's seq is remembered
   (the last ``MAX_ENDS`` of a session: a resumed session ends more than once) for rule 1.
4b. Delegations that never report back (the CLI exits before a background child's
   ``subagent_stop``; the gateway never finalizes): when the parent's ``delegate_task``
   tool call reaches its terminal, the open subagents of that run have
   ``subagent_grace_ns`` left, and likewise from the parent's session end. Then the
   bridge closes them ``x.hermes.pairing.orphaned {kind: subagent, reason:
   delegate_returned | session_end}``: it stopped waiting, it does not say how the
   child ended. A real ``subagent_stop`` after that (or a repeated one) is not a
   second terminal: it becomes ``x.hermes.delegation.stopped_late`` (its data kept,
   ``cause`` = the start).
5. A ``run.*`` terminal without ``run`` (``on_session_end`` without turn_id) closes
   the session's most recently started open run (``run`` and ``cause`` are set); with
   no open run it becomes ``x.hermes.run.closed {completed, interrupted}``.
6. ``tick`` does everything time does, in this order: starts past their kind's TTL or
   their ``due`` are closed (``dismissed`` / ``x.hermes.pairing.orphaned {reason: ttl |
   session_end | delegate_returned}``), held terminals
   past their deadline (and the mapper's floor) are released (3: so one held across a session end links to the
   late start it could not take, now closed), closed pairs older than
   ``recent_ns`` are forgotten, sessions idle past ``idle_ttl_ns`` (ended ones: past
   ``recent_ns``) are evicted.

Invariants (`bridge.core.invariants.check_invariants` checks them over an output stream)
---------------------------------------------------------------------
* At most one AEP terminal per run: a later one becomes ``x.hermes.run.closed``
  (same id and seq; cause = the run's start when known), counted ``suppressed.run``.
  So does a run's terminal released (its hold over) after its session ended and was
  forgotten: the session's end closed every run still open, stating its totals, and the
  run's calls went with the session, so the terminal could not restate them.
* At most one ``session.ended`` per session across epochs and resumes: a later
  finalize (another event id) becomes ``x.hermes.session.finalized {reason}`` (same
  id and seq; cause = the first session.ended while the session is remembered),
  counted ``suppressed.session``; it sweeps like a session.ended.
* Every attention follow-up (``answered`` / ``resolved`` / ``timeout``) has ``subject`` =
  the id of a request of its own session (AEP-0002 §7.1).
* Every ``attention.requested`` ends in ``attention.resolved`` or ``attention.timeout``
  with ``subject`` = its id, before its session's next end in (epoch, seq) order
  (and in stream order when the input is in order, except a dismissal ``hold_ns``
  after the end: rule 4).
* A linked terminal's ``cause`` is its start's id. Nothing is invented: what the
  bridge closes is ``dismissed`` or ``x.hermes.pairing.orphaned``, never a success.
* Every input event is published once (possibly rewritten, keeping id and seq);
  the same event again (by id) is dropped.
* Determinism: the output is a pure function of the input messages (events, hints,
  positions, tick times). Inserted events get ``id = event_id(<trigger id>/<suffix>,
  slot, <ms>)`` and ``seq = (trigger seq // 1024) * 1024 + slot``:

  ===============================  =======================  ==========  ===========  ==========
  inserted event                   trigger                  slot        id suffix    ms / time
  ===============================  =======================  ==========  ===========  ==========
  session-end sweep                the session.ended        0, 1, ...   ``/sweep``   trigger's
  resolved after an answer         the attention.answered   768         ``/resolved``  trigger's
  resolved after a late request    the attention.requested  768         ``/resolved``  trigger's
  TTL / overflow / late closure    the start itself         776 + i     ``/close``   the tick's
  ===============================  =======================  ==========  ===========  ==========

  (``i`` = the start's index among its raw message's events). A TTL closure sorts
  right after its start: a backfill in AEP ordering, with the tick's ``time``.
* Bounded memory: ``max_open`` open starts per session (the oldest is closed with
  reason ``overflow``), ``max_held`` held terminals, closed pairs kept ``recent_ns``,
  idle sessions evicted; ended sessions are remembered as 8-byte digests
  (``max_ended``, FIFO) and a session's last ``run_memory`` ended runs as 8-byte
  digests. Exclusivity holds within these bounds (a session evicted and seen again
  keeps session exclusivity, not its runs'). ``benchmarks/pairing_footprint.py`` measures
  an idle open session (about 0.5 KB).

The clock
---------
Time is *stream time*, never the wall clock: ``clock`` = the maximum of the
``ts`` hints (shim receive time, ns) of the processed events and of the ``now_ns``
of the tick messages. Ages are measured from a start's own ``ts``. Only ``tick``
acts on time; ``process`` never does. The service publishes ticks INTO the
partition's stream, so a replay meets the same ticks at the same positions and
produces the same output; the mapper's floor comes with the ticks too, and the last
one is in the checkpoint. A host whose clock runs ahead pushes the partition
clock forward (NTP is assumed); ``latency_ms`` / ``after_ms`` are differences of
two ``ts`` of the same host.

Driving it from a service
-------------------------
``process(event, hints, position)`` / ``tick(now_ns, position, mapped)`` (``mapped``: the
mapper's floor ``(epoch, raw seq)`` read before the tick was written, or None: the last
one holds; `tick_body` / `read_tick` are the tick message's body); ``position`` is
the ``BRIDGE_MAPPED`` stream sequence of the message and must grow. A position at
or below ``state.position`` returns ``[]`` (counted ``replayed``): publish
everything a call returned before acking its message; after a publish failure,
restore the last checkpoint and replay instead of feeding the message again.
Checkpoint: ``snapshot()`` (msgpack; covers ``state.position``); restart:
``PairingState.restore(data, config, partition=n)``, then
replay from ``position + 1``. ``PairingState(config, partition=n)`` starts empty.
Publish each event with ``Nats-Msg-Id`` = its id: replayed output is byte-identical.
``metrics()`` gives the counters (``orphaned.<reason>.<kind>``,
``dismissed.<reason>``, ``sweeps``, ``swept.<kind>``, ``suppressed.run|session``,
``unmatched.<kind>``, ``held``, ``floor.held_waits`` (held past their deadline for the
mapper's floor), ``floor.held_paired`` (those that then met their start),
``floor.held_capped``, ``floor.card_capped``, ``late_starts``, ``late_terminals.<kind>``,
``run_closed``, ``duplicates``, ``replayed``, ``evicted``, ``events_in|out``,
``ticks``) and gauges (``open.<kind>``, ``sessions``, ``held_now``,
``ended_remembered``).
"""

from __future__ import annotations

import hashlib
import heapq
import re
from array import array
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

import msgspec
from msgspec import UNSET

from bridge.core.aep import API_CALL_TYPE, RUN_USAGE_TYPE, USAGE_MEMBERS, Event, Severity
from bridge.core.pricing import COST_MEMBERS, COST_NANOS_MAX, TOKEN_MAX, from_nanos, to_nanos
from bridge.core.identity import AFTER_SLOT, MAPPED_SLOT, SLOTS, event_id, rfc3339, ulid_time_ms
from bridge.core.lanes import UNKNOWN

SECOND = 1_000_000_000
MINUTE = 60 * SECOND
HOUR = 60 * MINUTE

# ---------------------------------------------------------------- the rule tables

RUN, TOOL, CARD, SUBAGENT = 0, 1, 2, 3
START, END = 0, 1

#: event type -> (kind, role). session.ended is the one rule that is code (`_session_end`).
ROLES: dict[str, tuple[int, int]] = {
    "run.started": (RUN, START),
    "run.finished": (RUN, END),
    "run.failed": (RUN, END),
    "run.cancelled": (RUN, END),
    "tool.requested": (TOOL, START),
    "tool.completed": (TOOL, END),
    "tool.failed": (TOOL, END),
    "tool.denied": (TOOL, END),
    "attention.requested": (CARD, START),
    "attention.answered": (CARD, END),
    "attention.timeout": (CARD, END),
    "attention.resolved": (CARD, END),
    "delegation.subagent.started": (SUBAGENT, START),
    "delegation.subagent.stopped": (SUBAGENT, END),
}

#: how a linked terminal is rewritten: (set subject = start id, data field filled with ms since start).
#: Every linked terminal gets cause = start id.
LINKS: dict[str, tuple[bool, str | None]] = {
    "attention.answered": (True, None),
    "attention.timeout": (True, "after_ms"),
    "attention.resolved": (True, "latency_ms"),
}

#: terminals that are followed by an inserted event (after-slot) when they close their pair.
INSERT_AFTER: dict[str, str] = {"attention.answered": "answered"}

APPROVAL_HOOKS = frozenset({"pre_approval_request", "post_approval_response"})
DELEGATE_TOOL = "delegate_task"  # the Hermes tool whose call starts subagents (its run = their parent_turn_id)


def _run_key(ev: Event, h: dict[str, Any]) -> str:
    return _run(ev)


def _tool_key(ev: Event, h: dict[str, Any]) -> str:
    tool = _data(ev).get("tool") or {}
    call_id = h.get("tool_call_id") or tool.get("call_id") or ""
    run = _run(ev)
    if call_id:
        return f"{run}\x1f{call_id}"
    # execute_code calls: no tool_call_id, no turn id; same task, tool and arguments = same call (FIFO)
    return f"{run}\x1e{h.get('task_id', '')}\x1f{tool.get('name', '')}\x1f{h.get('args_digest', '')}"


def _card_key(ev: Event, h: dict[str, Any]) -> str:
    if h.get("hook") in APPROVAL_HOOKS:
        return f"a\x1f{h.get('session_key', '')}\x1f{h.get('pattern_key') or _subject(ev)}"
    return f"c\x1f{_run(ev)}\x1f{h.get('tool_call_id') or _subject(ev)}"


def _subagent_key(ev: Event, h: dict[str, Any]) -> str:
    if ev.subject:
        return _subject(ev)
    child = _data(ev).get("child") or {}
    return child.get("session") or ""


class KindRule(NamedTuple):
    """How one kind of pair behaves (the table in the module docstring)."""

    name: str  # in metrics and in x.hermes.pairing.orphaned.kind
    key: Callable[[Event, dict[str, Any]], str]
    nearest: bool  # a terminal closes the nearest earlier open start (else the oldest: FIFO)
    tie: bool  # the tool_call_id hint breaks ties between open starts of one key
    hold_first: bool  # a stray terminal waits for a late start before linking to a closed one
    relink_ended: bool  # a stray terminal may link to a start closed by its own terminal
    swept: bool  # closed at session end
    dismissed: bool  # the bridge closes it with attention.resolved {dismissed} (else orphaned)


RULES: tuple[KindRule, ...] = (
    KindRule("run", _run_key, nearest=False, tie=False, hold_first=False, relink_ended=True, swept=True, dismissed=False),
    KindRule("tool", _tool_key, nearest=False, tie=False, hold_first=True, relink_ended=True, swept=True, dismissed=False),
    KindRule("card", _card_key, nearest=True, tie=True, hold_first=False, relink_ended=False, swept=True, dismissed=True),
    KindRule("subagent", _subagent_key, nearest=False, tie=False, hold_first=False, relink_ended=True, swept=False, dismissed=False),
)
KINDS = tuple(rule.name for rule in RULES)

# pair states
OPEN, ENDED, CLOSED, UNLINKED, UNLINKED_ANSWER = 0, 1, 2, 3, 4
# ENDED: closed by its own terminal; CLOSED: closed by the bridge (orphaned / dismissed);
# UNLINKED(_ANSWER): a follow-up released without a start (remembered for a late start).

SWEEP_SLOT = 0  # 0..511: before the session.ended
AFTER_INSERT_SLOT = AFTER_SLOT  # 768: resolved after answered / after a late request
CLOSE_SLOT = AFTER_SLOT + 8  # 776 + index: TTL / overflow closure of a start


# ---------------------------------------------------------------- configuration


@dataclass(frozen=True)
class PairingConfig:
    """Knobs of the state machine (all times are stream time in ns)."""

    run_ttl_ns: int = 2 * HOUR
    tool_ttl_ns: int = 1 * HOUR
    card_ttl_ns: int = 1 * HOUR
    subagent_ttl_ns: int = 6 * HOUR
    #: how long a delegation may still report back (``subagent_stop``) after its parent's
    #: ``delegate_task`` call ended or its parent's session ended; then the bridge closes it
    #: (``x.hermes.pairing.orphaned``: the CLI exits before a background child reports, the
    #: gateway never finalizes)
    subagent_grace_ns: int = 10 * MINUTE
    #: how long a terminal waits for a start that has not arrived: replicas reorder, and a start
    #: redelivered after a mapper crash comes one ack_wait late; keep it above the mapper's ack_wait
    hold_ns: int = 45 * SECOND
    #: how long closed pairs (and ended sessions' structs) are remembered: repeats, late terminals
    recent_ns: int = 2 * MINUTE
    #: a session with nothing open, nothing held and no event for this long is evicted. Only a
    #: quiet session goes: an open start keeps its session until the start's own TTL, so this
    #: need not outlast the TTLs. What eviction forgets is the session's run digests (a terminal
    #: of one of its runs repeated later than this is no longer recognised). Sessions that
    #: never end (a subagent's own session: Hermes finalizes only the parent; ~29 % of the
    #: simulated fleet's) are kept this long: at 6 h they were the pairing stage's main growth.
    idle_ttl_ns: int = 30 * MINUTE
    #: how much longer than its deadline a held follow-up (or a card dismissed ``hold_ns`` after
    #: its session's end) waits while the mapper has not mapped every raw message before it (the
    #: floor the ticks carry, rule 3): the mapper retries a message for as long as an outage
    #: lasts, far past ``hold_ns``; this bounds the wait (counted ``floor.held_capped``)
    floor_wait_ns: int = 10 * MINUTE
    max_open: int = 128  # open pairs per session
    max_held: int = 64  # held follow-ups per session
    dedupe_ids: int = 4096  # recent input event ids remembered per partition
    max_ended: int = 100_000  # ended sessions remembered (8-byte digests) per partition
    run_memory: int = 4  # runs per session remembered as terminated (8-byte digests)

    def __post_init__(self) -> None:
        if self.idle_ttl_ns < self.recent_ns:
            raise ValueError("idle_ttl_ns must be >= recent_ns (a session outlives the closed pairs it remembers)")
        if self.max_open > SLOTS - CLOSE_SLOT or self.max_open > AFTER_SLOT - MAPPED_SLOT:
            raise ValueError("max_open must fit the seq slots of a session-end sweep")
        if min(self.ttls()) <= 0 or self.hold_ns < 0 or self.recent_ns < self.hold_ns or self.subagent_grace_ns < 0:
            raise ValueError("TTLs must be positive, hold_ns and subagent_grace_ns >= 0 and recent_ns >= hold_ns")
        if self.floor_wait_ns < 0:
            raise ValueError("floor_wait_ns must be >= 0")

    def ttls(self) -> tuple[int, int, int, int]:
        """TTL by kind, in the order of `RULES`."""
        return (self.run_ttl_ns, self.tool_ttl_ns, self.card_ttl_ns, self.subagent_ttl_ns)


# ---------------------------------------------------------------- state (msgspec structs: compact, and the snapshot format)


class _Usage(msgspec.Struct, array_like=True, gc=False):
    """The sums of one run's model calls so far (`_call`), until an end of the run carries them."""

    calls: int = 0
    tokens: list[int] = msgspec.field(default_factory=lambda: [-1] * len(USAGE_MEMBERS))  # -1: no call had it
    currency: str = ""  # "" no call yet; NO_COST: a call without a cost, or in another currency
    cost: list[int] = msgspec.field(default_factory=lambda: [0] * len(COST_MEMBERS))  # nano-units
    #: the calls counted, by raw position alone: only in a checkpoint of the code before
    #: ``keys`` (read, never added to; such a run's calls were all of one epoch)
    seqs: list[int] = msgspec.field(default_factory=list)
    #: the calls counted, (epoch, seq): a raw position is unique within its epoch only (a
    #: HERMES_RAW recreated mid-run starts its positions again). Kept sorted: a lookup bisects
    #: (a scan per call made a long run quadratic: 20,000 calls, 2.4 s), an insert is an
    #: append in the usual order, and the checkpoint's bytes stay canonical
    keys: list[tuple[int, int]] = msgspec.field(default_factory=list)


NO_COST = "-"
#: a run's sum (tokens of a member, nano-units of a cost member) never passes this (the largest
#: integer a JSON number holds exactly): a call past it leaves that member out of the run's
#: totals (``OVER`` for tokens, `NO_COST` for the cost; counted ``usage.overflow``), never a
#: wrapped or rounded figure, and every sum stays far inside what a checkpoint encodes. A call's
#: own count past `TOKEN_MAX` or cost past `COST_NANOS_MAX` (the mapper never makes one) is not
#: summed either (counted ``usage.invalid``).
RUN_SUM_MAX = 2**53
OVER = -2


_USAGE_KEYS = tuple(member for member, _ in USAGE_MEMBERS)


def _sum_count(a: int, b: int) -> int:
    """Two token sums (-1: no call had the member, `OVER`: past the bound) as one."""
    if a == OVER or b == OVER:
        return OVER
    if a < 0 and b < 0:
        return -1
    total = max(a, 0) + max(b, 0)
    return total if total <= RUN_SUM_MAX else OVER


class _Pair(msgspec.Struct, array_like=True, gc=False):
    kind: int
    key: str
    start: str  # the start's event id; "" for an UNLINKED pair (its start never seen)
    seq: int  # the start's seq (UNLINKED: the follow-up's)
    ts: int  # the start's receive time, ns (UNLINKED: the follow-up's)
    epoch: int
    run: str = ""
    tie: str = ""  # approvals: tool_call_id
    src: str = ""  # the start's source when it differs from the session's (the unknown lane)
    state: int = OPEN
    end: str = ""  # id of the event that closed it
    closed: int = 0  # stream time it closed
    capture_none: bool = False  # the start had capture "none": inserted events carry required fields only
    late: bool = False  # opened after its session ended (seq below the session.ended): TTL = hold_ns
    # Fields added after the first release (a snapshot without them decodes with these defaults):
    due: int = 0  # a stream-time deadline set by an event (session end, delegate returned); 0 = none
    why: str = ""  # the closure reason at ``due``: session_end | delegate_returned
    #: a closed run: the sums of its model calls its end carried, kept while the pair is
    #: remembered (``recent_ns``) so a call arriving after the end amends them (issue 40)
    use: _Usage | None = None


class _Held(msgspec.Struct, array_like=True, gc=False):
    deadline: int
    kind: int
    key: str
    event: Event
    hints: dict[str, Any]
    #: kept past ``deadline`` for the mapper's floor (counted once: ``floor.held_waits``); a
    #: snapshot of a release before decodes it False
    waited: bool = False




class _Session(msgspec.Struct, array_like=True, gc=False):
    source: str  # the source of its first event
    last: int  # stream time of its last event
    ended: str = ""  # id of its session.ended ("" = not ended, as far as this struct knows)
    fin: int = 0  # seq of that session.ended
    runs: bytes = b""  # 8-byte digests of the last runs that got an AEP terminal
    pairs: list[_Pair] | None = None
    held: list[_Held] | None = None
    #: seqs of its session ends seen (session.ended and every later finalize of a resumed
    #: session), ascending, the last ``MAX_ENDS``; None before the first or in a snapshot of a
    #: release that kept only ``fin`` (see `_ends`). Nothing pairs across one of them.
    ends: list[int] | None = None
    #: issue 40: run id -> the sums of its model calls (``x.hermes.api.call``) not yet carried by
    #: an end of the run; None in a snapshot of a release before (decoded as no sums)
    usage: dict[str, _Usage] | None = None


MAX_ENDS = 8


def _ends(s: _Session) -> list[int]:
    if s.ends is not None:
        return s.ends
    return [s.fin] if s.ended else []


def _crosses(ends: Sequence[int], lo: int, hi: int) -> bool:
    """Whether a session end lies between seqs ``lo`` and ``hi`` (a start and its would-be terminal)."""
    return any(lo < e < hi for e in ends)


class _Snapshot(msgspec.Struct, array_like=True):
    version: int
    position: int
    clock: int
    counters: dict[str, int]
    seen: list[str]
    ended: list[int]
    sessions: dict[str, _Session]
    #: the mapper's floor the last tick that had one carried, (epoch, raw seq); None in a
    #: snapshot of a release before (and msgspec ignores it when such a release reads this one)
    mapped: tuple[int, int] | None = None


SNAPSHOT_VERSION = 2  # 2: the unknown lane is keyed UNKNOWN_KEY (1, read too: keyed "unknown")
_snapshot_encoder = msgspec.msgpack.Encoder()
_snapshot_decoder = msgspec.msgpack.Decoder(_Snapshot)

UNKNOWN_KEY = ""  # the unknown lane's key in the state (events: session "unknown", lane "unknown")
INT64_MAX = 2**63 - 1
_ULID = re.compile(r"[0-7][0-9A-HJKMNP-TV-Z]{25}")


class PairingInputError(ValueError):
    """An input the pairing state does not take (nothing of it was kept)."""


def check_input(event: Event, hints: dict[str, Any], ts: int) -> None:
    """Refuse what a checkpoint could not hold, before any of it enters the state: times,
    seqs and epochs outside int64, and anything msgpack cannot encode (integers past 64
    bits deep in ``data``, lone surrogates). What the state derives from an input stays
    encodable by construction: a run's sums are bounded (`RUN_SUM_MAX`, `_add_call`)."""
    if not 0 <= ts <= INT64_MAX:
        raise PairingInputError(f"receive time {ts} outside 0..2**63-1 ns")
    for name in ("seq", "epoch"):
        value = getattr(event, name)
        if isinstance(value, int) and not 0 <= value <= INT64_MAX:
            raise PairingInputError(f"{name} {value} outside 0..2**63-1")
    try:
        _snapshot_encoder.encode(event)
        _snapshot_encoder.encode(hints)
    except (OverflowError, TypeError, ValueError, UnicodeEncodeError, msgspec.EncodeError) as exc:
        raise PairingInputError(f"a value no checkpoint can hold: {type(exc).__name__}: {exc}") from None


def tick_body(now_ns: int, mapped: tuple[int, int] | None = None) -> bytes:
    """A tick message's body: ``{"now": ns}``, and the mapper's floor when known,
    ``"mapped": [epoch, raw seq]`` (a tick without it reads as before the floor existed)."""
    if mapped is None:
        return msgspec.json.encode({"now": now_ns})
    return msgspec.json.encode({"now": now_ns, "mapped": [mapped[0], mapped[1]]})


def read_tick(data: bytes) -> tuple[int, tuple[int, int] | None]:
    """``(now_ns, mapped)`` of a tick's body (`tick_body`); a ``mapped`` that is not two
    integers in 0..2**63-1 reads as not known. Undecodable JSON raises ``msgspec.DecodeError``."""
    doc = msgspec.json.decode(data)
    if not isinstance(doc, dict):
        raise PairingInputError("a tick's body is not an object")
    now = int(doc.get("now", 0))
    mapped = doc.get("mapped")
    if (isinstance(mapped, list) and len(mapped) == 2
            and all(type(v) is int and 0 <= v <= INT64_MAX for v in mapped)):
        return now, (mapped[0], mapped[1])
    return now, None


class _DigestRing:
    """Up to ``limit`` 64-bit digests, first in first out, with membership tests.

    The ended sessions of a partition (``max_ended``, 100,000 by default) are its largest
    structure at a fleet's steady state; a ``set`` of ints plus a ``deque`` costs ~100 bytes
    a digest, this ~17: one array in insertion order (evicted from ``_head``, compacted
    now and then) and one sorted array searched by bisection (an insertion or an eviction
    moves at most ``8 * limit`` bytes: microseconds, once per session end).
    """

    __slots__ = ("limit", "_order", "_head", "_sorted")

    def __init__(self, limit: int, items: Any = ()) -> None:
        self.limit = limit
        self._order = array("Q", items)
        self._head = 0
        self._sorted = array("Q", sorted(set(self._order)))

    def __len__(self) -> int:
        return len(self._order) - self._head

    def __contains__(self, digest: int) -> bool:
        i = bisect_left(self._sorted, digest)
        return i < len(self._sorted) and self._sorted[i] == digest

    def add(self, digest: int) -> None:
        """Remember ``digest`` (the caller adds a digest only when it is not remembered yet)."""
        self._order.append(digest)
        if digest not in self:
            self._sorted.insert(bisect_left(self._sorted, digest), digest)
        while len(self) > self.limit:
            self._discard(self._order[self._head])
            self._head += 1
        if self._head > 1024 and 2 * self._head > len(self._order):
            del self._order[: self._head]
            self._head = 0

    def _discard(self, digest: int) -> None:
        i = bisect_left(self._sorted, digest)
        if i < len(self._sorted) and self._sorted[i] == digest:
            del self._sorted[i]

    def tolist(self) -> list[int]:
        """Oldest first (the snapshot's ``ended``)."""
        return self._order[self._head :].tolist()

    def nbytes(self) -> int:
        return (len(self._order) + len(self._sorted)) * self._order.itemsize


def _digest8(value: str) -> bytes:
    return hashlib.blake2b(value.encode("utf-8", "surrogatepass"), digest_size=8).digest()


# Typed accessors for the optional fields pairing reads (UNSET reads as "" / 0 / {}).


def _seq(ev: Event) -> int:
    return ev.seq if isinstance(ev.seq, int) else 0


def _epoch(ev: Event) -> int:
    return ev.epoch or 0


def _run(ev: Event) -> str:
    return ev.run or ""


def _subject(ev: Event) -> str:
    return ev.subject or ""


def _data(ev: Event) -> dict[str, Any]:
    return ev.data or {}


def _before(p: _Pair, seq: int, epoch: int) -> bool:
    """Can pair ``p`` be the start of a terminal at (epoch, seq)? (seq order holds within an epoch.)"""
    return p.seq < seq or p.epoch != epoch


def _ms(later_ns: int, earlier_ns: int) -> int:
    return max(0, (later_ns - earlier_ns) // 1_000_000)


class _At(NamedTuple):
    """Where an event pairing inserts goes, and the identity it takes."""

    source: str
    epoch: int
    anchor: int  # the seq of the event it goes with (its raw position decides the seq)
    slot: int
    seed: str  # hashed with the slot into the event id
    id_ms: int  # time part of the id
    time: str


# ---------------------------------------------------------------- the state machine


class PairingState:
    """The pairing state of one partition. See the module docstring for the rules."""

    def __init__(self, config: PairingConfig | None = None, *, partition: int | None = None) -> None:
        self.config = config or PairingConfig()
        self._ttls = self.config.ttls()  # by kind (`_deadline`; the config is frozen)
        #: which partition this state owns (a label for the service; not part of the state)
        self.partition = partition
        #: the last BRIDGE_MAPPED position (stream sequence) this state covers
        self.position = 0
        #: stream time, ns (max of event ts hints and tick times)
        self.clock = 0
        #: monotonic counters (part of the snapshot, so they continue across takeovers)
        self.counters: dict[str, int] = {}
        self._sessions: dict[str, _Session] = {}
        self._seen: set[str] = set()
        self._seen_order: deque[str] = deque()
        #: ended sessions' 8-byte digests (``max_ended``, FIFO): compact, see `_DigestRing`
        self._ended = _DigestRing(self.config.max_ended)
        #: the mapper's floor, (epoch, raw seq): every raw message of that epoch up to that seq
        #: was mapped and its events stored in BRIDGE_MAPPED before the tick that carried it
        #: (the latest a tick carried; None: no tick had one, the behaviour before it existed)
        self.mapped: tuple[int, int] | None = None
        # not snapshotted (rebuilt on restore): open pairs by kind, and the wake-up heap
        self._open = [0, 0, 0, 0]
        self._heap: list[tuple[int, str]] = []
        self._wake: dict[str, int] = {}

    # ------------------------------------------------------------ public API

    def process(self, event: Event, hints: dict[str, Any] | None, position: int) -> list[Event]:
        """Feed one mapped event; return the events to publish, in order.

        ``PairingInputError`` (nothing changed) for an input the state could not keep: a
        value no checkpoint can hold would otherwise fail every later checkpoint of the
        partition, and every restart would replay from the last good one."""
        if position <= self.position:
            self._count("replayed")
            return []
        h = hints or {}
        ts = h.get("ts")
        if not isinstance(ts, int) or isinstance(ts, bool) or ts <= 0:
            ts = ulid_time_ms(event.id) * 1_000_000 if _ULID.fullmatch(event.id) else 0
        check_input(event, h, ts)
        self.position = position
        self._count("events_in")
        if event.id in self._seen:
            self._count("duplicates")
            return []
        self._remember_id(event.id)
        if ts > self.clock:
            self.clock = ts
        if event.session is UNSET:  # agent.* events: nothing to pair
            return self._emit([event])
        # The unknown lane is keyed "" (no session id is empty): a real session named
        # "unknown" is another session.
        lane = UNKNOWN_KEY if event.lane == "unknown" else event.session
        s = self._sessions.get(lane)  # type: ignore[arg-type]
        if s is None:
            s = self._sessions[lane] = _Session(source=event.source, last=ts)
        elif ts > s.last:
            s.last = ts
        if event.type == "session.ended":
            out = self._session_end(lane, s, event, h, ts)
        else:
            role = ROLES.get(event.type)
            if role is None:
                out = [event]
                if event.type == API_CALL_TYPE:
                    out += self._call(lane, s, event)
            elif role[1] == START:
                out = self._start(role[0], lane, s, event, h, ts)
            else:
                out = self._end(role[0], lane, s, event, h, ts)
        self._schedule(lane, s)
        return self._emit(out)

    def tick(self, now_ns: int, position: int, mapped: tuple[int, int] | None = None) -> list[Event]:
        """Advance stream time to ``now_ns`` and close what waited too long.

        ``mapped``: the mapper's floor when the tick was written, ``(epoch, raw seq)`` (every raw
        message up to it mapped, its events in the stream before this tick); None: not known (a
        tick of a release before, or the mapper's durable could not be read): the last one a
        tick carried holds. A follow-up is released only once the floor passed the raw messages
        before it (rule 3)."""
        if position <= self.position:
            self._count("replayed")
            return []
        self.position = position
        self._count("ticks")
        if now_ns > self.clock:
            self.clock = now_ns
        if mapped is not None:
            last = self.mapped
            if last is None or mapped[0] > last[0] or (mapped[0] == last[0] and mapped[1] > last[1]):
                self.mapped = (mapped[0], mapped[1])
        due: set[str] = set()
        heap = self._heap
        while heap and heap[0][0] <= self.clock:
            deadline, lane = heapq.heappop(heap)
            if self._wake.get(lane) == deadline:
                del self._wake[lane]
                due.add(lane)
        out: list[Event] = []
        for lane in sorted(due):
            s = self._sessions.get(lane)
            if s is not None:
                out += self._expire(lane, s)
                if lane in self._sessions:
                    self._schedule(lane, s)
        return self._emit(out)

    @property
    def next_deadline(self) -> int | None:
        """The earliest stream time at which a tick may have work (a hint for tick pacing)."""
        return self._heap[0][0] if self._heap else None

    def open_pairs(self) -> dict[str, int]:
        """Open starts by kind (``run``, ``tool``, ``card``, ``subagent``): a gauge."""
        return {name: self._open[i] for i, name in enumerate(KINDS)}


    def metrics(self) -> dict[str, int]:
        """Counters plus gauges, flat (``open.<kind>``, ``sessions``, ``held_now``, ``ended_remembered``)."""
        out = dict(self.counters)
        for name, n in self.open_pairs().items():
            out[f"open.{name}"] = n
        out["sessions"] = len(self._sessions)
        out["held_now"] = sum(len(s.held) for s in self._sessions.values() if s.held)
        out["ended_remembered"] = len(self._ended)
        return out

    def snapshot(self) -> bytes:
        """The whole state as msgpack bytes; it covers `position`."""
        return _snapshot_encoder.encode(
            _Snapshot(
                version=SNAPSHOT_VERSION,
                position=self.position,
                clock=self.clock,
                counters=self.counters,
                seen=list(self._seen_order),
                ended=self._ended.tolist(),
                sessions=self._sessions,
                mapped=self.mapped,
            )
        )

    @classmethod
    def restore(
        cls, data: bytes, config: PairingConfig | None = None, *, partition: int | None = None
    ) -> PairingState:
        """A state from a snapshot; replay the stream from ``state.position + 1``.

        Raises ``ValueError`` for a snapshot of another version (or ``msgspec.DecodeError``
        for garbage): never start over silently from an unreadable checkpoint.
        """
        state = cls(config, partition=partition)
        state._load(data)
        return state


    def _load(self, data: bytes) -> None:
        snap = _snapshot_decoder.decode(data)
        if snap.version not in (1, SNAPSHOT_VERSION):
            raise ValueError(f"unsupported pairing snapshot version {snap.version}")
        self.position = snap.position
        self.clock = snap.clock
        self.counters = snap.counters
        self._seen_order = deque(snap.seen)
        self._seen = set(snap.seen)
        self._ended = _DigestRing(self.config.max_ended, snap.ended)
        self._sessions = snap.sessions
        self.mapped = tuple(snap.mapped) if snap.mapped is not None else None  # type: ignore[assignment]
        if UNKNOWN in self._sessions and UNKNOWN_KEY not in self._sessions and snap.version == 1:
            # Checkpoints written before the unknown lane had its own key held it as "unknown".
            self._sessions[UNKNOWN_KEY] = self._sessions.pop(UNKNOWN)
        self._open = [0, 0, 0, 0]
        self._heap = []
        self._wake = {}
        for lane, s in self._sessions.items():
            for p in s.pairs or ():
                if p.state == OPEN:
                    self._open[p.kind] += 1
            self._schedule(lane, s)

    # ------------------------------------------------------------ starts

    def _start(self, kind: int, lane: str, s: _Session, ev: Event, h: dict[str, Any], ts: int) -> list[Event]:
        rule = RULES[kind]
        key = rule.key(ev, h)
        pairs = s.pairs
        if pairs:
            for p in pairs:
                if p.start == ev.id:  # the same start again (beyond the id ring)
                    self._count("duplicates")
                    return []
            ends = _ends(s) if rule.swept else []
            for p in pairs:  # a start arriving after its follow-up was released unlinked
                if (p.kind == kind and p.key == key and not p.start and p.state >= UNLINKED and _seq(ev) < p.seq
                        and not _crosses(ends, _seq(ev), p.seq)):
                    return self._late_start(lane, p, ev, ts)
        if kind == RUN and ev.run and self._run_ended(s, _run(ev)):
            self._count("late_starts")
            return [ev]
        out: list[Event] = []
        if self._open_count(s) >= self.config.max_open:
            oldest = min((p for p in s.pairs or () if p.state == OPEN), key=lambda p: p.seq)
            out += self._bridge_close(lane, s, oldest, "overflow")
        pair = _Pair(
            kind=kind,
            key=key,
            start=ev.id,
            seq=_seq(ev),
            ts=ts,
            epoch=_epoch(ev),
            run=_run(ev),
            tie=h.get("tool_call_id", "") if rule.tie else "",
            src="" if ev.source == s.source else ev.source,
            capture_none=ev.capture == "none",
            late=rule.swept and any(e > _seq(ev) for e in _ends(s)),
        )
        if s.pairs is None:
            s.pairs = []
        s.pairs.append(pair)
        self._open[kind] += 1
        self._trim(s)
        out.append(ev)
        if s.held:  # follow-ups that arrived before this start, in seq order; the unpaired go back
            waiting = sorted((x for x in s.held if x.kind == kind and x.key == key), key=lambda x: _seq(x.event))
            for x in waiting:
                s.held.remove(x)
            for x in waiting:
                x_ts = x.hints.get("ts") or ulid_time_ms(x.event.id) * 1_000_000
                got = self._end(kind, lane, s, x.event, x.hints, x_ts, held=x)
                if got and x.waited:  # kept past its deadline for the floor: it found its start
                    self._count("floor.held_paired")
                out += got
            if not s.held:
                s.held = None
        return out

    def _late_start(self, lane: str, p: _Pair, ev: Event, ts: int) -> list[Event]:
        """The start of a pair whose follow-up went out unlinked: pass it through, keep cards ending."""
        self._count("late_starts")
        p.start = ev.id
        out = [ev]
        if p.kind == CARD:
            resolution = "answered" if p.state == UNLINKED_ANSWER else "dismissed"
            out.append(self._resolved_after(lane, ev, resolution, _ms(p.ts, ts), subject=ev.id, cause=p.end))
        return out

    def _resolved_after(self, lane: str, ev: Event, resolution: str, latency_ms: int, *, subject: str, cause: str) -> Event:
        """The ``attention.resolved`` pairing inserts right after ``ev`` (no latency at capture none)."""
        data: dict[str, Any] = {"resolution": resolution}
        if ev.capture != "none":
            data["latency_ms"] = latency_ms
        at = _At(ev.source, _epoch(ev), _seq(ev), AFTER_INSERT_SLOT, ev.id + "/resolved", ulid_time_ms(ev.id), ev.time)
        return self._insert(
            lane,
            at,
            etype="attention.resolved",
            data=data,
            run=_run(ev),
            subject=subject,
            cause=cause,
            capture_none=ev.capture == "none",
        )

    # ------------------------------------------------------------ terminals

    def _end(
        self, kind: int, lane: str, s: _Session, ev: Event, h: dict[str, Any], ts: int, held: _Held | None = None
    ) -> list[Event]:
        """A terminal: link it to its open start, or to a recently closed one, or hold it.

        ``held``: the terminal comes back from the held list (a start of its key arrived);
        when it still finds nothing it goes back there with its original deadline.
        """
        pairs = s.pairs or ()
        for p in pairs:
            if p.end == ev.id:  # the same terminal again (beyond the id ring)
                self._count("duplicates")
                return []
        if kind == RUN and not ev.run:
            return self._runless_end(s, ev, ts)
        rule = RULES[kind]
        key = rule.key(ev, h)
        seq, epoch = _seq(ev), _epoch(ev)
        ends = _ends(s) if rule.swept else []  # subagents outlive their parent's end
        match = self._find_open(pairs, kind, key, h.get("tool_call_id", "") if rule.tie else "", seq, epoch, ends)
        if match is not None:
            return self._link(lane, s, match, ev, ts, first=True)
        # A composite tool key (no tool_call_id: calls from inside execute_code) is reused by
        # every identical call, so such a terminal first waits for a late request of its own.
        # A real tool_call_id is unique within its run: a terminal whose call already closed is
        # a repeat Hermes reported, linked at once instead of being delayed by the hold.
        if not rule.hold_first or h.get("tool_call_id"):
            # not across a session end: the follow-up's own start (a resumed session's) may be
            # on its way; when the hold expires `_release` links across the end after all
            recent = self._find_recent(pairs, kind, key, seq, epoch, ends)
            if recent is not None:
                return self._link(lane, s, recent, ev, ts, first=False)
        if kind == RUN and self._run_ended(s, _run(ev)):
            self._count("suppressed.run")
            return [self._as_run_closed(ev, None)]
        if held is not None:
            if s.held is None:
                s.held = []
            s.held.append(held)
            return []
        if self.config.hold_ns > 0:
            return self._hold(lane, s, kind, key, ev, h, ts)
        return self._release(lane, s, kind, key, ev, ts, h)

    @staticmethod
    def _find_recent(pairs: Any, kind: int, key: str, seq: int, epoch: int, ends: Sequence[int] = ()) -> _Pair | None:
        """The most recently closed pair of this key with a known, earlier start (and no session
        end in ``ends`` between the two)."""
        recent = None
        for p in pairs:
            if (p.kind == kind and p.key == key and p.start and p.state != OPEN and _before(p, seq, epoch)
                    and not _crosses(ends, p.seq, seq)):
                if p.state != CLOSED and not RULES[kind].relink_ended:
                    continue  # a card ends once: an answered card's key reused = an early follow-up
                if recent is None or p.closed >= recent.closed:
                    recent = p
        return recent

    @staticmethod
    def _find_open(pairs: Any, kind: int, key: str, tie: str, seq: int, epoch: int, ends: list[int]) -> _Pair | None:
        """The open start of this key that this terminal closes (only starts with a lower seq qualify).

        A request of another tool_call_id is never taken (approvals, when both have one); a
        matching one wins; then FIFO (the lowest seq) for runs, tools and
        subagents, the NEAREST earlier request for cards (approval prompts are sequential, so a
        reused key's answer belongs to the last request before it, also when replicas reorder).
        Never across a session end (``ends``): a start before an end and a terminal after it
        belong to different lives of a resumed session; in stream order the end's sweep would
        have closed the start first.
        """
        best = best_tie = None
        nearest = RULES[kind].nearest
        for p in pairs:
            if (p.state == OPEN and p.kind == kind and p.key == key and _before(p, seq, epoch)
                    and not _crosses(ends, p.seq, seq) and not (tie and p.tie and p.tie != tie)):
                if best is None or (p.seq > best.seq if nearest else p.seq < best.seq):
                    best = p
                if tie and p.tie == tie and (best_tie is None or (p.seq > best_tie.seq if nearest else p.seq < best_tie.seq)):
                    best_tie = p
        return best_tie or best

    def _link(self, lane: str, s: _Session, p: _Pair, ev: Event, ts: int, *, first: bool) -> list[Event]:
        """Rewrite a terminal of pair ``p`` (open when ``first``, else already closed)."""
        if p.kind == RUN:
            if not first and p.state != CLOSED:  # invariant 1: one terminal per run
                self._count("suppressed.run")
                return [self._as_run_closed(ev, p.start)]
            self._remember_run(s, p.key)
        if first or p.kind == RUN:  # a run the bridge orphaned still takes its first real terminal
            self._close(p, ev.id, ENDED)
        else:
            self._count(f"late_terminals.{KINDS[p.kind]}")
            if p.kind == SUBAGENT:  # the delegation already has its end: no second terminal
                return [msgspec.structs.replace(ev, type="x.hermes.delegation.stopped_late", cause=p.start)]
        if p.kind == TOOL and first and ((ev.data or {}).get("tool") or {}).get("name") == DELEGATE_TOOL:
            self._delegate_returned(s, p.run, ts)
        subject, field = LINKS.get(ev.type, (False, None))
        changes: dict[str, Any] = {"cause": p.start}
        if p.kind == RUN:  # the run's end: the sums of its calls
            totals = self._settle(s, p, ev.capture == "none")
            if totals:
                changes["data"] = {**_data(ev), **totals}
        if subject:
            changes["subject"] = p.start
        if field and ev.capture != "none" and field not in _data(ev):
            changes["data"] = {**_data(ev), field: _ms(ts, p.ts)}
        out = [msgspec.structs.replace(ev, **changes)]
        resolution = INSERT_AFTER.get(ev.type)
        if resolution and first:
            out.append(self._resolved_after(lane, ev, resolution, _ms(ts, p.ts), subject=p.start, cause=ev.id))
        return out

    def _delegate_returned(self, s: _Session, run: str, ts: int) -> None:
        """The parent's ``delegate_task`` call ended: its run's open delegations have
        ``subagent_grace_ns`` left to report back (a foreground child has reported already)."""
        due = ts + self.config.subagent_grace_ns
        for q in s.pairs or ():
            if q.kind == SUBAGENT and q.state == OPEN and q.run == run and (not q.due or q.due > due):
                q.due, q.why = due, "delegate_returned"

    def _runless_end(self, s: _Session, ev: Event, ts: int) -> list[Event]:
        """``on_session_end`` without a turn id: close the session's latest open run, if any."""
        latest = None
        seq, epoch = _seq(ev), _epoch(ev)
        for p in s.pairs or ():
            if p.kind == RUN and p.state == OPEN and _before(p, seq, epoch) and (latest is None or p.seq > latest.seq):
                latest = p
        if latest is None:
            self._count("run_closed")
            return [self._as_run_closed(ev, None)]
        self._remember_run(s, latest.key)
        self._close(latest, ev.id, ENDED)
        totals = self._settle(s, latest, ev.capture == "none")
        data = {**_data(ev), **totals} if totals else ev.data
        return [msgspec.structs.replace(ev, run=latest.key or UNSET, cause=latest.start, data=data)]

    @staticmethod
    def _as_run_closed(ev: Event, cause: str | None) -> Event:
        data = {} if ev.capture == "none" else {
            "completed": ev.type == "run.finished",
            "interrupted": ev.type == "run.cancelled",
        }
        return msgspec.structs.replace(ev, type="x.hermes.run.closed", data=data, cause=cause or UNSET)

    # ------------------------------------------------------------ holding follow-ups without a start

    def _hold(self, lane: str, s: _Session, kind: int, key: str, ev: Event, h: dict[str, Any], ts: int) -> list[Event]:
        out: list[Event] = []
        if s.held is None:
            s.held = []
        elif len(s.held) >= self.config.max_held:
            oldest = s.held.pop(0)
            out += self._release(lane, s, oldest.kind, oldest.key, oldest.event, oldest.hints.get("ts") or 0, oldest.hints)
        self._count("held")
        s.held.append(_Held(deadline=self._arrival(ts) + self.config.hold_ns, kind=kind, key=key, event=ev,
                            hints=dict(h)))
        return out

    def _arrival(self, ts: int) -> int:
        """When an event of time ``ts`` reached pairing, in stream time: the clock (already >= ts),
        at most ``hold_ns`` after ts. A hold counts from here, not from ts: a terminal held up by
        the fault that also delays its start would otherwise arrive with its hold spent (CI,
        kill -9 of BRIDGE_MAPPED's leader). The bound: one event from a clock hours ahead must
        not hold every later follow-up of the partition until wall time catches up."""
        return min(max(ts, self.clock), ts + self.config.hold_ns)

    def _release(self, lane: str, s: _Session, kind: int, key: str, ev: Event, ts: int,
                 h: dict[str, Any] | None = None) -> list[Event]:
        """A follow-up whose start never came: a repeat of a recently closed pair is linked to it,
        anything else goes out unchanged (remembered for a late start), except an attention
        follow-up: with no request it has no id for ``subject`` (AEP-0002 §7.1), so it goes out
        as ``x.hermes.attention.unmatched`` (`_unmatched`)."""
        if not ts:
            ts = ulid_time_ms(ev.id) * 1_000_000
        recent = self._find_recent(s.pairs or (), kind, key, _seq(ev), _epoch(ev))
        if recent is not None:
            return self._link(lane, s, recent, ev, ts, first=False)
        if kind == RUN:
            if self._run_ended(s, _run(ev)):
                self._count("suppressed.run")
                return [self._as_run_closed(ev, None)]
            if self._end_forgotten(lane, s):
                # Its session ended and was forgotten: every run open at that end was closed then,
                # its totals stated (the sweep's x.hermes.pairing.orphaned). This terminal cannot
                # restate them (the run's calls are forgotten with the session): a run.finished
                # here said 0 calls after the closure said N (the property test, CI 2026-12-07).
                self._count("suppressed.run")
                self._remember_run(s, _run(ev))
                return [self._as_run_closed(ev, None)]
            self._remember_run(s, _run(ev))
        self._count(f"unmatched.{KINDS[kind]}")
        pair = _Pair(
            kind=kind,
            key=key,
            start="",
            seq=_seq(ev),
            ts=ts,
            epoch=_epoch(ev),
            run=_run(ev),
            state=UNLINKED_ANSWER if ev.type == "attention.answered" else UNLINKED,
            end=ev.id,
            closed=self.clock,
        )
        if s.pairs is None:
            s.pairs = []
        s.pairs.append(pair)
        self._trim(s)
        if kind == RUN:  # a run end released without its start still carries its calls' sums
            totals = self._settle(s, pair, ev.capture == "none")
            if totals:
                ev = msgspec.structs.replace(ev, data={**_data(ev), **totals})
        return [self._unmatched(ev, h or {}) if kind == CARD else ev]

    @staticmethod
    def _unmatched(ev: Event, h: dict[str, Any]) -> Event:
        """An attention follow-up released without its request: the vendor event that says what
        Hermes reported (the follow-up's type, the keys, the choice), same id and seq, no subject."""
        data: dict[str, Any] = {"follow_up": ev.type}
        if ev.capture != "none":
            pattern = h.get("pattern_key") or (ev.subject if h.get("hook") in APPROVAL_HOOKS else None)
            if isinstance(pattern, str) and pattern:
                data["pattern_key"] = pattern
            call = h.get("tool_call_id")
            if isinstance(call, str) and call:
                data["tool_call_id"] = call
            if ev.type == "attention.answered":
                option = ((ev.data or {}).get("answer") or {}).get("option")
                if isinstance(option, str) and option:
                    data["choice"] = option
            elif ev.type == "attention.timeout" and h.get("hook") in APPROVAL_HOOKS:
                data["choice"] = "timeout"
        return msgspec.structs.replace(ev, type="x.hermes.attention.unmatched", data=data, subject=UNSET,
                                       cause=UNSET)

    # ------------------------------------------------------------ session end

    def _session_end(self, lane: str, s: _Session, ev: Event, h: dict[str, Any], ts: int) -> list[Event]:
        if s.ended == ev.id:
            self._count("duplicates")
            return []
        digest = int.from_bytes(_digest8(lane), "big")
        already = bool(s.ended) or digest in self._ended
        out = self._sweep(lane, s, ev, ts)
        if already:  # invariant 2: one session.ended per session
            self._count("suppressed.session")
            data = {} if ev.capture == "none" or "reason" not in _data(ev) else {"reason": _data(ev)["reason"]}
            out.append(
                msgspec.structs.replace(ev, type="x.hermes.session.finalized", data=data, cause=s.ended or UNSET)
            )
        else:
            s.ended = ev.id
            s.fin = _seq(ev)
            self._ended.add(digest)
            out.append(ev)
        ends = sorted({*_ends(s), _seq(ev)})
        s.ends = ends[-MAX_ENDS:]
        return out

    def _sweep(self, lane: str, s: _Session, ev: Event, ts: int) -> list[Event]:
        """Before a session ends: close its open runs and tools; give its open cards ``hold_ns``
        and its open subagents ``subagent_grace_ns`` more (then the bridge closes them).

        A card's answer may still be on its way: a mapper replica that died holding it redelivers
        it one ``ack_wait`` later, below this end in seq order. Dismissing the card now would
        contradict an answer that exists (issue 17), so it is closed ``hold_ns`` after the end
        (``due``), with a seq right after its request: before this end in (epoch, seq) order.
        With ``hold_ns`` 0 cards are dismissed here, before the end.
        Held follow-ups stay held: their start may still arrive (reordered behind the finalize).
        """
        self._count("sweeps")
        out: list[Event] = []
        end_seq = _seq(ev)
        hold = self.config.hold_ns
        victims = []
        for p in s.pairs or ():
            if p.state != OPEN or p.seq >= end_seq or p.late or p.due:
                continue
            if p.kind == SUBAGENT:
                p.due, p.why = ts + self.config.subagent_grace_ns, "session_end"
            elif p.kind == CARD and hold:  # from the end's arrival, like a held terminal
                p.due, p.why = self._arrival(ts) + hold, "session_end"
            elif RULES[p.kind].swept:
                victims.append(p)
        victims.sort(key=lambda p: p.seq)
        id_ms = ulid_time_ms(ev.id)
        for slot, p in enumerate(victims, start=SWEEP_SLOT):
            self._count(f"swept.{KINDS[p.kind]}")
            at = _At(ev.source, _epoch(ev), _seq(ev), slot, ev.id + "/sweep", id_ms, ev.time)
            out.append(self._closure(lane, p, "session_end", at))
        return out

    # ------------------------------------------------------------ time: ticks

    def _expire(self, lane: str, s: _Session) -> list[Event]:
        now = self.clock
        out: list[Event] = []
        # Closures first: a held follow-up that could not take an open start (one across a
        # session end) is then linked to it, closed, when it is released below.
        if s.pairs:
            for p in sorted((p for p in s.pairs if p.state == OPEN), key=lambda p: p.seq):
                if p.ts + self._ttl(p) <= now:
                    if p.late and p.kind == CARD and self._answer_in_mapper(s, p, p.ts + self._ttl(p)):
                        continue
                    out += self._bridge_close(lane, s, p, "session_end" if p.late else "ttl")
                elif p.due and p.due <= now:
                    if p.kind == CARD and self._answer_in_mapper(s, p, p.due):
                        continue
                    out += self._bridge_close(lane, s, p, p.why or "session_end")
        if s.held:
            due = sorted((x for x in s.held if x.deadline <= now), key=lambda x: (x.deadline, _seq(x.event)))
            if due and self.mapped is not None:  # rule 3: not while its start may be inside the mapper
                due = [x for x in due if not self._held_for_floor(x, now)]
            for x in due:
                s.held.remove(x)
            if not s.held:
                s.held = None
            for x in due:
                out += self._release(lane, s, x.kind, x.key, x.event, x.hints.get("ts") or 0, x.hints)
        if s.pairs:  # forgotten only now: a released follow-up may still link to a closed pair
            s.pairs = [p for p in s.pairs if p.state == OPEN or p.closed + self._keep(p) > now] or None
        if s.pairs is None and s.held is None:
            idle = self.config.recent_ns if s.ended else self.config.idle_ttl_ns
            if s.last + idle <= now:
                del self._sessions[lane]
                self._count("evicted")
        return out

    def _inside_mapper(self, epoch: int, seq: int) -> bool:
        """Whether a raw message before the one of (``epoch``, ``seq``) may not be mapped yet: the
        floor the ticks carry is of this epoch and below it (no floor: as before it existed)."""
        mapped = self.mapped
        return mapped is not None and mapped[0] == epoch and seq // SLOTS - 1 > mapped[1]

    def _held_for_floor(self, x: _Held, now: int) -> bool:
        """A held follow-up past its deadline stays held while its start may still be inside the
        mapper (an outage longer than the hold), at most ``floor_wait_ns`` longer."""
        if not self._inside_mapper(_epoch(x.event), _seq(x.event)):
            return False
        if x.deadline + self.config.floor_wait_ns <= now:
            self._count("floor.held_capped")
            return False
        if not x.waited:
            x.waited = True
            self._count("floor.held_waits")
        return True

    def _answer_in_mapper(self, s: _Session, p: _Pair, due: int) -> bool:
        """A card open at its session's end is not dismissed while a raw message before that end
        (its answer, rule 4) may be inside the mapper; at most ``floor_wait_ns`` past ``due``."""
        if self.mapped is None:
            return False
        end = min((e for e in _ends(s) if e > p.seq), default=None)
        if end is None or not self._inside_mapper(p.epoch, end):
            return False
        if due + self.config.floor_wait_ns <= self.clock:
            self._count("floor.card_capped")
            return False
        return True

    def _deadline(self, s: _Session) -> int | None:
        """The session's next deadline: run on every event of the session (`_schedule`), so
        `_ttl` and `_keep` are inlined here (the same rules) over the TTLs read once."""
        cfg = self.config
        best = s.last + (cfg.recent_ns if s.ended else cfg.idle_ttl_ns)
        if s.pairs:
            ttls, hold, recent, subagent_keep = self._ttls, cfg.hold_ns, cfg.recent_ns, cfg.subagent_ttl_ns
            for p in s.pairs:
                if p.state == OPEN:
                    d = p.ts + (hold if p.late else ttls[p.kind])
                    if p.due and p.due < d:
                        d = p.due
                else:
                    d = p.closed + (subagent_keep if p.kind == SUBAGENT and p.state == CLOSED else recent)
                if d < best:
                    best = d
        if s.held:
            for x in s.held:
                if x.deadline < best:
                    best = x.deadline
        return best

    def _keep(self, p: _Pair) -> int:
        """How long a closed pair is remembered: ``recent_ns``; a delegation the bridge closed,
        ``subagent_ttl_ns`` (its real stop may still come, and must not be a second terminal)."""
        return self.config.subagent_ttl_ns if p.kind == SUBAGENT and p.state == CLOSED else self.config.recent_ns

    def _ttl(self, p: _Pair) -> int:
        return self.config.hold_ns if p.late else self.config.ttls()[p.kind]

    def _schedule(self, lane: str, s: _Session) -> None:
        """Keep a heap entry at or before the session's next deadline (stale entries are skipped)."""
        if lane not in self._sessions:
            return
        deadline = self._deadline(s)
        if deadline is None:
            return
        current = self._wake.get(lane)
        if current is None or deadline < current:
            self._wake[lane] = deadline
            heapq.heappush(self._heap, (deadline, lane))
            if len(self._heap) > 2 * len(self._wake) + 1024:  # drop stale entries
                self._heap = [(d, name) for name, d in self._wake.items()]
                heapq.heapify(self._heap)

    # ------------------------------------------------------------ closing by the bridge

    def _bridge_close(self, lane: str, s: _Session, p: _Pair, reason: str) -> list[Event]:
        """A TTL or overflow closure: the inserted event sits right after the start."""
        index = min(max(p.seq % SLOTS - MAPPED_SLOT, 0), SLOTS - 1 - CLOSE_SLOT)
        clock_ms = self.clock // 1_000_000
        at = _At(p.src or s.source, p.epoch, p.seq, CLOSE_SLOT + index, p.start + "/close", clock_ms, rfc3339(self.clock))
        return [self._closure(lane, p, reason, at)]

    def _closure(self, lane: str, p: _Pair, reason: str, at: _At) -> Event:
        """The honest end of an open start: cards are dismissed, the rest orphaned."""
        age = _ms(at.id_ms * 1_000_000 if reason == "session_end" else self.clock, p.ts)
        if RULES[p.kind].dismissed:
            self._count(f"dismissed.{reason}")
            etype = "attention.resolved"
            data: dict[str, Any] = {"resolution": "dismissed", "latency_ms": age}
            subject = p.start
            severity: Severity | None = None
        else:
            self._count(f"orphaned.{reason}.{KINDS[p.kind]}")
            etype = "x.hermes.pairing.orphaned"
            data = {"kind": KINDS[p.kind], "reason": reason, "start": p.start, "age_ms": age}
            subject = ""
            severity = "warning"
        if p.capture_none:
            data = {k: v for k, v in data.items() if k not in ("latency_ms", "age_ms")}
        if p.kind == RUN:  # a run the bridge closes carries the sums of its calls too
            s = self._sessions.get(lane)
            if s is not None:
                data.update(self._settle(s, p, p.capture_none))
        event = self._insert(
            lane,
            at,
            etype=etype,
            data=data,
            run=p.run,
            subject=subject,
            cause=p.start,
            capture_none=p.capture_none,
            severity=severity,
        )
        self._close(p, event.id, CLOSED)
        return event

    @staticmethod
    def _insert(
        lane: str,
        at: _At,
        *,
        etype: str,
        data: dict[str, Any],
        run: str,
        subject: str,
        cause: str,
        capture_none: bool,
        severity: Severity | None = None,
    ) -> Event:
        return Event(
            aep="0.1",
            id=event_id(at.seed, at.slot, at.id_ms),
            type=etype,
            time=at.time,
            source=at.source,
            agent="hermes",
            session=UNKNOWN if lane == UNKNOWN_KEY else lane,
            run=run or UNSET,
            seq=(at.anchor // SLOTS) * SLOTS + at.slot,
            epoch=at.epoch,
            subject=subject or UNSET,
            cause=cause or UNSET,
            severity=severity or UNSET,
            capture="none" if capture_none else "metadata",
            data=data,
            lane="unknown" if lane == UNKNOWN_KEY else UNSET,
        )

    # ------------------------------------------------------------ model calls: run totals (issue 40)

    def _call(self, lane: str, s: _Session, ev: Event) -> list[Event]:
        """Count one ``x.hermes.api.call`` in its run's sums, once (known by its raw position in
        its epoch, ``(epoch, seq)``; the id ring drops nearer repeats). While the run is open the sums wait for its
        end (`_settle`). A call that reaches pairing after its run's end (a mapper replica that
        died holding it: redelivered one ack wait later) amends them: right after the call goes
        ``x.hermes.run.usage`` with the run's new totals (``cause`` = the end), as long as the
        closed run is remembered (``recent_ns``); later than that it is in no total (counted
        ``usage.late``)."""
        run = _run(ev)
        if not run or ev.capture == "none":
            return []
        u = s.usage.get(run) if s.usage else None
        if u is not None:  # the run's sums are waiting for its end: it is open (the usual case)
            if not self._add_call(u, ev):
                self._count("usage.duplicates")
            return []
        closed = self._closed_run(s, run)
        if closed is not None:
            if closed.use is None:
                closed.use = _Usage()
            if not self._add_call(closed.use, ev):
                self._count("usage.duplicates")
                return []
            self._count("usage.amended")
            at = _At(ev.source, _epoch(ev), _seq(ev), AFTER_INSERT_SLOT, ev.id + "/usage", ulid_time_ms(ev.id), ev.time)
            return [self._insert(lane, at, etype=RUN_USAGE_TYPE, data=self._members(closed.use), run=run,
                                 subject="", cause=closed.end, capture_none=False)]
        if self._run_ended(s, run):
            self._count("usage.late")
            return []
        if s.usage is None:
            s.usage = {}
        if len(s.usage) >= self.config.max_open:  # bounded: the oldest run's sums go
            del s.usage[next(iter(s.usage))]
            self._count("usage.dropped")
        u = s.usage[run] = _Usage()
        if not self._add_call(u, ev):
            self._count("usage.duplicates")
        return []

    @staticmethod
    def _closed_run(s: _Session, run: str) -> _Pair | None:
        """The run's pair when it has ended (by its terminal or by the bridge) and is remembered."""
        found = None
        for p in s.pairs or ():
            if p.kind == RUN and p.key == run and p.state != OPEN and (found is None or p.closed >= found.closed):
                found = p
        return found

    def _add_call(self, u: _Usage, ev: Event) -> bool:
        key = (_epoch(ev), _seq(ev))
        i = bisect_left(u.keys, key)
        if (i < len(u.keys) and u.keys[i] == key) or (u.seqs and key[1] in u.seqs):
            return False
        u.keys.insert(i, key)
        u.calls += 1
        data = _data(ev)
        invalid = overflow = False
        tokens = u.tokens
        for i, member in enumerate(_USAGE_KEYS):
            v = data.get(member)
            if v is None:
                continue
            if isinstance(v, int) and v.__class__ is not bool and 0 <= v <= TOKEN_MAX:
                # `_sum_count(before, v)` inlined (a call per member and model call): -1 (no
                # call had it) takes v; OVER stays OVER; a sum past RUN_SUM_MAX becomes OVER.
                before = tokens[i]
                if before == OVER:
                    continue
                total = v if before < 0 else before + v
                if total > RUN_SUM_MAX:
                    tokens[i], overflow = OVER, True
                else:
                    tokens[i] = total
            else:
                invalid = True
        cost = data.get("cost")
        nanos = None
        if isinstance(cost, dict) and isinstance(cost.get("currency"), str):
            nanos = [to_nanos(cost.get(m, 0)) for m in COST_MEMBERS]
            if None in nanos or max(nanos) > COST_NANOS_MAX:  # type: ignore[type-var]
                nanos, invalid = None, True
        if nanos is None or (u.currency and u.currency != cost["currency"]):
            u.currency = NO_COST
        elif u.currency != NO_COST:
            summed = [a + b for a, b in zip(u.cost, nanos)]  # type: ignore[operator]
            if max(summed) > RUN_SUM_MAX:
                u.currency, overflow = NO_COST, True
            else:
                u.currency, u.cost = cost["currency"], summed
        if invalid:
            self._count("usage.invalid")
        if overflow:
            self._count("usage.overflow")
        return True

    def _settle(self, s: _Session, p: _Pair, capture_none: bool) -> dict[str, Any]:
        """A run's end: its calls' sums so far move into its pair (where a late call amends them);
        the members the end carries: the run's totals so far (every end of a run states all its
        calls counted until then, so the last one stated is the run's total)."""
        u = s.usage.pop(p.key, None) if s.usage and p.key else None
        if s.usage is not None and not s.usage:
            s.usage = None
        if u is not None:
            if p.use is None:
                p.use = u
            else:  # (calls of a run already closed once go to its pair; merged for safety)
                for seq in u.seqs:
                    if seq not in p.use.seqs:
                        p.use.seqs.append(seq)
                for key in u.keys:
                    i = bisect_left(p.use.keys, key)
                    if i == len(p.use.keys) or p.use.keys[i] != key:
                        p.use.keys.insert(i, key)
                p.use.calls += u.calls
                p.use.tokens = [_sum_count(a, b) for a, b in zip(p.use.tokens, u.tokens)]
                p.use.cost = [a + b for a, b in zip(p.use.cost, u.cost)]
                p.use.currency = p.use.currency if p.use.currency == u.currency else NO_COST
                if max(p.use.cost) > RUN_SUM_MAX:
                    p.use.currency, p.use.cost = NO_COST, [0] * len(COST_MEMBERS)
        elif p.use is None:
            p.use = _Usage()
        if capture_none or not p.use.calls:
            return {}
        self._count("usage.runs")
        return self._members(p.use)

    @staticmethod
    def _members(u: _Usage) -> dict[str, Any]:
        """``gen_ai.usage.*`` (a member when at least one call had it), ``cost`` (only when every
        call had one, in one currency), ``model_calls``."""
        out: dict[str, Any] = {}
        for (member, _), n in zip(USAGE_MEMBERS, u.tokens):
            if n >= 0:
                out[member] = n
        if u.currency and u.currency != NO_COST:
            out["cost"] = {"currency": u.currency, **{m: from_nanos(n) for m, n in zip(COST_MEMBERS, u.cost)}}
        out["model_calls"] = u.calls
        return out

    # ------------------------------------------------------------ small helpers

    def _close(self, p: _Pair, end_id: str, state: int) -> None:
        if p.state == OPEN:
            self._open[p.kind] -= 1
        p.state = state
        p.end = end_id
        p.closed = self.clock

    def _trim(self, s: _Session) -> None:
        """Keep at most 2 * max_open pairs: forget the oldest closed ones first."""
        pairs = s.pairs
        if pairs and len(pairs) > 2 * self.config.max_open:
            closed = sorted((p for p in pairs if p.state != OPEN), key=lambda p: p.closed)
            drop = {id(p) for p in closed[: len(pairs) - 2 * self.config.max_open]}
            s.pairs = [p for p in pairs if id(p) not in drop]

    @staticmethod
    def _open_count(s: _Session) -> int:
        return sum(1 for p in s.pairs or () if p.state == OPEN)

    def _remember_run(self, s: _Session, run: str) -> None:
        if not run:
            return
        ring = s.runs + _digest8(run)
        s.runs = ring[-8 * self.config.run_memory :]

    def _end_forgotten(self, lane: str, s: _Session) -> bool:
        """The session of ``s`` ended and its state was forgotten (`_expire`, ``recent_ns`` after
        the end) before ``s`` was made again: its end is in `_ended`, not in ``s``."""
        return not s.ended and int.from_bytes(_digest8(lane), "big") in self._ended

    @staticmethod
    def _run_ended(s: _Session, run: str) -> bool:
        if not run or not s.runs:
            return False
        d = _digest8(run)
        ring = s.runs
        return any(ring[i : i + 8] == d for i in range(0, len(ring), 8))

    def _remember_id(self, event_id_: str) -> None:
        self._seen.add(event_id_)
        self._seen_order.append(event_id_)
        if len(self._seen_order) > self.config.dedupe_ids:
            self._seen.discard(self._seen_order.popleft())

    def _count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def _emit(self, out: list[Event]) -> list[Event]:
        if out:
            self._count("events_out", len(out))
        return out


__all__ = [
    "KINDS",
    "LINKS",
    "ROLES",
    "PairingConfig",
    "PairingState",
    "read_tick",
    "tick_body",
]
