"""`bridge.nats.wire`: a batch of publishes written to nats-py's buffer in one step (issue 43).

What it relies on: the bytes are the ones nats-py 2.16 writes for the same publish (compared
with its own `_send_publish`, on a client that is not connected, whose buffer is only
appended to); nats-py's checks hold (nothing of a batch is written when one of its messages
is refused); a real server delivers and acks what was written; acks written together ack
their messages; while not connected, nats-py's public path decides.
"""

from __future__ import annotations

import asyncio

import nats
import nats.errors
import nats.js.api
import nats.js.errors
import pytest
from nats.aio.client import Client

from bridge.nats import wire
from tests.support.streams import on_scratch_stream

CASES = [
    ("bridge.mapped.3.inst-1.pre_tool_call", b'{"a":1}', "_INBOX.x.abc.17", {"Nats-Msg-Id": "01JABC:0", "Bridge-Hints": "l=1"}),
    ("aep.hermes.i.session_started", b"", "", None),
    ("a.b", b"x" * 1000, "", {"Nats-Msg-Id": " padded \r\nvalue ", "  ": "empty key skipped"}),
    ("a.b", "é".encode(), "r.1", {}),
]


async def nats_py_bytes(subject: str, payload: bytes, reply: str, headers: dict[str, str] | None) -> bytes:
    """What nats-py's own publish path appends to its buffer for one message."""
    nc = Client()  # not connected: `_send_publish` only appends (no flusher yet)
    await nc._send_publish(subject, reply, payload, len(payload), headers)
    return b"".join(nc._pending)


@pytest.mark.parametrize("subject,payload,reply,headers", CASES)
def test_a_command_is_the_bytes_nats_py_writes(subject, payload, reply, headers) -> None:  # type: ignore[no-untyped-def]
    assert wire.command(subject, payload, reply, headers) == asyncio.run(nats_py_bytes(subject, payload, reply, headers))


def test_nats_py_checks_hold() -> None:
    for subject in ("", "a b", "a\r\nPUB x 1", "a\tb"):
        with pytest.raises(nats.errors.BadSubjectError):
            wire.command(subject, b"x")
    with pytest.raises(nats.errors.BadSubjectError):
        wire.command("a.b", b"x", reply="r\r\nUNSUB 1")
    with pytest.raises(nats.errors.BadHeaderError):
        wire.command("a.b", b"x", headers={"Bad Key": "v"})
    with pytest.raises(nats.errors.MaxPayloadError):
        wire.command("a.b", b"x" * 11, max_payload=10)
    assert wire.command("a.b", b"x" * 10, max_payload=10).startswith(b"PUB a.b  10\r\n")


def test_a_batch_with_one_refused_message_writes_nothing(nats_server) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        nc = await nats.connect(nats_server.url)
        try:
            got: list = []
            async def cb(m) -> None:  # type: ignore[no-untyped-def]
                got.append(m)

            await nc.subscribe("w.>", cb=cb)
            await nc.flush()
            before = nc.stats["out_msgs"]
            with pytest.raises(nats.errors.BadSubjectError):
                await wire.publish_many(nc, [("w.1", b"1", "", None), ("w 2", b"2", "", None), ("w.3", b"3", "", None)])
            await nc.flush()
            await asyncio.sleep(0.2)
            assert got == [] and nc.stats["out_msgs"] == before
        finally:
            await nc.close()

    asyncio.run(main())


def test_a_server_delivers_what_was_written_in_order(nats_server) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        nc = await nats.connect(nats_server.url)
        try:
            got: list = []

            async def cb(m) -> None:  # type: ignore[no-untyped-def]
                got.append((m.subject, m.reply, m.data, dict(m.headers or {})))

            await nc.subscribe("w.>", cb=cb)
            await nc.flush()
            sent = [(f"w.{i}", str(i).encode(), f"r.{i}" if i % 2 else "", {"Nats-Msg-Id": f"id-{i}"} if i % 3 else None)
                    for i in range(300)]
            await wire.publish_many(nc, sent[:150])
            await wire.publish_many(nc, sent[150:])
            await nc.flush()
            for _ in range(100):
                if len(got) == len(sent):
                    break
                await asyncio.sleep(0.05)
            assert got == [(s, r, p, h or {}) for s, p, r, h in sent]
        finally:
            await nc.close()

    asyncio.run(main())


def test_acks_written_together_ack_their_messages(nats_server) -> None:  # type: ignore[no-untyped-def]
    async def body(js, nc, stream, prefix) -> None:  # type: ignore[no-untyped-def]
        for i in range(20):
            await js.publish(f"{prefix}.a", str(i).encode())
        await js.add_consumer(stream, nats.js.api.ConsumerConfig(durable_name="d", ack_policy=nats.js.api.AckPolicy.EXPLICIT,
                                                                  ack_wait=30))
        sub = await js.pull_subscribe_bind("d", stream)
        msgs = await sub.fetch(20, timeout=5)
        assert len(msgs) == 20
        assert (await js.consumer_info(stream, "d")).num_ack_pending == 20
        async def ack_pending(expected: int) -> int:  # (the server applies acks after its PONG)
            for _ in range(100):
                info = await js.consumer_info(stream, "d")
                if info.num_ack_pending == expected:
                    break
                await asyncio.sleep(0.05)
            return info.num_ack_pending

        await wire.ack_many(nc, msgs[:15])
        assert all(m._ackd for m in msgs[:15]) and not any(m._ackd for m in msgs[15:])
        assert await ack_pending(5) == 5
        assert (await js.consumer_info(stream, "d")).ack_floor.stream_seq == 15
        with pytest.raises(nats.errors.MsgAlreadyAckdError):
            await wire.ack_many(nc, msgs[14:])  # one acked already: nothing written
        await nc.flush()
        await asyncio.sleep(0.3)
        assert (await js.consumer_info(stream, "d")).num_ack_pending == 5 and not any(m._ackd for m in msgs[15:])

    on_scratch_stream(nats_server.url, "WIRE", body)


def test_while_not_connected_nats_py_decides(nats_server) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        nc = await nats.connect(nats_server.url)
        await nc.close()
        assert not wire.direct(nc)
        with pytest.raises(nats.errors.ConnectionClosedError):
            await wire.publish_many(nc, [("w.1", b"1", "", None)])

    asyncio.run(main())
