"""The opt-in control plane's protocol logic (AEP-0004 control, AEP-0008 text answers), pure.

Everything here is a function of its arguments: no I/O, no clock, no NATS. The gate
service (``bridge/services/gate/``) feeds it what it read (commands, cards, queues,
the time) and publishes what it returns; the tables below are the whole protocol.

Theory of operation
-------------------
Two opt-ins change one moment each, and only when switched on (README, "Control plane"):

* The operator-deny gate (``AEP_HERMES_CONTROL=1``): the shim holds a matching
  ``pre_tool_call`` and the gate opens a *card*: ``attention.requested {kind:
  "permission", options allow/deny, respond_via: ["control"], expires_at}``. The card
  is a small state machine (``CARD_TRANSITIONS``)::

      OPEN --respond--> RELEASING --released--> ANSWERED   accepted, answered, resolved{answered}
        |                   |-------gone------> DISMISSED  resolved{dismissed}, rejected{refused}
        |                   |----gone_late----> TIMEOUT    timeout, rejected{refused}
        |                   `--resumed_gone---> ANSWERED   (after a gate crash mid-release, see below)
        |--gone----------> DISMISSED                      resolved{dismissed}
        `--gone_late/expired--> TIMEOUT                   timeout

  ``gone`` = the shim no longer listens (a NATS "no responders" answer) while the
  hold window is still open; ``gone_late`` = the same at or after ``expires_at`` minus
  the skew grace (the shim released itself with ``{}``: that is the expiry, not a
  dismissal). A command for a card that is not OPEN is ``rejected {refused}``.
* Steering (``AEP_INSTRUCT=1``): ``x.hermes.control.instruct {text}`` queues per
  session (FIFO, at most ``MAX_QUEUE`` entries of ``MAX_TEXT`` characters); the
  shim's ``pre_llm_call`` pulls the queue and answers ``{"context": <joined>}``;
  each delivery is audited ``x.hermes.instruction.delivered {queued_ms}``, each entry
  still queued at the real session end ``x.hermes.instruction.dropped {reason:
  "session_ended"}`` (before ``session.ended``).

Commands, in this order of checks (``parse_command``: the id and the envelope; ``gate_command``:
rows 2-4; then ``respond_decision`` or ``instruct_decision``):

====================================================  ====================================
condition                                             ack
====================================================  ====================================
no usable ``id``                                      none possible: dropped, counted
a sender allowlist is set and ``agent`` is not in it  ``rejected {unauthorized}``
``type`` not in the declared ``control.accepts``      ``rejected {unsupported}``
malformed envelope (``aep``, ``source``, ``agent``,   ``rejected {invalid}``
``session`` vs the subject's lane, a ``seq``, data)
respond: no ``subject``, answer not per AEP-0008      ``rejected {invalid}``
respond: no such card, or the card is not OPEN        ``rejected {refused}``
respond: valid, card OPEN                             released; ack = outcome of the release
instruct: text missing, empty or > MAX_TEXT chars     ``rejected {invalid}``
instruct: session unknown or ended                    ``rejected {refused}``
instruct: queue holds MAX_QUEUE entries               ``rejected {busy}``
instruct: valid                                       ``accepted``, queued
====================================================  ====================================

Text answers (AEP-0008, ``interpret_answer``): ``option`` ``allow``/``deny`` is that
option (a ``deny`` with ``text`` uses the text as the reason); ``text`` alone that,
trimmed and case-insensitively, is ``allow`` or ``deny`` (an option id or label) is
that option with no text residue; any other non-empty text DENIES with the text as
the reason (unmatched text never grants); empty text, no answer, ``values`` or a
foreign option are ``invalid``.

Dedupe and acks (``dedupe_action``): the key is ``(source, id)``
(``command_key``). The first delivery is processed; the gate records the command as
``pending`` before it acts and ``done`` with the exact bytes of its ack (and of every
event the command caused) once decided. Another copy of a done command gets the
recorded ack re-published byte-identically (``reack``); a redelivery of the SAME
stream message (the gate crashed before acknowledging it) re-publishes every recorded
event (``republish``: the stream's duplicate window and consumers' ``(source, id)``
dedupe absorb them); a copy while pending needs nothing (``ignore``: the coming ack
answers it), a redelivery while pending resumes (``resume``). A resumed release whose
shim is gone before the expiry counts as delivered (``resumed_gone``): the shim only
leaves early after it got a decision. One decision per command, always.

Identity of the gate's events
-----------------------------
``source`` is the session's (``aep://{instance}/agent/hermes/session/{session}``),
``epoch`` the raw stream's, like every event of the session. ``seq`` shares the
session's raw-position space (``raw_seq * 1024 + slot``, docs/ARCHITECTURE.md) through
reserved slots: ``GATE_SLOT`` (896..1023) after an anchor raw message, ``DROP_SLOT``
(384..511) before the finalize's ``session.ended``. ``next_seq`` takes
``max(anchor * 1024 + slot, last + 1)`` with ``last`` the session's last gate seq, so
the gate's own events strictly increase and sort after everything the session had
published when they were made (the anchor is the request's raw message for
``attention.requested``, the raw stream's last sequence otherwise). Drops take the
finalize's before-slots outright (``drop_seqs``): before ``session.ended`` always, a
backfill in the rare case a command was acked between the finalize and the gate seeing
it. If more than 128 gate events of one session share one anchor (no raw message at
all reached the stream meanwhile), ``last + 1`` spills into the next position's
before-slots: harmless unless that message is the session's own finalize. Ids are ULIDs
of the decision time whose random part hashes a seed naming what the event is (the
card, the command key, the purpose): a re-emission after a crash is the same event.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import msgspec
from msgspec import UNSET

from bridge.core import aep
from bridge.core.ceiling import LEVELS, NONE, REDACTED, CapturePolicy, Ceiling, strip_to_required
from bridge.core.identity import MAPPED_SLOT, SLOTS, rfc3339, ulid_from
from bridge.core.lanes import UNKNOWN, lane_from_token
from bridge.core.lanes import lane_token as _token_of

# ---------------------------------------------------------------- constants (documented in README/ARCHITECTURE)

ACK_WINDOW_MS = 10_000
RESPOND = "control.attention.respond"
INSTRUCT = "x.hermes.control.instruct"
ACCEPTED, REJECTED = "control.accepted", "control.rejected"
ACK_TYPES = frozenset({ACCEPTED, REJECTED})
REASONS = ("unsupported", "unauthorized", "busy", "refused", "invalid")

MAX_QUEUE = 20
MAX_TEXT = 4000
DEFAULT_HOLD_MS = 55_000
#: the block message when a deny carries no reason (Hermes shows it to the model as {"error": ...})
DEFAULT_DENY_MESSAGE = "Blocked by an operator through the aep-bridge control gate."
ALLOW, DENY = "allow", "deny"
OPTIONS = ((ALLOW, "Allow"), (DENY, "Deny"))
DROP_REASON = "session_ended"
INSTRUCTION_SEPARATOR = "\n\n"

GATE_SLOT = 896  # 896..1023: gate events after their anchor raw message (pairing uses 768..~800)
DROP_SLOT = 384  # 384..511: drops before the finalize's session.ended (pairing's sweep uses 0..~200)

# The headers of a held raw pre_tool_call (the shim's copies: bridge/shim/hook.py; a test compares
# them). The control plane's subjects, and the checks of the reply subjects the gate answers to,
# are bridge.nats.subjects' (`HELLO_SUBJECT`, `COMMAND_FILTERS`, `shim_reply_ok`...).
GATE_REPLY_HEADER = "Aep-Gate-Reply"  # on a held raw pre_tool_call: where the decision goes
GATE_HOLD_HEADER = "Aep-Gate-Hold-Ms"  # and how long the shim waits for it


# ---------------------------------------------------------------- capabilities


def accepted_verbs(control: bool, instruct: bool) -> list[str]:
    """``control.accepts``: empty when both opt-ins are off."""
    verbs = []
    if control:
        verbs.append(RESPOND)
    if instruct:
        verbs.append(INSTRUCT)
    return verbs


def hello(accepts: list[str], ack_window_ms: int = ACK_WINDOW_MS, instance: str = "",
          where: dict[str, str] | None = None) -> dict[str, Any]:
    """The hello/capabilities document (AEP-0003 §4 shape) the gate serves on its hello subject
    and /healthz; ``where``: the control plane's subjects (``bridge.nats.subjects.control_where``)."""
    doc = {
        "type": "hello",
        "versions": ["0.1"],
        "role": "emitter",
        "identity": {"agent": "hermes", "instance": instance},
        "capabilities": {
            "emits": ["attention", "control", "x.hermes.instruction"] if accepts else [],
            "control": {"accepts": list(accepts), "ack_window_ms": ack_window_ms},
        },
    }
    if where is not None:
        doc["x-aep-bridge"] = dict(where)
    return doc


