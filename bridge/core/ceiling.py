"""Capture levels and ceilings (AEP-0001 §8.2, AEP-0003 §9): what an event may carry.

* A level is one of ``none < metadata < redacted < full`` (``LEVELS``, ranks 0-3).
* The policy (``CapturePolicy``, built from the operator's settings by ``configure``) gives
  each event category (`tool`, `attention`, ...) its ceiling: a default (``metadata``)
  with per-category overrides (default ``attention=redacted``), never above the global
  limit.
* The mapping asks the policy for the ceiling of the event it is about to build
  (``Ceiling``) and includes a field only when the ceiling admits the field's level. Free
  text admitted at ``redacted`` goes through the redaction pipeline
  (``bridge.core.redaction``) first; at ``full`` it is verbatim. The event's ``capture`` is
  the ceiling honoured. Nothing here ever labels unredacted text ``redacted``.

What a hop does with a finished event above its own ceiling is ``bridge.core.downlevel``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import msgspec
from msgspec import UNSET

from bridge.core import aep
from bridge.core.redaction import Redactor

LEVELS = ("none", "metadata", "redacted", "full")
NONE, METADATA, REDACTED, FULL = range(4)
LEVEL_RANK = {name: rank for rank, name in enumerate(LEVELS)}


def level_rank(name: str) -> int:
    try:
        return LEVEL_RANK[name]
    except KeyError:
        raise ValueError(f"unknown capture level {name!r} (expected one of {', '.join(LEVELS)})") from None



# ---------------------------------------------------------------- the policy


def parse_overrides(spec: str | Iterable[str]) -> dict[str, str]:
    """`"attention=redacted,tool=full"` (or a list of `CATEGORY=LEVEL`) -> mapping, validated."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    result: dict[str, str] = {}
    for item in items:
        item = item.strip()
        if not item:
            continue
        category, sep, level = item.partition("=")
        category = category.strip().rstrip(".*").strip()
        if not sep or not category:
            raise ValueError(f"capture override {item!r} must look like CATEGORY=LEVEL")
        level_rank(level.strip())
        result[category] = level.strip()
    return result


RANKS_CACHED = 1024  # event types whose ceiling a policy remembers


@dataclass(frozen=True)
class CapturePolicy:
    """Ceilings per event category. Categories are the first type segment, or for
    vendor types `x.hermes.<category>` the segment after the vendor.

    ``default`` is the level of a category without an override; ``limit`` (when set) is
    the global ceiling: no category gets more, whatever its override says. `configure`
    builds the policy the operator's settings ask for."""

    default: str = "metadata"
    overrides: dict[str, str] = field(default_factory=lambda: {"attention": "redacted"})
    redactor: Redactor = field(default_factory=Redactor)
    limit: str | None = None
    #: event type -> its ceiling, as `ceiling` found it (the policy does not change; a type is
    #: asked for twice per event, and its splits were ~4 % of the mapper's batch: issue 43)
    _ranks: dict[str, int] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        level_rank(self.default)
        for level in self.overrides.values():
            level_rank(level)
        if self.limit is not None:
            level_rank(self.limit)

    def ceiling(self, event_type: str) -> int:
        rank = self._ranks.get(event_type)
        if rank is None:
            rank = self._ceiling(event_type)
            if len(self._ranks) >= RANKS_CACHED:  # (types from the wire: `x.hermes.<hook>`) bounded
                self._ranks.clear()
            self._ranks[event_type] = rank
        return rank

    def _ceiling(self, event_type: str) -> int:
        parts = event_type.split(".")
        candidates = [parts[0]]
        if parts[0] == "x" and len(parts) > 2:
            candidates = [".".join(parts[:3]), parts[2]]
        rank = LEVEL_RANK[self.default]
        for category in candidates:
            if category in self.overrides:
                rank = LEVEL_RANK[self.overrides[category]]
                break
        return rank if self.limit is None else min(rank, LEVEL_RANK[self.limit])

    def lowest(self) -> int:
        """The lowest ceiling of any category: what content of unknown category (a dead
        letter) may carry."""
        rank = min(LEVEL_RANK[level] for level in (self.default, *self.overrides.values()))
        return rank if self.limit is None else min(rank, LEVEL_RANK[self.limit])


#: The built-in per-category override (AEP-0003 §9.1's recommendation: prompts stay readable).
DEFAULT_OVERRIDES = "attention=redacted"


def configure(capture: str | None = None, overrides: str | None = None, extra: Iterable[str] = (),
              redactor: Redactor | None = None) -> tuple[CapturePolicy, list[str]]:
    """The policy of the operator's settings, and the warnings to show at start.

    * ``capture`` (`AEP_BRIDGE_CAPTURE`, `--capture`) is the ceiling: no event carries more,
      and it is the level of every category without an override. Unset (None), the bridge
      runs the default posture: `metadata`, with `attention` at `redacted` (its ceiling).
    * ``overrides`` (`AEP_BRIDGE_CAPTURE_OVERRIDES`; None: the built-in `attention=redacted`)
      and ``extra`` (`--capture-override`, applied over them) may only lower a category's
      level: one above the ceiling is clamped to it, with a warning. The built-in override
      is clamped silently (`--capture none` means none: the operator did not ask for it).
    """
    if capture is None:
        default, limit = "metadata", "redacted"
    else:
        level_rank(capture)
        default = limit = capture
    top = LEVEL_RANK[limit]
    levels: dict[str, str] = {}
    if overrides is None:
        for category, level in parse_overrides(DEFAULT_OVERRIDES).items():
            levels[category] = LEVELS[min(LEVEL_RANK[level], top)]
    asked = parse_overrides(overrides) if overrides is not None else {}
    asked.update(parse_overrides(list(extra)))
    warnings: list[str] = []
    for category, level in asked.items():
        if LEVEL_RANK[level] > top:
            why = "the default posture's ceiling (AEP_BRIDGE_CAPTURE is unset)" if capture is None else "the capture ceiling"
            warnings.append(f"capture override {category}={level} is above {why} {limit}: clamped to {limit}"
                            + (f" (set AEP_BRIDGE_CAPTURE={level} to allow it)" if capture is None else ""))
            level = limit
        levels[category] = level
    return CapturePolicy(default=default, overrides=levels, redactor=redactor or Redactor(), limit=limit), warnings


# ---------------------------------------------------------------- one event's ceiling


@dataclass(frozen=True)
class Ceiling:
    """The ceiling of one event and the redaction that goes with it."""

    level: int
    policy: CapturePolicy

    def admits(self, level: int) -> bool:
        return self.level >= level

    def text(self, value: Any, level: int = REDACTED) -> Any:
        """Free text (or a JSON value) admitted at ``level``: UNSET, redacted, or verbatim."""
        if value is None or not self.admits(level):
            return UNSET
        if self.level >= FULL:
            return value
        return self.policy.redactor.value(value)


def strip_to_required(payload: aep._Payload) -> aep._Payload:
    """Capture ``none``: keep only the fields a payload schema requires (envelope-level structure)."""
    kept = {}
    for f in msgspec.structs.fields(payload):
        value = getattr(payload, f.name)
        if f.required:
            kept[f.name] = strip_to_required(value) if isinstance(value, aep._Payload) else value
    return type(payload)(**kept)
