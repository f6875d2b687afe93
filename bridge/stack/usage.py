"""`aep-bridge usage`: read the model calls of AEP_EVENTS once and sum them (`bridge.core.usage`).

It reads the way `aep-bridge tail` does: an ephemeral ordered consumer (nothing durable,
nothing acked), filtered on the subjects of the model-call types
(``aep.hermes.*.x.hermes.api.*``: the server skips every other event), from ``since`` (the
time the stream stored the event) or the start. It stops at the stream's last sequence at
start: what arrives later is for the next run. A read that takes longer than a second says
how far it got on ``progress`` (stderr) every second.

Memory stays bounded however long the stream: the subscription has no callback (nats-py
answers an ordered consumer's flow control as soon as a message ARRIVES when there is one, so
nothing held the server back and a callback's queue took the whole stream: 400k events,
390 MB); the loop takes each message from the subscription's own queue, which nats-py counts
as delivered only once taken, so the server stops at its flow-control window (~1.7 MB here)
while the fold is behind (a 400k-event read: 56 MB max RSS, 7.2 s; 373 MB, 15.8 s with the
callback). The fold keeps counts, not lists (`bridge.core.usage`).
"""

from __future__ import annotations

import asyncio
import time
from datetime import datetime
from typing import Any, TextIO

import msgspec
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.client import JetStreamContext

from bridge.core.usage import API_CALL, API_ERROR, Usage
from bridge.nats import streams as S
from bridge.nats.connection import ordered_subscribe
from bridge.nats import subjects as subj

#: Both model-call types share this subject tail; other `x.hermes.api.*` types are skipped in `Usage.add`.
SUBJECT_FILTER = f"{subj.EVENTS_PREFIX}.*.x.hermes.api.*"
STALL_S = 15.0  # no message for this long while the server says more are pending: an error, not a hang


def _take(sub: Any) -> Any:
    """The subscription's next message when one is waiting, else None: what `next_msg` does
    without its task, timer and uuid per message (which made a 400k-event read 1.8x slower)."""
    queue = sub._pending_queue
    if queue.empty():
        return None
    msg = queue.get_nowait()
    sub._pending_size -= len(msg.data)
    queue.task_done()
    return msg


class _Created(JetStreamContext):
    """``nc.jetstream()`` that keeps the server's answers to the consumer creations it sends
    (nats-py does not keep them)."""

    def __init__(self, nc: Any) -> None:
        super().__init__(nc)
        self.created: list[Any] = []

    @property
    def _jsm(self) -> Any:
        jsm = JetStreamContext._jsm.fget(self)  # type: ignore[attr-defined]
        add_consumer = jsm.add_consumer

        async def recorded(*args: Any, **kw: Any) -> Any:
            info = await add_consumer(*args, **kw)
            self.created.append(info)
            return info

        jsm.add_consumer = recorded
        return jsm


async def subscribe(nc: Any, **kwargs: Any) -> tuple[Any, Any]:
    """The read's consumer: ordered, ephemeral, AckNone, created by name (the aep-consumer role
    may create no nameless consumer: bridge/nats/connection.py), and WITHOUT a callback, so
    flow control holds the server back while the reader is behind (module docstring).

    With the server's answer to the creation (its ``num_pending``: the matching events from
    the start point): the role may not ask ``$JS.API.CONSUMER.INFO`` afterwards."""
    js = _Created(nc)
    sub = await ordered_subscribe(js, SUBJECT_FILTER, S.AEP_EVENTS, **kwargs)
    return sub, (js.created[0] if js.created else None)


class UsageReadError(RuntimeError):
    """The read could not complete (the stream is missing, the server stopped answering)."""


async def read_usage(nc: Any, usage: Usage, *, since: datetime | None = None, progress: TextIO | None = None,
                     progress_s: float = 1.0, stall_s: float = STALL_S) -> int:
    """Fold the model-call events stored up to now into ``usage``; returns the messages read."""
    js = nc.jetstream()
    try:
        info = await js.stream_info(S.AEP_EVENTS)
    except Exception as exc:
        raise UsageReadError(f"cannot read stream {S.AEP_EVENTS}: {type(exc).__name__}: {exc or 'no answer'} "
                             "(is the bridge bootstrapped? `aep-bridge bootstrap`)") from None
    last = info.state.last_seq
    if not info.state.messages or last == 0:
        return 0
    if since is not None:
        config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=since)
        kwargs: dict[str, Any] = {"config": config}
    else:
        kwargs = {"deliver_policy": DeliverPolicy.ALL}
    sub, created = await subscribe(nc, **kwargs)
    read = 0
    started = time.monotonic()
    next_progress = started + progress_s
    last_msg = started
    try:
        expected = (created.num_pending or 0) if created is not None else 0  # matching messages from the start point
        if expected == 0:
            return 0
        while True:
            msg = _take(sub)
            if msg is None:
                try:
                    msg = await sub.next_msg(timeout=max(0.05, min(progress_s, stall_s)))
                except (asyncio.TimeoutError, NatsTimeoutError):
                    msg = None
            now = time.monotonic()
            if progress is not None and now >= next_progress:
                progress.write(f"aep-bridge usage: read {read:,} of ~{expected:,} model-call events "
                               f"({now - started:.0f} s)\n")
                progress.flush()
                next_progress = now + progress_s
            if msg is None:
                if nc.is_closed or not nc.is_connected:  # a server gone mid-read: say so now, not after stall_s
                    raise UsageReadError(f"lost the connection to NATS after {read} of ~{expected} events")
                if now - last_msg > stall_s:
                    raise UsageReadError(f"no event from {S.AEP_EVENTS} for {stall_s:.0f} s after {read} "
                                         f"of ~{expected}; the server stopped answering")
                continue
            last_msg = now
            meta = msg.metadata
            if meta.sequence.stream > last:
                break  # stored after we started
            read += 1
            try:
                event = msgspec.json.decode(msg.data)
            except msgspec.DecodeError:
                event = None
            if isinstance(event, dict) and event.get("type") in (API_CALL, API_ERROR):
                usage.add(event)
            if meta.sequence.stream >= last or not meta.num_pending:
                break
    finally:
        try:
            await sub.unsubscribe()
        except Exception:  # the connection is going away anyway
            pass
    return read