# ---------------------------------------------------------------- commands


class Reject(NamedTuple):
    reason: str
    detail: str = ""


@dataclass(frozen=True)
class Command:
    """A command as received: the fields the decision needs, and its exact bytes."""

    id: str
    source: str
    type: str
    session: str
    agent: str = ""
    subject: str = ""
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return command_key(self.source, self.id)


def command_key(source: str, command_id: str) -> str:
    """The dedupe key of ``(source, id)``, KV-key safe (32 hex characters)."""
    return hashlib.sha256(f"{source}\n{command_id}".encode("utf-8", "surrogatepass")).hexdigest()[:32]


_decode_any = msgspec.json.Decoder()


def parse_command(data: bytes, lane_token: str, subject_type: str | None = None) -> tuple[Command | None, Reject | None]:
    """(command, None) when well-formed; (partial command, Reject invalid) when it has an id
    but is malformed (it can still be acked, filed under the subject's lane); (None, None)
    when it cannot be acked at all (not JSON, no id). ``lane_token`` / ``subject_type``: the
    subject it came on (``aep.hermes.<lane token>.<type>``); the body must agree with both."""
    try:
        obj = _decode_any.decode(data)
    except (msgspec.DecodeError, ValueError):
        return None, None
    if not isinstance(obj, dict):
        return None, None
    cid = obj.get("id")
    if not isinstance(cid, str) or not cid:
        return None, None
    lane = _lane_of(lane_token)
    if isinstance(obj.get("session"), str) and _token_of(obj["session"]) == lane_token:
        lane = obj["session"]  # also a long id, whose (hashed) token cannot be reversed
    source = obj.get("source") if isinstance(obj.get("source"), str) else ""
    ctype = obj.get("type") if isinstance(obj.get("type"), str) else ""
    agent = obj.get("agent") if isinstance(obj.get("agent"), str) else ""
    session = obj.get("session") if isinstance(obj.get("session"), str) else ""
    subject = obj.get("subject") if isinstance(obj.get("subject"), str) else ""
    payload = obj.get("data", {})
    cmd = Command(cid, source, ctype, lane, agent, subject, payload if isinstance(payload, dict) else {})
    problem = None
    if obj.get("aep") != aep.AEP_VERSION:
        problem = "aep must be \"0.1\""
    elif not ctype:
        problem = "type is missing"
    elif subject_type is not None and ctype != subject_type:
        problem = "type does not match the subject"
    elif not source:
        problem = "source is missing"
    elif not agent:
        problem = "agent (the sender) is missing"
    elif not session:
        problem = "session (the target) is missing"
    elif session != lane:
        problem = "session does not match the subject's lane"
    elif "seq" in obj:
        problem = "commands carry no seq (AEP-0004 §2)"
    elif not isinstance(payload, dict):
        problem = "data must be an object"
    return cmd, (Reject("invalid", problem) if problem else None)


