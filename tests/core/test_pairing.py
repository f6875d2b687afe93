"""Table tests of the pairing state machine (bridge/core/pairing.py), one rule at a time.

Events are built the way the mapper builds them (`Mk`): one raw message per call,
id = event_id(raw id, slot, receive ms), seq = raw * 1024 + 512 + index, and the
hints the mapper sends in the Bridge-Hints header.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from msgspec import UNSET

from bridge.core.aep import encode_event
from bridge.core.identity import SLOTS, event_id, rfc3339, ulid_time_ms
from bridge.core.pairing import (
    HOUR,
    MINUTE,
    SECOND,
    PairingConfig,
    PairingState,
)
from bridge.core.invariants import check_invariants
from benchmarks.pairing_footprint import idle_session_footprint
from tests.support.pairing import BASE_NS, MS, Mk, Msg, Run, types


@pytest.fixture
def m() -> Mk:
    return Mk()


@pytest.fixture
def r() -> Run:
    return Run()


# ---------------------------------------------------------------- tools


@pytest.mark.parametrize("etype", ["tool.completed", "tool.failed", "tool.denied"])
def test_tool_terminal_gets_cause_of_its_request(m: Mk, r: Run, etype: str) -> None:
    req = m.tool_req()
    end = m.tool_end(etype=etype)
    out = r.feed(req, end)
    assert types(out) == ["tool.requested", etype]
    assert out[0] == req[0]
    assert out[1].cause == req[0].id
    assert msgspec.structs.replace(out[1], cause=UNSET) == end[0]
    assert r.state.open_pairs()["tool"] == 0


def test_tool_without_call_id_pairs_by_task_name_and_args_fifo(m: Mk, r: Run) -> None:
    a1 = m.tool_req(run=None, cid="", args="same")
    a2 = m.tool_req(run=None, cid="", args="same")
    b = m.tool_req(run=None, cid="", args="other")
    other_task = m.tool_req(run=None, cid="", args="same", task="t2")
    r.feed(a1, a2, b, other_task)
    out = r.feed(
        m.tool_end(run=None, cid="", args="other"),
        m.tool_end(run=None, cid="", args="same"),
        m.tool_end(run=None, cid="", args="same", task="t2"),
        m.tool_end(run=None, cid="", args="same"),
    )
    assert [e.cause for e in out] == [b[0].id, a1[0].id, other_task[0].id, a2[0].id]


def test_tool_call_ids_are_scoped_by_run(m: Mk, r: Run) -> None:
    t1 = m.tool_req(run="S:t:r1", cid="call_0")
    r.feed(t1, m.tool_end(run="S:t:r1", cid="call_0"))
    t2 = m.tool_req(run="S:t:r2", cid="call_0")
    out = r.feed(t2, m.tool_end(run="S:t:r2", cid="call_0"))
    assert out[1].cause == t2[0].id


def test_tool_terminal_before_its_request_is_held_then_linked(m: Mk, r: Run) -> None:
    req = m.tool_req()
    end = m.tool_end()
    assert r.feed(end) == []
    assert r.state.metrics()["held_now"] == 1
    out = r.feed(req)
    assert types(out) == ["tool.requested", "tool.completed"]
    assert out[1].cause == req[0].id and out[1].id == end[0].id and out[1].seq == end[0].seq
    assert r.state.metrics()["held_now"] == 0


def test_tool_terminal_without_request_is_released_unchanged_after_the_hold(m: Mk, r: Run) -> None:
    cfg = r.state.config
    req = m.tool_req()
    end = m.tool_end()
    ts = BASE_NS + 2 * MS
    r.feed(end)
    assert r.tick(ts + cfg.hold_ns - 1) == []
    out = r.tick(ts + cfg.hold_ns)
    assert out == [end[0]]
    assert r.state.counters["unmatched.tool"] == 1
    # the request shows up after all (seq below the terminal's): passed through, never opened
    assert r.feed(req) == [req[0]]
    assert r.state.open_pairs()["tool"] == 0
    assert types(r.feed(m.ended())) == ["session.ended"]


def test_repeated_terminal_of_one_call_links_to_the_same_request_at_once(m: Mk, r: Run) -> None:
    """A real tool_call_id is unique within its run: a second terminal is a repeat Hermes
    reported (the corpus has three for one call), linked at once, not delayed by the hold."""
    req = m.tool_req()
    out = r.feed(req, m.tool_end(), m.tool_end(etype="tool.failed"), m.tool_end(etype="tool.denied"))
    assert types(out) == ["tool.requested", "tool.completed", "tool.failed", "tool.denied"]
    assert [e.cause for e in out[1:]] == [req[0].id] * 3
    assert r.state.counters["late_terminals.tool"] == 2
    assert r.tick(BASE_NS + 4 * MS + r.state.config.hold_ns) == []


def test_composite_key_terminal_waits_for_its_late_request(m: Mk, r: Run) -> None:
    """Without a tool_call_id (calls inside execute_code) identical calls share a key, so a
    terminal whose key just closed may belong to a request still on its way: it waits."""
    first = m.tool_req(cid="")
    r.feed(first, m.tool_end(cid=""))
    again, end = m.tool_req(cid=""), m.tool_end(cid="", etype="tool.failed")
    assert r.feed(end) == []
    out = r.feed(again)
    assert out[1].cause == again[0].id


# ---------------------------------------------------------------- duplicates and replays


def _dup_scenarios(m: Mk) -> list[Msg]:
    return [
        m.started(),
        m.run_start(),
        m.tool_req(),
        m.ev("x.hermes.pre.api.request", run="S:t:r1"),
        m.tool_end(),
        m.appr_req(),
        m.appr_ans(),
        m.run_end(),
        m.ended(),
    ]


PAIRED = {2, 4, 5, 6, 7, 8}  # indexes of _dup_scenarios whose duplicates the pair state itself recognises


@pytest.mark.parametrize(
    "dedupe_ids, index", [(4096, i) for i in range(9)] + [(0, i) for i in sorted(PAIRED)]
)
def test_the_same_event_twice_is_emitted_once(dedupe_ids: int, index: int) -> None:
    """With the id ring, and for paired events also without it (dedupe_ids=0)."""
    msgs = _dup_scenarios(Mk())
    clean = Run(PairingConfig(dedupe_ids=dedupe_ids))
    clean.feed(*msgs)
    twice = Run(PairingConfig(dedupe_ids=dedupe_ids))
    twice.feed(*msgs[: index + 1], msgs[index], *msgs[index + 1 :])
    assert [encode_event(e) for e in twice.out] == [encode_event(e) for e in clean.out]
    assert twice.state.open_pairs() == clean.state.open_pairs()


def test_an_unpaired_duplicate_beyond_the_id_ring_is_byte_identical(m: Mk) -> None:
    r = Run(PairingConfig(dedupe_ids=0))
    e = m.ev("x.hermes.pre.api.request")
    first, second = r.feed(e), r.feed(e)
    assert [encode_event(x) for x in first] == [encode_event(x) for x in second]  # Nats-Msg-Id absorbs it


def test_a_position_already_covered_is_ignored(m: Mk, r: Run) -> None:
    req = m.tool_req()
    assert r.state.process(req[0], req[1], 5) == [req[0]]
    assert r.state.process(m.tool_end()[0], {}, 5) == []
    assert r.state.tick(BASE_NS * 2, 4) == []
    assert r.state.position == 5 and r.state.counters["replayed"] == 2


def test_duplicate_terminal_while_held_is_dropped(m: Mk, r: Run) -> None:
    req = m.tool_req()
    end = m.tool_end()
    r.feed(end, end)
    assert types(r.feed(req)) == ["tool.requested", "tool.completed"]


# ---------------------------------------------------------------- approvals


def test_approval_answer_links_to_request_and_inserts_resolved(m: Mk, r: Run) -> None:
    req = m.appr_req()
    ans = m.appr_ans()
    out = r.feed(req, ans)
    assert types(out) == ["attention.requested", "attention.answered", "attention.resolved"]
    answered, resolved = out[1], out[2]
    assert answered.subject == req[0].id and answered.cause == req[0].id
    assert answered.data == ans[0].data and answered.id == ans[0].id and answered.seq == ans[0].seq
    assert resolved.subject == req[0].id and resolved.cause == answered.id
    assert resolved.data == {"resolution": "answered", "latency_ms": 1}
    assert resolved.seq == (ans[0].seq // SLOTS) * SLOTS + 768
    assert resolved.id == event_id(ans[0].id + "/resolved", 768, ulid_time_ms(ans[0].id))
    assert resolved.time == ans[0].time and resolved.session == "S" and resolved.run == "S:t:r1"


def test_approval_timeout_gets_subject_cause_and_after_ms(m: Mk, r: Run) -> None:
    req = m.appr_req()
    r.feed(req)
    m.raw += 30_000  # 30 s later
    out = r.feed(m.appr_ans(choice="timeout"))
    assert types(out) == ["attention.timeout"]
    assert out[0].subject == req[0].id and out[0].cause == req[0].id
    assert out[0].data == {"after_ms": 30_001}


def test_approvals_with_one_key_break_ties_by_tool_call_id(m: Mk, r: Run) -> None:
    q1 = m.appr_req(cid="call_1")
    q2 = m.appr_req(cid="call_2")
    r.feed(q1, q2)
    out = r.feed(m.appr_ans(cid="call_2", choice="deny"), m.appr_ans(cid="call_1"))
    assert [e.subject for e in out] == [q2[0].id] * 2 + [q1[0].id] * 2


def test_approval_answer_without_tiebreak_goes_to_the_nearest_earlier_request(m: Mk, r: Run) -> None:
    q1, a1 = m.appr_req(cid=""), m.appr_ans(cid="")
    q2, a2 = m.appr_req(cid=""), m.appr_ans(cid="")
    out = r.feed(q1, q2, a2, a1)  # two replicas: q2 and a2 overtook a1
    assert [(e.id, e.subject) for e in out if e.type == "attention.answered"] == [
        (a2[0].id, q2[0].id), (a1[0].id, q1[0].id),
    ]


def test_a_terminal_never_closes_a_later_start(m: Mk, r: Run) -> None:
    q1, a1, q2 = m.appr_req(), m.appr_ans(), m.appr_req()
    out = r.feed(q2, a1)
    assert types(out) == ["attention.requested"]  # a1 waits for q1
    out = r.feed(q1)
    assert [e.subject for e in out[1:]] == [q1[0].id, q1[0].id]
    assert r.state.open_pairs()["card"] == 1


def test_tools_without_call_id_are_fifo(m: Mk, r: Run) -> None:
    t1, t2 = m.tool_req(cid=""), m.tool_req(cid="")
    out = r.feed(t1, t2, m.tool_end(cid=""), m.tool_end(cid=""))
    assert [e.cause for e in out[2:]] == [t1[0].id, t2[0].id]


def test_approvals_of_different_session_keys_do_not_pair(m: Mk, r: Run) -> None:
    q = m.appr_req(s="unknown", sk="default", pk="rm")
    r.feed(q)
    assert r.feed(m.appr_ans(s="unknown", sk="telegram:dm:1", pk="rm")) == []  # held: no request of that key


def test_approval_answer_before_its_request_is_held_then_linked(m: Mk, r: Run) -> None:
    req = m.appr_req()
    ans = m.appr_ans()
    assert r.feed(ans) == []
    out = r.feed(req)
    assert types(out) == ["attention.requested", "attention.answered", "attention.resolved"]
    assert out[1].subject == req[0].id
    assert out[2].seq == (ans[0].seq // SLOTS) * SLOTS + 768  # still sorts right after the answer


def test_reused_approval_key_answer_ahead_of_its_request_waits_for_it(m: Mk, r: Run) -> None:
    q1, a1 = m.appr_req(), m.appr_ans()
    q2, a2 = m.appr_req(), m.appr_ans(choice="deny")
    r.feed(q1, a1)
    assert r.feed(a2) == []  # q1 already ended: a2 belongs to a request still on its way
    out = r.feed(q2)
    assert [e.subject for e in out[1:]] == [q2[0].id, q2[0].id]


def test_an_answer_whose_request_never_reaches_its_lane_becomes_a_vendor_event(m: Mk, r: Run) -> None:
    """Issue 17: pairing emitted `attention.answered {subject: "rm"}` (the pattern key) in `unknown`.
    AEP-0002 §7.1: every follow-up's subject is the request's id; with no request there is none,
    so after the hold the answer is `x.hermes.attention.unmatched` with the keys and the choice."""
    cfg = r.state.config
    req = m.appr_req(s="S", sk="S")
    r.feed(m.started(), req)
    ans = m.appr_ans(s="unknown", sk="S")  # filed elsewhere than its request
    assert r.feed(ans) == []
    [out] = r.tick(BASE_NS + 3 * MS + cfg.hold_ns)
    assert out.type == "x.hermes.attention.unmatched" and out.id == ans[0].id and out.seq == ans[0].seq
    assert out.subject is UNSET and out.cause is UNSET
    assert out.data == {"follow_up": "attention.answered", "pattern_key": "rm", "tool_call_id": "call_1", "choice": "once"}
    assert r.state.counters["unmatched.card"] == 1
    assert not [e for e in r.out if e.type.startswith("attention.") and e.type != "attention.requested"
                and e.subject != req[0].id]
    timeout = m.appr_ans(s="unknown", pk="push", cid="call_2", choice="timeout")
    r.feed(timeout)
    [out] = r.tick(BASE_NS + 10 * MS + 2 * cfg.hold_ns)
    assert out.type == "x.hermes.attention.unmatched"
    assert out.data == {"follow_up": "attention.timeout", "pattern_key": "push", "tool_call_id": "call_2", "choice": "timeout"}
    assert check_invariants(r.out, complete=False) == []


def test_an_answer_that_reached_pairing_late_is_held_hold_ns_from_its_arrival(m: Mk, r: Run) -> None:
    """CI, kill -9 of BRIDGE_MAPPED's leader: the answer reached pairing ~15 s after Hermes wrote
    it (stream time had moved on with other sessions), its request a few seconds later still (a
    retried publish). Counted from the answer's own ts, the hold had all but run out on arrival,
    and the answer went out `x.hermes.attention.unmatched`. The hold counts from when pairing
    got the terminal (the stream clock then), so a request one retry behind still links."""
    cfg = r.state.config
    req, ans = m.appr_req(), m.appr_ans()
    late = cfg.hold_ns - SECOND  # what the outage cost the answer before pairing saw it
    assert r.tick(BASE_NS + late) == []
    assert r.feed(ans) == []  # held
    assert r.tick(BASE_NS + late + 5 * SECOND) == []  # past ans.ts + hold_ns, not past its arrival + hold_ns
    out = r.feed(req)
    assert types(out) == ["attention.requested", "attention.answered", "attention.resolved"]
    assert out[1].subject == req[0].id
    assert check_invariants(r.out, complete=False) == []
    # without its request, the answer is released hold_ns after its arrival, not before
    r2, m2 = Run(cfg), Mk()
    ans2 = m2.appr_ans()
    r2.tick(BASE_NS + late)
    assert r2.feed(ans2) == []
    assert r2.tick(BASE_NS + late + cfg.hold_ns - 1) == []
    assert types(r2.tick(BASE_NS + late + cfg.hold_ns)) == ["x.hermes.attention.unmatched"]


def test_a_clock_far_ahead_does_not_hold_follow_ups_until_wall_time_catches_up(m: Mk, r: Run) -> None:
    """Review: with the hold counted from arrival, one event from a host whose clock runs hours
    ahead moved the stream clock there, and every answer held after it waited until wall time
    caught up. Arrival counts at most hold_ns after the answer's own time."""
    cfg = r.state.config
    assert 2 * cfg.hold_ns < 10 * HOUR
    skewed = m.appr_req(s="other", sk="other", ts=BASE_NS + 10 * HOUR)
    r.feed(skewed)
    ans = m.appr_ans()  # its request never comes
    assert r.feed(ans) == []
    # the clock is hours ahead: the next tick finds the answer's bounded deadline (ts + 2 holds) past
    assert types(r.tick(BASE_NS + cfg.hold_ns)) == ["x.hermes.attention.unmatched"]


