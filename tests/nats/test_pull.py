"""`bridge.nats.pull.Puller`: nats-py's fetch with one open pull request (issue 24).

What the mapper and pairing rely on: every message once, in order, at most ``batch`` per
call, as soon as it is published (a long poll, not a poll per call); ``TimeoutError`` when
nothing came; a missing consumer an error, not an empty wait for ever; and the
subscription's pending-bytes count kept (nats-py drops messages as a slow consumer past it).
"""

from __future__ import annotations

import asyncio
import time

import nats.errors
import pytest

from bridge.nats.pull import Puller
from tests.support.streams import on_scratch_stream


def run(url: str, body) -> None:  # type: ignore[no-untyped-def]
    """``await body(js, nc, stream, prefix, sub)`` with ``sub`` an explicit-ack pull consumer."""
    from nats.js.api import AckPolicy, ConsumerConfig

    async def with_consumer(js, nc, stream, prefix) -> None:  # type: ignore[no-untyped-def]
        sub = await js.pull_subscribe("", durable="p", stream=stream, config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT))
        await body(js, nc, stream, prefix, sub)

    on_scratch_stream(url, "PULL", with_consumer)


def test_every_message_once_in_order_and_batches_bounded(nats_server) -> None:  # type: ignore[no-untyped-def]
    async def body(js, nc, stream, prefix, sub) -> None:  # type: ignore[no-untyped-def]
        for i in range(300):
            await js.publish(f"{prefix}.a", str(i).encode())
        puller = Puller(sub)
        got: list[int] = []
        while len(got) < 300:
            msgs = await puller.fetch(64, timeout=2.0)
            assert 0 < len(msgs) <= 64
            got.extend(int(m.data) for m in msgs)
            for m in msgs:
                await m.ack()
        assert got == list(range(300))
        assert sub.pending_bytes == 0, "the subscription's byte count follows what was taken"
        with pytest.raises(Exception) as err:
            await puller.fetch(64, timeout=0.3)
        assert type(err.value).__name__ == "TimeoutError"

    run(nats_server.url, body)


def test_a_long_poll_one_request_for_many_messages(nats_server) -> None:  # type: ignore[no-untyped-def]
    """Messages published one by one while it waits: each returned as it comes, and the open
    request serves them all (nats-py's fetch sends two requests per call)."""
    async def body(js, nc, stream, prefix, sub) -> None:  # type: ignore[no-untyped-def]
        puller = Puller(sub)

        async def trickle() -> None:
            for i in range(20):
                await asyncio.sleep(0.02)
                await js.publish(f"{prefix}.a", str(i).encode())

        task = asyncio.create_task(trickle())
        got: list[int] = []
        started = time.monotonic()
        while len(got) < 20 and time.monotonic() - started < 10:
            msgs = await puller.fetch(256, timeout=5.0)
            got.extend(int(m.data) for m in msgs)
            for m in msgs:
                await m.ack()
        await task
        assert got == list(range(20))
        assert puller.requests == 1, puller.requests

    run(nats_server.url, body)


def test_a_consumer_that_is_gone_is_an_error(nats_server) -> None:  # type: ignore[no-untyped-def]
    async def body(js, nc, stream, prefix, sub) -> None:  # type: ignore[no-untyped-def]
        puller = Puller(sub)
        await js.delete_consumer(stream, "p")
        started = time.monotonic()
        with pytest.raises(Exception) as err:
            await puller.fetch(16, timeout=2.0)
        assert type(err.value).__name__ != "TimeoutError", err.value
        assert time.monotonic() - started < 2.0

    run(nats_server.url, body)


@pytest.mark.parametrize("reply", [
    "$JS.ACK.HERMES_RAW.bridge-mapper.3.1234.77.1764543353123456789.42",
    "$JS.ACK._.ACCHASH.HERMES_RAW.bridge-mapper.1.5.6.1764543353000000001.0.tok",
    "$JS.ACK.hub.ACCHASH.BRIDGE_MAPPED.p3.2.99.98.1764543353999999999.7",
])
def test_metadata_of_reads_what_nats_py_reads(reply: str) -> None:
    from nats.aio.msg import Msg

    from bridge.nats.pull import metadata_of

    ours, theirs = metadata_of(reply), Msg.Metadata._from_reply(reply)
    assert ours is not None
    assert (ours.sequence.stream, ours.sequence.consumer) == (theirs.sequence.stream, theirs.sequence.consumer)
    assert (ours.num_delivered, ours.num_pending, ours.stream, ours.consumer, ours.domain) == (
        theirs.num_delivered, theirs.num_pending, theirs.stream, theirs.consumer, theirs.domain)
    assert abs((ours.timestamp - theirs.timestamp).total_seconds()) < 1e-6
    tokens = reply.split(".")
    assert ours.ts_ns == int(tokens[7] if len(tokens) == 9 else tokens[9]), "the store time exact, in ns"


