"""Is a message with this ``Nats-Msg-Id`` already in a stream? For resends past the duplicate window.

Every publish of the bridge carries ``Nats-Msg-Id``, and each stream drops a second
copy within its duplicate window (2 min by default). A copy sent again later (a shim
spool replayed after a long outage, a mapper redelivery, a pairing replay from its
last checkpoint after a long takeover) would be stored twice. The stage that resends
knows when the first attempt can have happened at the earliest, so it asks the
stream, on the subject the copy would have had, from that time on: JetStream's
``STREAM.MSG.GET`` with ``start_time`` + ``next_by_subj``, then ``seq`` +
``next_by_subj``, at most ``max_probes`` messages (SCAN_BUDGET unless the caller says).
Only messages that may be older than the window are looked up, so the normal path never
pays for it. The only reply that ends a subject is "no message found" (10037); any other
error reply raises `ScanError`, as a timeout raises: the read did not cover its stretch.
The caller then publishes, a duplicate at worst, never a loss, and counts it.

`find_msg_id` looks for one id; `msg_ids_on` reads the ids of a whole stretch of a
subject once, for a caller with many ids to look up on it (a redelivered batch).
"""

from __future__ import annotations

import base64
import calendar
import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

DEFAULT_MARGIN_NS = 10 * 1_000_000_000  # a shim host's clock vs the server's, plus the shim's deadline
SERVER_MARGIN_NS = 1_000_000_000  # two JetStream timestamps (stream leaders' clocks may differ a little)
# Messages one look-up reads at most (one request each: ~0.4-0.5 ms on a local server). A
# busy subject (`_unknown` collects every session's unknown events) holds far more than the
# 64 probes of earlier releases within a window.
SCAN_BUDGET = 10_000
NO_MESSAGE = 10037  # JetStream's err_code for "no message found": the end of the subject
MSG_ID_HEADER = b"Nats-Msg-Id: "


def rfc3339_ns(ns: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ns // 1_000_000_000)) + f".{ns % 1_000_000_000:09d}Z"


def parse_rfc3339_ns(text: str) -> int:
    """The server's ``2026-12-01T00:04:18.336432962Z`` (UTC) as ns since the epoch."""
    head, _, frac = text.rstrip("Z").partition(".")
    seconds = calendar.timegm(time.strptime(head[:19], "%Y-%m-%dT%H:%M:%S"))
    return seconds * 1_000_000_000 + int((frac[:9] or "0").ljust(9, "0"))


def stored_ns(msg: Any) -> int | None:
    """When JetStream stored a delivered message (ns), from its metadata."""
    meta = getattr(msg, "metadata", None)
    ts_ns = getattr(meta, "ts_ns", None)  # bridge.nats.pull.Metadata: exact, no datetime
    if ts_ns is not None:
        return ts_ns
    ts = getattr(meta, "timestamp", None)
    return int(ts.timestamp() * 1e9) if ts is not None else None


def msg_id_of(headers: bytes) -> str | None:
    """The ``Nats-Msg-Id`` in a raw header block (``NATS/1.0\\r\\nKey: value\\r\\n...``)."""
    start = headers.find(MSG_ID_HEADER)
    if start < 0:
        return None
    start += len(MSG_ID_HEADER)
    end = headers.find(b"\r\n", start)
    return headers[start:end if end >= 0 else len(headers)].decode("utf-8", "replace")


class ScanError(Exception):
    """A STREAM.MSG.GET answered an error other than "no message found" (no stream, no
    leader, ...): what was read so far is not all there is."""

    def __init__(self, stream: str, error: dict[str, Any]) -> None:
        self.code = error.get("err_code")
        super().__init__(f"{stream}: {error.get('code')} {self.code} {error.get('description', '')}".strip())


async def _stored_on(nc: Any, stream: str, subject: str, since_ns: int, *, api_prefix: str,
                     timeout: float) -> AsyncIterator[tuple[int, int, bytes]]:
    """(stream seq, stored time ns, raw headers) of each message on ``subject`` from ``since_ns`` on."""
    api = f"{api_prefix}.STREAM.MSG.GET.{stream}"
    request: dict[str, Any] = {"start_time": rfc3339_ns(max(since_ns, 0)), "next_by_subj": subject}
    while True:
        reply = await nc.request(api, json.dumps(request).encode(), timeout=timeout)
        answer = json.loads(reply.data)
        found = answer.get("message")
        if not found:
            error = answer.get("error") or {}
            if error.get("err_code") == NO_MESSAGE:
                return  # nothing more on the subject
            raise ScanError(stream, error)
        seq = int(found["seq"])
        yield seq, parse_rfc3339_ns(found["time"]), base64.b64decode(found.get("hdrs") or "")
        request = {"seq": seq + 1, "next_by_subj": subject}


async def find_msg_id(nc: Any, stream: str, subject: str, msg_id: str, since_ns: int, *,
                      before_seq: int | None = None, until_ns: int | None = None,
                      max_probes: int = SCAN_BUDGET, api_prefix: str = "$JS.API",
                      timeout: float = 5.0) -> int | None:
    """The stream sequence of a message on ``subject`` stored at or after ``since_ns`` whose
    ``Nats-Msg-Id`` is ``msg_id`` (stopping at ``before_seq`` / after ``until_ns``), or None."""
    needle = MSG_ID_HEADER + msg_id.encode() + b"\r\n"
    probes = 0
    async with aclosing(_stored_on(nc, stream, subject, since_ns, api_prefix=api_prefix, timeout=timeout)) as stored_on:
        async for seq, stored, headers in stored_on:
            if before_seq is not None and seq >= before_seq:
                return None
            if until_ns is not None and stored > until_ns:
                return None
            if needle in headers:
                return seq
            probes += 1
            if probes >= max_probes:
                return None
    return None


async def msg_ids_on(nc: Any, stream: str, subject: str, since_ns: int, until_ns: int, *, max_probes: int,
                     api_prefix: str = "$JS.API", timeout: float = 5.0) -> tuple[set[str], bool]:
    """The ``Nats-Msg-Id`` of every message on ``subject`` stored from ``since_ns`` to
    ``until_ns``, and whether that is all of them (False: ``max_probes`` messages were read
    and there are more). An error reply raises `ScanError`."""
    ids: set[str] = set()
    if max_probes <= 0:
        return ids, False
    probes = 0
    async with aclosing(_stored_on(nc, stream, subject, since_ns, api_prefix=api_prefix, timeout=timeout)) as stored_on:
        async for _seq, stored, headers in stored_on:
            if stored > until_ns:
                return ids, True
            if probes >= max_probes:
                return ids, False
            probes += 1
            msg_id = msg_id_of(headers)
            if msg_id is not None:
                ids.add(msg_id)
    return ids, True


async def duplicate_window_s(js: Any, stream: str) -> float | None:
    """``stream``'s duplicate window in seconds (what a resend must be looked up past), None
    when it has none or this role may not ask (the caller assumes the default). No answer (an
    election: `bridge.nats.connection.UNANSWERED`) raises: asked again, not assumed."""
    from bridge.nats.connection import UNANSWERED

    try:
        window = getattr((await js.stream_info(stream)).config, "duplicate_window", None)
    except UNANSWERED:
        raise
    except Exception:
        return None
    return float(window) if window else None
