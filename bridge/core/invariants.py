"""The pairing invariants, checked over an output stream (AEP_EVENTS, or `PairingState` output).

Used by the tests and by ``aep-bridge verify``; the pairing state machine itself
(`bridge.core.pairing`) does not import it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from msgspec import UNSET

from bridge.core.aep import API_CALL_TYPE, RUN_USAGE_TYPE as RUN_USAGE, Event

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


# ---------------------------------------------------------------- issue 40: run totals


class UsageCheck(NamedTuple):
    problems: list[str]
    runs: int  # runs with an end, checked
    calls: int  # model calls counted in their run's last totals
    late: int  # model calls published after their run's last totals (in no total)
    amended: int  # x.hermes.run.usage events (a call that reached pairing after its run's end)




def _usage_row(data: dict[str, Any]) -> list[int]:
    from bridge.core.aep import USAGE_MEMBERS

    row = []
    for member, _ in USAGE_MEMBERS:
        v = data.get(member, 0)
        row.append(v if isinstance(v, int) and not isinstance(v, bool) else 0)
    return row


def _cost_row(data: dict[str, Any]) -> tuple[str, list[int]] | None:
    from bridge.core.pricing import COST_MEMBERS, to_nanos

    cost = data.get("cost")
    if not isinstance(cost, dict) or not isinstance(cost.get("currency"), str):
        return None
    nanos = [to_nanos(cost.get(m, 0)) for m in COST_MEMBERS]
    if any(n is None for n in nanos):
        return None
    return cost["currency"], nanos  # type: ignore[return-value]


def is_run_end(e: Event) -> bool:
    """A run's end: its terminal, or the ``x.hermes.pairing.orphaned`` the bridge closed it with."""
    return e.type in RUN_TERMINALS or (e.type == "x.hermes.pairing.orphaned" and (e.data or {}).get("kind") == "run")


def check_usage(events: list[Event], call_type: str = API_CALL_TYPE) -> UsageCheck:
    """Every model call counted once in its run's totals (issue 40), over an output stream in
    stream order (distinct event ids). Every statement of a run's totals (each end of the run:
    its terminal, the ``x.hermes.pairing.orphaned`` closing it; and each ``x.hermes.run.usage``
    amendment) must equal the sums over the run's ``x.hermes.api.call`` events published before
    it: ``model_calls`` their number, each ``gen_ai.usage.*`` member their sum, and ``cost``
    (exact, in nano-units) their sum when every one of them had a cost in one currency, else no
    ``cost``. A call published after its run's last statement is in no total: counted ``late``
    (pairing had forgotten the run), not a problem. Runs with an end at capture ``none`` carry
    no totals and are skipped, like calls at capture ``none``."""
    Key = tuple[Any, Any]
    sums: dict[Key, list[int]] = {}
    costs: dict[Key, tuple[str, list[int]] | None] = {}  # None: a call without a cost / mixed currencies
    ids: dict[Key, list[str]] = {}
    stated: dict[Key, int] = {}  # calls covered by the run's last statement
    skip: set[Key] = set()
    problems: list[tuple[Key, str]] = []
    amended = 0
    for e in events:
        if not e.run:
            continue
        key = (e.session, e.run)
        data = e.data or {}
        if e.type == call_type:
            if e.capture == "none":
                continue
            sums[key] = [a + b for a, b in zip(sums.get(key, [0] * 6), [1, *_usage_row(data)])]
            ids.setdefault(key, []).append(e.id)
            c = _cost_row(data)
            if key not in costs:
                costs[key] = c
            elif costs[key] is not None:
                prev = costs[key]
                costs[key] = None if c is None or c[0] != prev[0] else (c[0], [a + b for a, b in zip(prev[1], c[1])])  # type: ignore[index]
            continue
        statement = is_run_end(e) or e.type == RUN_USAGE
        if not statement:
            continue
        if e.capture == "none":
            skip.add(key)
            continue
        amended += e.type == RUN_USAGE
        want = sums.get(key, [0] * 6)
        got = [data.get("model_calls", 0) if isinstance(data.get("model_calls", 0), int) else -1, *_usage_row(data)]
        stated[key] = want[0]
        if got != want:
            problems.append((key, f"{e.type} {e.id} of run {e.run} ({e.session}): calls+tokens {got}, "
                                  f"its {want[0]} calls so far sum to {want}"))
            continue
        have = _cost_row(data)
        owed = costs.get(key) if want[0] else None
        if (have is None) != (owed is None) or (have is not None and have != owed):
            problems.append((key, f"{e.type} {e.id} of run {e.run} ({e.session}): cost {have}, its calls so far: {owed}"))
    runs = calls = late = 0
    for key, n in stated.items():
        if key in skip:
            continue
        runs += 1
        calls += n
        late += sums.get(key, [0])[0] - n
    return UsageCheck([text for key, text in problems if key not in skip], runs, calls, late, amended)