@pytest.mark.parametrize("reply", [None, "", "_INBOX.x.y", "$JS.ACK.S.C.1.2", "$JS.ACK.S.C.x.2.3.4.5"])
def test_metadata_of_is_none_for_what_is_not_an_ack_subject(reply) -> None:  # type: ignore[no-untyped-def]
    from bridge.nats.pull import metadata_of

    assert metadata_of(reply) is None


def test_fetched_messages_carry_their_metadata(nats_server) -> None:  # type: ignore[no-untyped-def]
    async def body(js, nc, stream, prefix, sub) -> None:  # type: ignore[no-untyped-def]
        from bridge.nats.lookup import stored_ns

        for i in range(5):
            await js.publish(f"{prefix}.a", str(i).encode())
        puller, msgs = Puller(sub), []
        while len(msgs) < 5:  # a fetch returns what has arrived (CI's loaded machine: 2, then 3)
            msgs += await puller.fetch(10, timeout=2.0)
        assert [m.metadata.sequence.stream for m in msgs] == [1, 2, 3, 4, 5]
        assert [m.metadata.sequence.consumer for m in msgs] == [1, 2, 3, 4, 5]
        assert all(m.metadata.num_delivered == 1 and m.metadata.stream == stream for m in msgs)
        # num_pending is the server's count when it sent each message, racy with the publishes'
        # own accounting on a loaded machine (CI once: [3, 2, 1, 0, 0]): never more than what is
        # left, never rising, and nothing left after the last.
        pending = [m.metadata.num_pending for m in msgs]
        assert all(p <= 4 - i for i, p in enumerate(pending)), pending
        assert pending == sorted(pending, reverse=True) and pending[-1] == 0, pending
        now = time.time_ns()
        assert all(0 <= now - stored_ns(m) < 60e9 for m in msgs)

    run(nats_server.url, body)


def test_gather_takes_a_burst_published_at_once_in_one_call(nats_server) -> None:  # type: ignore[no-untyped-def]
    """``gather_s`` (pairing's reader): after the first message of a burst (the mapper's batch,
    published at once), a call takes the rest as it comes until nothing new came for
    ``gather_s``, at most ``batch``, from the one open request; it returns then, long before
    its timeout."""
    async def body(js, nc, stream, prefix, sub) -> None:  # type: ignore[no-untyped-def]
        puller = Puller(sub, gather_s=0.05)
        sent = 0

        async def burst(n: int) -> None:
            nonlocal sent
            futures = [await js.publish_async(f"{prefix}.a", str(sent + i).encode()) for i in range(n)]
            sent += n
            await asyncio.gather(*futures)

        async def later(n: int) -> None:
            await asyncio.sleep(0.2)
            await burst(n)

        calls: list[list[int]] = []
        for n in (40, 100, 150):
            task = asyncio.create_task(later(n))  # the call waits for the first message
            taken = 0
            while taken < n:
                started = time.monotonic()
                msgs = await puller.fetch(256, timeout=5.0)
                assert time.monotonic() - started < 2.5, "returned once the burst ended, not at the timeout"
                calls.append([int(m.data) for m in msgs])
                taken += len(msgs)
                for m in msgs:
                    await m.ack()
            await task
        # The open request (256) ends inside the third burst: the call returns what it had
        # (116), and the next call's request takes the rest.
        assert [len(c) for c in calls] == [40, 100, 116, 34], [len(c) for c in calls]
        assert [i for c in calls for i in c] == list(range(290))
        assert puller.requests == 2, "one open request until its batch was used up"

    run(nats_server.url, body)


def test_gather_on_a_steady_stream_returns_after_gather_max_s(nats_server) -> None:  # type: ignore[no-untyped-def]
    """A stream with no quiet gap of ``gather_s`` (several busy mappers; one message every ~2 ms
    here against a 50 ms gap) still gives the caller what came every ``gather_max_s`` after a
    call's first message, not only a full batch or the call's timeout: many calls, every
    message once, in order."""
    async def body(js, nc, stream, prefix, sub) -> None:  # type: ignore[no-untyped-def]
        puller = Puller(sub, gather_s=0.05, gather_max_s=0.05)
        n = 300

        async def steady() -> None:
            for i in range(n):
                await js.publish(f"{prefix}.a", str(i).encode())
                await asyncio.sleep(0.002)

        task = asyncio.create_task(steady())
        calls: list[list[int]] = []
        while sum(map(len, calls)) < n:
            msgs = await puller.fetch(512, timeout=5.0)
            calls.append([int(m.data) for m in msgs])
            for m in msgs:
                await m.ack()
        await task
        assert [i for c in calls for i in c] == list(range(n))
        # ~1 s of stream (at least 0.6 s: 300 sleeps of 2 ms) in calls of at most ~50 ms each;
        # without the bound one call would take them all.
        assert len(calls) >= 8, [len(c) for c in calls]

    run(nats_server.url, body)


