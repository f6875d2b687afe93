"""What the fleet spent, from the model-call events of the stream (`aep-bridge usage`, issue 40).

Pure: `Usage.add` takes AEP events as the JSON objects they are on the wire and sums the
`x.hermes.api.call` ones per group (model, instance, session or day): calls, the five
`gen_ai.usage.*` token counts, the call durations (a count per distinct ms: exact p50/p99,
nearest rank) and the `cost` per currency (an integer sum of nano-units, exact). Its state does
not grow with the number of calls read, only with the distinct groups and durations. `x.hermes.api.error` events count as errors of their group. A member that
is not a count (negative, bool, fractional, a string, past 2**53) is left out, as the mapper
leaves it out, and the event is counted in `skipped_members`.

The cost is what the bridge computed from the operator's price table (AEP-0002 calls `cost`
emitter-asserted); a call without one is counted `unpriced`, never guessed.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from bridge.core.aep import API_CALL_TYPE as API_CALL, API_ERROR_TYPE as API_ERROR
from bridge.core.pricing import COST_NANOS_MAX, from_nanos, to_nanos

GROUPINGS = ("model", "instance", "session", "day")

#: `gen_ai.usage.*` member -> column.
TOKENS = (
    ("gen_ai.usage.input_tokens", "input"),
    ("gen_ai.usage.output_tokens", "output"),
    ("gen_ai.usage.cache_read.input_tokens", "cache_read"),
    ("gen_ai.usage.cache_creation.input_tokens", "cache_write"),
    ("gen_ai.usage.reasoning.output_tokens", "reasoning"),
)
_MAX = 2**53


def _count(value: Any) -> bool:
    return type(value) is int and 0 <= value <= _MAX


def printable(text: str) -> str:
    """``text`` with every character that is not printable (escape sequences, line breaks, bidi
    overrides, NULs: what the wire may carry in a name) shown as its escape (``\\x1b``), so a
    terminal gets only what it shows."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def percentile(ordered: list[int], p: float) -> int | None:
    """Nearest-rank percentile of an ascending list (an observed value, never interpolated)."""
    if not ordered:
        return None
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[rank - 1]


def percentile_counted(counts: Counter[int], p: float) -> int | None:
    """`percentile` of the list a Counter of values stands for (value -> how many times)."""
    n = sum(counts.values())
    if not n:
        return None
    rank = max(1, math.ceil(p / 100 * n))
    seen = 0
    for value in sorted(counts):
        seen += counts[value]
        if seen >= rank:
            return value
    return None  # unreachable: seen ends at n >= rank


def instance_of(source: Any) -> str:
    """The Hermes instance of a bridge event: the authority of its `source`
    (``aep://<instance>/agent/hermes/session/<session>``)."""
    if isinstance(source, str) and "://" in source:
        authority = source.split("://", 1)[1].split("/", 1)[0]
        if authority:
            return unquote(authority)
    return "unknown"


def model_of(data: dict[str, Any]) -> str:
    for member in ("gen_ai.request.model", "gen_ai.response.model"):
        name = data.get(member)
        if isinstance(name, str) and name:
            return name
    return "unknown"


def group_of(event: dict[str, Any], data: dict[str, Any], by: str) -> str:
    if by == "model":
        return model_of(data)
    if by == "instance":
        return instance_of(event.get("source"))
    if by == "session":
        session = event.get("session")
        return session if isinstance(session, str) and session else "unknown"
    time = event.get("time")
    return time[:10] if isinstance(time, str) and len(time) >= 10 else "unknown"  # RFC 3339: the day as written


@dataclass
class Group:
    calls: int = 0
    errors: int = 0
    tokens: dict[str, int] = field(default_factory=lambda: {column: 0 for _, column in TOKENS})
    durations: Counter[int] = field(default_factory=Counter)  # ms -> calls
    cost: dict[str, int] = field(default_factory=dict)  # currency -> nano-units
    unpriced: int = 0

    def row(self, name: str) -> dict[str, Any]:
        return {
            "group": name,
            "calls": self.calls,
            "errors": self.errors,
            **{f"{column}_tokens": self.tokens[column] for _, column in TOKENS},
            "p50_ms": percentile_counted(self.durations, 50),
            "p99_ms": percentile_counted(self.durations, 99),
            "cost": {currency: from_nanos(nanos) for currency, nanos in sorted(self.cost.items())},
            "unpriced_calls": self.unpriced,
        }


