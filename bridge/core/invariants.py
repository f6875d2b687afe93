"""The pairing invariants, checked over an output stream (AEP_EVENTS, or `PairingState` output).

Used by the tests and by ``aep-bridge verify``; the pairing state machine itself
(`bridge.core.pairing`) does not import it.
"""

from __future__ import annotations

from typing import Any

from msgspec import UNSET

from bridge.core.aep import Event

#: terminal type -> the start type its cause must name
START_OF: dict[str, str] = {
    "run.finished": "run.started",
    "run.failed": "run.started",
    "run.cancelled": "run.started",
    "tool.completed": "tool.requested",
    "tool.failed": "tool.requested",
    "tool.denied": "tool.requested",
    "delegation.subagent.stopped": "delegation.subagent.started",
}
RUN_TERMINALS = frozenset({"run.finished", "run.failed", "run.cancelled"})
SESSION_ENDS = frozenset({"session.ended", "x.hermes.session.finalized"})
CARD_ENDINGS = frozenset({"attention.resolved", "attention.timeout"})
CARD_FOLLOW_UPS = CARD_ENDINGS | {"attention.answered"}


def check_invariants(
    events: list[Event], *, complete: bool = True, linked: bool = False, stream_order: bool = True
) -> list[str]:
    """The pairing invariants over an output stream, as a list of problems (empty = all hold).

    * every event id appears once; (session, epoch, seq) is unique;
    * at most one run terminal per (session, run), and it carries ``run``;
      at most one ``session.ended`` per session;
    * a terminal's ``cause``, when set, names an event of its start type (same run for runs);
      with ``linked`` every terminal and attention follow-up must be linked;
    * every attention follow-up (``answered`` / ``resolved`` / ``timeout``) has ``subject`` =
      the id of an ``attention.requested`` of its own session (AEP-0002 §7.1);
    * every ``attention.requested`` ends (``complete``) in ``attention.resolved`` or
      ``attention.timeout`` with ``subject`` = its id, and before the next session end
      (``session.ended`` / ``x.hermes.session.finalized``) of its session in (epoch, seq)
      order, and with ``stream_order`` also in stream order, except a dismissal: a card open
      at its session's end is dismissed ``hold_ns`` later (its answer may still come);
    * ``x.hermes.pairing.orphaned`` names an existing start.
    """
    problems: list[str] = []
    by_id: dict[str, Event] = {}
    seqs: set[tuple[Any, Any, Any]] = set()
    for i, e in enumerate(events):
        if e.id in by_id:
            problems.append(f"{e.id} ({e.type}): appears twice")
        by_id[e.id] = e
        if e.session is not UNSET and e.seq is not UNSET:
            k = (e.session, e.epoch, e.seq)
            if k in seqs:
                problems.append(f"{e.id} ({e.type}): seq {e.seq} reused in session {e.session}")
            seqs.add(k)
    run_terms: dict[tuple[Any, Any], int] = {}
    ended: dict[Any, int] = {}
    for e in events:
        if e.type in RUN_TERMINALS:
            if e.run is UNSET:
                problems.append(f"{e.id} ({e.type}): run terminal without run")
            run_key = (e.session, e.run)
            run_terms[run_key] = run_terms.get(run_key, 0) + 1
            if run_terms[run_key] == 2:
                problems.append(f"run {e.run} of {e.session}: two terminals")
        elif e.type == "session.ended":
            ended[e.session] = ended.get(e.session, 0) + 1
            if ended[e.session] == 2:
                problems.append(f"session {e.session}: two session.ended")
        start_type = START_OF.get(e.type)
        if start_type is not None:
            if e.cause is UNSET:
                if linked:
                    problems.append(f"{e.id} ({e.type}): no cause")
            else:
                start = by_id.get(e.cause)
                if start is None or start.type != start_type:
                    problems.append(f"{e.id} ({e.type}): cause {e.cause} is not a {start_type}")
                elif e.type in RUN_TERMINALS and start.run != e.run:
                    problems.append(f"{e.id} ({e.type}): cause is the start of another run")
        if e.type == "x.hermes.pairing.orphaned":
            start = by_id.get((e.data or {}).get("start", ""))
            if start is None or start.type not in ("run.started", "tool.requested", "delegation.subagent.started"):
                problems.append(f"{e.id}: orphaned names no start")
    requests = {e.id: i for i, e in enumerate(events) if e.type == "attention.requested"}
    first_end: dict[str, int] = {}
    for i, e in enumerate(events):
        if e.type in CARD_FOLLOW_UPS:
            if e.subject not in requests:
                problems.append(f"{e.id} ({e.type}): subject {e.subject!r} is not a request id")
                continue
            if events[requests[e.subject]].session != e.session:  # type: ignore[index]
                problems.append(f"{e.id} ({e.type}): subject is a request of another session")
                continue
            if e.type in CARD_ENDINGS and e.subject not in first_end:
                first_end[e.subject] = i
    ends_by_session: dict[Any, list[int]] = {}
    for i, e in enumerate(events):
        if e.type in SESSION_ENDS:
            ends_by_session.setdefault(e.session, []).append(i)
    for rid, i in requests.items():
        r = events[i]
        j = first_end.get(rid)
        if j is None:
            if complete:
                problems.append(f"request {rid} never ends")
            continue
        session_ends = ends_by_session.get(r.session, [])
        if stream_order and (events[j].data or {}).get("resolution") != "dismissed":
            nxt = next((k for k in session_ends if k > i), None)
            if nxt is not None and j > nxt:
                problems.append(f"request {rid} ends after its session.ended (stream order)")
        later = [events[k] for k in session_ends if events[k].epoch == r.epoch and events[k].seq > r.seq]  # type: ignore[operator]
        if later:
            end_seq = min(x.seq for x in later)  # type: ignore[type-var]
            if events[j].seq >= end_seq:  # type: ignore[operator]
                problems.append(f"request {rid} ends after its session.ended (seq order)")
    return problems


__all__ = ["CARD_ENDINGS", "CARD_FOLLOW_UPS", "RUN_TERMINALS", "SESSION_ENDS", "START_OF", "check_invariants"]
