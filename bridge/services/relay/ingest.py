"""POST /events (AEP-0003 §3.2): events from other AEP emitters, checked and stored on
AEP_EVENTS under ``aep.ingest.<lane token>.<type>`` (never ``aep.hermes.>``, which only the
bridge's own pipeline writes).

* ``AEP-Version`` is required; a missing or unsupported major version answers 426 with the
  versions served. ``Content-Type``: ``application/json`` (one event) or
  ``application/x-ndjson`` (a batch, order kept); anything else 415. Over the body limit: 413.
* Commands (``control.*`` but the acks, ``x.<vendor>.control.*``) are refused: they reach a
  session's history only through the relay's routing (operators, the WebSocket).
* Every event is checked against the AEP 0.1 envelope (the bridge's own struct,
  ``bridge.core.aep.Event``, and the AEP-0001 §5.2 requiredness rules); one bad line rejects
  the whole batch with 400 ``invalid-event`` and the index of the first failing line, and
  nothing of that batch is stored.
* Dedupe: the JetStream message id is a digest of ``(source, id)`` (AEP-0001 §7.4), so a
  retry inside the stream's duplicate window (120 s) is absorbed; 202 reports how many
  events were new and how many duplicates.
* The stored bytes are the posted line itself, unless it spans lines (pretty-printed JSON),
  which is re-encoded compactly so SSE ``data:`` and JSONL keep one event per line. It is
  delivered at the relay's position (``hub.relay_position``: ``seq`` = its stream sequence,
  no ``epoch``), the same bytes on SSE and WS.
* Who may post what (``config.Principal``, ``Relay.emit_refusal``): the token's agents and
  sources, never into a Hermes session; 403 ``unauthorized`` otherwise.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import msgspec

from bridge.core.aep import Event
from bridge.core.lanes import lane_token
from bridge.runtime import subjects as subj

_decode_event = msgspec.json.Decoder(Event).decode
_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode

_COMMAND = re.compile(r"^(control\.attention\.respond|control\.cancel|control\.pause|control\.resume"
                      r"|x\.[a-z0-9_-]+\.control\..+|attention\.routed)$")


class InvalidEvent(ValueError):
    def __init__(self, line: int, detail: str) -> None:
        super().__init__(detail)
        self.line = line
        self.detail = detail


def envelope_problem(event: dict[str, Any]) -> str | None:
    """What AEP-0001 §5.2 requires beyond the struct: agent.* events carry no
    session/run/step/seq; commands and attention.routed carry session and no seq; every
    other event carries session and seq."""
    etype = event["type"]
    if etype.startswith("agent."):
        extra = [k for k in ("session", "run", "step", "seq") if k in event]
        return f"agent.* events carry no {', '.join(extra)}" if extra else None
    if _COMMAND.match(etype):
        if "session" not in event:
            return f"{etype} needs session"
        return f"{etype} carries no seq" if "seq" in event else None
    missing = [k for k in ("session", "seq") if k not in event]
    return f"missing {', '.join(missing)}" if missing else None


def _checked(line: bytes) -> tuple[dict[str, Any], str | None]:
    """The event of one line and what is wrong with it (None: nothing): the envelope struct,
    AEP-0001 §5.2, and a type a subject can carry. InvalidEvent(0, ...) when it is not one."""
    try:
        _decode_event(line)
        event = _decode(line)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise InvalidEvent(0, str(exc)) from None
    problem = envelope_problem(event)
    if not problem and not subj.valid_type(event["type"]):  # the pattern admits types no subject can carry
        problem = f"type has {len(event['type'])} characters (a stored type has at most 128)"
    return event, problem


def check_lines(lines: list[bytes]) -> list[tuple[bytes, dict[str, Any]]]:
    """The events to store, as (bytes, event); InvalidEvent at the first bad one."""
    out = []
    for i, line in enumerate(lines):
        try:
            event, problem = _checked(line)
        except InvalidEvent as exc:
            raise InvalidEvent(i, exc.detail) from None
        if not problem and is_command(event["type"]):
            problem = f"{event['type']} is a command: operators send commands on the WebSocket (AEP-0004 §4)"
        if problem:
            raise InvalidEvent(i, problem)
        if b"\n" in line or b"\r" in line:
            line = _encode(event)
        out.append((line, event))
    return out


def split_body(body: bytes, ndjson: bool) -> list[bytes]:
    if not ndjson:
        return [body.strip()]
    return [ln.strip() for ln in body.split(b"\n") if ln.strip()]


def msg_id(event: dict[str, Any], space: str = "") -> str:
    """The ``Nats-Msg-Id`` of an event's (source, id). ``space="command"``: a command published
    for the gate, in a space of its own, so an event posted under the same (source, id)
    cannot make a later command a "duplicate" the gate never sees."""
    prefix = f"{space}\x00" if space else ""
    return hashlib.sha256(f"{prefix}{event['source']}\x00{event['id']}".encode()).hexdigest()[:32]


def lane_of(event: dict[str, Any]) -> str:
    session = event.get("session")
    return lane_token(session) if isinstance(session, str) and session else "_agent"


def is_command(event_type: str) -> bool:
    """A control command (AEP-0004): routed to a target, never stored as an emitter's event.
    The acks (control.accepted / control.rejected) are events; attention.routed is an event."""
    return bool(_COMMAND.match(event_type)) and event_type != "attention.routed"


def command_problem(raw: bytes) -> str | None:
    """Why ``raw`` is not a well-formed AEP command (as an event line, AEP-0001 §5.2: a
    session, no seq), or None."""
    try:
        return _checked(raw)[1]
    except InvalidEvent as exc:
        return exc.detail