class Usage:
    def __init__(self, by: str = "model") -> None:
        if by not in GROUPINGS:
            raise ValueError(f"--by {by!r}: expected one of {', '.join(GROUPINGS)}")
        self.by = by
        self.groups: dict[str, Group] = {}
        self.events = 0  # model-call and error events read
        self.skipped_members = 0  # events with a member that was not a count (left out)

    def add(self, event: Any) -> bool:
        """Fold one event in; False when it is not a model call or error (ignored)."""
        if not isinstance(event, dict):
            return False
        etype = event.get("type")
        if etype != API_CALL and etype != API_ERROR:
            return False
        data = event.get("data")
        data = data if isinstance(data, dict) else {}
        name = group_of(event, data, self.by)
        g = self.groups.get(name)
        if g is None:
            g = self.groups[name] = Group()
        self.events += 1
        if etype == API_ERROR:
            g.errors += 1
            return True
        g.calls += 1
        bad = False
        for member, column in TOKENS:
            if member in data:
                if _count(data[member]):
                    g.tokens[column] += data[member]
                else:
                    bad = True
        if "duration_ms" in data:
            if _count(data["duration_ms"]):
                g.durations[data["duration_ms"]] += 1
            else:
                bad = True
        cost = data.get("cost")
        total = cost.get("total") if isinstance(cost, dict) else None
        currency = cost.get("currency") if isinstance(cost, dict) else None
        nanos = to_nanos(total) if isinstance(currency, str) and currency else None
        if nanos is not None and nanos <= COST_NANOS_MAX:  # (the mapper prices no call past it)
            g.cost[currency] = g.cost.get(currency, 0) + nanos
        else:
            g.unpriced += 1
            bad = bad or cost is not None
        self.skipped_members += bad
        return True

    def rows(self) -> list[dict[str, Any]]:
        """One row per group: by day in date order, else the most calls first (then by name)."""
        rows = [g.row(name) for name, g in self.groups.items()]
        if self.by == "day":
            rows.sort(key=lambda r: r["group"])
        else:
            rows.sort(key=lambda r: (-r["calls"], -r["errors"], r["group"]))
        return rows

    def total(self) -> dict[str, Any]:
        """The row of every group together."""
        all_ = Group()
        for g in self.groups.values():
            all_.calls += g.calls
            all_.errors += g.errors
            for column in all_.tokens:
                all_.tokens[column] += g.tokens[column]
            all_.durations.update(g.durations)
            for currency, nanos in g.cost.items():
                all_.cost[currency] = all_.cost.get(currency, 0) + nanos
            all_.unpriced += g.unpriced
        return all_.row("total")


def format_cost(cost: dict[str, float]) -> str:
    return ", ".join(f"{_number(total)} {currency}" for currency, total in cost.items())


def _number(value: float) -> str:
    text = f"{value:.6f}".rstrip("0").rstrip(".")
    return text or "0"


COLUMNS = (
    ("calls", "calls"), ("errors", "errors"), ("input_tokens", "input"), ("output_tokens", "output"),
    ("cache_read_tokens", "cache_read"), ("cache_write_tokens", "cache_write"), ("reasoning_tokens", "reasoning"),
    ("p50_ms", "p50_ms"), ("p99_ms", "p99_ms"),
)


def format_table(usage: Usage) -> str:
    """The table `aep-bridge usage` prints: a header, a row per group, a total when there are
    several; an empty duration or cost is blank."""
    rows = usage.rows()
    if len(rows) > 1:
        rows.append(usage.total())
    header = [usage.by, *(title for _, title in COLUMNS), "cost"]
    lines = [header]
    for row in rows:
        cells = [printable(str(row["group"]))]
        for key, _ in COLUMNS:
            cells.append("" if row[key] is None else str(row[key]))
        cost = printable(format_cost(row["cost"]))
        if cost and row["unpriced_calls"]:
            cost += f" (+{row['unpriced_calls']} unpriced)"
        cells.append(cost)
        lines.append(cells)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = []
    for line in lines:
        cells = [line[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(line[1:-1], widths[1:-1])] + [line[-1]]
        out.append("  ".join(cells).rstrip())
    return "\n".join(out)
