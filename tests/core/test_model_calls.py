"""Issue 40: model calls on the AEP stream (`x.hermes.api.call`), their cost from the operator's
price table, and bad numbers left out (counted), never a wrong number."""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path

import pytest

from bridge.config import SettingError, load_price_table, role_settings
from bridge.core.aep import payload_to_data
from bridge.core.ceiling import CapturePolicy
from bridge.core.envelope import envelope_from_obj
from bridge.core.identity import Origin
from bridge.core.lanes import MemoryLanes
from bridge.core.mapping import API_CALL_TYPE, map_envelope, map_specs
from bridge.core.pricing import PriceTableError, cost_of, parse_price_table, to_nanos
from tests.corpus import envelopes

TABLE = {"currency": "USD", "models": {"fake-model": {"input": 2.5, "output": 10, "cache_read": 1.25,
                                                       "cache_write": 3.75, "reasoning": 10}}}


def _post_api_request() -> dict:
    """A post_api_request as real Hermes 0.19 sends it (tests/corpus shape, content elided)."""
    return {
        "hook_event_name": "post_api_request", "tool_name": None, "tool_input": None,
        "session_id": "S1", "cwd": "/home/dev/p",
        "extra": {
            "task_id": "t1", "turn_id": "S1:t1:aa", "api_request_id": "S1:t1:aa:api:2", "platform": "cli",
            "model": "fake-model", "provider": "custom", "base_url": "http://127.0.0.1:1/v1",
            "api_mode": "chat_completions", "api_call_count": 2, "api_duration": 0.34325480461120605,
            "started_at": 1.0, "ended_at": 1.3, "finish_reason": "stop", "message_count": 4,
            "response_model": "fake-model-2026", "response": {"content": "SECRET RESPONSE"},
            "usage": {"input_tokens": 1234, "output_tokens": 567, "cache_read_tokens": 89, "cache_write_tokens": 10,
                      "reasoning_tokens": 200, "request_count": 1, "prompt_tokens": 1333, "total_tokens": 1900},
            "assistant_message": "SECRET ASSISTANT", "telemetry_schema_version": "hermes.observer.v1",
        },
    }


def _map(obj: dict, table: dict | None = TABLE, policy: CapturePolicy | None = None):  # type: ignore[no-untyped-def]
    origin = Origin(raw_id="r1", raw_seq=7, ts_ns=1_700_000_000_000_000_000, instance="vm", epoch=0)
    prices = parse_price_table(table) if table else None
    return map_envelope(envelope_from_obj(obj), origin, MemoryLanes(), policy or CapturePolicy(), prices)


def test_post_api_request_is_one_api_call_with_model_duration_and_exact_counts() -> None:
    r = _map(_post_api_request())
    (ev,) = r.events
    assert ev.type == API_CALL_TYPE == "x.hermes.api.call"
    assert ev.run == "S1:t1:aa" and ev.session == "S1" and ev.capture == "metadata"
    d = ev.data
    assert {k: v for k, v in d.items() if k != "cost"} == {
        "gen_ai.request.model": "fake-model", "gen_ai.response.model": "fake-model-2026",
        "gen_ai.provider.name": "custom", "api_mode": "chat_completions", "duration_ms": 343,
        "finish_reason": "stop", "call_index": 2,
        "gen_ai.usage.input_tokens": 1234, "gen_ai.usage.output_tokens": 567,
        "gen_ai.usage.cache_read.input_tokens": 89, "gen_ai.usage.cache_creation.input_tokens": 10,
        "gen_ai.usage.reasoning.output_tokens": 200,
    }
    body = json.dumps(d)
    assert "SECRET" not in body and "127.0.0.1" not in body
    assert r.invalid == [] and r.unpriced == []


