"""Run totals (pairing, issue 40) under hostile model calls: no input makes a checkpoint
unencodable, a sum is never a wrong number, and each call is counted once by its raw
position in its epoch (review of issue 40's merged code)."""

from __future__ import annotations

from typing import Any

import msgspec

from bridge.core.aep import Event
from bridge.core.identity import event_id
from bridge.core.invariants import is_run_end
from bridge.core.pairing import PairingState
from tests.support.pairing import Mk

R = "S:t:1"
INPUT = "gen_ai.usage.input_tokens"
OUTPUT = "gen_ai.usage.output_tokens"


def _feed(state: PairingState, msgs: list[Any], start: int = 1) -> list[Event]:
    out: list[Event] = []
    for pos, (ev, h) in enumerate(msgs, start=start):
        out += state.process(ev, h, pos)
    return out


def _forgotten(msg: Any, n: int = 1) -> Any:
    """The message again, past the id ring (``dedupe_ids``, the nearer repeats): another id, the
    same raw position, so only the run's own dedupe knows it."""
    ev, h = msg
    return msgspec.structs.replace(ev, id=event_id(f"forgotten-{n}", 512, 1764500000000)), h


def _end(out: list[Event]) -> Event:
    (end,) = [e for e in out if is_run_end(e)]
    return end


def test_a_call_with_a_huge_count_and_cost_leaves_them_out_and_the_checkpoint_encodes() -> None:
    """What the mapper used to make of input_tokens=2**53 at $2.5/M: a cost of ~2.25e10 USD,
    ~2.25e19 nano-units, past msgpack's 2**64: every checkpoint of the partition failed while
    the run was open. Now the bad count and cost are left out of the run's totals (counted)."""
    m = Mk()
    big = 2**53 * 2.5 / 1e6
    cost = {"currency": "USD", "total": big, "prompt": big, "completion": 0.0, "cache": 0.0, "reasoning": 0.0}
    state = PairingState()
    _feed(state, [m.started("S"), m.run_start("S", run=R), m.api_call("S", run=R, tokens=(2**53, 1, 0, 0, 0), cost=cost),
                  m.api_call("S", run=R, tokens=(2**63, 2, 0, 0, 0))])
    restored = PairingState.restore(state.snapshot())
    end = _end(_feed(restored, [m.run_end("S", run=R)], start=5))
    assert end.data[OUTPUT] == 3 and end.data["model_calls"] == 2
    assert INPUT not in end.data and "cost" not in end.data
    assert restored.counters["usage.invalid"] == 2  # calls with a member left out


def test_run_sums_that_would_pass_the_bound_are_left_out_counted_never_wrapped() -> None:
    from bridge.core.pairing import RUN_SUM_MAX
    from bridge.core.pricing import COST_NANOS_MAX, TOKEN_MAX

    m = Mk()
    most = COST_NANOS_MAX / 1e9
    cost = {"currency": "USD", "total": most, "prompt": most, "completion": 0.0, "cache": 0.0, "reasoning": 0.0}
    n = RUN_SUM_MAX // TOKEN_MAX + 1
    state = PairingState()
    msgs = [m.started("S"), m.run_start("S", run=R)]
    msgs += [m.api_call("S", run=R, tokens=(TOKEN_MAX, 1, 0, 0, 0), cost=cost) for _ in range(n)]
    _feed(state, msgs)
    state.snapshot()  # encodes
    end = _end(_feed(state, [m.run_end("S", run=R)], start=len(msgs) + 1))
    assert INPUT not in end.data and "cost" not in end.data  # past the bound: left out
    assert end.data[OUTPUT] == n and end.data["model_calls"] == n
    assert state.counters["usage.overflow"] == 2  # the input sum and the cost sum, once each


def test_calls_of_two_epochs_at_the_same_raw_position_are_both_counted() -> None:
    """HERMES_RAW recreated mid-run (a new epoch): its raw positions start again, so a call of
    the new epoch may have the seq of one already counted. A call is known by (epoch, seq)."""
    a, b = Mk(epoch=1), Mk(epoch=2)
    msgs = [a.started("S"), a.run_start("S", run=R), a.api_call("S", run=R, tokens=(100, 10, 0, 0, 0))]
    b.raw = a.raw - 1  # b's next raw position is a's call's
    again = _forgotten(b.api_call("S", run=R, tokens=(7, 7, 0, 0, 0)))
    assert (again[0].seq, again[0].epoch) == (msgs[-1][0].seq, 2)
    msgs += [again, _forgotten(again, 2), b.run_end("S", run=R)]
    state = PairingState()
    end = _end(_feed(state, msgs))
    assert end.data[INPUT] == 107 and end.data["model_calls"] == 2
    assert state.counters["usage.duplicates"] == 1


# A checkpoint of the code before calls were known by (epoch, seq) (pairing at a3b92d5): session
# S, run S:t:1 open with one call counted (100 input tokens, raw 3), run S:t:2 closed with one
# call (5 input tokens, raw 5) on its pair.
OLD_CHECKPOINT = bytes.fromhex(
    "970206cf187cc366ba88cd8083a96576656e74735f696e06aa6576656e74735f6f757406aa75736167652e72756e730196ba"
    "30314b424136414b383146424131333234564e33393831314a5aba30314b424136414b3832384d4d5145373633334d475a38"
    "543156ba30314b424136414b3833574a323632575a515a50413530393332ba30314b424136414b38344b5159415133425139"
    "4d413443434235ba30314b424136414b38355a4e4448414e38323252594b5a535034ba30314b424136414b38364a4a514e44"
    "435954474e4339363653399081a15399d9206165703a2f2f6465762f6167656e742f6865726d65732f73657373696f6e2f53"
    "cf187cc366ba88cd80a000c408c894ee70f6e7f7b992dc001100a5533a743a31ba30314b424136414b3832384d4d51453736"
    "33334d475a38543156cd0a00cf187cc366ba4bc48000a5533a743a31a0a000a000c2c200a0c0dc001100a5533a743a32ba30"
    "314b424136414b38344b51594151334251394d413443434235cd1200cf187cc366ba6a490000a5533a743a32a0a001ba3031"
    "4b424136414b38364a4a514e44435954474e433936365339cf187cc366ba88cd80c2c200a09501950505000000a12d950000"
    "00000091cd1600c0c081a5533a743a31950195640a000000a12d95000000000091cd0e00"
)


