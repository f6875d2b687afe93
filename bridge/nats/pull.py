"""A lean fetch for a nats-py pull subscription: one long-poll request at a time.

nats-py's ``PullSubscription.fetch(batch, timeout)`` costs per message and per call what a
busy service pays on every event (issue 24, the profile in docs/BENCHMARKS.md "Cost"): each
message is taken with ``next_msg``, which makes a ``uuid4`` name, a task and a ``wait_for``
(another task and a timer); and each call sends a ``no_wait`` pull request first, then a
long-poll one when nothing was there, two publishes and a status reply per call, so a quiet
stream (one message per call) costs several times more per event than a busy one.

`Puller.fetch` keeps one pull request open on the server (``batch`` messages, ``expires`` =
the timeout) and sends the next only when that one is used up, expired or ended by a status
(404, 408, 409); the messages the server pushes for it wait in the subscription's queue and
are taken without a task each. Waiting for the first one is one ``wait_for`` per call (none
while messages are queued). The result is the same as ``fetch``'s: up to ``batch`` messages
in delivery order, ``nats.errors.TimeoutError`` when none came within ``timeout``, an
``APIError`` for a status that is not temporary (503: no consumer).

``burst`` (the mapper's): an open request takes each message as it is published, one socket
read and parse per message even while the caller pauses (`Linger`), so a quiet stream costs
per message what a busy one costs per batch. With ``burst``, once a call got messages the next
asks with ``no_wait`` for what gathered since (one burst, ended by a full batch or a status,
taken within `BURST_GRACE_S` of each message), a call that found nothing waits for one message
only, and a first message with a backlog behind it asks for the backlog at once: what comes
during a pause stays on the server. `cost.py --rates 250,2000` (2026-12-04, alternated, 2 rounds): the mapper 0.260, 0.274
-> 0.200, 0.198 ms per event at 250/s, 0.140, 0.142 -> 0.140, 0.134 at 2,000/s. Not for a
busy pairing reader: when each partition had its own, at 2,000/s the extra requests and statuses
cost pairing 0.100, 0.102 -> 0.114, 0.112 ms per event (the attribute may change between
calls: an open request is used up first).

``gather_s`` (pairing's reader, whose input comes in bursts: the mapper publishes a batch's
events at once): the open request stays open, and a call that got a first message takes the
rest as it comes until nothing new came for ``gather_s`` (or ``gather_max_s`` after the first
message: a stream with no such gap, such as several busy mappers, is not held up to a full
batch), so a burst is one call, one wake-up of the caller, and no pause is needed to gather it
(cost.py --rates 250,2000, 2026-12-05,
alternated: e2e p50 / p99 at 250/s 124-131 / 266-281 -> 78-79 / 146-149 ms, at 2,000/s p99
71-75 -> 53-54 ms, for the same CPU).

Each message it returns carries its JetStream metadata already parsed (`metadata_of`: two
named tuples with nats-py's field names, the store time kept as integer ns and turned into a
``datetime`` only when asked), which nats-py would build on the first ``msg.metadata`` from
two frozen dataclasses and a ``datetime``: ~8 % of the mapper's batch in `bench_mapper.py`'s
profile, and every service reads it for every message.

Messages the server pushed but no call took yet are delivered messages: on a consumer with
explicit acks they are redelivered after its ack wait when the subscriber goes away (as after
a fetch that timed out with a message in flight); pairing's consumers have no acks and resume
from their checkpoint.
"""

from __future__ import annotations

import asyncio
import datetime
import time
from typing import Any, NamedTuple

import nats.errors
import nats.js.errors

_STATUS = "Status"
_HEARTBEAT = "100"
_OVER = ("404", "408", "409")  # no messages, request expired, conflict (leadership change, max waiting, ...)
#: how long the rest of a burst may take after its last message before the call returns
BURST_GRACE_S = 0.05
_MARGIN_S = 0.05  # a request this close to its expiry is treated as expired (the server's clock runs too)
_REQUEST = b'{"batch": %d, "expires": %d}'  # a pull request (JetStream's JSON), as json.dumps wrote it
_NO_WAIT_REQUEST = b'{"batch": %d, "expires": %d, "no_wait": true}'


