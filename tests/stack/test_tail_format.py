"""`aep-bridge tail`'s one line per event shows what a model call and a run's totals spend
(issue 40): the model, the tokens, the number of calls and the cost."""

from __future__ import annotations

import io

import pytest

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


HOSTILE = "a\x1b]0;pwned\x07\x1b[2J\r\n\u202eb\x00"


def test_no_control_character_from_the_wire_reaches_the_terminal() -> None:
    """Every field of the line comes from the wire: escape sequences, line breaks, bidi
    overrides and NULs in it are shown as visible escapes, never sent to the terminal."""
    event = {"type": "x.hermes.api.call" + HOSTILE, "time": "2026-12-07T02:55:57.348Z" + HOSTILE,
             "session": "s1" + HOSTILE, "run": "s1:t:" + HOSTILE, "subject": HOSTILE, "cause": "c" * 8 + HOSTILE,
             "data": {"gen_ai.request.model": HOSTILE, "cost": {"currency": "US\x1b", "total": 1.0}}}
    for color in (False, True):
        f = Formatter(color=color, out=io.StringIO())
        f.emit(event)
        text = f.out.getvalue()
        if color:
            text = text.replace("\x1b[", "CSI[")  # the formatter's own colours only: ESC [ digits m
            assert "\x1b" not in text
        assert "\x07" not in text and "\r" not in text and "\x00" not in text and "\u202e" not in text
        assert text.count("\n") == 2  # the lane header and the line
        assert "\\x1b]0;pwned\\x07" in text


def test_a_since_too_far_back_is_a_one_line_error_not_a_traceback() -> None:
    from bridge.stack.tail import parse_since

    # (the last one is before year 1 in UTC: it failed later, when the consumer was created)
    for value in ("1000000d", "99999999999999999999s", "0001-01-01T00:00:00+01:00"):
        with pytest.raises(ValueError, match="--since .*too far back"):
            parse_since(value)
    assert parse_since("2026-12-07T03:00:00+01:00").isoformat() == "2026-12-07T02:00:00+00:00"
