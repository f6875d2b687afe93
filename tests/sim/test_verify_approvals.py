"""The verifier's approval checks (issue 17), on crafted streams.

The bad streams below are exactly what the code before issue 17 published on a bad day
(two mappers, two pairing workers, kill -9 and a NATS restart): a CLI answer filed under
`unknown` and emitted as `attention.answered {subject: "force push"}`, and its request
closed `dismissed` at session end although the user had answered `once`. `aep-bridge
verify` reported OK on them; these checks must not.
"""

from __future__ import annotations

from typing import Any

from msgspec import UNSET

from bridge.core.aep import Event
from bridge.core.identity import event_id
from bridge.core.invariants import check_invariants
from bridge.sim.verify import approval_problems

S = "20261201_101010_abcdef"


def ev(i: int, etype: str, session: str = S, subject: Any = UNSET, data: Any = None, seq: int | None = None,
       cause: Any = UNSET) -> Event:
    return Event(aep="0.1", id=event_id(f"raw-{i}", 512, 1_764_500_000_000 + i), type=etype,
                 time="2025-11-30T10:53:20.000Z", source=f"aep://dev/agent/hermes/session/{session}", agent="hermes",
                 session=session, seq=seq if seq is not None else i * 1024 + 512, epoch=0, subject=subject,
                 cause=cause, capture="metadata", data=data or {},
                 lane="unknown" if session == "unknown" else UNSET)


def the_bad_day() -> tuple[list[Event], dict[str, str]]:
    start = ev(1, "session.started")
    req = ev(2, "attention.requested", subject="force push",
             data={"kind": "permission", "prompt": "p", "respond_via": ["oob"]})
    ans = ev(3, "attention.answered", session="unknown", subject="force push",
             data={"answer": {"option": "once"}, "via": "oob"})
    dismissed = ev(5, "attention.resolved", subject=req.id, cause=req.id, seq=4 * 1024 + 0,
                   data={"resolution": "dismissed", "latency_ms": 3})
    end = ev(4, "session.ended", data={"reason": "shutdown"})
    return [start, req, ans, dismissed, end], {ans.id: S}


def test_an_answer_in_unknown_with_a_pattern_key_subject_fails_both_checks():
    events, answers = the_bad_day()
    problems = check_invariants(events, complete=False)
    assert any("subject 'force push' is not a request id" in p for p in problems), problems
    found = approval_problems(events, answers)
    assert len(found) == 1 and "filed under unknown" in found[0], found


def test_a_request_dismissed_although_its_answer_came_fails():
    start = ev(1, "session.started")
    req = ev(2, "attention.requested", subject="force push", data={"kind": "permission", "prompt": "p"})
    end = ev(4, "session.ended")
    dismissed = ev(5, "attention.resolved", subject=req.id, cause=req.id, seq=4 * 1024, data={"resolution": "dismissed"})
    # the answer, redelivered after the finalize, linked late to the dismissed request
    ans = ev(3, "attention.answered", subject=req.id, cause=req.id, data={"answer": {"option": "once"}, "via": "oob"})
    events = [start, req, dismissed, end, ans]
    assert check_invariants(events, complete=True, stream_order=False) == []  # the old checks were content
    found = approval_problems(events, {ans.id: S})
    assert found == [f"answer {ans.id} of session {S}: its request {req.id} was closed dismissed",
                     f"answer {ans.id} of session {S}: no attention.resolved {{answered}} for request {req.id}"]


def test_a_follow_up_naming_a_request_of_another_session_fails():
    other = ev(2, "attention.requested", session="other", subject="rm", data={"kind": "permission", "prompt": "p"})
    ans = ev(3, "attention.timeout", subject=other.id, cause=other.id)
    problems = check_invariants([other, ans], complete=False)
    assert problems == [f"{ans.id} (attention.timeout): subject is a request of another session"]
    assert "not a request of its session" in approval_problems([other, ans], {ans.id: S})[0]


def test_an_unmatched_answer_is_reported_as_what_it_is():
    req = ev(2, "attention.requested", subject="rm", data={"kind": "permission", "prompt": "p"})
    ans = ev(3, "x.hermes.attention.unmatched", data={"follow_up": "attention.answered", "pattern_key": "rm"})
    assert check_invariants([req, ans], complete=False) == []  # honest, and legal
    [problem] = approval_problems([req, ans], {ans.id: S})
    assert "is x.hermes.attention.unmatched" in problem  # but the answer did not keep its request


def test_the_good_stream_passes():
    req = ev(2, "attention.requested", subject="rm", data={"kind": "permission", "prompt": "p"})
    ans = ev(3, "attention.answered", subject=req.id, cause=req.id, data={"answer": {"option": "once"}, "via": "oob"})
    res = ev(33, "attention.resolved", subject=req.id, cause=ans.id, seq=3 * 1024 + 768,
             data={"resolution": "answered", "latency_ms": 1})
    timeout_req = ev(6, "attention.requested", subject="push", data={"kind": "permission", "prompt": "p"})
    timeout = ev(7, "attention.timeout", subject=timeout_req.id, cause=timeout_req.id, data={"after_ms": 5})
    events = [req, ans, res, timeout_req, timeout, ev(8, "session.ended")]
    assert check_invariants(events, complete=True) == []
    assert approval_problems(events, {ans.id: S, timeout.id: S, "not-there": S}) == []