def test_cost_is_the_tables_arithmetic_exactly_and_never_charges_a_token_twice() -> None:
    d = _map(_post_api_request()).events[0].data
    cost = d["cost"]
    # input excludes cache tokens (Hermes's normalize_usage); output includes reasoning
    M = Decimal(1_000_000)
    prompt = Decimal(1234) * Decimal("2.5") / M
    completion = Decimal(567 - 200) * Decimal(10) / M
    cache = (Decimal(89) * Decimal("1.25") + Decimal(10) * Decimal("3.75")) / M
    reasoning = Decimal(200) * Decimal(10) / M
    q = Decimal("1e-9")
    want = {"prompt": prompt.quantize(q), "completion": completion.quantize(q), "cache": cache.quantize(q),
            "reasoning": reasoning.quantize(q)}
    want["total"] = sum(want.values())
    assert cost["currency"] == "USD"
    for member, value in want.items():
        assert Decimal(repr(cost[member])) == value, member
        assert to_nanos(cost[member]) == int(value * 10**9)
    assert to_nanos(cost["total"]) == sum(to_nanos(cost[m]) for m in ("prompt", "completion", "cache", "reasoning"))


def test_rounding_is_half_even_to_a_nano_unit() -> None:
    prices = parse_price_table({"currency": "EUR", "models": {"m": {"input": 0.0000005, "output": 0.0000015}}}).prices("m")
    assert prices is not None
    c = cost_of(prices, {"input": 1000, "output": 1000})  # 0.5e-9 -> 0 (even), 1.5e-9 -> 2e-9
    assert c["prompt"] == Decimal("0E-9") and c["completion"] == Decimal("2E-9") and c["total"] == Decimal("2E-9")


def test_no_table_no_cost_and_an_unpriced_model_is_reported() -> None:
    assert "cost" not in _map(_post_api_request(), table=None).events[0].data
    other = {"currency": "USD", "models": {"another": {"input": 1, "output": 1}}}
    r = _map(_post_api_request(), table=other)
    assert "cost" not in r.events[0].data and r.unpriced == ["fake-model"]
    assert r.events[0].data["gen_ai.usage.input_tokens"] == 1234  # the call still flows


def test_the_response_model_prices_a_call_whose_request_model_is_not_in_the_table() -> None:
    table = {"currency": "USD", "models": {"fake-model-2026": {"input": 1, "output": 1}}}
    r = _map(_post_api_request(), table=table)
    assert r.events[0].data["cost"]["prompt"] == 0.001234 and r.unpriced == []


BAD = [-1, 1.5, "12", True, float("nan"), float("inf"), 2**53 + 1, 10**30, None, [3], {"n": 1}]


@pytest.mark.parametrize("bad", BAD, ids=repr)
@pytest.mark.parametrize("field", ["input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens",
                                   "reasoning_tokens"])
def test_a_bad_token_count_is_left_out_counted_and_the_event_flows(field: str, bad: object) -> None:
    obj = _post_api_request()
    obj["extra"]["usage"][field] = bad
    r = _map(obj)
    (ev,) = r.events
    members = {"input_tokens": "gen_ai.usage.input_tokens", "output_tokens": "gen_ai.usage.output_tokens",
               "cache_read_tokens": "gen_ai.usage.cache_read.input_tokens",
               "cache_write_tokens": "gen_ai.usage.cache_creation.input_tokens",
               "reasoning_tokens": "gen_ai.usage.reasoning.output_tokens"}
    assert members[field] not in ev.data
    assert all(ev.data[m] == obj["extra"]["usage"][f] for f, m in members.items() if f != field)
    assert r.invalid == [field]
    assert "cost" not in ev.data  # never the cost of a partial count


