"""Run totals (pairing, issue 40) under hostile model calls: no input makes a checkpoint
unencodable, a sum is never a wrong number, and each call is counted once by its raw
position in its epoch (review of issue 40's merged code)."""

from __future__ import annotations

from typing import Any

from bridge.core.aep import Event
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