def _lane_of(lane_token: str) -> str:
    try:
        return lane_from_token(lane_token)
    except (ValueError, UnicodeDecodeError):
        return lane_token


def gate_command(cmd: Command, malformed: Reject | None, accepts: list[str], senders: frozenset[str] | None) -> Reject | None:
    """The checks every command passes before its verb's own (the table above, rows 2-4)."""
    if senders is not None and cmd.agent not in senders:
        return Reject("unauthorized", f"sender {cmd.agent!r} may not command this target")
    if cmd.type not in accepts:
        return Reject("unsupported", f"{cmd.type or 'this command'} is not in control.accepts {accepts}")
    return malformed


# ---------------------------------------------------------------- text answers (AEP-0008)


class Verdict(NamedTuple):
    option: str  # ALLOW | DENY
    message: str | None  # the block message (DENY), the operator's reason or DEFAULT_DENY_MESSAGE
    answer: dict[str, str]  # what attention.answered records: {option, text?}


def _word(text: str) -> str | None:
    """The option a text names: an option id or label, trimmed, case-insensitive."""
    t = text.strip().casefold()
    for oid, label in OPTIONS:
        if t == oid or t == label.casefold():
            return oid
    return None


def interpret_answer(answer: Any) -> Verdict | Reject:
    if not isinstance(answer, dict):
        return Reject("invalid", "data.answer must be an object")
    if "values" in answer:
        return Reject("invalid", "values answer forms; a permission request takes an option or a text")
    option, text = answer.get("option"), answer.get("text")
    if option is not None and not isinstance(option, str):
        return Reject("invalid", "answer.option must be a string")
    if text is not None and not isinstance(text, str):
        return Reject("invalid", "answer.text must be a string")
    reason = text.strip() if isinstance(text, str) else ""
    if option is not None:
        if option == ALLOW:
            return Verdict(ALLOW, None, {"option": ALLOW, **({"text": reason} if reason else {})})
        if option == DENY:
            return Verdict(DENY, reason or DEFAULT_DENY_MESSAGE, {"option": DENY, **({"text": reason} if reason else {})})
        return Reject("invalid", f"unknown option {option!r} (this request offers allow, deny)")
    if text is None:
        return Reject("invalid", "answer needs an option or a text")
    if not reason:
        return Reject("invalid", "answer.text is empty")
    word = _word(reason)
    if word == ALLOW:
        return Verdict(ALLOW, None, {"option": ALLOW})
    if word == DENY:
        return Verdict(DENY, DEFAULT_DENY_MESSAGE, {"option": DENY})
    return Verdict(DENY, reason, {"option": DENY, "text": reason})  # unmatched text never grants


