"""`aep-bridge tail`: follow AEP_EVENTS, one readable line per event, grouped by lane.

It reads with an ephemeral ordered consumer (nothing durable, nothing acked), so
it never takes an event away from the real consumers.
"""

from __future__ import annotations

import asyncio
import fnmatch
import re
import sys
import time
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, TextIO

import msgspec
from nats.js.api import ConsumerConfig, DeliverPolicy

from bridge.core.lanes import UNKNOWN, UNKNOWN_TOKEN, lane_token
from bridge.core.usage import printable
from bridge.nats import streams as S
from bridge.nats import subjects as subj
from bridge.nats.connection import ordered_subscribe

_COLORS = [32, 34, 35, 36, 33, 92, 94, 95, 96, 93]
_RESET = "\x1b[0m"

_KEY_FIELDS = (
    ("tool", lambda d: (d.get("tool") or {}).get("name")),
    ("call", lambda d: (d.get("tool") or {}).get("call_id")),
    ("ms", lambda d: d.get("duration_ms")),
    ("error", lambda d: (d.get("error") or {}).get("type")),
    ("by", lambda d: d.get("by")),
    ("kind", lambda d: d.get("kind")),
    ("answer", lambda d: _answer(d.get("answer"))),
    ("resolution", lambda d: d.get("resolution")),
    ("latency_ms", lambda d: d.get("latency_ms")),
    ("child", lambda d: (d.get("child") or {}).get("session")),
    ("status", lambda d: d.get("status")),
    ("reason", lambda d: d.get("reason")),
    ("trigger", lambda d: d.get("trigger")),
    ("status_code", lambda d: d.get("status_code")),
    # what a model call (x.hermes.api.call / .error) and a run's totals spend (issue 40)
    ("model", lambda d: str(d.get("gen_ai.request.model") or d.get("gen_ai.response.model") or "")[:40] or None),
    ("in", lambda d: d.get("gen_ai.usage.input_tokens")),
    ("out", lambda d: d.get("gen_ai.usage.output_tokens")),
    ("calls", lambda d: d.get("model_calls")),
    ("cost", lambda d: _cost(d.get("cost"))),
)


def _cost(cost: Any) -> str | None:
    if not isinstance(cost, dict) or "total" not in cost:
        return None
    return f"{cost['total']:g}{cost.get('currency', '')}" if isinstance(cost["total"], (int, float)) else None


def _answer(answer: Any) -> str | None:
    if not isinstance(answer, dict):
        return None
    if "option" in answer:
        return str(answer["option"])
    if "values" in answer:
        return ",".join(f"{k}={v}" for k, v in answer["values"].items())
    return None


def parse_since(value: str | None, now: datetime | None = None) -> datetime | None:
    """`5m`, `2h`, `30s`, `1d` ago, or an RFC 3339 time."""
    if not value:
        return None
    now = now or datetime.now(timezone.utc)
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", value.strip())
    if m:
        unit = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}[m.group(2)]
        try:
            return now - timedelta(**{unit: float(m.group(1))})
        except OverflowError:  # before year 1 (1000000d): a one-line error, not a traceback
            raise ValueError(f"--since {value!r}: too far back (at most {(now - datetime.min.replace(tzinfo=timezone.utc)).days}d)") from None
    try:
        dt = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"--since {value!r}: expected a duration like 5m/2h/1d or an RFC 3339 time") from None
    try:
        return dt.astimezone(timezone.utc) if dt.tzinfo else dt.replace(tzinfo=timezone.utc)
    except OverflowError:  # 0001-01-01T00:00:00+01:00 is before year 1 in UTC
        raise ValueError(f"--since {value!r}: too far back") from None