def test_a_missing_count_a_missing_usage_and_integral_floats() -> None:
    obj = _post_api_request()
    del obj["extra"]["usage"]["output_tokens"]
    obj["extra"]["usage"]["input_tokens"] = 1234.0
    r = _map(obj)
    assert r.invalid == ["output_tokens"] and r.events[0].data["gen_ai.usage.input_tokens"] == 1234
    assert "cost" not in r.events[0].data
    # a provider with no cache / reasoning buckets: not reported, not counted, priced as 0
    obj = _post_api_request()
    for name in ("cache_read_tokens", "cache_write_tokens", "reasoning_tokens"):
        del obj["extra"]["usage"][name]
    r = _map(obj)
    assert r.invalid == [] and r.events[0].data["cost"]["cache"] == 0.0
    assert r.events[0].data["cost"]["completion"] == 567 * 10 / 1_000_000
    obj = _post_api_request()
    obj["extra"]["usage"] = None
    r = _map(obj)
    assert r.invalid == ["usage"] and not any(k.startswith("gen_ai.usage") for k in r.events[0].data)
    assert r.events[0].data["gen_ai.request.model"] == "fake-model"


@pytest.mark.parametrize("bad", [-0.5, "0.3", True, float("nan"), None, 1e300], ids=repr)
def test_a_bad_duration_or_call_number_is_left_out_and_counted(bad: object) -> None:
    obj = _post_api_request()
    obj["extra"]["api_duration"] = bad
    obj["extra"]["api_call_count"] = bad
    r = _map(obj)
    d = r.events[0].data
    assert "duration_ms" not in d and "call_index" not in d
    assert sorted(r.invalid) == ["api_call_count", "api_duration"]
    assert d["gen_ai.usage.output_tokens"] == 567


def test_capture_none_carries_no_usage() -> None:
    r = _map(_post_api_request(), policy=CapturePolicy(default="none", overrides={}))
    assert r.events[0].type == API_CALL_TYPE and r.events[0].data == {}


def test_api_request_error_gains_model_provider_duration_from_real_hermes() -> None:
    env = next(e for e in envelopes() if e["hook_event_name"] == "api_request_error")
    (spec,) = map_specs(envelope_from_obj(env), CapturePolicy())
    d = payload_to_data(spec[1])
    assert spec[0] == "x.hermes.api.error"
    assert d["gen_ai.request.model"] == "fake-model" and d["gen_ai.provider.name"] == "custom"
    assert d["duration_ms"] == round(env["extra"]["api_duration"] * 1000)
    assert d["status_code"] == 500


def test_every_real_post_api_request_maps_to_one_api_call() -> None:
    n = 0
    for env in envelopes():
        if env["hook_event_name"] != "post_api_request":
            continue
        (spec,) = map_specs(envelope_from_obj(env), CapturePolicy(), parse_price_table(TABLE))
        d = payload_to_data(spec[1])
        assert spec[0] == API_CALL_TYPE
        assert d["gen_ai.usage.input_tokens"] == env["extra"]["usage"]["input_tokens"]
        assert d["gen_ai.request.model"] == env["extra"]["model"]
        assert d["cost"]["currency"] == "USD"
        n += 1
    assert n >= 5


# ---------------------------------------------------------------- the price table


@pytest.mark.parametrize(
    "doc, says",
    [
        ([], "expected an object"),
        ({"currency": "usd", "models": {"m": {"input": 1, "output": 1}}}, "currency"),
        ({"currency": "USD"}, "models must be"),
        ({"currency": "USD", "models": {}}, "models must be"),
        ({"currency": "USD", "models": {"m": {"input": -1, "output": 1}}}, "models.m.input"),
        ({"currency": "USD", "models": {"m": {"input": "x", "output": 1}}}, "models.m.input"),
        ({"currency": "USD", "models": {"m": {"input": True, "output": 1}}}, "models.m.input"),
        ({"currency": "USD", "models": {"m": {"input": float("nan"), "output": 1}}}, "models.m.input"),
        ({"currency": "USD", "models": {"m": {"input": 1e9, "output": 1}}}, "models.m.input"),
        # a huge negative exponent passed the range check and stalled the first priced call (60 s)
        ({"currency": "USD", "models": {"m": {"input": "1E-30000000", "output": 1}}}, "models.m.input.*decimal places"),
        ({"currency": "USD", "models": {"m": {"input": 1, "output": "0.0000000000001"}}}, "models.m.output.*decimal places"),
        ({"currency": "USD", "models": {"m": {"input": 1}}}, "needs at least input and output"),
        ({"currency": "USD", "models": {"m": {"input": 1, "output": 1, "cache": 2}}}, "unknown price 'cache'"),
        ({"currency": "USD", "models": {"m": [1, 2]}}, "models.m must be an object"),
        ({"currency": "USD", "models": {"m": {"input": 1, "output": 1}}, "extra": 1}, "unknown key"),
    ],
)
def test_a_bad_price_table_is_a_named_error(doc: object, says: str) -> None:
    with pytest.raises(PriceTableError, match=says.replace("(", r"\(")):
        parse_price_table(doc)