@pytest.mark.parametrize("burst", [False, True])
def test_a_burst_puller_leaves_what_comes_during_a_pause_on_the_server(nats_server, burst) -> None:  # type: ignore[no-untyped-def]
    """``burst``: once a call got messages, the next asks with ``no_wait`` for what gathered
    meanwhile, so nothing is pushed (one socket read per message) while the caller pauses;
    a quiet stream is waited for one message at a time. Every message still comes once, in
    order. Without it the open request takes each message as it is published."""
    async def body(js, nc, stream, prefix, sub) -> None:  # type: ignore[no-untyped-def]
        puller = Puller(sub, burst=burst)
        got: list[int] = []

        async def publish(first: int, n: int) -> None:
            for i in range(first, first + n):
                await js.publish(f"{prefix}.a", str(i).encode())

        async def take(n: int) -> None:
            while len(got) < n:
                msgs = await puller.fetch(64, timeout=2.0)
                got.extend(int(m.data) for m in msgs)
                for m in msgs:
                    await m.ack()

        await publish(0, 3)
        await take(3)
        await publish(3, 5)  # the caller's pause: where do these wait?
        await asyncio.sleep(0.3)
        pending = (await sub.consumer_info()).num_pending
        assert pending == (5 if burst else 0), pending
        requests = puller.requests
        before = len(got)
        await take(8)
        if burst:
            assert len(got) - before == 5 and puller.requests == requests + 1, "the five in one no_wait call"
        await publish(8, 4)
        await take(12)
        assert got == list(range(12))
        with pytest.raises(Exception) as err:
            await puller.fetch(64, timeout=0.3)
        assert type(err.value).__name__ == "TimeoutError"

    run(nats_server.url, body)


def test_burst_switched_on_and_off_between_calls_loses_and_repeats_nothing(nats_server) -> None:  # type: ignore[no-untyped-def]
    """A caller may switch ``burst`` on and off between calls (pairing's partitions did, when each
    had its own consumer and paused): the request open at the switch is used up first (a plain one until it expires, a no_wait one
    until its status), and every message still comes once, in order. Once the plain request
    has expired, what comes during a pause waits on the server."""
    async def body(js, nc, stream, prefix, sub) -> None:  # type: ignore[no-untyped-def]
        puller = Puller(sub)
        got: list[int] = []
        sent = 0

        async def publish(n: int) -> None:
            nonlocal sent
            for _ in range(n):
                await js.publish(f"{prefix}.a", str(sent).encode())
                sent += 1

        async def take(timeout: float = 0.4) -> None:
            while len(got) < sent:
                msgs = await puller.fetch(64, timeout=timeout)
                got.extend(int(m.data) for m in msgs)
                for m in msgs:
                    await m.ack()

        for burst in (False, True, True, False, True, False, False, True):
            puller.burst = burst
            await publish(3)
            await take()
        puller.burst = True
        await asyncio.sleep(0.5)  # the plain request of the last switch has expired meanwhile
        with pytest.raises(nats.errors.TimeoutError):
            await puller.fetch(64, timeout=0.3)
        await publish(1)
        await take()  # a quiet burst puller: waits for one message
        await publish(4)  # during the caller's pause
        await asyncio.sleep(0.2)
        assert (await sub.consumer_info()).num_pending == 4, "nothing pushed while the caller pauses"
        await take()
        assert got == list(range(sent))

    run(nats_server.url, body)


@pytest.mark.parametrize("status", ["409", "400"])
def test_a_status_without_a_description_is_an_api_error_not_a_key_error(status) -> None:  # type: ignore[no-untyped-def]
    """nats-py's ``APIError.from_msg`` reads the Description header of any status but a 503
    and raised ``KeyError`` without one: past every ``except APIError``, it ended the loop
    that fetched (a pairing partition's) instead of being handled as the status it is."""
    import nats.js.errors
    from nats.aio.msg import Msg

    from bridge.nats.pull import status_error

    msg = Msg(None, subject="_INBOX.x", headers={"Status": status})  # type: ignore[arg-type]
    error = status_error(msg)
    assert isinstance(error, nats.js.errors.APIError) and error.code == int(status), repr(error)

    if status == "409":  # a request ended (a conflict): temporary, the next call asks again
        return

    class Sub:
        _pending_size = 0

    puller = Puller.__new__(Puller)
    puller._queue, puller._sub, puller._open_left, puller._error = asyncio.Queue(), Sub(), 1, None
    msg.data = b""
    with pytest.raises(nats.js.errors.APIError):
        puller._take(16, msg)
