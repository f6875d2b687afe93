"""The operator's price table and the cost of one model call (pure: no I/O).

`AEP_BRIDGE_PRICE_TABLE` names a YAML or JSON file; the mapper reads it at start
(`bridge.config.load_price_table`) and hands the parsed `PriceTable` to the mapping::

    currency: USD
    models:            # price per 1,000,000 tokens
      fake-model: {input: 2.5, output: 10, cache_read: 1.25, cache_write: 3.75, reasoning: 10}

The cost is what the bridge computed from that table (AEP calls ``cost`` emitter-asserted);
it never guesses: no table, no ``cost``; a model the table does not name, no ``cost`` for
that call (the mapper counts it, ``aep_bridge_model_unpriced_total{model}``).

The arithmetic (exact: `Decimal`, never binary floats):

* Hermes's token buckets (``agent/usage_pricing.py`` ``normalize_usage``) are disjoint on
  the input side: ``input_tokens`` is the prompt *minus* cache reads and cache writes. On the
  output side ``output_tokens`` is the provider's completion count, which INCLUDES the
  reasoning tokens (``reasoning_tokens`` is the breakdown of ``completion_tokens_details``).
  So nothing is charged twice:
  ``prompt = input * p.input``, ``cache = cache_read * p.cache_read + cache_write * p.cache_write``,
  ``reasoning = reasoning * p.reasoning``, ``completion = max(output - reasoning, 0) * p.output``
  (all prices per 1,000,000 tokens; a bucket the call did not report counts 0).
* The arithmetic is exact: each price is the decimal the table wrote (``2.5`` is 25/10, never a
  binary float), held as an integer numerator and denominator of nano-units per token.
* Each member is rounded to ``1e-9`` of the currency unit (`QUANTUM`, half-even), and
  ``total`` is the sum of the four rounded members, so ``total == prompt + completion + cache
  + reasoning`` holds exactly in nano-units, and a run's sums (pairing adds nano-units) are
  the exact sums of its calls'. On the wire each member is a JSON number whose shortest
  decimal form is exactly that value (a float holds every 9-decimal value below 10**6).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, Decimal
from functools import cached_property
from typing import Any, Mapping

#: price keys of a model's row, per 1,000,000 tokens
PRICE_KEYS = ("input", "output", "cache_read", "cache_write", "reasoning")
#: the cost members, in the order pairing keeps their sums (AEP-0002 §5.2 ``cost``)
COST_MEMBERS = ("total", "prompt", "completion", "cache", "reasoning")
QUANTUM = Decimal("1e-9")
NANOS = 10**9
FAST_BELOW = 1e6  # cost members below this many units are read back by float arithmetic (`to_nanos`)
MILLION = Decimal(1_000_000)
#: a price above this per 1,000,000 tokens is taken for a typo (and keeps the figures in range)
MAX_PRICE = Decimal(1_000_000)
MAX_MODELS = 10_000
#: a price has at most this many decimal places (trailing zeros aside): 1e-12 per 1,000,000
#: tokens is far below a nano-unit; more is taken for a typo, and bounds the integer arithmetic
#: (``'1E-30000000'`` passed the range check and then took 60 s at the first priced call)
MAX_DECIMALS = 12
#: the most tokens one model call can report in one bucket (~1.1e12): no model call has that many
#: (context windows are ~1e6-1e7); a count past it is a bad value, left out and counted, so no
#: cost and no run sum (pairing, a sum of at most 2**53) is ever built from a hostile figure
TOKEN_MAX = 2**40
#: the largest cost one call is priced at, in nano-units (10**6 currency units, where the JSON
#: number of a member is still exactly its 9-decimal value, `from_nanos`): 2**40 tokens at
#: `MAX_PRICE` would be ~1.1e21 nano-units, past int64 and msgpack; such a call has no cost
COST_NANOS_MAX = 10**15
_CURRENCY = re.compile(r"^[A-Z]{3}$")


class PriceTableError(ValueError):
    """A price table the bridge cannot use; the message says where and what is wrong."""


@dataclass(frozen=True)
class Prices:
    input: Decimal = Decimal(0)
    output: Decimal = Decimal(0)
    cache_read: Decimal = Decimal(0)
    cache_write: Decimal = Decimal(0)
    reasoning: Decimal = Decimal(0)

    @cached_property
    def scaled(self) -> tuple[tuple[int, int], ...]:
        """Each price (`PRICE_KEYS` order) as (numerator, denominator) of nano-units per token:
        ``price / 10**6 * 10**9`` = ``digits * 1000 / 10**decimals``, exact integers."""
        out = []
        for key in PRICE_KEYS:
            _, digits, exp = getattr(self, key).as_tuple()
            num = int("".join(map(str, digits)) or "0") * 1000
            if exp >= 0:  # type: ignore[operator]
                out.append((num * 10**exp, 1))  # type: ignore[operator]
            else:
                out.append((num, 10 ** -exp))  # type: ignore[operator]
        return tuple(out)


@dataclass(frozen=True)
class PriceTable:
    currency: str
    models: Mapping[str, Prices]

    def prices(self, model: str) -> Prices | None:
        return self.models.get(model)


def _price(value: Any, where: str) -> Decimal:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise PriceTableError(f"{where} must be a non-negative number, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise PriceTableError(f"{where} must be a non-negative number, got {value!r}")
    try:
        # str(float) is its shortest decimal form: 2.5 -> Decimal("2.5"), never 2.5000000001
        price = Decimal(str(value).strip())
    except ArithmeticError:
        raise PriceTableError(f"{where} must be a non-negative number, got {value!r}") from None
    if not price.is_finite() or price < 0 or price > MAX_PRICE:
        raise PriceTableError(f"{where} must be a non-negative number of at most {MAX_PRICE}, got {value!r}")
    _, digits, exp = price.as_tuple()
    zeros = len(digits) - len("".join(map(str, digits)).rstrip("0"))  # 2.50 has 1 decimal place
    if exp + zeros < -MAX_DECIMALS:  # type: ignore[operator]
        raise PriceTableError(f"{where} has more than {MAX_DECIMALS} decimal places, got {value!r}")
    return price


def parse_price_table(doc: Any, where: str = "price table") -> PriceTable:
    """The table of a decoded YAML/JSON document; `PriceTableError` names the bad value."""
    if not isinstance(doc, dict):
        raise PriceTableError(f"{where}: expected an object with currency and models, got {type(doc).__name__}")
    unknown = sorted(str(k) for k in doc if k not in ("currency", "models"))
    if unknown:
        raise PriceTableError(f"{where}: unknown key {unknown[0]!r} (expected currency, models)")
    currency = doc.get("currency")
    if not isinstance(currency, str) or not _CURRENCY.match(currency):
        raise PriceTableError(f"{where}: currency must be an ISO 4217 code of three capital letters, got {currency!r}")
    models = doc.get("models")
    if not isinstance(models, dict) or not models:
        raise PriceTableError(f"{where}: models must be a non-empty object of model -> prices")
    if len(models) > MAX_MODELS:
        raise PriceTableError(f"{where}: {len(models)} models (at most {MAX_MODELS})")
    table: dict[str, Prices] = {}
    for name, row in models.items():
        if not isinstance(name, str) or not name:
            raise PriceTableError(f"{where}: a model name must be a non-empty string, got {name!r}")
        if not isinstance(row, dict):
            raise PriceTableError(f"{where}: models.{name} must be an object of prices per 1,000,000 tokens")
        bad = sorted(str(k) for k in row if k not in PRICE_KEYS)
        if bad:
            raise PriceTableError(f"{where}: models.{name}: unknown price {bad[0]!r} (expected {', '.join(PRICE_KEYS)})")
        if "input" not in row or "output" not in row:
            raise PriceTableError(f"{where}: models.{name} needs at least input and output")
        prices = Prices(**{k: _price(v, f"{where}: models.{name}.{k}") for k, v in row.items()})
        _ = prices.scaled  # computed once here, at start, not at the first priced call
        table[name] = prices
    return PriceTable(currency=currency, models=table)


def _round(num: int, den: int) -> int:
    """num / den rounded half to even (non-negative integers)."""
    q, r = divmod(num, den)
    if 2 * r > den or (2 * r == den and q & 1):
        q += 1
    return q


def cost_nanos(prices: Prices, tokens: Mapping[str, int]) -> dict[str, int]:
    """The cost members of one call in nano-units of the currency, from its token buckets
    (``input``, ``output``, ``cache_read``, ``cache_write``, ``reasoning``; missing = 0): exact
    integer arithmetic on the table's decimal prices, each member rounded half to even
    (module docstring); ``total`` the sum of the rounded members."""
    (i_n, i_d), (o_n, o_d), (r_n, r_d), (w_n, w_d), (z_n, z_d) = prices.scaled
    reasoning_tokens = tokens.get("reasoning", 0)
    prompt = _round(tokens.get("input", 0) * i_n, i_d)
    completion = _round(max(tokens.get("output", 0) - reasoning_tokens, 0) * o_n, o_d)
    den = r_d * w_d  # the two cache prices over one denominator: one rounding for the member
    cache = _round(tokens.get("cache_read", 0) * r_n * w_d + tokens.get("cache_write", 0) * w_n * r_d, den)
    reasoning = _round(reasoning_tokens * z_n, z_d)
    return {"total": prompt + completion + cache + reasoning, "prompt": prompt, "completion": completion,
            "cache": cache, "reasoning": reasoning}


def cost_of(prices: Prices, tokens: Mapping[str, int]) -> dict[str, Decimal]:
    """`cost_nanos` as Decimals of the currency (``Decimal("0.000250000")``)."""
    return {k: Decimal(v).scaleb(-9) for k, v in cost_nanos(prices, tokens).items()}


def to_nanos(value: Any) -> int | None:
    """A cost member read back from an event (a JSON number) in nano-units, exact; None when it
    is no non-negative number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value < 0:
        return None
    if isinstance(value, int):
        return value * NANOS
    if value < FAST_BELOW:
        # exact: a 9-decimal value d/1e9 below 10**6 units is d < 10**15 nano-units, and the float
        # product's error stays under 0.25 of a unit (2 roundings of 2**-53 relative), so the
        # nearest integer is d (the Decimal path below, ~5x slower, gives the same)
        return round(value * NANOS)
    return int((Decimal(repr(value)) * NANOS).to_integral_value(rounding=ROUND_HALF_EVEN))


def from_nanos(nanos: int) -> float:
    """Nano-units as the JSON number an event carries (exactly that decimal below 10**6 units):
    Python's int / int is correctly rounded, so this is the float nearest to nanos / 10**9."""
    return nanos / NANOS


__all__ = [
    "COST_MEMBERS",
    "COST_NANOS_MAX",
    "PRICE_KEYS",
    "PriceTable",
    "PriceTableError",
    "Prices",
    "TOKEN_MAX",
    "cost_nanos",
    "cost_of",
    "from_nanos",
    "parse_price_table",
    "to_nanos",
]
