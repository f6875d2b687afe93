"""`bridge.nats.lookup`: finding an earlier copy of a message by its `Nats-Msg-Id`.

Resends past a stream's duplicate window were stored twice (found by the fleet simulator
and the fault scenarios, issue 8): the lookup finds an earlier copy by `Nats-Msg-Id` on
its subject from a start time; the mapper uses it for late raw messages and late
redeliveries, pairing for the batch in flight when a previous owner stopped (see
tests/services/test_pairing.py), and the owner's acked progress (`q.<n>`) for the rest.
"""

from __future__ import annotations

import asyncio
import time

from bridge.nats.lookup import find_msg_id, msg_id_of, msg_ids_on, parse_rfc3339_ns, rfc3339_ns


def test_rfc3339_round_trip():
    now = time.time_ns()
    assert parse_rfc3339_ns(rfc3339_ns(now)) == now
    assert parse_rfc3339_ns("2026-12-01T00:04:18Z") % 1_000_000_000 == 0


def test_msg_id_of_a_header_block():
    assert msg_id_of(b"NATS/1.0\r\nNats-Msg-Id: abc\r\nBridge-Hints: []\r\n\r\n") == "abc"
    assert msg_id_of(b"NATS/1.0\r\nBridge-Hints: []\r\nNats-Msg-Id: last") == "last"
    assert msg_id_of(b"NATS/1.0\r\nBridge-Hints: []\r\n\r\n") is None


def test_msg_ids_on_reads_a_stretch_of_a_subject(nats_server, jetstream):
    """Every id on a subject between two times, past 64 messages (a busy lane), and whether
    that was all: the mapper's late redeliveries look their events up in one read per batch."""
    import nats

    stream = "LOOKUP_IDS_TEST"

    async def main() -> None:
        nc = await nats.connect(nats_server.url)
        js = nc.jetstream()
        try:
            await js.add_stream(name=stream, subjects=["ids.>"])
            before = time.time_ns()
            for i in range(150):
                await js.publish("ids.a", b"x", headers={"Nats-Msg-Id": f"a-{i}"})
                await js.publish("ids.b", b"y", headers={"Nats-Msg-Id": f"b-{i}"})
            await asyncio.sleep(0.05)
            middle = time.time_ns()
            await asyncio.sleep(0.05)
            await js.publish("ids.a", b"x", headers={"Nats-Msg-Id": "a-later"})
            ids, complete = await msg_ids_on(nc, stream, "ids.a", before, time.time_ns(), max_probes=1000)
            assert complete and ids == {f"a-{i}" for i in range(150)} | {"a-later"}
            ids, complete = await msg_ids_on(nc, stream, "ids.a", before, middle, max_probes=1000)
            assert complete and ids == {f"a-{i}" for i in range(150)}, "nothing stored after until_ns"
            ids, complete = await msg_ids_on(nc, stream, "ids.a", before, middle, max_probes=150)
            assert complete and len(ids) == 150, "exactly the budget: the next one is past until_ns"
            ids, complete = await msg_ids_on(nc, stream, "ids.a", before, middle, max_probes=100)
            assert not complete and ids == {f"a-{i}" for i in range(100)}
            assert await msg_ids_on(nc, stream, "ids.c", before, middle, max_probes=10) == (set(), True)
            assert await msg_ids_on(nc, stream, "ids.a", before, middle, max_probes=0) == (set(), False)
        finally:
            await js.delete_stream(stream)
            await nc.close()

    asyncio.run(main())


def test_find_msg_id_by_subject_from_a_start_time(nats_server, jetstream):
    import nats

    stream = "LOOKUP_TEST"

    async def main() -> None:
        nc = await nats.connect(nats_server.url)
        js = nc.jetstream()
        try:
            await js.add_stream(name=stream, subjects=["lookup.>"], duplicate_window=1.0)
            before = time.time_ns()
            seqs = []
            for i in range(5):
                seqs.append((await js.publish("lookup.a", b"x", headers={"Nats-Msg-Id": f"id-{i}"})).seq)
                await js.publish("lookup.b", b"y", headers={"Nats-Msg-Id": f"other-{i}"})
            assert await find_msg_id(nc, stream, "lookup.a", "id-3", before) == seqs[3]
            assert await find_msg_id(nc, stream, "lookup.a", "other-3", before) is None  # another subject
            assert await find_msg_id(nc, stream, "lookup.a", "id-4", before, before_seq=seqs[4]) is None
            assert await find_msg_id(nc, stream, "lookup.a", "id-4", before, max_probes=2) is None
            assert await find_msg_id(nc, stream, "lookup.a", "id-0", time.time_ns() + 10**9) is None
            await asyncio.sleep(1.2)  # past the window: the server stores the same id again
            again = (await js.publish("lookup.a", b"x", headers={"Nats-Msg-Id": "id-1"})).seq
            assert again > seqs[-1]
            assert await find_msg_id(nc, stream, "lookup.a", "id-1", before, before_seq=again) == seqs[1]
        finally:
            await js.delete_stream(stream)
            await nc.close()

    asyncio.run(main())


def test_an_error_reply_is_not_the_end_of_the_subject(nats_server, jetstream):
    """Only "no message found" ends a subject; any other error reply (here: no such stream)
    means the read did not cover its stretch, and says so (issue 25: a scan that met an error
    reported itself complete)."""
    import nats
    import pytest

    from bridge.nats.lookup import ScanError

    async def main() -> None:
        nc = await nats.connect(nats_server.url)
        try:
            with pytest.raises(ScanError) as got:
                await msg_ids_on(nc, "NO_SUCH_STREAM", "x.a", 0, time.time_ns(), max_probes=10)
            assert got.value.code == 10059  # stream not found
            with pytest.raises(ScanError):
                await find_msg_id(nc, "NO_SUCH_STREAM", "x.a", "id-1", 0)
        finally:
            await nc.close()

    asyncio.run(main())


def test_a_look_up_reads_past_64_messages_by_default(nats_server, jetstream):
    """The default budget is the mapper's, not the 64 probes of earlier releases (pairing's
    restore check used that default and missed a copy 100 messages along its subject)."""
    import nats

    stream = "LOOKUP_DEFAULT"

    async def main() -> None:
        nc = await nats.connect(nats_server.url)
        js = nc.jetstream()
        try:
            await js.add_stream(name=stream, subjects=["deflt.>"])
            before = time.time_ns()
            for i in range(100):
                await js.publish("deflt.a", b"x", headers={"Nats-Msg-Id": f"other-{i}"})
            seq = (await js.publish("deflt.a", b"x", headers={"Nats-Msg-Id": "needle"})).seq
            assert await find_msg_id(nc, stream, "deflt.a", "needle", before) == seq
        finally:
            await js.delete_stream(stream)
            await nc.close()

    asyncio.run(main())
