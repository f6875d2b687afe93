"""Deterministic identity of AEP events.

At-least-once delivery is made safe by determinism: every stage may see a raw
message twice (redelivery, a second replica, a replay), so the same input must
give byte-identical output, and every publish carries ``Nats-Msg-Id`` = the
event id so the stream's duplicate window absorbs the second copy.

* ``id``: a ULID whose 48-bit time is the shim's receive time (ms) and whose
  80-bit "random" part is the first 10 bytes of SHA-256(``raw id/slot``).
* ``seq``: ``raw_seq * SLOTS + slot``. It grows with arrival order, has gaps,
  and is the same on every replica. Slots below ``MAPPED_SLOT`` are for events
  the pairing stage inserts before the mapped events of that raw message (a
  session-end sweep), ``MAPPED_SLOT..AFTER_SLOT-1`` for the mapper's events, and
  ``AFTER_SLOT..SLOTS-1`` for events inserted after them.
* ``epoch``: supplied by the caller (the raw stream's creation time).
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from datetime import datetime, timezone
from urllib.parse import quote

import msgspec

SLOTS = 1024
BEFORE_SLOT = 0
MAPPED_SLOT = 512
AFTER_SLOT = 768
MAX_MAPPED = AFTER_SLOT - MAPPED_SLOT

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


# Every 10-bit value as its two Crockford characters: 80 bits of entropy are 8 look-ups. The
# same string as RFC 4648 base32 translated to Crockford's alphabet (tests/core/test_identity.py
# holds them equal), 2.6 us per id against 9.4 us for base64.b32encode + translate (issue 24).
_PAIRS = tuple(a + b for a in _CROCKFORD for b in _CROCKFORD)


@lru_cache(maxsize=4096)
def _ulid_time(time_ms: int) -> str:
    """The ULID's 10 time characters: the first 8 (the time in units of 1,024 ms) cached, the
    last 2 from `_PAIRS`. A quiet stream's events each miss the cache by the millisecond (250
    events/s hardly share one, 2,000/s do): 1.2 us a miss before, 0.2 now."""
    value = time_ms & 0xFFFFFFFFFFFF
    return _ulid_time_high(value >> 10) + _PAIRS[value & 1023]


@lru_cache(maxsize=64)
def _ulid_time_high(high: int) -> str:
    chars = []
    for _ in range(8):
        chars.append(_CROCKFORD[high & 31])
        high >>= 5
    return "".join(reversed(chars))


def ulid_from(time_ms: int, entropy: bytes) -> str:
    """Encode a ULID from a 48-bit millisecond time and 10 bytes of entropy."""
    if len(entropy) < 10:
        raise ValueError("a ULID needs 10 bytes of entropy")
    v, p = int.from_bytes(entropy[:10], "big"), _PAIRS
    return "".join((_ulid_time(time_ms), p[v >> 70], p[v >> 60 & 1023], p[v >> 50 & 1023], p[v >> 40 & 1023],
                    p[v >> 30 & 1023], p[v >> 20 & 1023], p[v >> 10 & 1023], p[v & 1023]))


def ulid_time_ms(ulid: str) -> int:
    value = 0
    for ch in ulid.upper():
        value = value * 32 + _CROCKFORD.index(ch)
    return value >> 80


def event_id(raw_id: str, slot: int, time_ms: int) -> str:
    entropy = hashlib.sha256(f"{raw_id}/{slot}".encode()).digest()
    return ulid_from(time_ms, entropy)


def event_seq(raw_seq: int, slot: int) -> int:
    if not 0 <= slot < SLOTS:
        raise ValueError(f"slot {slot} outside 0..{SLOTS - 1}")
    return raw_seq * SLOTS + slot


def rfc3339(ts_ns: int) -> str:
    """Receive time as RFC 3339 UTC with millisecond precision (display only)."""
    return _rfc3339_ms(ts_ns // 1_000_000)


@lru_cache(maxsize=4096)
def _rfc3339_ms(ms: int) -> str:
    """The second's part cached, the milliseconds formatted: a quiet stream's events each miss
    the cache by the millisecond (250 events/s hardly share one): 3.0 us a miss before, 0.4 now."""
    return f"{_rfc3339_s(ms // 1000)}.{ms % 1000:03d}Z"


@lru_cache(maxsize=256)
def _rfc3339_s(s: int) -> str:
    return f"{datetime.fromtimestamp(s, tz=timezone.utc):%Y-%m-%dT%H:%M:%S}"


# Sized to the live sessions of a fleet (a few thousand), not to every session ever seen: at
# 65,536 entries the cache alone grew the mapper by ~0.35 KiB per new session for ~17 min
# of a 1,000-instance soak (tracemalloc, 2026-12-01). A miss costs one quote() and a format.
@lru_cache(maxsize=8192)
def source_uri(instance: str, session: str) -> str:
    return f"aep://{_uri_part(instance)}/agent/hermes/session/{_uri_part(session)}"


def _uri_part(value: str) -> str:
    """Percent-encode what a URI path segment / host cannot carry (ids are untrusted)."""
    return quote(value, safe="-._~") or "_"


class Origin(msgspec.Struct, frozen=True):
    """Where a mapped event comes from: the raw message and its place in HERMES_RAW."""

    raw_id: str
    raw_seq: int
    ts_ns: int
    instance: str
    epoch: int = 0

    @property
    def time_ms(self) -> int:
        return self.ts_ns // 1_000_000

    def id_for(self, slot: int) -> str:
        return event_id(self.raw_id, slot, self.time_ms)

    def seq_for(self, slot: int) -> int:
        return event_seq(self.raw_seq, slot)