def test_a_card_whose_session_end_reached_pairing_late_still_waits_hold_ns(m: Mk, r: Run) -> None:
    """The same for a card open at its session's end: its answer gets hold_ns from when the end
    reached pairing, not from the end's own ts (the end may have been held up by the same fault)."""
    cfg = r.state.config
    card = m.appr_req()
    r.feed(m.started(), m.run_start(), card)
    end = m.ended()
    late = cfg.hold_ns - SECOND
    r.tick(BASE_NS + late)
    r.feed(end)
    assert r.tick(BASE_NS + late + 5 * SECOND) == []  # the card is still open
    ans = m.appr_ans()
    ans = (msgspec.structs.replace(ans[0], seq=card[0].seq + 1), ans[1])
    out = r.feed(ans)
    assert types(out) == ["attention.answered", "attention.resolved"]
    assert out[1].data["resolution"] == "answered"




def test_request_arriving_after_its_answer_was_released_still_ends(m: Mk, r: Run) -> None:
    cfg = r.state.config
    req = m.appr_req()
    ans = m.appr_ans()
    r.feed(ans)
    assert [(e.id, e.type) for e in r.tick(BASE_NS + 2 * MS + cfg.hold_ns)] == [(ans[0].id, "x.hermes.attention.unmatched")]
    out = r.feed(req)
    assert types(out) == ["attention.requested", "attention.resolved"]
    assert out[1].subject == req[0].id and out[1].cause == ans[0].id
    assert out[1].data["resolution"] == "answered"
    assert out[1].seq == (req[0].seq // SLOTS) * SLOTS + 768
    assert r.state.open_pairs()["card"] == 0


# ---------------------------------------------------------------- clarify forms


@pytest.mark.parametrize(
    "outcome, follow, extra",
    [
        ("answered", ["attention.answered", "attention.resolved"], {}),
        ("timeout", ["attention.timeout"], {"after_ms": 1}),
        ("dismissed", ["attention.resolved"], {"resolution": "dismissed", "latency_ms": 1}),
    ],
)
def test_clarify_card_follow_ups(m: Mk, r: Run, outcome: str, follow: list[str], extra: dict[str, Any]) -> None:
    tool_req, card = m.clar_req()
    out = r.feed([tool_req, card], m.clar_post(outcome=outcome))
    assert types(out) == ["tool.requested", "attention.requested", "tool.completed", *follow]
    assert out[2].cause == tool_req[0].id
    assert all(e.subject == card[0].id for e in out[3:])
    assert out[3].cause == card[0].id
    for k, v in extra.items():
        assert out[3].data[k] == v
    assert r.state.open_pairs() == {"run": 0, "tool": 0, "card": 0, "subagent": 0}


# ---------------------------------------------------------------- subagents


def test_subagent_stop_after_the_parent_ended_is_linked(m: Mk, r: Run) -> None:
    start = m.sub_start()
    r.feed(m.started(), m.run_start(), start, m.run_end())
    out = r.feed(m.ended())
    assert types(out) == ["session.ended"]  # subagents are not swept
    assert r.state.open_pairs()["subagent"] == 1
    out = r.feed(m.sub_stop())
    assert out[0].cause == start[0].id
    assert r.state.open_pairs()["subagent"] == 0


def test_subagent_stop_before_its_start_is_held(m: Mk, r: Run) -> None:
    start, stop = m.sub_start(), m.sub_stop()
    assert r.feed(stop) == []
    assert [e.cause for e in r.feed(start)] == [UNSET, start[0].id]


def test_a_delegation_that_never_reports_back_is_closed_after_the_delegate_call_plus_the_grace(m: Mk, r: Run) -> None:
    """Issue 17: `subagent_stop` sometimes never fires (the CLI exits first; the gateway never
    finalizes): the delegation stayed open for 6 h. When the parent's `delegate_task` call ends
    (background: "dispatched"), the child has `subagent_grace_ns` to report; then the bridge says
    it stopped waiting (x.hermes.pairing.orphaned), not how the child ended. A later real stop
    is not a second terminal."""
    cfg = r.state.config
    call = m.tool_req(cid="call_9", name="delegate_task")
    start = m.sub_start()
    done = m.tool_end(cid="call_9", name="delegate_task")
    r.feed(m.started(), m.run_start(), call, start, done)
    assert r.state.open_pairs()["subagent"] == 1
    snap = r.state.snapshot()  # the grace survives a takeover
    r.state = PairingState.restore(snap)
    assert r.tick(done[1]["ts"] + cfg.subagent_grace_ns - 1) == []
    [closed] = r.tick(done[1]["ts"] + cfg.subagent_grace_ns)
    assert closed.type == "x.hermes.pairing.orphaned" and closed.cause == start[0].id
    assert closed.data["kind"] == "subagent" and closed.data["reason"] == "delegate_returned"
    assert closed.seq < done[0].seq  # right after its start
    r.tick(done[1]["ts"] + cfg.subagent_grace_ns + 3 * HOUR)  # long after recent_ns: still remembered
    late = r.feed(m.sub_stop())
    assert types(late) == ["x.hermes.delegation.stopped_late"] and late[0].cause == start[0].id
    assert late[0].data["status"] == "completed"
    assert not [e for e in r.out if e.type == "delegation.subagent.stopped"]
    assert check_invariants(r.out, complete=False) == []


def test_a_delegation_open_at_its_parents_end_gets_the_grace_and_a_stop_within_it_is_its_terminal(m: Mk, r: Run) -> None:
    cfg = r.state.config
    a, b = m.sub_start(child="A"), m.sub_start(child="B")
    r.feed(m.started(), m.run_start(), a, b, m.run_end())
    end = m.ended()  # raw 6
    assert types(r.feed(end)) == ["session.ended"]
    stop = r.feed(m.sub_stop(child="A"))  # within the grace: the real terminal
    assert types(stop) == ["delegation.subagent.stopped"] and stop[0].cause == a[0].id
    [closed] = r.tick(end[1]["ts"] + cfg.subagent_grace_ns)
    assert closed.data == {"kind": "subagent", "reason": "session_end", "start": b[0].id,
                           "age_ms": closed.data["age_ms"]}
    assert r.state.open_pairs()["subagent"] == 0


def test_a_foreground_delegation_reports_before_its_call_ends_and_nothing_is_closed(m: Mk, r: Run) -> None:
    call, start, stop = m.tool_req(cid="call_9", name="delegate_task"), m.sub_start(), m.sub_stop()
    done = m.tool_end(cid="call_9", name="delegate_task")
    r.feed(m.started(), m.run_start(), call, start, stop, done)
    r.tick(BASE_NS + HOUR)
    assert not [e for e in r.out if e.type.startswith("x.hermes.")]
    assert types([e for e in r.out if e.type.startswith("delegation.")]) == [
        "delegation.subagent.started", "delegation.subagent.stopped"]


def test_an_answer_never_takes_a_request_of_another_tool_call(m: Mk, r: Run) -> None:
    """Issue 17: match by session, pattern_key AND tool_call_id. The second call's answer,
    overtaking its own request, took the first call's still-open request."""
    first = m.appr_req(cid="call_1")
    second, ans2 = m.appr_req(cid="call_2"), m.appr_ans(cid="call_2")
    r.feed(m.started(), m.run_start(), first)
    assert r.feed(ans2) == []  # held for its own request
    out = r.feed(second)
    assert types(out) == ["attention.requested", "attention.answered", "attention.resolved"]
    assert out[1].subject == second[0].id
    assert r.state.open_pairs()["card"] == 1  # the first call's request is still open


# ---------------------------------------------------------------- runs


@pytest.mark.parametrize("etype", ["run.finished", "run.failed", "run.cancelled"])
def test_run_terminal_gets_cause_of_run_started(m: Mk, r: Run, etype: str) -> None:
    start = m.run_start()
    out = r.feed(start, m.run_end(etype=etype))
    assert out[1].type == etype and out[1].cause == start[0].id


def test_run_end_without_run_closes_the_open_run(m: Mk, r: Run) -> None:
    start = m.run_start(run="S:t:r1")
    out = r.feed(start, m.run_end(run=None, etype="run.cancelled"))
    assert out[1].type == "run.cancelled" and out[1].run == "S:t:r1" and out[1].cause == start[0].id


def test_run_end_without_run_closes_the_latest_of_two_open_runs(m: Mk, r: Run) -> None:
    r.feed(m.run_start(run="S:t:r1"))
    r2 = m.run_start(run="S:t:r2")
    out = r.feed(r2, m.run_end(run=None))
    assert out[1].run == "S:t:r2" and out[1].cause == r2[0].id


def test_run_end_without_run_and_no_open_run_becomes_run_closed(m: Mk, r: Run) -> None:
    r.feed(m.run_start(), m.run_end())
    end = m.run_end(run=None, etype="run.cancelled")
    out = r.feed(end)
    assert types(out) == ["x.hermes.run.closed"]
    assert out[0].id == end[0].id and out[0].seq == end[0].seq and out[0].run is UNSET
    assert out[0].data == {"completed": False, "interrupted": True}
    assert r.state.counters["run_closed"] == 1


@pytest.mark.parametrize("later_ns", [0, 10 * MINUTE])
def test_second_terminal_of_a_run_becomes_run_closed(m: Mk, r: Run, later_ns: int) -> None:
    start = m.run_start()
    r.feed(start, m.run_end())
    if later_ns:  # also after the closed pair is forgotten (the per-session run digests remember)
        r.tick(BASE_NS + later_ns)
    out = r.feed(m.run_end(etype="run.cancelled"))
    assert types(out) == ["x.hermes.run.closed"]
    assert out[0].cause == (UNSET if later_ns else start[0].id)
    assert r.state.counters["suppressed.run"] == 1


def test_run_started_after_its_terminal_was_released_is_passed_through(m: Mk, r: Run) -> None:
    start, end = m.run_start(), m.run_end()
    r.feed(end)
    assert r.tick(BASE_NS + 2 * MS + r.state.config.hold_ns) == [end[0]]
    assert r.feed(start) == [start[0]]
    assert r.state.open_pairs()["run"] == 0
    assert types(r.feed(m.run_end())) == ["x.hermes.run.closed"]


# ---------------------------------------------------------------- session end


def test_session_end_sweeps_cards_runs_and_tools_but_not_subagents() -> None:
    """With hold_ns 0 (no answer can be on its way) an open card is dismissed before the end."""
    m, r = Mk(), Run(PairingConfig(hold_ns=0))
    started = m.started()
    run = m.run_start()
    tool = m.tool_req()
    card = m.appr_req()
    sub = m.sub_start()
    r.feed(started, run, tool, card, sub)
    end = m.ended()
    out = r.feed(end)
    assert types(out) == ["x.hermes.pairing.orphaned", "x.hermes.pairing.orphaned", "attention.resolved", "session.ended"]
    base = (end[0].seq // SLOTS) * SLOTS
    assert [e.seq for e in out[:3]] == [base, base + 1, base + 2]
    ms = ulid_time_ms(end[0].id)
    assert [e.id for e in out[:3]] == [event_id(end[0].id + "/sweep", i, ms) for i in range(3)]
    assert out[0].data == {"kind": "run", "reason": "session_end", "start": run[0].id, "age_ms": 4}
    assert out[0].cause == run[0].id and out[0].run == "S:t:r1" and out[0].severity == "warning"
    assert out[1].data["kind"] == "tool" and out[1].data["start"] == tool[0].id
    assert out[2].data == {"resolution": "dismissed", "latency_ms": 2}  # raw 4 -> raw 6
    assert out[2].subject == card[0].id and out[2].cause == card[0].id
    assert all(e.time == end[0].time and e.source == end[0].source for e in out[:3])
    assert out[3] == end[0]
    assert r.state.open_pairs() == {"run": 0, "tool": 0, "card": 0, "subagent": 1}
    assert r.state.counters["sweeps"] == 1 and r.state.counters["swept.card"] == 1
    assert r.state.counters["orphaned.session_end.run"] == 1


def test_a_card_open_at_session_end_waits_hold_ns_for_its_answer(m: Mk, r: Run) -> None:
    """Issue 17: a mapper killed holding the answer redelivers it one ack_wait later, behind the
    finalize. Dismissing the request at the end contradicted the answer that came (the user
    answered `once` and the command ran). The card now gets hold_ns after the end: the answer
    links; without one it is dismissed then, with a seq right after the request (before the end)."""
    cfg = r.state.config
    started, run, card, card2 = m.started(), m.run_start(), m.appr_req(), m.appr_req(pk="push", cid="call_2")
    r.feed(started, run, card, card2)
    end = m.ended()
    out = r.feed(end)
    assert types(out) == ["x.hermes.pairing.orphaned", "session.ended"]
    ans = m.appr_ans()  # redelivered late: stream order after the end, seq order before it
    ans = (msgspec.structs.replace(ans[0], seq=card[0].seq + 1), ans[1])
    out = r.feed(ans)
    assert types(out) == ["attention.answered", "attention.resolved"]
    assert out[0].subject == card[0].id and out[1].data["resolution"] == "answered"
    end_ts = BASE_NS + 5 * MS
    assert r.tick(end_ts + cfg.hold_ns - 1) == []
    [dismissed] = r.tick(end_ts + cfg.hold_ns)
    assert dismissed.type == "attention.resolved" and dismissed.subject == card2[0].id
    assert dismissed.data["resolution"] == "dismissed" and dismissed.seq < end[0].seq
    assert not [e for e in r.out if e.subject == card[0].id and (e.data or {}).get("resolution") == "dismissed"]
    assert check_invariants(r.out, complete=True, stream_order=False) == []


def test_second_finalize_becomes_session_finalized_and_sweeps_again(m: Mk, r: Run) -> None:
    started = m.started()
    first = m.ended()
    r.feed(started, first)
    resumed, run = m.started(), m.run_start(run="S:t:r2")
    card = m.appr_req()  # the session was resumed
    r.feed(resumed, run, card)
    second = m.ended()
    out = r.feed(second)
    assert types(out) == ["x.hermes.pairing.orphaned", "x.hermes.session.finalized"]
    [dismissed] = r.tick(BASE_NS + 10 * MS + r.state.config.hold_ns)  # the card's answer may still come
    assert dismissed.subject == card[0].id and dismissed.data["resolution"] == "dismissed"
    fin = out[1]
    assert fin.id == second[0].id and fin.seq == second[0].seq and fin.cause == first[0].id
    assert fin.data == {"reason": "normal"}
    assert r.state.counters["suppressed.session"] == 1
    assert types(r.feed(m.ended())) == ["x.hermes.session.finalized"]


def test_session_exclusivity_survives_eviction(m: Mk, r: Run) -> None:
    started = m.started()
    r.feed(started, m.ended())
    r.tick(BASE_NS + HOUR)
    assert r.state.metrics()["sessions"] == 0
    started = m.started()
    out = r.feed(started, m.ended())
    assert types(out) == ["session.started", "x.hermes.session.finalized"]
    assert out[1].cause is UNSET  # the ended id went with the session; the 8-byte digest stayed


def test_run_terminal_overtaken_by_the_finalize_is_still_linked(m: Mk, r: Run) -> None:
    run = m.run_start()
    r.feed(m.started(), run)
    fin = m.run_end()  # on_session_end ...
    end = m.ended()  # ... and on_session_finalize, swapped by two mapper replicas
    out = r.feed(end)
    assert types(out) == ["x.hermes.pairing.orphaned", "session.ended"]
    out = r.feed(fin)
    assert types(out) == ["run.finished"] and out[0].cause == run[0].id  # the run's one real terminal
    assert types(r.feed(m.run_end(etype="run.cancelled"))) == ["x.hermes.run.closed"]


def test_answer_overtaken_by_the_finalize_links_and_the_request_is_never_dismissed(m: Mk, r: Run) -> None:
    """Issue 17: the request was dismissed at the end, then its answer (seq before the end,
    delayed by a replica) came: a dismissed prompt where an approval happened."""
    req = m.appr_req()
    r.feed(m.started(), req)
    ans = m.appr_ans()
    out = r.feed(m.ended())
    assert types(out) == ["session.ended"]
    out = r.feed(ans)
    assert types(out) == ["attention.answered", "attention.resolved"]
    assert out[0].subject == req[0].id and out[0].cause == req[0].id
    assert out[1].subject == req[0].id and out[1].data["resolution"] == "answered"
    r.tick(BASE_NS + HOUR)
    assert [e.data["resolution"] for e in r.out if e.type == "attention.resolved"] == ["answered"]
    assert check_invariants(r.out, stream_order=False) == []


def test_held_follow_up_outlives_the_sweep(m: Mk, r: Run) -> None:
    r.feed(m.started())
    req = m.appr_req()
    ans = m.appr_ans()
    end = m.ended()
    assert r.feed(ans) == []
    assert types(r.feed(end)) == ["session.ended"]
    out = r.feed(req)  # the request was the slowest of the three
    assert types(out) == ["attention.requested", "attention.answered", "attention.resolved"]
    assert out[2].seq < end[0].seq
    assert check_invariants(r.out, stream_order=False) == []


@pytest.mark.parametrize("order", ["in_order", "answer_first", "request_first"])
def test_a_follow_up_after_the_session_end_never_takes_a_request_before_it(m: Mk, r: Run, order: str) -> None:
    """An answer that sorts AFTER its session's end (Hermes answered during teardown) and a
    request before it: in stream order the end's sweep dismisses the request. Reordered by
    replicas (the request overtaken by the finalize), the answer must not take the request
    either, or its attention.resolved would sort after the session.ended: it waits (a resumed
    session's own request may be on its way), and when its hold expires it links, late, to the
    request the bridge closed. The three orders tell the same story."""
    r.feed(m.started())
    req, end, ans = m.appr_req(), m.ended(), m.appr_ans()
    hold = r.state.config.hold_ns
    if order == "in_order":
        assert types(r.feed(req, end)) == ["attention.requested", "session.ended"]  # dismissed hold_ns later
        assert r.feed(ans) == []  # held
    else:
        r.feed(end)
        got = r.feed(ans, req) if order == "answer_first" else r.feed(req, ans)
        assert types(got) == ["attention.requested"]  # the answer is held, the request open (late)
    out = r.tick(BASE_NS + 10 * MS + hold)
    closes = [e for e in r.out if e.type == "attention.resolved"]
    assert len(closes) == 1 and closes[0].subject == req[0].id
    assert closes[0].data["resolution"] == "dismissed" and closes[0].seq < end[0].seq
    answered = next(e for e in out if e.type == "attention.answered")
    assert answered.subject == req[0].id and answered.cause == req[0].id
    assert r.state.open_pairs()["card"] == 0 and r.state.metrics()["held_now"] == 0
    assert check_invariants(r.out, stream_order=order == "in_order") == []


def test_a_resumed_session_never_pairs_across_its_finalize(m: Mk, r: Run) -> None:
    """The kill -9 fault test's failure: a session finalized (shutdown), resumed and finalized
    again; the same approval pattern asked in both lives. A mapper replica died holding both
    requests, so they reach pairing after the finalizes. The second life's answer must take
    the second life's request (not the first's, which would end after the first finalize),
    and the second request ends before the second finalize (it is late too)."""
    r.feed(m.started())
    req1 = m.appr_req()
    fin1 = m.ended()
    resume = m.started()
    req2 = m.appr_req()
    ans2 = m.appr_ans()
    fin2 = m.ended()
    r.feed(fin1, req1, resume)
    assert r.feed(ans2) == []  # not req1's: held
    assert types(r.feed(fin2)) == ["x.hermes.session.finalized"]
    out = r.feed(req2)
    assert types(out) == ["attention.requested", "attention.answered", "attention.resolved"]
    assert out[1].cause == req2[0].id and out[2].subject == req2[0].id and out[2].seq < fin2[0].seq
    out = r.tick(BASE_NS + 10 * MS + r.state.config.hold_ns)
    assert types(out) == ["attention.resolved"] and out[0].subject == req1[0].id
    assert out[0].data["resolution"] == "dismissed" and out[0].seq < fin1[0].seq
    assert check_invariants(r.out, stream_order=False) == []
    assert r.state.open_pairs()["card"] == 0


def test_a_snapshot_without_session_ends_still_knows_the_first(m: Mk) -> None:
    """Snapshots of the previous release have `fin` but no `ends`: a late request still counts
    as late after such a restore."""
    import msgspec as _msgspec

    from bridge.core import pairing as P

    r = Run()
    r.feed(m.started(), m.ended())
    old = r.state.snapshot()
    snap = _msgspec.msgpack.decode(old)
    sessions = snap[6]
    for lane, sess in sessions.items():
        del sess[7]  # drop the trailing `ends` field, as the previous release wrote it
    restored = P.PairingState.restore(_msgspec.msgpack.encode(snap))
    req = m.appr_req(raw=1, slot=1)  # before the finalize
    out = restored.process(req[0], req[1], r.pos + 1)
    assert types(out) == ["attention.requested"]
    assert restored._sessions["S"].pairs[0].late


def test_start_arriving_after_its_session_ended_closes_after_the_hold(m: Mk, r: Run) -> None:
    r.feed(m.started())
    tool = m.tool_req()
    end = m.ended()
    r.feed(end)
    assert r.feed(tool) == [tool[0]]
    out = r.tick(BASE_NS + 3 * MS + r.state.config.hold_ns)
    assert types(out) == ["x.hermes.pairing.orphaned"]
    assert out[0].data["reason"] == "session_end" and out[0].seq < end[0].seq
    assert out[0].seq == (tool[0].seq // SLOTS) * SLOTS + 776


def test_resumed_session_start_overtaking_the_finalize_is_not_swept(m: Mk, r: Run) -> None:
    r.feed(m.started())
    end = m.ended()
    card = m.appr_req()  # after the finalize in Hermes, first at the pairing stage
    out = r.feed(card, end)
    assert types(out) == ["attention.requested", "session.ended"]
    assert r.state.open_pairs()["card"] == 1


# ---------------------------------------------------------------- time: TTLs and eviction


@pytest.mark.parametrize(
    "kind, build, ttl",
    [
        ("tool", lambda m: m.tool_req(), PairingConfig().tool_ttl_ns),
        ("run", lambda m: m.run_start(), PairingConfig().run_ttl_ns),
        ("subagent", lambda m: m.sub_start(), PairingConfig().subagent_ttl_ns),
        ("card", lambda m: m.appr_req(), PairingConfig().card_ttl_ns),
    ],
)
def test_starts_open_past_their_ttl_are_closed_honestly(m: Mk, r: Run, kind: str, build: Any, ttl: int) -> None:
    start = build(m)
    r.feed(start)
    ts = BASE_NS + MS
    assert r.tick(ts + ttl - 1) == []
    out = r.tick(ts + ttl)
    assert len(out) == 1
    e = out[0]
    if kind == "card":
        assert e.type == "attention.resolved" and e.data["resolution"] == "dismissed"
        assert e.subject == start[0].id and e.data["latency_ms"] == ttl // MS
    else:
        assert e.type == "x.hermes.pairing.orphaned"
        assert e.data == {"kind": kind, "reason": "ttl", "start": start[0].id, "age_ms": ttl // MS}
    assert e.cause == start[0].id
    assert e.seq == (start[0].seq // SLOTS) * SLOTS + 776  # right after its start
    assert e.id == event_id(start[0].id + "/close", 776, (ts + ttl) // MS)
    assert e.time == rfc3339(ts + ttl)
    assert r.state.open_pairs()[kind] == 0
    key = "dismissed.ttl" if kind == "card" else f"orphaned.ttl.{kind}"
    assert r.state.counters[key] == 1


def test_idle_sessions_are_evicted(m: Mk, r: Run) -> None:
    cfg = r.state.config
    r.feed(m.started("A"), m.run_start("A", run="A:t:1"), m.run_end("A", run="A:t:1"))
    r.feed(m.started("B"), m.ended("B"))
    r.tick(BASE_NS + cfg.recent_ns + SECOND)
    assert r.state.metrics()["sessions"] == 1  # B ended: gone after recent_ns
    r.tick(BASE_NS + cfg.idle_ttl_ns - SECOND)
    assert r.state.metrics()["sessions"] == 1
    r.tick(BASE_NS + cfg.idle_ttl_ns + SECOND)
    assert r.state.metrics()["sessions"] == 0
    assert r.state.counters["evicted"] == 2


def test_an_idle_ttl_below_the_ttls_never_evicts_an_open_start(m: Mk) -> None:
    """Eviction takes only quiet sessions: a session whose card is open outlives idle_ttl_ns
    and the card still ends at its own TTL, honestly (dismissed, ttl)."""
    cfg = PairingConfig(idle_ttl_ns=10 * MINUTE)
    r = Run(cfg)
    req = m.appr_req()
    r.feed(m.started(), req)
    r.tick(BASE_NS + 30 * MINUTE)
    assert r.state.metrics()["sessions"] == 1 and r.state.open_pairs()["card"] == 1
    out = r.tick(BASE_NS + cfg.card_ttl_ns + SECOND)
    assert types(out) == ["attention.resolved"] and out[0].subject == req[0].id
    assert out[0].data["resolution"] == "dismissed" and r.state.counters["dismissed.ttl"] == 1
    r.tick(BASE_NS + cfg.card_ttl_ns + cfg.idle_ttl_ns + cfg.recent_ns + 2 * SECOND)
    assert r.state.metrics()["sessions"] == 0  # quiet now: evicted


def test_ticks_are_the_only_clock(m: Mk, r: Run) -> None:
    r.feed(m.tool_req())
    # an event far in the future moves the clock but acts on nothing until a tick
    later = m.ev("session.started", "other", ts=BASE_NS + 2 * HOUR)
    assert types(r.feed(later)) == ["session.started"]
    assert r.state.open_pairs()["tool"] == 1
    assert types(r.tick(0)) == ["x.hermes.pairing.orphaned"]  # the clock is max(ts, ticks)


def test_per_session_cap_closes_the_oldest_start(m: Mk) -> None:
    r = Run(PairingConfig(max_open=2))
    t1, t2, t3 = m.tool_req(cid="a"), m.tool_req(cid="b"), m.tool_req(cid="c")
    out = r.feed(t1, t2, t3)
    assert types(out) == ["tool.requested", "tool.requested", "x.hermes.pairing.orphaned", "tool.requested"]
    assert out[2].data["reason"] == "overflow" and out[2].cause == t1[0].id
    assert r.state.open_pairs()["tool"] == 2


def test_inserted_events_honour_capture_none(m: Mk, r: Run) -> None:
    req = m.appr_req(capture="none")
    out = r.feed(req, m.appr_ans(capture="none"))
    assert out[2].capture == "none" and out[2].data == {"resolution": "answered"}
    t = m.tool_req(capture="none")
    r.feed(t)
    out = r.feed(m.ended())
    assert out[0].capture == "none" and set(out[0].data) == {"kind", "reason", "start"}
    assert out[0].data["start"] == t[0].id


def test_inserted_events_are_metadata_otherwise(m: Mk, r: Run) -> None:
    out = r.feed(m.appr_req(capture="redacted"), m.appr_ans(capture="redacted"))
    assert out[2].capture == "metadata"


def test_events_of_the_unknown_lane_keep_their_lane_mark(m: Mk, r: Run) -> None:
    r.feed(m.appr_req(s="unknown", sk="default"))
    out = r.tick(BASE_NS + HOUR + SECOND)
    assert out[0].session == "unknown" and out[0].lane == "unknown"


def test_unpaired_events_pass_through_unchanged(m: Mk, r: Run) -> None:
    msgs = [m.ev("x.hermes.api.error", run="S:t:r1"), m.ev("x.hermes.session.reset"), m.ev("agent.started", None)]
    out = r.feed(*msgs)
    assert out == [e for e, _ in msgs]


def test_missing_hints_fall_back_to_the_event(m: Mk, r: Run) -> None:
    req, _ = m.tool_req()
    end, _ = m.tool_end()
    r.pos += 1
    r.state.process(req, None, r.pos)
    r.pos += 1
    out = r.state.process(end, {}, r.pos)
    assert out[0].cause == req.id


def test_held_terminals_are_capped_per_session(m: Mk) -> None:
    r = Run(PairingConfig(max_held=2))
    ends = [m.tool_end(cid=f"c{i}") for i in range(3)]
    assert r.feed(ends[0], ends[1]) == []
    assert r.feed(ends[2]) == [ends[0][0]]  # the oldest goes out unlinked to make room
    assert r.state.metrics()["held_now"] == 2


def test_closed_pairs_are_trimmed_to_twice_max_open(m: Mk) -> None:
    r = Run(PairingConfig(max_open=2))
    for i in range(10):
        r.feed(m.tool_req(cid=f"c{i}"), m.tool_end(cid=f"c{i}"))
    pairs = r.state._sessions["S"].pairs
    assert pairs is not None and len(pairs) <= 4


def test_ended_sessions_are_remembered_fifo_up_to_max_ended(m: Mk) -> None:
    r = Run(PairingConfig(max_ended=2))
    for s in ("A", "B", "C"):
        r.feed(m.ended(s))
    r.tick(BASE_NS + HOUR)
    assert r.state.metrics()["ended_remembered"] == 2
    assert types(r.feed(m.ended("A"))) == ["session.ended"]  # forgotten: the bound is documented
    assert types(r.feed(m.ended("C"))) == ["x.hermes.session.finalized"]


def test_a_terminal_of_another_epoch_may_have_a_lower_seq() -> None:
    old, new = Mk(epoch=100), Mk(epoch=200)
    old.raw = 50
    r = Run()
    req = old.tool_req()
    out = r.feed(req, new.tool_end())  # the raw stream was recreated: seq restarted
    assert out[1].cause == req[0].id


def test_closures_in_the_unknown_lane_keep_the_source_of_their_start() -> None:
    a, b = Mk(instance="host-a"), Mk(instance="host-b")
    b.raw = 10
    r = Run()
    r.feed(a.ev("x.hermes.kanban.task.claimed", "unknown"))
    req = b.appr_req(s="unknown", sk="default")
    r.feed(req)
    out = r.tick(BASE_NS + 2 * HOUR)
    assert out[0].source == req[0].source == "aep://host-b/agent/hermes/session/unknown"


# ---------------------------------------------------------------- checkpoints, metrics, config


def test_snapshot_restore_continues_exactly(m: Mk) -> None:
    msgs = [m.started(), m.run_start(), m.tool_req(), m.appr_req(), m.tool_end(), m.appr_ans(), m.run_end(), m.ended()]
    clean = Run()
    clean.feed(*msgs)
    for cut in range(len(msgs) + 1):
        a = Run()
        a.feed(*msgs[:cut])
        b = Run()
        b.state = PairingState.restore(a.state.snapshot())
        assert b.state.position == cut
        b.pos = cut
        b.feed(*msgs[cut:])
        assert a.out + b.out == clean.out
        assert b.state.counters == clean.state.counters
        assert b.state.open_pairs() == clean.state.open_pairs()


def test_snapshot_rejects_another_version() -> None:
    data = msgspec.msgpack.encode([99, 0, 0, {}, [], [], {}])
    with pytest.raises(ValueError):
        PairingState.restore(data)
    with pytest.raises(msgspec.DecodeError):
        PairingState.restore(b"not a snapshot")


def test_the_service_facing_api() -> None:
    """What bridge/services/pairing.py calls."""
    state = PairingState(partition=3)
    assert state.partition == 3 and state.position == 0
    again = PairingState.restore(state.snapshot(), partition=3)
    assert again.partition == 3 and again.open_pairs() == state.open_pairs()
    assert PairingState.restore(state.snapshot()).position == 0


def test_metrics_expose_open_pairs_and_counters(m: Mk, r: Run) -> None:
    r.feed(m.started(), m.run_start(), m.tool_req(), m.appr_req(), m.sub_start())
    got = r.state.metrics()
    assert {k: got[k] for k in ("open.run", "open.tool", "open.card", "open.subagent")} == {
        "open.run": 1, "open.tool": 1, "open.card": 1, "open.subagent": 1,
    }
    assert got["sessions"] == 1 and got["events_in"] == 5 and got["events_out"] == 5
    assert r.state.next_deadline is not None


def test_config_is_validated() -> None:
    with pytest.raises(ValueError):
        PairingConfig(idle_ttl_ns=MINUTE, recent_ns=2 * MINUTE)
    PairingConfig(idle_ttl_ns=2 * MINUTE, recent_ns=2 * MINUTE, subagent_ttl_ns=6 * HOUR)  # may be below the TTLs
    with pytest.raises(ValueError):
        PairingConfig(max_open=300)
    with pytest.raises(ValueError):
        PairingConfig(tool_ttl_ns=0)


def test_idle_session_footprint_probe_runs() -> None:
    got = idle_session_footprint(300)
    assert got["sessions"] == 300
    assert 0 < got["snapshot_bytes_per_session"] < 1024
    assert got["bytes_per_session"] > 0