def shim_answer(option: str, message: str | None) -> dict[str, str]:
    """What the shim prints for a released call (HERMES.md: the pre_tool_call block shape)."""
    if option == DENY:
        return {"action": "block", "message": message or DEFAULT_DENY_MESSAGE}
    return {}


# ---------------------------------------------------------------- cards


OPEN, RELEASING, ANSWERED, TIMEOUT, DISMISSED = "open", "releasing", "answered", "timeout", "dismissed"
Trigger = Literal["respond", "released", "gone", "gone_late", "expired", "resumed_gone"]


class Transition(NamedTuple):
    state: str
    emits: tuple[str, ...]  # card events, in order: answered, resolved_answered, resolved_dismissed, timeout
    ack: str | None  # "accepted" | "refused" | None: the ack of the command being released


#: (state, trigger) -> transition. Anything else is not a transition (ignored, or refused for a respond).
CARD_TRANSITIONS: dict[tuple[str, str], Transition] = {
    (OPEN, "respond"): Transition(RELEASING, (), None),
    (OPEN, "gone"): Transition(DISMISSED, ("resolved_dismissed",), None),
    (OPEN, "gone_late"): Transition(TIMEOUT, ("timeout",), None),
    (OPEN, "expired"): Transition(TIMEOUT, ("timeout",), None),
    (RELEASING, "released"): Transition(ANSWERED, ("answered", "resolved_answered"), "accepted"),
    (RELEASING, "resumed_gone"): Transition(ANSWERED, ("answered", "resolved_answered"), "accepted"),
    (RELEASING, "gone"): Transition(DISMISSED, ("resolved_dismissed",), "refused"),
    (RELEASING, "gone_late"): Transition(TIMEOUT, ("timeout",), "refused"),
}