class SequencePair(NamedTuple):
    consumer: int
    stream: int


class Metadata(NamedTuple):
    """A delivered message's metadata, as nats-py's ``Msg.Metadata`` names it (``ts_ns``: when
    JetStream stored it, exact)."""

    sequence: SequencePair
    num_pending: int
    num_delivered: int
    ts_ns: int
    stream: str
    consumer: str
    domain: str | None = None

    @property
    def timestamp(self) -> datetime.datetime:
        return datetime.datetime.fromtimestamp(self.ts_ns / 1e9, datetime.timezone.utc)


def metadata_of(reply: str | None) -> Metadata | None:
    """The metadata in a JetStream ack subject: ``$JS.ACK.<stream>.<consumer>.<delivered>.<stream
    seq>.<consumer seq>.<ns>.<pending>`` or, with a domain and an account hash, ``$JS.ACK.<domain>.
    <hash>.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<ns>.<pending>[.<token>]``
    (the two forms nats-py reads); ``None`` for anything else."""
    if not reply or not reply.startswith("$JS.ACK."):
        return None
    t = reply.split(".")
    try:
        if len(t) == 9:
            return Metadata(SequencePair(int(t[6]), int(t[5])), int(t[8]), int(t[4]), int(t[7]), t[2], t[3])
        if len(t) >= 11:
            return Metadata(SequencePair(int(t[8]), int(t[7])), int(t[10]), int(t[6]), int(t[9]), t[4], t[5],
                            "" if t[2] == "_" else t[2])
    except ValueError:
        return None
    return None


def status_error(msg: Any) -> Exception:
    """nats-py's exception for a status message (503: ``ServiceUnavailableError``), returned:
    ``APIError.from_msg`` raises it, which lost the messages taken before the status."""
    try:
        nats.js.errors.APIError.from_msg(msg)
    except nats.js.errors.APIError as exc:
        return exc
    except (KeyError, ValueError):  # from_msg reads a Description any status but a 503 may lack
        status = (msg.headers or {}).get(_STATUS, "")
        return nats.js.errors.APIError(code=int(status) if status.isascii() and status.isdigit() else None, description=f"status {status}")
    return nats.js.errors.APIError(description="a status message")