class Formatter:
    """One line per event; a header line whenever the lane changes."""

    def __init__(self, color: bool, out: TextIO) -> None:
        self.color = color
        self.out = out
        self.lane_colors: dict[str, int] = {}
        self.last_lane: str | None = None

    def _c(self, code: int, text: str) -> str:
        return f"\x1b[{code}m{text}{_RESET}" if self.color else text

    def lane_label(self, event: dict[str, Any]) -> str:
        session = event.get("session", "")
        if event.get("lane") == UNKNOWN:
            return "unknown"
        return printable(str(session)) or "-"

    def line(self, event: dict[str, Any]) -> str:
        lane = self.lane_label(event)
        if lane == "unknown":
            color = 31
        else:
            color = self.lane_colors.setdefault(lane, _COLORS[len(self.lane_colors) % len(_COLORS)])
        parts = []
        t = printable(str(event.get("time", "")))
        parts.append(t[11:23] if len(t) >= 23 else t)
        parts.append(self._c(color, f"[{lane[-22:]}]"))
        run = printable(str(event.get("run", "")))
        parts.append(f"run={run.rsplit(':', 1)[-1]}" if run else "run=-")
        etype = printable(str(event.get("type", "?")))
        type_color = 31 if etype.endswith((".failed", ".denied", ".error", ".timeout")) else 1
        parts.append(self._c(type_color, f"{etype:<28}"))
        if event.get("subject"):
            parts.append(f"subject={printable(str(event['subject'])[:40])}")
        data = event.get("data") or {}
        for name, getter in _KEY_FIELDS:
            try:
                value = getter(data)
            except AttributeError:
                value = None
            if value is not None:
                parts.append(printable(f"{name}={value}"))
        if event.get("cause"):
            parts.append(self._c(90, f"cause={printable(str(event['cause'])[-8:])}"))
        return "  ".join(parts)

    def emit(self, event: dict[str, Any]) -> None:
        lane = self.lane_label(event)
        if lane != self.last_lane:
            self.out.write(self._c(90, f"── lane {lane} ──") + "\n")
            self.last_lane = lane
        self.out.write(self.line(event) + "\n")
        self.out.flush()


async def tail(
    nc: Any,
    *,
    session: str | None = None,
    type_pattern: str | None = None,
    since: datetime | None = None,
    all_events: bool = False,
    as_json: bool = False,
    color: bool = False,
    out: TextIO = sys.stdout,
    count: int | None = None,
    idle_exit: float | None = None,
    stop: asyncio.Event | None = None,
    on_event: Callable[[dict[str, Any]], None] | None = None,
) -> int:
    js = nc.jetstream()
    # `--session unknown` follows the unknown lane (as documented), not a session named so.
    subject = subj.events_filter((UNKNOWN_TOKEN if session == UNKNOWN else lane_token(session)) if session else None)
    kwargs: dict[str, Any] = {}
    if since is not None:
        kwargs["config"] = _start_time_config(since)
    elif all_events:
        kwargs["deliver_policy"] = DeliverPolicy.ALL
    else:
        kwargs["deliver_policy"] = DeliverPolicy.NEW
    queue: asyncio.Queue = asyncio.Queue()

    async def cb(msg: Any) -> None:
        await queue.put(msg.data)

    sub = await ordered_subscribe(js, subject, S.AEP_EVENTS, cb=cb, **kwargs)  # by name: aep-consumer's right
    fmt = Formatter(color, out)
    seen = 0
    last = time.monotonic()
    try:
        while True:
            if stop is not None and stop.is_set():
                break
            try:
                # asyncio.timeout, not wait_for: Python 3.11's wait_for returns a get done by the
                # time Ctrl-C's cancel lands, and with events flowing tail never ended (gh-86296)
                async with asyncio.timeout(0.25):
                    data = await queue.get()
            except TimeoutError:
                if idle_exit is not None and time.monotonic() - last > idle_exit:
                    break
                continue
            last = time.monotonic()
            event = msgspec.json.decode(data)
            if type_pattern and not fnmatch.fnmatchcase(str(event.get("type", "")), type_pattern):
                continue
            if as_json:
                out.write(data.decode() + "\n")
                out.flush()
            else:
                fmt.emit(event)
            if on_event:
                on_event(event)
            seen += 1
            if count is not None and seen >= count:
                break
            await asyncio.sleep(0)  # Ctrl-C lands between two events, not once a backlog is drained
    finally:
        await sub.unsubscribe()
    return seen


def _start_time_config(since: datetime) -> Any:
    return ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=since)
