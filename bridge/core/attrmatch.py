"""The `attr-match` filter dialect (AEP-0003 §6): which AEP events a subscriber, or a sink, takes.

A filter is a JSON object; each member is a predicate on one envelope attribute, and an
event matches when every member matches (an empty filter matches everything):

* a scalar (string, integer, boolean): equality, exact JSON value (``1`` is not ``true``);
* a non-empty array of scalars: any of them;
* on ``type`` only: a pattern ``prefix.*`` (a type strictly under ``prefix.``), alone or
  in an array with exact types; ``*`` alone is not a pattern;
* on ``severity`` only: ``{"gte": L}``, ``{"lte": L}`` or both, inclusive, in the
  AEP-0001 §8.1 order.

Keys: ``id type subject source agent session run step epoch cause severity capture`` and
legal extension attribute names; ``time seq aep traceparent data`` and anything else are
rejected. An event without the attribute does not match, except ``severity``, ``capture``
and ``epoch``, which take their defaults (``info``, ``metadata``, ``0``) first.

`compile_filter` checks a filter once and fails closed (`InvalidFilter`), never into
match-all; the compiled `Filter.matches` takes the event as its wire JSON object.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

SEVERITY_ORDER = ("debug", "info", "notice", "warning", "error", "critical")
_SEVERITY_RANK = {name: rank for rank, name in enumerate(SEVERITY_ORDER)}

#: AEP-0003 §6.2 rule 1: the filterable core attributes.
FILTERABLE = frozenset(("id", "type", "subject", "source", "agent", "session", "run", "step", "epoch", "cause",
                        "severity", "capture"))
#: Core attributes that are not filterable (and never legal extension names).
NOT_FILTERABLE = frozenset(("time", "seq", "aep", "traceparent", "data"))
#: §6.2 rule 5: the defaults applied to an absent attribute before matching.
DEFAULTS: dict[str, Any] = {"severity": "info", "capture": "metadata", "epoch": 0}

_EXTENSION_NAME = re.compile(r"[a-z0-9]{1,20}")


class InvalidFilter(ValueError):
    """The filter is not attr-match (AEP `invalid-filter`); the message says which member and why."""


def _is_scalar(value: Any) -> bool:
    return isinstance(value, (str, int)) and not isinstance(value, float)  # bool is an int


def _same(a: Any, b: Any) -> bool:
    """JSON equality without coercion: ``1`` is not ``true``, ``"1"`` is not ``1``."""
    return type(a) is type(b) and a == b


Predicate = Callable[[Any], bool]


def _equal_any(values: tuple[Any, ...]) -> Predicate:
    return lambda v: any(_same(v, x) for x in values)


def _type_predicate(key: str, spec: Any) -> Predicate:
    items = spec if isinstance(spec, list) else [spec]
    if not items:
        raise InvalidFilter(f"{key!r}: an inclusion array must not be empty")
    exact: list[str] = []
    prefixes: list[str] = []
    for item in items:
        if not isinstance(item, str) or not item:
            raise InvalidFilter(f"{key!r}: {item!r} is not a type or a type pattern")
        if "*" in item:
            head = item[:-2]
            if not item.endswith(".*") or not head or "*" in head:
                raise InvalidFilter(f"{key!r}: {item!r} is not a pattern (only 'prefix.*'; '*' alone is not one)")
            prefixes.append(head + ".")
        else:
            exact.append(item)
    exact_t, prefixes_t = frozenset(exact), tuple(prefixes)
    return lambda v: isinstance(v, str) and (v in exact_t or any(v.startswith(p) and len(v) > len(p) for p in prefixes_t))


def _severity_cmp(key: str, spec: dict[str, Any]) -> Predicate:
    if not spec or set(spec) - {"gte", "lte"}:
        raise InvalidFilter(f"{key!r}: a comparison is {{'gte': level}}, {{'lte': level}} or both, not {spec!r}")
    bounds = {}
    for op, level in spec.items():
        if level not in _SEVERITY_RANK:
            raise InvalidFilter(f"{key!r}: {level!r} is not a severity ({', '.join(SEVERITY_ORDER)})")
        bounds[op] = _SEVERITY_RANK[level]
    low, high = bounds.get("gte", 0), bounds.get("lte", len(SEVERITY_ORDER) - 1)
    return lambda v: isinstance(v, str) and v in _SEVERITY_RANK and low <= _SEVERITY_RANK[v] <= high


def _scalar_predicate(key: str, spec: Any) -> Predicate:
    items = spec if isinstance(spec, list) else [spec]
    if not items:
        raise InvalidFilter(f"{key!r}: an inclusion array must not be empty")
    for item in items:
        if not _is_scalar(item):
            raise InvalidFilter(f"{key!r}: {item!r} is not a string, integer or boolean")
        if isinstance(item, str) and "*" in item:
            raise InvalidFilter(f"{key!r}: patterns exist on 'type' only ({item!r})")
    return _equal_any(tuple(items))


@dataclass(frozen=True)
class Filter:
    """A checked attr-match filter. ``source`` is the filter as given."""

    source: dict[str, Any]
    predicates: tuple[tuple[str, Predicate], ...]

    def matches(self, event: dict[str, Any]) -> bool:
        for key, predicate in self.predicates:
            if key in event:
                value = event[key]
            elif key in DEFAULTS:
                value = DEFAULTS[key]
            else:
                return False
            if not predicate(value):
                return False
        return True


MATCH_ALL = Filter({}, ())


def compile_filter(spec: Any) -> Filter:
    """Check ``spec`` against AEP-0003 §6 and return the `Filter`; raise `InvalidFilter` otherwise."""
    if not isinstance(spec, dict):
        raise InvalidFilter(f"a filter is a JSON object, not {type(spec).__name__}")
    predicates: list[tuple[str, Predicate]] = []
    for key, value in spec.items():
        if not isinstance(key, str) or key in NOT_FILTERABLE:
            raise InvalidFilter(f"{key!r} is not filterable (time, seq, aep, traceparent and data never are)")
        if key not in FILTERABLE and not _EXTENSION_NAME.fullmatch(key):
            raise InvalidFilter(f"{key!r} is neither a filterable attribute nor a legal extension name")
        if key == "type":
            predicates.append((key, _type_predicate(key, value)))
        elif key == "severity" and isinstance(value, dict):
            predicates.append((key, _severity_cmp(key, value)))
        else:
            predicates.append((key, _scalar_predicate(key, value)))
    return Filter(dict(spec), tuple(predicates))