class Puller:
    """`fetch` over ``psub`` (a nats-py ``PullSubscription``) with one open pull request;
    ``burst``: ``no_wait`` requests while messages flow (the module's docstring)."""

    def __init__(self, psub: Any, burst: bool = False, gather_s: float = 0.0, gather_max_s: float = 0.025) -> None:
        self.psub = psub
        self.burst = burst
        self.gather_s = gather_s  # (not with ``burst``) a call returns once nothing came for this long,
        self.gather_max_s = gather_max_s  # or this long after its first message (a steady stream)
        self._flowing = False  # the last request delivered messages: the next asks without waiting
        self._no_wait = False  # the open request is a no_wait one (it ends with a status or a full batch)
        self._sub = psub._sub  # nats-py's own fetch reads these too
        self._queue: asyncio.Queue[Any] = self._sub._pending_queue
        self._nc = psub._nc
        self._next = psub._nms
        self._inbox = psub._deliver
        self._open_until = 0.0  # monotonic expiry of the open request
        self._open_left = 0  # messages it may still deliver
        self.requests = 0  # pull requests sent (tests, benchmarks)
        self._error: Exception | None = None  # a status met behind messages: raised by the next call

    async def fetch(self, batch: int, timeout: float) -> list[Any]:
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        if not self._queue.empty():
            await asyncio.sleep(0)  # one turn for the other tasks per batch (nats-py's fetch gives one per message)
            msgs = self._take(batch)
            if msgs:
                return msgs
        deadline = time.monotonic() + timeout
        while True:
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                raise nats.errors.TimeoutError
            if self._open_left <= 0 or now >= self._open_until - _MARGIN_S:
                if not self.burst:
                    await self._request(batch, left)
                elif self._flowing:  # what gathered since the last call, in one burst
                    await self._request(batch, left, no_wait=True)
                else:  # quiet: wait for the first message only, so nothing trickles in during a pause
                    await self._request(1, left)
                left = deadline - time.monotonic()
            try:
                # asyncio.timeout, not wait_for: on 3.11 wait_for runs the get in a task of its
                # own (uvloop: 9.5 against 4.5 us a call; a call per batch and per pause).
                async with asyncio.timeout(min(left, max(0.0, self._open_until - time.monotonic()))):
                    first = await self._queue.get()
            except TimeoutError:
                if self._nc.is_closed:
                    raise nats.errors.ConnectionClosedError from None
                self._open_left = 0  # expired (its 408 may still come: dropped by `_take`)
                self._flowing = False
                continue
            msgs = self._take(batch, first)
            if self._no_wait:
                msgs = await self._rest_of_burst(msgs, batch, deadline)
            elif self.gather_s > 0 and not self.burst:
                until = min(deadline, time.monotonic() + self.gather_max_s)
                msgs = await self._rest_of_burst(msgs, batch, until, self.gather_s)
            elif self.burst and msgs and len(msgs) < batch and self._open_left <= 0 \
                    and getattr(msgs[-1].metadata, "num_pending", 0):
                # A quiet stream's first message with a backlog behind it (a start, shims
                # flushing their spools): the rest asked for now, not after the caller's pause.
                await self._request(batch - len(msgs), max(0.001, deadline - time.monotonic()), no_wait=True)
                msgs = await self._rest_of_burst(msgs, batch, deadline)
            self._flowing = self.burst and bool(msgs)
            if msgs:
                return msgs

    async def _rest_of_burst(self, msgs: list[Any], batch: int, deadline: float, grace: float = BURST_GRACE_S) -> list[Any]:
        """The rest of a no_wait request's burst, taken whole rather than one socket read at a
        time: it ends with a full batch or a status (408 once it delivered, 404). What has not
        come within ``grace`` of the last message (a status lost with a consumer leader, a
        message of an older request counted against this one) stays queued for the next call.
        With ``gather_s``, the same for an open request: the rest of a burst that another
        service published at once (the mapper's batch, for pairing), until ``grace`` passes
        with nothing new or ``deadline`` (the call's, or ``gather_max_s`` after the first)."""
        while self._open_left > 0 and len(msgs) < batch and self._error is None:
            wait = min(deadline, time.monotonic() + grace) - time.monotonic()
            try:
                async with asyncio.timeout(max(0.0, wait)):
                    more = await self._queue.get()
            except TimeoutError:
                break
            try:
                msgs += self._take(batch - len(msgs), more)
            except nats.js.errors.APIError as exc:  # a status behind the messages in hand: they first
                self._error = exc
        if self._open_left <= 0:
            self._no_wait = False
        return msgs

    async def _request(self, batch: int, seconds: float, no_wait: bool = False) -> None:
        expires_ns = max(1_000_000, int(seconds * 1e9) - 100_000)
        body = (_NO_WAIT_REQUEST if no_wait else _REQUEST) % (batch, expires_ns)  # json.dumps: 2.0 us, this 0.15
        await self._nc.publish(self._next, body, self._inbox)
        self._open_until = time.monotonic() + expires_ns / 1e9
        self._open_left = batch
        self._no_wait = no_wait
        self.requests += 1

    def _take(self, batch: int, first: Any = None) -> list[Any]:
        """The queued messages, up to ``batch`` (status messages counted and dropped)."""
        msgs: list[Any] = []
        queue, sub = self._queue, self._sub
        msg = first
        while True:
            if msg is None:
                if queue.empty() or len(msgs) >= batch:
                    return msgs
                msg = queue.get_nowait()
            sub._pending_size -= len(msg.data)
            headers = msg.headers
            status = headers.get(_STATUS) if headers else None
            if status is None:
                if msg._metadata is None:
                    msg._metadata = metadata_of(msg.reply)
                msgs.append(msg)
                self._open_left -= 1
            elif status in _OVER:
                self._open_left = 0
            elif status != _HEARTBEAT:
                self._open_left = 0
                error = status_error(msg)
                if not msgs:
                    raise error
                self._error = error  # the messages before it are returned first
                return msgs
            msg = None
