"""Is a message with this ``Nats-Msg-Id`` already in a stream? For resends past the duplicate window.

Every publish of the bridge carries ``Nats-Msg-Id``, and each stream drops a second
copy within its duplicate window (2 min by default). A copy sent again later (a shim
spool replayed after a long outage, a mapper redelivery, a pairing replay from its
last checkpoint after a long takeover) would be stored twice. The stage that resends
knows when the first attempt can have happened at the earliest, so it asks the
stream, on the subject the copy would have had, from that time on: JetStream's
``STREAM.MSG.GET`` with ``start_time`` + ``next_by_subj``, then ``seq`` +
``next_by_subj``, at most ``max_probes`` messages. Only messages that may be older
than the window are looked up, so the normal path never pays for it. Errors (no
permission, a timeout) answer "not found": the caller then publishes, a duplicate at
worst, never a loss.
"""

from __future__ import annotations

import base64
import calendar
import json
import time
from typing import Any

DEFAULT_MARGIN_NS = 10 * 1_000_000_000  # a shim host's clock vs the server's, plus the shim's deadline
SERVER_MARGIN_NS = 1_000_000_000  # two JetStream timestamps (stream leaders' clocks may differ a little)
DEFAULT_MAX_PROBES = 64


def rfc3339_ns(ns: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ns // 1_000_000_000)) + f".{ns % 1_000_000_000:09d}Z"


def parse_rfc3339_ns(text: str) -> int:
    """The server's ``2026-12-01T00:04:18.336432962Z`` (UTC) as ns since the epoch."""
    head, _, frac = text.rstrip("Z").partition(".")
    seconds = calendar.timegm(time.strptime(head[:19], "%Y-%m-%dT%H:%M:%S"))
    return seconds * 1_000_000_000 + int((frac[:9] or "0").ljust(9, "0"))


def stored_ns(msg: Any) -> int | None:
    """When JetStream stored a delivered message (ns), from its metadata."""
    ts = getattr(getattr(msg, "metadata", None), "timestamp", None)
    return int(ts.timestamp() * 1e9) if ts is not None else None


async def find_msg_id(nc: Any, stream: str, subject: str, msg_id: str, since_ns: int, *,
                      before_seq: int | None = None, until_ns: int | None = None,
                      max_probes: int = DEFAULT_MAX_PROBES, api_prefix: str = "$JS.API",
                      timeout: float = 5.0) -> int | None:
    """The stream sequence of a message on ``subject`` stored at or after ``since_ns`` whose
    ``Nats-Msg-Id`` is ``msg_id`` (stopping at ``before_seq`` / after ``until_ns``), or None."""
    needle = b"Nats-Msg-Id: " + msg_id.encode() + b"\r\n"
    api = f"{api_prefix}.STREAM.MSG.GET.{stream}"
    request: dict[str, Any] = {"start_time": rfc3339_ns(max(since_ns, 0)), "next_by_subj": subject}
    for _ in range(max_probes):
        reply = await nc.request(api, json.dumps(request).encode(), timeout=timeout)
        found = json.loads(reply.data).get("message")
        if not found:
            return None  # {"error": {"code": 404, ...}}: nothing more on the subject
        seq = int(found["seq"])
        if before_seq is not None and seq >= before_seq:
            return None
        if until_ns is not None and parse_rfc3339_ns(found["time"]) > until_ns:
            return None
        if needle in base64.b64decode(found.get("hdrs") or ""):
            return seq
        request = {"seq": seq + 1, "next_by_subj": subject}
    return None