CLOSED_DETAIL = {
    RELEASING: "the request is being answered by another command",
    ANSWERED: "the request was already answered",
    TIMEOUT: "the request expired",
    DISMISSED: "the call is no longer held (the hook went away)",
}


def transition(state: str, trigger: str) -> Transition | None:
    return CARD_TRANSITIONS.get((state, trigger))


def gone_trigger(now_ns: int, expires_ns: int, grace_ns: int) -> str:
    """A shim that stopped listening: dismissed, unless the hold window was (about to be) over."""
    return "gone_late" if now_ns >= expires_ns - grace_ns else "gone"


class Card(msgspec.Struct, kw_only=True):
    """One held pre_tool_call (KV ``card.<id>``); ``id`` = its attention.requested's id."""

    id: str
    state: str = OPEN
    session: str
    lane: str  # lane token
    source: str
    run: str = ""
    tool: str = ""
    call_id: str = ""
    tool_event: str = ""  # the tool.requested id: the request's cause
    inbox: str = ""  # where the shim listens
    raw_id: str = ""
    raw_seq: int = 0
    ts: int = 0  # the shim's receive time, ns
    expires: int = 0  # ns
    epoch: int = 0
    cmd: str = ""  # dedupe key of the command being released / that answered it
    cmd_id: str = ""
    verdict: str = ""
    message: str = ""
    answer: dict[str, str] = {}


def is_card_id(value: str) -> bool:
    """A request id the gate could have minted (a ULID): anything else names no card."""
    return len(value) == 26 and value.isascii() and value.isalnum()


def respond_decision(cmd: Command, card: Card | None) -> Verdict | Reject:
    if not cmd.subject:
        return Reject("invalid", "subject must be the id of the attention.requested to answer")
    if card is None or card.session != cmd.session:
        return Reject("refused", f"no gate request {cmd.subject} in session {cmd.session}")
    if card.state != OPEN:
        return Reject("refused", CLOSED_DETAIL.get(card.state, "the request is closed"))
    return interpret_answer(cmd.data.get("answer"))


def tool_prompt(tool: str) -> str:
    """Structural at every capture level: static text plus the tool name (metadata)."""
    return f"Allow the {tool} tool call?" if tool else "Allow this tool call?"


# ---------------------------------------------------------------- steering


class Instruction(msgspec.Struct, kw_only=True):
    cmd: str  # the command's id (cause of the audits)
    key: str  # its dedupe key
    text: str
    queued: int  # ns
    run: str = ""


class SessionInfo(msgspec.Struct, kw_only=True):
    """What the gate knows of a session (KV ``sess.<lane token>``)."""

    source: str = ""
    instance: str = ""
    ended: bool = False
    session: str = ""  # the session id itself (its lane token may be a hash); "" in records before it
    seen: float = 0.0  # when the gate last saw a raw message of it (unix s; 0: a record before it)


def is_idle(info: SessionInfo, now: float, idle_ttl_s: float) -> bool:
    """A session the gate has not seen for ``idle_ttl_s`` (a crashed Hermes never sends its
    finalize) is no longer live; a record without ``seen`` (an older gate's) is judged live."""
    return bool(info.seen) and now - info.seen > idle_ttl_s


def restamp(old: SessionInfo | None, new: SessionInfo, idle_ttl_s: float) -> bool:
    """Whether the gate rewrites its record: something changed, or its ``seen`` is older than
    a quarter of the idle TTL (so a session that speaks stays live with room to spare)."""
    if old is None or msgspec.structs.replace(old, seen=0.0) != msgspec.structs.replace(new, seen=0.0):
        return True
    return new.seen - old.seen >= idle_ttl_s / 4


