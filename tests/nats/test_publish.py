"""`bridge.nats.publish.AckPublisher`: nats-py's publish_async with one future per publish
(issue 24), on a real nats-server.

What the mapper and pairing rely on: a future per publish that completes with the stream's
ack (sequence, duplicate flag) once JetStream stored it; fails with nats-py's own exceptions
when nothing stores the subject (503) or the server refuses the write (an error reply, with
its ``err_code``: the KV create of a lane fact that exists already); futures given up on do
not pile up.
"""

from __future__ import annotations

import asyncio
import time

import nats.js.errors
import pytest

from bridge.nats import publish as publish_mod
from bridge.nats.publish import Ack, AckPublisher
from tests.support.streams import on_scratch_stream

WRONG_LAST_SEQUENCE = 10071


def run(url: str, body) -> None:  # type: ignore[no-untyped-def]
    """``await body(js, nc, stream, prefix, publisher)`` on a stream of its own (60 s duplicate window)."""
    async def with_publisher(js, nc, stream, prefix) -> None:  # type: ignore[no-untyped-def]
        await body(js, nc, stream, prefix, await AckPublisher(nc).start())

    on_scratch_stream(url, "PUB", with_publisher, duplicate_window=60.0)


def test_each_publish_is_acked_with_its_sequence_and_duplicates_are_flagged(nats_server) -> None:  # type: ignore[no-untyped-def]
    async def body(js, nc, stream, prefix, pub) -> None:  # type: ignore[no-untyped-def]
        futures = [await pub.publish(f"{prefix}.a", str(i).encode(), headers={"Nats-Msg-Id": f"id-{i}"})
                   for i in range(500)]
        acks = await asyncio.gather(*futures)
        assert [a.seq for a in acks] == list(range(1, 501)), "one ack per publish, each its own"
        assert {a.stream for a in acks} == {stream} and not any(a.duplicate for a in acks)
        again = await (await pub.publish(f"{prefix}.a", b"0", headers={"Nats-Msg-Id": "id-0"}))
        assert again == Ack(stream, 1, True), "the duplicate window's answer"
        assert (await js.stream_info(stream)).state.messages == 500
        assert pub.pending == 0

    run(nats_server.url, body)


def test_a_subject_no_stream_stores_fails_with_no_responders(nats_server) -> None:  # type: ignore[no-untyped-def]
    async def body(js, nc, stream, prefix, pub) -> None:  # type: ignore[no-untyped-def]
        future = await pub.publish("nowhere.at.all", b"x")
        with pytest.raises(nats.js.errors.NoStreamResponseError):
            await asyncio.wait_for(future, 5)

    run(nats_server.url, body)


def test_an_error_reply_fails_the_future_with_its_err_code(nats_server) -> None:  # type: ignore[no-untyped-def]
    """A KV-style create (expected last subject sequence 0) of a subject that exists: the
    server answers with an error; the future fails at once with that error, not a timeout."""
    async def body(js, nc, stream, prefix, pub) -> None:  # type: ignore[no-untyped-def]
        create = {"Nats-Expected-Last-Subject-Sequence": "0"}
        first = await asyncio.wait_for(await pub.publish(f"{prefix}.fact", b"a", headers=create), 5)
        assert first.seq == 1
        started = time.monotonic()
        with pytest.raises(nats.js.errors.APIError) as err:
            await asyncio.wait_for(await pub.publish(f"{prefix}.fact", b"b", headers=create), 5)
        assert err.value.err_code == WRONG_LAST_SEQUENCE, err.value
        assert time.monotonic() - started < 4, "answered, not timed out"

    run(nats_server.url, body)


