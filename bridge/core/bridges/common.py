"""What the three AEP-0005 projections share: the envelope check, names, time.

The projections take an AEP event as the JSON object it is on the wire (a ``dict``), not
as `bridge.core.aep.Event`: they must carry every extension attribute and every type,
including ones this bridge never emits (AEP-0001 §5.4: relays preserve them).
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone
from typing import Any

from bridge.core.ceiling import LEVEL_RANK

#: The reverse-DNS root of exported type names (AEP-0005 §1 B3, §3.2): one identity everywhere.
TYPE_ROOT = "dev.aep."

#: AEP-0001 §5.1: the sixteen context attributes and `data`.
CORE_ATTRIBUTES = frozenset(
    (
        "aep", "id", "type", "subject", "time", "source", "agent", "session", "run", "step",
        "seq", "epoch", "cause", "traceparent", "severity", "capture", "data",
    )
)

#: AEP-0001 §5.4 (the CloudEvents extension-name rule).
EXTENSION_NAME = re.compile(r"[a-z0-9]{1,20}")

SEVERITIES = ("debug", "info", "notice", "warning", "error", "critical")

TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")

_RFC3339 = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[Tt](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9})\d*)?(?:([Zz])|([+-])(\d{2}):(\d{2}))"
)
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)

_STRINGS = ("aep", "id", "type", "time", "source", "agent")
_OPTIONAL_STRINGS = ("subject", "session", "run", "step", "cause")


class BridgeError(ValueError):
    """An input the projection cannot take; `reason` is a short machine word."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def time_ns(text: str) -> int:
    """RFC 3339 -> Unix time in integer nanoseconds (exact: no float on the way)."""
    m = _RFC3339.fullmatch(text)
    if not m:
        raise BridgeError("bad_time", f"time {text!r} is not an RFC 3339 timestamp with a time zone")
    year, month, day, hour, minute, second = (int(g) for g in m.group(1, 2, 3, 4, 5, 6))
    if m.group(8):
        offset = timedelta(0)
    else:
        offset = timedelta(hours=int(m.group(10)), minutes=int(m.group(11)))
        if m.group(9) == "-":
            offset = -offset
    try:
        moment = datetime(year, month, day, hour, minute, second, tzinfo=timezone(offset))
    except ValueError as exc:
        raise BridgeError("bad_time", f"time {text!r}: {exc}") from None
    delta = moment - _EPOCH
    fraction = int((m.group(7) or "").ljust(9, "0"))
    return (delta.days * 86_400 + delta.seconds) * 1_000_000_000 + fraction


def _nonneg_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_event(event: Any) -> dict[str, Any]:
    """The envelope rules the projections rely on; returns the event or raises BridgeError.

    Not a full validation against the type schemas: the payload is carried, never read,
    except for the few members a projection names (tool call id, resolution).
    """
    if not isinstance(event, dict):
        raise BridgeError("not_object", "an AEP event is a JSON object")
    for name in _STRINGS:
        value = event.get(name)
        if not isinstance(value, str) or not value:
            raise BridgeError("bad_envelope", f"{name!r} must be a non-empty string")
    for name in _OPTIONAL_STRINGS:
        if name in event and (not isinstance(event[name], str) or not event[name]):
            raise BridgeError("bad_envelope", f"{name!r} must be a non-empty string when present")
    time_ns(event["time"])
    for name in ("seq", "epoch"):
        if name in event and not _nonneg_int(event[name]):
            raise BridgeError("bad_envelope", f"{name!r} must be an integer >= 0")
    if "severity" in event and event["severity"] not in SEVERITIES:
        raise BridgeError("bad_envelope", f"severity {event['severity']!r} is not one of {', '.join(SEVERITIES)}")
    if "capture" in event and (not isinstance(event["capture"], str) or event["capture"] not in LEVEL_RANK):
        raise BridgeError("bad_envelope", f"capture {event['capture']!r} is not one of {', '.join(LEVEL_RANK)}")
    if "traceparent" in event and (
        not isinstance(event["traceparent"], str) or not TRACEPARENT.fullmatch(event["traceparent"])
    ):
        raise BridgeError("bad_envelope", f"traceparent {event['traceparent']!r} is not a W3C traceparent")
    if "data" in event and not isinstance(event["data"], dict):
        raise BridgeError("bad_envelope", "'data' must be a JSON object")
    for name, value in event.items():
        if name in CORE_ATTRIBUTES:
            continue
        if not EXTENSION_NAME.fullmatch(name):
            raise BridgeError("bad_extension", f"extension attribute name {name!r} does not match [a-z0-9]{{1,20}}")
        if not isinstance(value, (str, int)):  # bool is an int
            raise BridgeError("bad_extension", f"extension attribute {name!r} must be a string, integer or boolean")
    return event


def extensions(event: dict[str, Any]) -> dict[str, Any]:
    """The event's extension attributes (AEP-0001 §5.4), in wire order."""
    return {k: v for k, v in event.items() if k not in CORE_ATTRIBUTES}


def envelope(event: dict[str, Any]) -> dict[str, Any]:
    """Every attribute but `data`, extension attributes included, in wire order."""
    return {k: v for k, v in event.items() if k != "data"}
