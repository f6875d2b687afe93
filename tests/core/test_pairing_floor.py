"""Rule 3/4 and the mapper's floor: a follow-up (or a card at its session's end) is not released
(dismissed) while the raw messages before it may still be inside the mapper.

Cluster fault run (tests/cluster/test_faults.py::test_sigstop_one_node_for_20_s): a mapper
replica on a SIGSTOPped node held the approval's request for 20 s (its publishes retried for as
long as the outage lasted); the other replica mapped the answer at once. The ticks (wall clock)
passed the answer's hold and it went out ``x.hermes.attention.unmatched``; the request came 13 s
later. The ticks now carry the mapper durable's ack floor; the hold only ends once the floor has
passed every raw message before the follow-up (bounded: ``floor_wait_ns``).
"""

from __future__ import annotations

import msgspec

from bridge.core.aep import encode_event
from bridge.core.invariants import check_invariants
from bridge.core.pairing import MINUTE, SECOND, PairingConfig, PairingState, read_tick, tick_body
from tests.support.pairing import BASE_NS, EPOCH, MS, Mk, Msg, Run, types


def raw_of(msg: Msg) -> int:
    assert isinstance(msg[0].seq, int)
    return msg[0].seq >> 10


def test_an_answer_whose_request_is_inside_the_mapper_waits_past_its_hold_and_pairs() -> None:
    m, r = Mk(epoch=EPOCH), Run()
    cfg = r.state.config
    r.feed(m.started(), m.run_start())
    req, ans = m.appr_req(), m.appr_ans()  # raw 3 (stuck in a stopped mapper replica), raw 4
    assert r.feed(ans) == []  # held
    arrival = BASE_NS + 4 * MS
    below = raw_of(req) - 1  # the floor stops right before the request
    # stream time passes the hold several times over: the floor says the request is not mapped yet
    for k in range(1, 5):
        assert r.tick(arrival + k * cfg.hold_ns, floor=below) == []
    assert r.state.counters["floor.held_waits"] == 1 and "unmatched.card" not in r.state.counters
    out = r.feed(req)  # the mapper replica is back: the request comes after the answer's deadline
    assert types(out) == ["attention.requested", "attention.answered", "attention.resolved"]
    assert out[1].subject == req[0].id and out[2].data["resolution"] == "answered"
    assert r.state.counters["floor.held_paired"] == 1
    assert not [e for e in r.out if e.type == "x.hermes.attention.unmatched"]
    assert check_invariants(r.out, complete=False) == []


def test_a_held_answer_is_released_once_the_floor_passes_it_and_no_request_came() -> None:
    m, r = Mk(epoch=EPOCH), Run()
    cfg = r.state.config
    ans = m.appr_ans()  # raw 1: its request never comes (filed in another lane)
    m.raw = 40
    assert r.feed(ans) == []
    arrival = BASE_NS + MS
    assert r.tick(arrival + cfg.hold_ns, floor=raw_of(ans) - 2) == []  # a raw message before it not mapped
    # the floor reaches the raw message right before the answer: nothing before it is left
    [out] = r.tick(arrival + cfg.hold_ns + 2 * SECOND, floor=raw_of(ans) - 1)
    assert out.type == "x.hermes.attention.unmatched" and out.id == ans[0].id
    assert r.state.counters["unmatched.card"] == 1


def test_the_floor_never_releases_before_the_hold() -> None:
    m, r = Mk(epoch=EPOCH), Run()
    cfg = r.state.config
    ans = m.appr_ans()
    assert r.feed(ans) == []
    assert r.tick(BASE_NS + MS + cfg.hold_ns - 1, floor=10_000) == []
    assert types(r.tick(BASE_NS + MS + cfg.hold_ns, floor=10_000)) == ["x.hermes.attention.unmatched"]


def test_ticks_without_a_floor_behave_as_before() -> None:
    """Old ticks (``{"now": ...}``: a release before, or no mapper durable) release at the deadline."""
    m, r = Mk(epoch=EPOCH), Run()
    cfg = r.state.config
    ans = m.appr_ans()
    assert r.feed(ans) == []
    assert r.tick(BASE_NS + MS + cfg.hold_ns - 1) == []
    assert types(r.tick(BASE_NS + MS + cfg.hold_ns)) == ["x.hermes.attention.unmatched"]