def instruct_decision(cmd: Command, session: SessionInfo | None, queued: int) -> str | Reject:
    """The text to queue, or why not."""
    text = cmd.data.get("text")
    if not isinstance(text, str):
        return Reject("invalid", "data.text must be a string")
    if not text.strip():
        return Reject("invalid", "data.text is empty")
    if len(text) > MAX_TEXT:
        return Reject("invalid", f"data.text has {len(text)} characters (at most {MAX_TEXT})")
    if session is None:
        return Reject("refused", f"unknown session {cmd.session}")
    if session.ended:
        return Reject("refused", f"session {cmd.session} has ended")
    if queued >= MAX_QUEUE:
        return Reject("busy", f"{queued} instructions are already queued for this session (at most {MAX_QUEUE})")
    return text


def joined_context(queue: list[Instruction]) -> str:
    """The ``{"context": ...}`` text: the instructions in arrival order."""
    return INSTRUCTION_SEPARATOR.join(i.text for i in queue)


# ---------------------------------------------------------------- dedupe


class CmdRecord(msgspec.Struct, kw_only=True):
    """KV ``cmd.<key>``: one command's dedupe state and recorded output."""

    state: str  # "pending" | "done"
    id: str
    lane: str
    card: str = ""
    stream_seq: int = 0  # AEP_EVENTS sequence of the copy that was processed
    ack: str = ""  # the ack event, exact JSON
    events: list[str] = []  # every event the command caused, ack included, in publish order


def dedupe_action(record: CmdRecord | None, stream_seq: int) -> str:
    """process | reack | republish | ignore | resume (see the module docstring)."""
    if record is None:
        return "process"
    same = record.stream_seq == stream_seq
    if record.state == "done":
        return "republish" if same else "reack"
    return "resume" if same else "ignore"


# ---------------------------------------------------------------- identity


class Position(msgspec.Struct, kw_only=True):
    """KV ``seq.<lane token>``: the last seq the gate gave an event of the session."""

    epoch: int
    seq: int


def next_seq(last: Position | None, epoch: int, anchor_raw_seq: int, slot: int = GATE_SLOT) -> int:
    base = anchor_raw_seq * SLOTS + slot
    if last is not None and last.epoch == epoch:
        return max(base, last.seq + 1)
    return base


def drop_seqs(finalize_raw_seq: int, n: int) -> list[int]:
    """The seqs of ``n`` drops: the before-slots of the finalize's raw message, so they sort
    before its ``session.ended`` even when the gate already gave the session a later seq (a
    backfill, like pairing's TTL closures). A session ends at most once per finalize."""
    return [finalize_raw_seq * SLOTS + DROP_SLOT + i for i in range(min(n, MAPPED_SLOT - DROP_SLOT))]


def gate_id(seed: str, time_ms: int) -> str:
    return ulid_from(time_ms, hashlib.sha256(seed.encode("utf-8", "surrogatepass")).digest())


def ack_id(key: str, time_ms: int) -> str:
    """The id of the gate's one ack of the command whose dedupe key is ``key``. Its 80-bit
    random part hashes the key, so the ack names its command's (source, id): ``cause`` is the
    id alone, and two sources may use one id (ids are unique per source, AEP-0004 §2.3)."""
    return gate_id(f"ack/{key}", time_ms)


def is_ack_of(ack: Any, source: str, command_id: str) -> bool:
    """Is ``ack`` (an event id) the gate's ack of the command (``source``, ``command_id``)?"""
    return (isinstance(ack, str) and len(ack) == 26
            and ack[10:].upper() == ack_id(command_key(source, command_id), 0)[10:])


@dataclass(frozen=True)
class Where:
    """Where an event of a session goes: identity shared by the session's events."""

    session: str
    source: str
    epoch: int
    run: str = ""