def test_the_setting_reads_yaml_and_json_and_names_a_bad_file(tmp_path: Path) -> None:
    y = tmp_path / "p.yaml"
    y.write_text("currency: USD\nmodels:\n  fake-model: {input: 2.5, output: 10, cache_read: 1.25}\n")
    t = load_price_table(str(y))
    assert t.currency == "USD" and t.prices("fake-model").cache_read == Decimal("1.25")
    j = tmp_path / "p.json"
    j.write_text(json.dumps(TABLE))
    assert load_price_table(str(j)).prices("fake-model").reasoning == Decimal(10)
    bad = tmp_path / "bad.yaml"
    bad.write_text("currency: USD\nmodels: {m: {input: -2, output: 1}}\n")
    with pytest.raises(SettingError, match=r"AEP_BRIDGE_PRICE_TABLE .*models\.m\.input"):
        role_settings("mapper", environ={"AEP_BRIDGE_PRICE_TABLE": str(bad), "AEP_BRIDGE_CONFIG": "/nonexistent"})
    with pytest.raises(SettingError, match="AEP_BRIDGE_PRICE_TABLE: cannot read"):
        role_settings("mapper", environ={"AEP_BRIDGE_PRICE_TABLE": str(tmp_path / "missing.yaml"),
                                         "AEP_BRIDGE_CONFIG": "/nonexistent"})
    s = role_settings("mapper", environ={"AEP_BRIDGE_PRICE_TABLE": str(y), "AEP_BRIDGE_CONFIG": "/nonexistent"})
    assert s.prices is not None and s.prices.currency == "USD"
    # pairing does not read it: a bad table stops only the mapper
    assert role_settings("pairing", environ={"AEP_BRIDGE_PRICE_TABLE": str(bad),
                                             "AEP_BRIDGE_CONFIG": "/nonexistent"}).prices is None