def test_a_tick_without_a_floor_keeps_the_last_one_known() -> None:
    """The mapper durable's info could not be read (an outage): the last floor holds, so a
    follow-up whose start was inside the mapper is not released by that tick."""
    m, r = Mk(epoch=EPOCH), Run()
    cfg = r.state.config
    m.raw = 10
    ans = m.appr_ans()
    r.tick(BASE_NS, floor=5)
    assert r.feed(ans) == []
    assert r.tick(BASE_NS + 11 * MS + 2 * cfg.hold_ns) == []  # no floor in this tick: still 5
    assert r.tick(BASE_NS + 11 * MS + 2 * cfg.hold_ns + SECOND, floor=4) == []  # never goes back
    assert r.state.mapped == (EPOCH, 5)
    assert types(r.tick(BASE_NS + 11 * MS + 3 * cfg.hold_ns, floor=10)) == ["x.hermes.attention.unmatched"]


def test_a_floor_of_another_epoch_does_not_hold() -> None:
    m, r = Mk(epoch=EPOCH), Run()
    cfg = r.state.config
    ans = m.appr_ans()
    assert r.feed(ans) == []
    # HERMES_RAW recreated: the floor is the new stream's; the answer's epoch is gone
    assert types(r.tick(BASE_NS + MS + cfg.hold_ns, floor=0, epoch=EPOCH + 1)) == ["x.hermes.attention.unmatched"]


def test_the_wait_for_the_floor_is_bounded() -> None:
    m, r = Mk(epoch=EPOCH), Run(PairingConfig(floor_wait_ns=5 * MINUTE))
    cfg = r.state.config
    m.raw = 10
    ans = m.appr_ans()
    assert r.feed(ans) == []
    deadline = BASE_NS + 11 * MS + cfg.hold_ns
    assert r.tick(deadline + cfg.floor_wait_ns - 1, floor=3) == []
    [out] = r.tick(deadline + cfg.floor_wait_ns, floor=3)
    assert out.type == "x.hermes.attention.unmatched"
    assert r.state.counters["floor.held_capped"] == 1
    # a tool's terminal alike (released unchanged)
    tool_end = m.tool_end(cid="call_9")
    assert r.feed(tool_end) == []
    t_deadline = deadline + cfg.floor_wait_ns + cfg.hold_ns
    assert r.tick(t_deadline, floor=3) == []
    assert r.tick(t_deadline + cfg.floor_wait_ns, floor=3) == [tool_end[0]]


def test_a_card_at_its_session_end_is_not_dismissed_while_its_answer_may_be_inside_the_mapper() -> None:
    """Rule 4: a request is never dismissed when its answer exists in the stream. The answer
    (raw below the session's end) is stuck in a stopped mapper replica longer than the hold."""
    m, r = Mk(epoch=EPOCH), Run()
    cfg = r.state.config
    r.feed(m.started(), m.run_start())
    card = m.appr_req()  # raw 3
    r.feed(card)
    stuck = m.next_raw()  # raw 4: the answer, in the stopped replica
    end = m.ended()  # raw 5
    r.feed(end)
    end_ts = BASE_NS + 5 * MS
    for k in range(1, 4):
        assert r.tick(end_ts + k * cfg.hold_ns, floor=stuck - 1) == []
    ans = m.appr_ans(raw=stuck)
    out = r.feed(ans)
    assert types(out) == ["attention.answered", "attention.resolved"]
    assert out[0].subject == card[0].id and out[1].data["resolution"] == "answered"
    assert not [e for e in r.out if (e.data or {}).get("resolution") == "dismissed"]
    assert check_invariants(r.out, complete=True, stream_order=False) == []


def test_a_card_at_its_session_end_is_dismissed_once_the_floor_passes_the_end_or_at_the_cap() -> None:
    m, r = Mk(epoch=EPOCH), Run()
    cfg = r.state.config
    r.feed(m.started(), m.run_start())
    card = m.appr_req()  # raw 3
    r.feed(card)
    end = m.ended()  # raw 4
    r.feed(end)
    end_ts = BASE_NS + 4 * MS
    assert r.tick(end_ts + cfg.hold_ns, floor=raw_of(end) - 2) == []
    [dismissed] = r.tick(end_ts + cfg.hold_ns + SECOND, floor=raw_of(end) - 1)
    assert dismissed.type == "attention.resolved" and dismissed.subject == card[0].id
    assert dismissed.data["resolution"] == "dismissed"
    # the cap: a floor that never moves
    m2, r2 = Mk(epoch=EPOCH), Run()
    r2.feed(m2.started(), m2.run_start(), m2.appr_req(), m2.ended())
    assert r2.tick(end_ts + cfg.hold_ns + cfg.floor_wait_ns - 1, floor=1) == []
    assert types(r2.tick(end_ts + cfg.hold_ns + cfg.floor_wait_ns, floor=1)) == ["attention.resolved"]
    assert r2.state.counters["floor.card_capped"] == 1