def build_event(
    policy: CapturePolicy,
    event_type: str,
    payload: aep._Payload,
    *,
    where: Where,
    event_id: str,
    seq: int,
    time_ns: int,
    subject: str = "",
    cause: str = "",
) -> aep.Event:
    """An AEP event at the ceiling of its category (``capture`` says which)."""
    level = policy.ceiling(event_type)
    if level == NONE:
        payload = strip_to_required(payload)
    return aep.Event(
        aep="0.1",
        id=event_id,
        type=event_type,
        time=rfc3339(time_ns),
        source=where.source,
        agent="hermes",
        session=where.session,
        run=where.run or UNSET,
        seq=seq,
        epoch=where.epoch,
        subject=subject or UNSET,
        cause=cause or UNSET,
        capture=LEVELS[level],  # type: ignore[arg-type]
        data=aep.payload_to_data(payload),
        lane="unknown" if where.session == UNKNOWN else UNSET,
    )


def _text(policy: CapturePolicy, event_type: str, text: str | None) -> Any:
    if not text:
        return UNSET
    return Ceiling(policy.ceiling(event_type), policy).text(text, REDACTED)


def ack_payload(policy: CapturePolicy, ack: str, reject: Reject | None = None) -> tuple[str, aep._Payload]:
    if ack == "accepted":
        return ACCEPTED, aep.ControlAccepted()
    assert reject is not None
    return REJECTED, aep.ControlRejected(reason=reject.reason, detail=_text(policy, REJECTED, reject.detail))  # type: ignore[arg-type]


def card_payload(policy: CapturePolicy, kind: str, card: Card, now_ns: int) -> tuple[str, aep._Payload]:
    """The payload of a card event (``kind`` from ``Transition.emits``, or ``requested``)."""
    if kind == "requested":
        return "attention.requested", aep.AttentionRequested(
            kind="permission",
            prompt=tool_prompt(card.tool),
            options=[aep.Option(id=i, label=label) for i, label in OPTIONS],
            expires_at=rfc3339(card.expires),
            respond_via=["control"],
        )
    latency = max(0, (now_ns - card.ts) // 1_000_000)
    if kind == "answered":
        g = Ceiling(policy.ceiling("attention.answered"), policy)
        text = card.answer.get("text")
        answer = aep.Answer(option=card.answer.get("option", card.verdict), text=g.text(text) if text else UNSET)
        return "attention.answered", aep.AttentionAnswered(answer=answer, via="control")
    if kind == "resolved_answered":
        return "attention.resolved", aep.AttentionResolved(resolution="answered", latency_ms=latency)
    if kind == "resolved_dismissed":
        return "attention.resolved", aep.AttentionResolved(resolution="dismissed", latency_ms=latency)
    if kind == "timeout":
        return "attention.timeout", aep.AttentionTimeout(after_ms=max(0, (min(now_ns, card.expires) - card.ts) // 1_000_000))
    raise ValueError(f"unknown card event {kind!r}")


__all__ = [
    "ACCEPTED", "ACK_TYPES", "ACK_WINDOW_MS", "ALLOW", "CARD_TRANSITIONS", "Card", "CmdRecord",
    "Command", "DEFAULT_DENY_MESSAGE", "DEFAULT_HOLD_MS", "DENY", "DROP_REASON", "DROP_SLOT", "GATE_HOLD_HEADER",
    "GATE_REPLY_HEADER", "GATE_SLOT", "INSTRUCT", "Instruction", "MAX_QUEUE", "MAX_TEXT", "Position", "REJECTED", "RESPOND", "Reject",
    "SessionInfo", "Verdict", "Where", "accepted_verbs", "ack_id", "ack_payload", "build_event", "card_payload",
    "command_key", "dedupe_action", "drop_seqs", "gate_command", "gate_id", "gone_trigger", "hello",
    "instruct_decision", "interpret_answer", "is_ack_of", "is_idle", "joined_context", "next_seq", "parse_command",
    "respond_decision", "restamp", "shim_answer", "tool_prompt", "transition",
]
