"""A batch of publishes written to nats-py's outgoing buffer in one step (issue 43).

nats-py's `Client.publish` costs ~5.5 µs of CPU per message on uvloop: the subject checked by
a regular expression, the header block built key by key in a bytearray (its `str.translate` of
each value alone ~1.5 µs), two awaits and the flusher's queue checked, per message. Made here
and appended once per batch: ~2.05 µs (`benchmarks/wire_publish.py`, 64 messages of 600 bytes
with a reply and a Nats-Msg-Id, 2026-12-07). The mapper publishes every event and acks every
raw message, pairing publishes every event: three such calls per event.

The commands are made by nats-py's own builders (`nats.protocol.command`); the header block as
its `_send_publish` makes it (`tests/nats/test_wire.py` compares the bytes, and what a real
server delivers); the checks are nats-py's too (a subject or reply with whitespace or CR/LF, a
header key outside the token characters, a payload over the server's max_payload). What is private is where they go:
`Client._pending`, `_pending_data_size`, `_max_pending_size`, `_flush_queue` and
`_flush_pending`, as `Client._send_publish` uses them (nats-py is pinned in
deploy/requirements.lock; the tests fail if they move). While the client is not connected
(reconnecting, draining, closed) every message goes through the public `Client.publish`,
which buffers or raises as nats-py decides.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Sequence

import nats.errors
from nats.protocol.command import hpub_cmd, pub_cmd  # nats-py's own command builders

_INVALID = re.compile(r"[ \t\r\n]")  # nats-py's _SUBJECT_INVALID_RE: CR/LF would inject commands
_KEY = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # nats-py's _HEADER_KEY_RE

#: one message to send: (subject, payload, reply, headers)
Item = tuple[str, bytes, str, "dict[str, str] | None"]


_KEYS: dict[str, bytes] = {}  # a header key as written (b"Key: "), or b"" for one nats-py skips


def header_block(headers: dict[str, str]) -> bytes:
    """``NATS/1.0`` and the headers, as nats-py's `_send_publish` writes them (its checks on
    a key made once per key: the services' keys are a handful of constants)."""
    out = b"NATS/1.0\r\n"
    for k, v in headers.items():
        key = _KEYS.get(k)
        if key is None:
            stripped = k.strip()
            if stripped and not _KEY.fullmatch(stripped):
                raise nats.errors.BadHeaderError(stripped)
            key = stripped.encode() + b": " if stripped else b""
            if len(_KEYS) < 1024:
                _KEYS[k] = key
        if key:
            v = v.strip()
            if "\r" in v or "\n" in v:  # (nats-py's str.translate, ~1.5 µs per value, does the same)
                v = v.replace("\r", " ").replace("\n", " ")
            out += key + v.encode() + b"\r\n"
    return out + b"\r\n"


def command(subject: str, payload: bytes, reply: str = "", headers: dict[str, str] | None = None,
            max_payload: int | None = None) -> bytes:
    """The PUB (or HPUB, with headers) command for one message, checked as nats-py checks it."""
    if not subject or _INVALID.search(subject) or (reply and _INVALID.search(reply)):
        raise nats.errors.BadSubjectError
    if max_payload is not None and len(payload) > max_payload:
        raise nats.errors.MaxPayloadError
    if headers is None:
        return pub_cmd(subject, reply, payload)
    return hpub_cmd(subject, reply, header_block(headers), payload)


def direct(nc: Any) -> bool:
    """May commands be appended to ``nc``'s buffer (connected, not draining, not closed)?"""
    return nc.is_connected and not nc.is_draining_pubs


async def write(nc: Any, commands: Sequence[bytes], payload_bytes: int) -> None:
    """Append ``commands`` to ``nc``'s outgoing buffer as one write and wake its flusher, as
    `Client._send_publish` does for one (the caller checked `direct`)."""
    if not commands:
        return
    data = b"".join(commands) if len(commands) > 1 else commands[0]
    nc._pending.append(data)
    nc._pending_data_size += len(data)
    stats = nc.stats
    stats["out_msgs"] += len(commands)
    stats["out_bytes"] += payload_bytes
    if nc._max_pending_size > 0 and nc._pending_data_size > nc._max_pending_size:
        await nc._flush_pending(force_flush=True)
    if nc._flush_queue is not None and nc._flush_queue.empty():
        await nc._flush_pending()


async def publish_many(nc: Any, items: Iterable[Item]) -> None:
    """Publish every ``(subject, payload, reply, headers)`` of ``items``, in order: one write
    while connected (every command made, and checked, before any is sent), else one public
    `Client.publish` each."""
    items = list(items)
    if not direct(nc):
        for subject, payload, reply, headers in items:
            await nc.publish(subject, payload, reply=reply, headers=headers)
        return
    limit = nc._max_payload
    commands = [command(subject, payload, reply, headers, limit) for subject, payload, reply, headers in items]
    await write(nc, commands, sum(len(i[1]) for i in items))


async def ack_many(nc: Any, msgs: Sequence[Any]) -> None:
    """Ack every JetStream message of ``msgs`` (an empty publish to its reply subject, as
    nats-py's `Msg.ack`) in one write; each is marked acked once written. A message without a
    reply subject, or acked already, raises as `Msg.ack` does, before anything is sent."""
    for m in msgs:
        m._check_reply()
    if not direct(nc):
        for m in msgs:
            await m.ack()
        return
    await write(nc, [command(m.reply, b"") for m in msgs], 0)
    for m in msgs:
        m._ackd = True