def test_futures_given_up_on_are_swept(nats_server, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(publish_mod, "SWEEP_EVERY", 50)

    async def body(js, nc, stream, prefix, pub) -> None:  # type: ignore[no-untyped-def]
        await asyncio.gather(*[await pub.publish(f"{prefix}.b", b"x") for _ in range(200)])
        assert pub.pending == 0 and len(pub._futures) < 50, "answered futures leave at once"
        # A caller that gives up on a future (an ack lost with a dying server, the sibling of
        # a failed publish): its entry goes at the next sweep.
        lost = asyncio.get_running_loop().create_future()
        pub._futures["lost"] = lost
        lost.cancel()
        await asyncio.gather(*[await pub.publish(f"{prefix}.b", b"y") for _ in range(60)])
        assert "lost" not in pub._futures
        assert len(pub._futures) < 60

    run(nats_server.url, body)


def test_publish_many_acks_each_in_order_and_a_failed_send_leaves_nothing_awaited(nats_server) -> None:  # type: ignore[no-untyped-def]
    """A batch's publishes in one call (pairing's): a future per item, in the items' order, each
    with its own ack; a send that raises (here: a payload past max_payload, refused by nats-py
    before it is written) cancels the futures of the items before it, which the caller never
    gets, so none of them is left pending in the publisher."""
    import nats.errors

    async def body(js, nc, stream, prefix, pub) -> None:  # type: ignore[no-untyped-def]
        items = [(f"{prefix}.m", str(i).encode(), {"Nats-Msg-Id": f"m-{i}"}) for i in range(300)]
        futures = await pub.publish_many(items)
        acks = [await f for f in futures]
        assert [a.seq for a in acks] == list(range(1, 301)) and not any(a.duplicate for a in acks)
        again = await pub.publish_many(items[:3])
        assert [(await f).duplicate for f in again] == [True, True, True], "same ids: the window's duplicates"
        too_big = b"x" * (nc.max_payload + 1)
        with pytest.raises(nats.errors.MaxPayloadError):
            await pub.publish_many([(f"{prefix}.m", b"a", None), (f"{prefix}.m", b"b", None), (f"{prefix}.m", too_big, None)])
        assert pub.pending == 0, "the two sent before the refused one are not left awaited"
        assert await pub.publish_many([]) == []

    run(nats_server.url, body)


def test_error_of_keeps_nats_py_exception_classes() -> None:
    assert isinstance(publish_mod.error_of({"code": 503, "description": "x"}), nats.js.errors.ServiceUnavailableError)
    err = publish_mod.error_of({"code": 400, "err_code": 10071, "description": "wrong last sequence", "extra": 1})
    assert isinstance(err, nats.js.errors.BadRequestError) and err.err_code == 10071


def test_publishes_unanswered_or_without_responders_keep_the_failure_clock_running(nats_server) -> None:  # type: ignore[no-untyped-def]
    """A publish that finds no responders ("no response from stream": its server does not reach
    the stream's leader), or whose ack never comes and that its caller gives up on, is not an
    answer: `unacked_since` stays at the first such send until the server answers a publish.
    It used to stop as soon as nothing was awaited: during a flapping link a mapper's server
    answered 13,991 publishes "no response from stream" in 20 s and the follower never moved it
    (a partition run, 2026-12-07)."""
    async def body(js, nc, stream, prefix, pub) -> None:  # type: ignore[no-untyped-def]
        nowhere = await pub.publish("nowhere.at.all", b"x")
        sent = pub.unacked_since()
        assert sent is not None
        with pytest.raises(nats.js.errors.NoStreamResponseError):
            await asyncio.wait_for(nowhere, 5)
        assert pub.pending == 0 and pub.unacked_since() == sent
        await nc.subscribe("swallowed.>")  # takes the publish, never answers: a cut node
        lost = await pub.publish("swallowed.x", b"x")
        await asyncio.sleep(0.2)
        lost.cancel()  # the caller gives up
        assert pub.pending == 0 and pub.unacked_since() == sent
        await asyncio.wait_for(await pub.publish(f"{prefix}.a", b"1"), 5)  # an answer ends it
        assert pub.unacked_since() is None

    run(nats_server.url, body)


def test_a_publish_refused_before_it_was_sent_starts_no_failure_clock(nats_server) -> None:  # type: ignore[no-untyped-def]
    """A subject nats-py's checks refuse (or a closed connection) never reached the server: the
    follower's failure clock is left as it was (it started, and an idle service moved 5 s later)."""
    async def body(js, nc, stream, prefix, pub) -> None:  # type: ignore[no-untyped-def]
        with pytest.raises(nats.errors.BadSubjectError):
            await pub.publish("bad subject", b"x")
        assert pub.unacked_since() is None
        with pytest.raises(nats.errors.BadSubjectError):
            await pub.publish_many([(f"{prefix}.a", b"1", None), ("bad subject", b"2", None)])
        assert pub.unacked_since() is None and pub.pending == 0

    run(nats_server.url, body)


def test_one_no_responders_then_quiet_stops_the_failure_clock(nats_server, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """One "no responders" answer (a stream electing its leader on a healthy cluster) followed by
    silence is no server that cannot serve: once nothing is awaited and QUIET_S passed with no
    publish sent and no such answer, the clock stops (else the idle service would move)."""
    monkeypatch.setattr(publish_mod, "QUIET_S", 0.3)

    async def body(js, nc, stream, prefix, pub) -> None:  # type: ignore[no-untyped-def]
        with pytest.raises(nats.js.errors.NoStreamResponseError):
            await asyncio.wait_for(await pub.publish("nowhere.at.all", b"x"), 5)
        assert pub.unacked_since() is not None, "within QUIET_S it still counts"
        await asyncio.sleep(0.5)
        assert pub.unacked_since() is None

    run(nats_server.url, body)
