"""`aep-bridge tail`'s one line per event shows what a model call and a run's totals spend
(issue 40): the model, the tokens, the number of calls and the cost."""

from __future__ import annotations

import io

from bridge.stack.tail import Formatter


def line(etype: str, data: dict) -> str:
    event = {"type": etype, "time": "2026-12-07T02:55:57.348Z", "session": "s1", "run": "s1:t:df5e7b68", "data": data}
    return Formatter(color=False, out=io.StringIO()).line(event)


def test_a_model_call_shows_its_model_tokens_and_cost() -> None:
    text = line("x.hermes.api.call", {"gen_ai.request.model": "fake-model", "duration_ms": 343,
                                      "gen_ai.usage.input_tokens": 100, "gen_ai.usage.output_tokens": 10,
                                      "cost": {"currency": "USD", "total": 0.00035}})
    assert "ms=343  model=fake-model  in=100  out=10  cost=0.00035USD" in text


def test_a_run_end_shows_its_totals() -> None:
    text = line("run.finished", {"gen_ai.usage.input_tokens": 200, "gen_ai.usage.output_tokens": 20, "model_calls": 2,
                                 "cost": {"currency": "USD", "total": 0.0007}})
    assert "in=200  out=20  calls=2  cost=0.0007USD" in text


def test_a_hostile_model_name_or_cost_is_cut_or_left_out() -> None:
    text = line("x.hermes.api.call", {"gen_ai.request.model": "m" * 5000, "cost": {"currency": "USD", "total": "lots"}})
    assert f"model={'m' * 40}  " in text + "  " and "m" * 41 not in text and "cost=" not in text