def test_a_checkpoint_written_before_calls_were_known_by_epoch_restores() -> None:
    m = Mk()
    feed = [m.started("S"), m.run_start("S", run="S:t:1"), m.api_call("S", run="S:t:1", tokens=(100, 10, 0, 0, 0)),
            m.run_start("S", run="S:t:2"), m.api_call("S", run="S:t:2", tokens=(5, 5, 0, 0, 0)),
            m.run_end("S", run="S:t:2")]  # the same messages the checkpoint was taken after
    state = PairingState.restore(OLD_CHECKPOINT)
    assert state.position == 6
    out = _feed(state, [_forgotten(feed[2]), _forgotten(feed[4], 2), m.api_call("S", run="S:t:1", tokens=(1, 1, 0, 0, 0)),
                        m.run_end("S", run="S:t:1")], start=7)
    assert state.counters["usage.duplicates"] == 2  # both counted calls, redelivered: not again
    end = next(e for e in out if e.type == "run.finished" and e.run == "S:t:1")
    assert end.data[INPUT] == 101 and end.data["model_calls"] == 2
    assert not [e for e in out if e.type == "x.hermes.run.usage"]
    assert PairingState.restore(state.snapshot()).snapshot() == state.snapshot()


class _CountingSeq(int):
    """A raw position that counts how often it is compared for equality."""

    compared = 0

    def __eq__(self, other: object) -> bool:
        _CountingSeq.compared += 1
        return int(self) == other

    def __lt__(self, other: Any) -> bool:
        _CountingSeq.compared += 1
        return int(self) < other

    def __gt__(self, other: Any) -> bool:
        _CountingSeq.compared += 1
        return int(self) > other

    __hash__ = int.__hash__


def test_a_long_runs_dedupe_does_not_scan_every_call_counted() -> None:
    """A run of 20,000 calls took 2.4 s when each call scanned the list of those counted
    (quadratic); the dedupe looks a call up in a few steps (comparisons counted, not time),
    also for a call redelivered out of order, and its checkpoint restores to the same bytes."""
    m = Mk()
    n = 5000
    calls = [m.api_call("S", run=R, tokens=(1, 1, 0, 0, 0)) for _ in range(n)]
    state = PairingState()
    _feed(state, [m.started("S"), m.run_start("S", run=R)] + calls[1:])
    (usage,) = [s.usage[R] for s in state._sessions.values() if s.usage]
    plain = usage.keys
    usage.keys = [(epoch, _CountingSeq(seq)) for epoch, seq in plain]  # the calls counted, counting
    _CountingSeq.compared = 0
    _feed(state, [calls[0]], start=n + 2)  # the first call, last: out of order
    assert 0 < _CountingSeq.compared <= 64  # ~log2(5000) = 13 steps, not 5000
    usage.keys = [(epoch, int(seq)) for epoch, seq in usage.keys]
    _feed(state, [_forgotten(calls[0]), _forgotten(calls[n // 2], 2)], start=n + 3)
    assert state.counters["usage.duplicates"] == 2
    assert PairingState.restore(state.snapshot()).snapshot() == state.snapshot()
    end = _end(_feed(state, [m.run_end("S", run=R)], start=n + 5))
    assert end.data["model_calls"] == n and end.data[INPUT] == n


def test_a_run_end_after_its_ended_session_was_forgotten_restates_no_totals() -> None:
    """Found by the property test in CI (2026-12-07): a session ends with a run still open (the
    sweep closes it, `x.hermes.pairing.orphaned` stating its one call), the session is forgotten
    ``recent_ns`` later, then the run's real terminal arrives. Pairing no longer knows the run's
    calls, so that terminal must not state totals (it went out as a `run.finished` saying 0 calls,
    after the closure had said 1: a consumer keeping a run's last statement lost the call). It
    goes out as `x.hermes.run.closed`, as a terminal of a run already ended does."""
    from bridge.core.invariants import check_invariants, check_usage
    from bridge.core.pairing import HOUR, MINUTE
    from tests.support.pairing import BASE_NS

    m, state = Mk(), PairingState()
    call = m.api_call(run=R, tokens=(7, 3, 0, 0, 0))
    start = m.run_start(run=R)
    late_end = m.run_end(run=R)  # sent before the session's end, delayed past it (a replica killed)
    out = _feed(state, [m.started(), start, call, m.ended()])
    closure = _end(out)
    assert closure.type == "x.hermes.pairing.orphaned" and closure.data["model_calls"] == 1
    pos = 10
    out += state.tick(BASE_NS + 3 * MINUTE, pos)  # the ended session is forgotten (recent_ns)
    assert state.metrics()["sessions"] == 0
    out += state.process(*late_end, pos + 1)
    out += state.tick(BASE_NS + 7 * HOUR, pos + 2)  # its hold expires: released
    assert [e.type for e in out if e.id == late_end[0].id] == ["x.hermes.run.closed"]
    assert check_usage(out).problems == []
    assert check_invariants(out, complete=True, linked=False, stream_order=False) == []