def test_the_mapper_command_exits_2_on_a_bad_price_table(tmp_path: Path) -> None:
    import subprocess
    import sys

    bad = tmp_path / "bad.json"
    bad.write_text('{"currency": "EUR", "models": {"a": {"input": 1, "output": "ten"}}}')
    env = {"AEP_BRIDGE_PRICE_TABLE": str(bad), "AEP_BRIDGE_CONFIG": "/nonexistent", "PATH": "/usr/bin:/bin"}
    exe = Path(sys.executable).parent / "aep-bridge"
    p = subprocess.run([str(exe), "mapper"], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert "AEP_BRIDGE_PRICE_TABLE" in p.stderr and "models.a.output" in p.stderr
    assert "Traceback" not in p.stderr


def test_reading_a_cost_back_is_exact_on_both_paths() -> None:
    """`to_nanos` reads a member by float arithmetic below 10**6 units and by Decimal above:
    both give the exact nano-units of every 9-decimal value (random and edge values)."""
    import random
    from decimal import ROUND_HALF_EVEN

    from bridge.core.pricing import from_nanos

    rng = random.Random(40)
    values = [0, 1, 5, 999_999_999_999_999, 10**15 - 1, 123_456_789_012_345, 500_000_001]
    values += [rng.randrange(10**15) for _ in range(20000)] + [rng.randrange(10**9) for _ in range(20000)]
    for nanos in values:
        x = from_nanos(nanos)
        slow = int((Decimal(repr(x)) * 10**9).to_integral_value(rounding=ROUND_HALF_EVEN))
        assert to_nanos(x) == slow == nanos, nanos


def test_the_integer_arithmetic_is_the_decimal_arithmetic() -> None:
    """`cost_nanos` (integers) against the module docstring's formula in Decimal, quantized half
    to even, over random counts and prices of up to 9 decimals."""
    import random
    from decimal import ROUND_HALF_EVEN

    from bridge.core.pricing import cost_nanos

    rng = random.Random(7)
    for _ in range(3000):
        row = {k: Decimal(rng.randrange(0, 10**6)).scaleb(-rng.randrange(0, 10)) for k in
               ("input", "output", "cache_read", "cache_write", "reasoning")}
        prices = parse_price_table({"currency": "USD", "models": {"m": {k: str(v) for k, v in row.items()}}}).prices("m")
        assert prices is not None
        out = rng.randrange(0, 10**6)
        n = {"input": rng.randrange(0, 10**7), "output": out, "cache_read": rng.randrange(0, 10**6),
             "cache_write": rng.randrange(0, 10**5), "reasoning": rng.randrange(0, out + 2)}
        M, q = Decimal(10**6), Decimal("1e-9")
        want = {"prompt": n["input"] * row["input"] / M,
                "completion": max(n["output"] - n["reasoning"], 0) * row["output"] / M,
                "cache": (n["cache_read"] * row["cache_read"] + n["cache_write"] * row["cache_write"]) / M,
                "reasoning": n["reasoning"] * row["reasoning"] / M}
        want = {k: int((v.quantize(q, rounding=ROUND_HALF_EVEN) * 10**9)) for k, v in want.items()}
        want["total"] = sum(want.values())
        assert cost_nanos(prices, n) == want, (row, n)


def test_a_count_past_the_token_bound_is_left_out_and_counted() -> None:
    """No model call has 2**40 tokens; a count past that is a bad value, not a figure to sum."""
    obj = _post_api_request()
    obj["extra"]["usage"]["input_tokens"] = 2**40 + 1
    r = _map(obj)
    assert "gen_ai.usage.input_tokens" not in r.events[0].data and r.invalid == ["input_tokens"]
    assert "cost" not in r.events[0].data
    obj["extra"]["usage"]["input_tokens"] = 2**40
    assert _map(obj).events[0].data["gen_ai.usage.input_tokens"] == 2**40


def test_a_cost_past_the_bound_is_left_out_and_counted() -> None:
    """2**40 tokens at the highest price the table takes is ~1.1e21 nano-units, past int64: such
    a call is not priced (counted as a bad ``cost``), the counts still flow."""
    obj = _post_api_request()
    obj["extra"]["usage"]["input_tokens"] = 2**40
    r = _map(obj, {"currency": "USD", "models": {"fake-model": {"input": 1_000_000, "output": 10}}})
    assert "cost" not in r.events[0].data and r.invalid == ["cost"]
    assert r.events[0].data["gen_ai.usage.input_tokens"] == 2**40


def test_prices_with_up_to_twelve_decimal_places_are_exact() -> None:
    t = parse_price_table({"currency": "USD", "models": {"m": {"input": "0.000000000001", "output": "2.50000000000000000000"}}})
    p = t.prices("m")
    assert p.output == Decimal("2.5") and p.input == Decimal("1e-12")
    assert cost_of(p, {"input": 10**12, "output": 10**6}) == {
        "total": Decimal("2.500001000"), "prompt": Decimal("0.000001000"), "completion": Decimal("2.500000000"),
        "cache": Decimal(0), "reasoning": Decimal(0)}
