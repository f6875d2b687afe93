"""`bridge.core.usage`: the sums of `aep-bridge usage`, pure (the command's numbers against a real
server are in tests/stack/test_usage.py)."""

from __future__ import annotations

import pytest

from bridge.core.usage import Usage, format_table, instance_of, percentile
from tests.support.api_calls import api_call, event


def test_percentile_is_the_nearest_rank() -> None:
    assert percentile([], 50) is None
    assert percentile([7], 99) == 7
    values = list(range(1, 101))
    assert (percentile(values, 50), percentile(values, 99), percentile(values, 100)) == (50, 99, 100)
    assert percentile([10, 20, 30, 40], 50) == 20 and percentile([10, 20, 30, 40], 99) == 40


def test_bad_members_are_left_out_and_counted() -> None:
    u = Usage("model")
    assert u.add(event("x.hermes.api.call", data=api_call(duration_ms=-1, input=2.5, output=True, cache_read="9",
                                                          reasoning=2**60, cache_write=3,
                                                          cost={"currency": "USD", "total": float("nan")})))
    assert u.add(event("x.hermes.api.call", data=api_call(duration_ms=10, input=5)))
    assert not u.add(event("tool.completed", data={"tool": {"name": "t"}}))
    assert not u.add("not an event")
    (row,) = u.rows()
    assert (row["calls"], row["input_tokens"], row["output_tokens"], row["cache_read_tokens"],
            row["cache_write_tokens"], row["reasoning_tokens"], row["p50_ms"]) == (2, 5, 0, 0, 3, 0, 10)
    assert row["cost"] == {} and row["unpriced_calls"] == 2 and u.skipped_members == 1


def test_groups_and_the_table() -> None:
    assert instance_of("aep://gw%20one/agent/hermes/session/s") == "gw one"
    assert instance_of("urn:x") == "unknown"
    u = Usage("day")
    u.add(event("x.hermes.api.call", time="2026-12-06T23:00:00Z", data=api_call(duration_ms=5, input=1,
                                                                                cost={"currency": "USD", "total": 0.5})))
    u.add(event("x.hermes.api.call", time="2026-12-05T01:00:00Z", data=api_call(input=2)))
    lines = format_table(u).splitlines()
    assert [line.split()[0] for line in lines] == ["day", "2026-12-05", "2026-12-06", "total"]
    assert lines[2].endswith("5       5  0.5 USD")
    assert lines[3].endswith("0.5 USD (+1 unpriced)")
    with pytest.raises(ValueError, match="--by 'team'"):
        Usage("team")


def test_the_folds_state_does_not_grow_with_the_number_of_calls() -> None:
    """A long read keeps a count per distinct duration (ms) and an integer nano-unit sum per
    currency, not every call's duration and cost: its state is the same for 300 calls as for
    30,000 with the same distinct values, and the percentiles and sums stay exact."""
    def fold(n: int) -> Usage:
        u = Usage("model")
        for i in range(n):
            u.add(event("x.hermes.api.call", data=api_call(duration_ms=100 + i % 7, input=1,
                                                           cost={"currency": "USD", "total": 0.000000001})))
        return u

    small, large = fold(300), fold(30_000)
    for u, n in ((small, 300), (large, 30_000)):
        (g,) = u.groups.values()
        assert len(g.durations) == 7 and sum(g.durations.values()) == n
        assert g.cost == {"USD": n}  # nano-units, an int
        (row,) = u.rows()
        assert row["cost"] == {"USD": n / 1e9} and (row["p50_ms"], row["p99_ms"]) == (103, 106)
        assert u.total()["p50_ms"] == 103


def test_percentiles_of_counted_durations_are_the_nearest_rank_of_the_whole_list() -> None:
    import random
    from collections import Counter

    from bridge.core.usage import percentile_counted

    rng = random.Random(40)
    for _ in range(200):
        values = [rng.randrange(0, 20) for _ in range(rng.randrange(1, 60))]
        for p in (50, 99, 100):
            assert percentile_counted(Counter(values), p) == percentile(sorted(values), p)
    assert percentile_counted(Counter(), 50) is None


def test_the_table_shows_no_control_character_from_the_wire() -> None:
    """A model name (or instance, session, day, currency) is the wire's: an escape sequence in
    it would reach the terminal; it is shown escaped."""
    hostile = "evil\x1b]0;pwned\x07\x1b[2J\r\n\u202e\x00"
    u = Usage("model")
    u.add(event("x.hermes.api.call", data=api_call(hostile, duration_ms=5, input=1,
                                                   cost={"currency": "US\x1bD", "total": 0.5})))
    u.add(event("x.hermes.api.call", data=api_call("plain", duration_ms=5, input=1)))
    text = format_table(u)
    assert all(c == "\n" or c.isprintable() for c in text), repr(text)
    assert len(text.splitlines()) == 4  # header, two groups, total
    assert "evil\\x1b]0;pwned\\x07" in text