def test_the_floor_is_in_the_checkpoint_and_a_replay_gives_the_same_output() -> None:
    m, r = Mk(epoch=EPOCH), Run()
    cfg = r.state.config
    r.feed(m.started(), m.run_start())
    req, ans = m.appr_req(), m.appr_ans()
    r.feed(ans)
    r.tick(BASE_NS + 4 * MS + cfg.hold_ns, floor=raw_of(req) - 1)
    snap = r.state.snapshot()
    restored = PairingState.restore(snap, cfg)
    assert restored.mapped == (EPOCH, raw_of(req) - 1)
    # a tick with no floor after the restore keeps the restored one: the same as the original's
    later = BASE_NS + 4 * MS + 2 * cfg.hold_ns
    assert restored.tick(later, r.pos + 1) == r.state.tick(later, r.pos + 1) == []
    a = restored.process(*req, r.pos + 2)
    b = r.state.process(*req, r.pos + 2)
    assert [encode_event(e) for e in a] == [encode_event(e) for e in b]
    assert types(a) == ["attention.requested", "attention.answered", "attention.resolved"]
    assert restored.snapshot() == r.state.snapshot()


def test_a_checkpoint_of_the_release_before_reads_without_a_floor() -> None:
    m, r = Mk(epoch=EPOCH), Run()
    r.feed(m.started(), m.appr_ans())
    r.tick(BASE_NS, floor=7)
    fields = msgspec.msgpack.decode(r.state.snapshot())
    assert fields[-1] == [EPOCH, 7]
    # the snapshot without the trailing field; held follow-ups of a release before had no `waited`
    for s in fields[6].values():
        for x in s[6] or ():
            assert x[-1] is False
            x.pop()
    old = msgspec.msgpack.encode(fields[:-1])
    restored = PairingState.restore(old, r.state.config)
    assert restored.mapped is None and restored.metrics()["held_now"] == 1


def test_the_tick_body() -> None:
    assert tick_body(5) == b'{"now":5}'
    assert read_tick(b'{"now":5}') == (5, None)
    assert read_tick(tick_body(5, (EPOCH, 9))) == (5, (EPOCH, 9))
    for bad in (b'{"now":5,"mapped":[1]}', b'{"now":5,"mapped":[1,-1]}', b'{"now":5,"mapped":[true,2]}',
                b'{"now":5,"mapped":"x"}', b'{"now":5,"mapped":[1,18446744073709551616]}'):
        assert read_tick(bad) == (5, None)


def test_a_late_card_is_not_closed_while_its_answer_may_be_inside_the_mapper() -> None:
    """A request overtaken by its session's end (opened late: its TTL is hold_ns, closed
    ``session_end``) whose answer is in a stopped mapper replica: it waits for the floor too."""
    m, r = Mk(epoch=EPOCH), Run()
    cfg = r.state.config
    r.feed(m.started(), m.run_start())  # raw 1, 2
    card_raw, answer_raw = m.next_raw(), m.next_raw()  # raw 3 (late), raw 4 (in the stopped replica)
    r.feed(m.ended())  # raw 5
    card = m.appr_req(raw=card_raw, ts=BASE_NS + 6 * MS)
    assert types(r.feed(card)) == ["attention.requested"]
    assert r.state.open_pairs()["card"] == 1
    for k in range(1, 4):
        assert r.tick(BASE_NS + 6 * MS + k * cfg.hold_ns, floor=answer_raw - 1) == []
    out = r.feed(m.appr_ans(raw=answer_raw))
    assert types(out) == ["attention.answered", "attention.resolved"]
    assert out[0].subject == card[0].id and out[1].data["resolution"] == "answered"
    # without the answer: closed once the floor passes the end
    m2, r2 = Mk(epoch=EPOCH), Run()
    r2.feed(m2.started(), m2.run_start())
    late_raw = m2.next_raw()
    end = m2.ended()
    r2.feed(end)
    r2.feed(m2.appr_req(raw=late_raw, ts=BASE_NS + 6 * MS))
    assert r2.tick(BASE_NS + 6 * MS + cfg.hold_ns, floor=raw_of(end) - 2) == []
    [closed] = r2.tick(BASE_NS + 6 * MS + cfg.hold_ns, floor=raw_of(end) - 1)
    assert closed.type == "attention.resolved" and closed.data["resolution"] == "dismissed"
