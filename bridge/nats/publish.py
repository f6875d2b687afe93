"""A lean JetStream ``publish_async`` for the services' hot path: one future per publish.

nats-py's ``JetStreamContext.publish_async`` costs, per publish, what the mapper and pairing
pay on every event (issue 24, docs/BENCHMARKS.md "Cost"): a ``wait_for`` on a semaphore, a
NUID and ``secrets.token_hex(2)`` (an ``os.urandom`` system call) for the reply subject, a
done-callback closure, and, per ack, ``json.loads`` and a ``PubAck`` dataclass. In
``bench_mapper.py``'s profile its wrapper around the core publish was ~9 % of the mapper's
batch and the ack handling more. And an error reply (``{"error": ...}``) never completes its
future there (``APIError.from_error`` raises inside the reply callback), so a refused publish
looked like a lost ack until the caller's timeout.

`AckPublisher.publish` sends through nats-py's core ``Client.publish`` with a reply subject
under one inbox wildcard subscription of its own (the same shape nats-py uses), named by a
counter, and returns a future that resolves to the ack's ``(stream, seq, duplicate)`` or
fails with nats-py's own exceptions (``NoStreamResponseError`` for a 503 no-responders reply,
``APIError`` and its subclasses for an error reply, with their ``code`` and ``err_code``).
The protocol is still nats-py's; only the bookkeeping is ours. Futures the caller cancels (an
ack lost with a dying server, the siblings of a failed publish) are swept out every
`SWEEP_EVERY` publishes.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any, NamedTuple, Sequence

import msgspec
import nats.js.errors

from bridge.nats import follow, wire

_STATUS = "Status"
_NO_RESPONDERS = "503"
SWEEP_EVERY = 4096  # publishes between two sweeps of the futures a caller gave up on
#: With nothing awaited, no publish sent and no "no responders" for this long, the failure clock
#: (`AckPublisher.unacked_since`) stops: one such answer followed by silence is no server that
#: cannot serve (a stream electing its leader on a healthy cluster answers a publish so).
QUIET_S = 2.0


class Ack(NamedTuple):
    stream: str
    seq: int
    duplicate: bool


class _Reply(msgspec.Struct):
    stream: str = ""
    seq: int = 0
    duplicate: bool = False
    error: dict | None = None


_decode = msgspec.json.Decoder(_Reply).decode


async def wait_all(futures: list[asyncio.Future], timeout: float) -> None:
    """Wait until every one of ``futures`` is done, or ``timeout`` seconds passed (then the
    ones not done are left as they are: the caller cancels or reads them), like
    ``asyncio.wait(futures, timeout=timeout)`` but with a callback on one future at a time:
    the last one first (a batch's acks come back about in the order it was sent), then any
    earlier one still not done. ``asyncio.wait`` adds and removes a done-callback on every
    future of the batch and builds two sets (issue 43: a batch's publishes, KV puts and
    creates, 300-odd futures)."""
    i = len(futures) - 1
    if i < 0:
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while i >= 0:
        future = futures[i]
        if future.done():
            i -= 1
            continue
        left = deadline - loop.time()
        if left <= 0:
            return
        await asyncio.wait((future,), timeout=left)


def error_of(err: dict[str, Any]) -> Exception:
    """nats-py's exception for a JetStream error reply (``APIError.from_error`` raises it)."""
    known = {k: err.get(k) for k in ("code", "description", "err_code") if k in err}  # a server may add keys
    try:
        nats.js.errors.APIError.from_error({"code": None, **known})
    except nats.js.errors.APIError as exc:
        return exc
    return nats.js.errors.APIError(**known)  # from_error raises; never reached


class AckPublisher:
    """Acked JetStream publishes over ``nc`` (a connected nats-py ``Client``)."""

    def __init__(self, nc: Any) -> None:
        self.nc = nc
        self._prefix = ""
        self._cut = 0
        self._futures: dict[str, asyncio.Future] = {}
        self._count = 0
        self._sub: Any = None
        #: monotonic time of the first publish sent since the last ack came (None: none since);
        #: read by bridge.nats.follow (a server whose publishes are not acked is left)
        self._unacked_since: float | None = None
        self._last_unanswered = 0.0  # monotonic: the last publish sent, or "no responders" answer

    async def start(self) -> "AckPublisher":
        if self._sub is None:
            inbox = self.nc._inbox_prefix  # the role's own prefix (bridge.nats.connection.ROLE_INBOX)
            prefix = (inbox.decode() if isinstance(inbox, (bytes, bytearray)) else str(inbox))
            self._prefix = f"{prefix}.{secrets.token_hex(8)}."
            self._cut = len(self._prefix)
            self._sub = await self.nc.subscribe(self._prefix + "*", cb=self._reply)
            follower = follow.of(self.nc)
            if follower is not None:
                follower.publishers.append(self)
        return self

    def unacked_since(self) -> float | None:
        """When the oldest publish sent after the last answer was sent: set until the server
        answers one (an ack or an error about what was sent) or `forget_unacked`. A publish its
        caller gave up on (cancelled unanswered) or that found no responders is no answer: the
        clock runs on. (Before, it stopped once nothing was awaited, answered or not: during a
        flapping link a mapper's server answered its publishes "no response from stream" at
        once, 13,991 times in 20 s, each batch's futures all done, so the clock started again
        with each batch and the follower never counted it; a partition run,
        2026-12-07.) It stops, too, once nothing is awaited and for `QUIET_S` no publish was sent
        and none found no responders: a service that goes quiet after one such answer stays."""
        if self._unacked_since is not None and time.monotonic() - self._last_unanswered > QUIET_S and not self.pending:
            self._unacked_since = None
        return self._unacked_since

    def forget_unacked(self) -> None:
        self._unacked_since = None

    def waiting(self) -> list[asyncio.Future]:
        """The publishes whose ack has not come (nor been given up on)."""
        return [f for f in self._futures.values() if not f.done()]

    @property
    def pending(self) -> int:
        """Publishes whose ack has not come (nor been given up on)."""
        return len(self.waiting())

    async def publish(self, subject: str, payload: bytes, headers: dict[str, str] | None = None) -> asyncio.Future:
        """Send one message; the returned future completes with its `Ack` or fails."""
        if self._sub is None:
            await self.start()
        self._count += 1
        token = str(self._count)
        future = asyncio.get_running_loop().create_future()
        self._futures[token] = future
        if self._count % SWEEP_EVERY == 0:
            self._sweep()
        was = self._unacked_since
        now = self._last_unanswered = time.monotonic()
        if was is None:
            self._unacked_since = now
        try:
            await wire.publish_many(self.nc, ((subject, payload, self._prefix + token, headers),))
        except BaseException:
            self._futures.pop(token, None)
            self._unacked_since = was  # (refused before it was sent, or the connection closed: not the server's silence)
            raise
        return future

    async def publish_many(self, items: Sequence[tuple[str, bytes, dict[str, str] | None]]) -> list[asyncio.Future]:
        """`publish` each ``(subject, payload, headers)`` of ``items`` in order, in one call and
        one write to the client's buffer (`bridge.nats.wire`): their futures, in the same order.
        When one cannot be sent (a bad subject, a payload over the server's limit, the
        connection closed) the futures are cancelled and the exception propagates; while
        connected nothing of the batch was sent then, every command being made first."""
        if self._sub is None:
            await self.start()
        loop = asyncio.get_running_loop()
        prefix, pending = self._prefix, self._futures
        futures: list[asyncio.Future] = []
        sends: list[wire.Item] = []
        was = self._unacked_since
        if items:
            now = self._last_unanswered = time.monotonic()
            if was is None:
                self._unacked_since = now
        count = self._count
        for subject, payload, headers in items:
            count += 1
            token = str(count)
            future = loop.create_future()
            pending[token] = future
            futures.append(future)
            sends.append((subject, payload, prefix + token, headers))
        if self._count // SWEEP_EVERY != count // SWEEP_EVERY:
            self._sweep()
        self._count = count
        try:
            await wire.publish_many(self.nc, sends)
        except BaseException:
            for (_s, _p, reply, _h), f in zip(sends, futures):
                pending.pop(reply[self._cut:], None)
                f.cancel()
            self._unacked_since = was  # (refused before it was sent, or the connection closed: not the server's silence)
            raise
        return futures

    def _sweep(self) -> None:
        for token in [t for t, f in self._futures.items() if f.done()]:
            del self._futures[token]

    async def _reply(self, msg: Any) -> None:
        headers = msg.headers
        if headers and headers.get(_STATUS) == _NO_RESPONDERS:  # no stream answered: not an ack
            self._last_unanswered = time.monotonic()
            future = self._futures.pop(msg.subject[self._cut:], None)
            if future is not None and not future.done():
                future.set_exception(nats.js.errors.NoStreamResponseError())
            return
        self._unacked_since = None  # the server's JetStream answers
        future = self._futures.pop(msg.subject[self._cut:], None)
        if future is None or future.done():
            return
        try:
            reply = _decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            future.set_exception(nats.js.errors.APIError(description=f"unreadable publish ack: {exc}"))
            return
        if reply.error is not None:
            future.set_exception(error_of(reply.error))
        else:
            future.set_result(Ack(reply.stream, reply.seq, reply.duplicate))
