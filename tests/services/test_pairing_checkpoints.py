"""Pairing checkpoints in the `aep_checkpoints` object store, on a real nats-server.

The server's max_payload is 64 KiB, far below the compressed checkpoint of the
partition fed here (2,500 open sessions with unrelated ids: ~115 KB). As one KV value
such a checkpoint cannot be written (the fleet reached NATS's default 1 MiB after
~3 h); as an object in chunks it is. The real `PairingService` reads BRIDGE_MAPPED,
checkpoints, hands the partition over and restores, on:

* a checkpoint above max_payload: written (object of several chunks, counted, no
  `too_large`), and a new owner continues from its position (no replay from 0);
* a partition whose only checkpoint is the KV key `p.<n>` an older release wrote:
  restored from it (and an object, when there is one, wins over that key);
* an object whose chunks are gone, or one chunk too many (digest mismatch): a read
  error (`CheckpointUnreadable`, counted `read`) within the read timeout, not a hang,
  and no subscription left behind.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import zlib
from collections.abc import Callable
from typing import Any

import msgspec
import pytest

import nats
import nats.js.api
import nats.js.errors
from bridge.config import Settings
from bridge.core.aep import Event, encode_event
from bridge.core.identity import MAPPED_SLOT, SLOTS, event_id, rfc3339, source_uri
from bridge.core.lanes import lane_token
from bridge.core.pairing import PairingState
from bridge.nats import streams as S
from bridge.nats.bootstrap import bootstrap
from bridge.services import pairing as P

MAX_PAYLOAD = 64 * 1024
SESSIONS = 2500  # ~46 B of compressed checkpoint each (unrelated ids): ~115 KB > MAX_PAYLOAD
BOUND_S = 120  # an outer bound on each scenario: a hang fails the test instead of blocking the run


def session(i: int) -> str:
    return hashlib.sha256(f"ckpt-{i}".encode()).hexdigest()[:32]


def started(i: int, base_ns: int) -> tuple[Event, dict[str, Any]]:
    """session.started of session i, as the mapper makes it (raw message i)."""
    ts = base_ns + i * 1_000_000
    s = session(i)
    event = Event(
        aep="0.1", id=event_id(f"raw-ckpt-{i}", MAPPED_SLOT, ts // 1_000_000), type="session.started",
        time=rfc3339(ts), source=source_uri("ckpt", s), agent="hermes", session=s,
        seq=i * SLOTS + MAPPED_SLOT, epoch=0, capture="metadata", data={"client": {"name": "hermes"}},
    )
    return event, {"ts": ts, "hook": "on_session_start"}


async def publish_sessions(js: Any, numbers: range, base_ns: int, partition: int = 0) -> None:
    futures = []
    for i in numbers:
        event, hints = started(i, base_ns)
        subject = f"{S.MAPPED_PREFIX}.{partition}.{lane_token(event.session)}"
        headers = {"Nats-Msg-Id": event.id, "Bridge-Hints": msgspec.json.encode(hints).decode()}
        futures.append(await js.publish_async(subject, encode_event(event), headers=headers))
    await asyncio.gather(*futures)


def state_of(numbers: range, base_ns: int, partition: int) -> PairingState:
    """The pure state after session.started i at position i, for i in numbers."""
    state = PairingState(partition=partition)
    for i in numbers:
        event, hints = started(i, base_ns)
        state.process(event, hints, i)
    return state


async def service(url: str, replica: str, partitions: int = 1) -> P.PairingService:
    settings = Settings()
    settings.nats_url = url
    settings.partitions = partitions
    svc = P.PairingService(settings, replica=replica, tick_s=3600)  # no ticks: the input is all there is
    await svc.connect()
    return svc


async def until(predicate: Callable[[], bool]) -> None:
    while not predicate():  # bounded by the scenario's BOUND_S
        await asyncio.sleep(0.02)


def sample(svc: P.PairingService, name: str, **labels: str) -> float:
    return svc.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture
def url(nats_factory) -> str:  # type: ignore[no-untyped-def]
    server = nats_factory(f"max_payload: {MAX_PAYLOAD}")

    async def setup() -> None:
        nc = await nats.connect(server.url)
        try:
            await bootstrap(nc.jetstream(), None, replicas=1)
        finally:
            await nc.close()

    asyncio.run(setup())
    return server.url


def test_a_checkpoint_above_max_payload_is_written_and_a_new_owner_continues_from_it(url: str) -> None:
    asyncio.run(asyncio.wait_for(takeover(url), BOUND_S))


async def takeover(url: str) -> None:
    base = time.time_ns()
    nc = await nats.connect(url)
    js = nc.jetstream()
    first = second = None
    try:
        assert nc.max_payload == MAX_PAYLOAD
        await publish_sessions(js, range(1, SESSIONS + 1), base)
        last = (await js.stream_info(S.BRIDGE_MAPPED)).state.last_seq

        # The first owner: takes the lease, reads the partition, stops cleanly (final checkpoint).
        first = await service(url, "first")
        await first.maintain()
        part = first.partitions[0]
        await until(lambda: part.position >= last)
        first.stopper.trigger("test")
        await part.task
        await first.release(part)
        position, snapshot = part.position, part.state.snapshot()
        assert position == last

        info = await (await js.object_store(S.CHECKPOINTS_BUCKET)).get_info("p.0")
        assert info.size > MAX_PAYLOAD and info.chunks > 1, info
        assert sample(first, "aep_bridge_pairing_checkpoints_total") >= 1
        assert sample(first, "aep_bridge_pairing_checkpoint_bytes", partition="0") == info.size
        assert sample(first, "aep_bridge_pairing_checkpoint_errors_total", what="too_large") == 0
        assert sample(first, "aep_bridge_pairing_checkpoint_errors_total", what="write") == 0

        # More input, then a new owner: it restores the checkpoint and reads only what is new.
        await publish_sessions(js, range(SESSIONS + 1, SESSIONS + 11), base)
        last = (await js.stream_info(S.BRIDGE_MAPPED)).state.last_seq
        second = await service(url, "second")
        await second.maintain()
        taken = second.partitions[0]
        assert taken.position == position, "restored from the checkpoint, not from 0"
        assert taken.state.snapshot() == snapshot
        await until(lambda: taken.position >= last)
        assert sample(second, "aep_bridge_pairing_events_in_total", partition="0") == 10
        assert taken.state.position == last
        assert sample(second, "aep_bridge_pairing_checkpoint_errors_total", what="read") == 0
    finally:
        for svc in (first, second):
            if svc is not None:
                svc.stopper.trigger("test")
                for p in list(svc.partitions.values()):
                    if p.task is not None:
                        await asyncio.wait([p.task], timeout=20)
                await svc.close()
        await nc.close()


def test_a_checkpoint_an_older_release_left_in_kv_is_restored(url: str) -> None:
    async def scenario() -> None:
        base = time.time_ns()
        nc = await nats.connect(url)
        js = nc.jetstream()
        svc = None
        try:
            kv = await js.key_value(S.PAIRING_BUCKET)
            legacy = state_of(range(1, 51), base, partition=1)
            await kv.put("p.1", zlib.compress(legacy.snapshot(), 1))  # what releases before the object store wrote
            # Partition 0 has both: an old KV checkpoint and a newer object. The object wins.
            await kv.put("p.0", zlib.compress(state_of(range(1, 51), base, partition=0).snapshot(), 1))
            newer = state_of(range(1, 81), base, partition=0)
            store = await js.object_store(S.CHECKPOINTS_BUCKET)
            await store.put("p.0", zlib.compress(newer.snapshot(), 1))

            svc = await service(url, "upgraded", partitions=2)
            part = await svc.restore(1)
            assert part.position == 50, "restored from the KV key p.1, not a fresh state"
            assert part.state.snapshot() == legacy.snapshot()
            part = await svc.restore(0)
            assert part.position == 80, "the object, not the older KV key"
            assert part.state.snapshot() == newer.snapshot()
            assert sample(svc, "aep_bridge_pairing_checkpoint_errors_total", what="read") == 0
        finally:
            if svc is not None:
                await svc.close()
            await nc.close()

    asyncio.run(asyncio.wait_for(scenario(), BOUND_S))


@pytest.mark.parametrize("damage", ["chunks_gone", "chunk_added"])
def test_an_unreadable_checkpoint_object_is_a_read_error_not_a_hang(url: str, damage: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(P, "CHECKPOINT_READ_TIMEOUT_S", 1.0)

    async def scenario() -> None:
        base = time.time_ns()
        nc = await nats.connect(url)
        js = nc.jetstream()
        svc = None
        try:
            store = await js.object_store(S.CHECKPOINTS_BUCKET)
            blob = zlib.compress(state_of(range(1, SESSIONS + 1), base, partition=2).snapshot(), 1)
            info = await store.put("p.2", blob, meta=nats.js.api.ObjectMeta(
                name="p.2", options=nats.js.api.ObjectMetaOptions(max_chunk_size=MAX_PAYLOAD)))
            assert info.chunks > 1
            chunks = f"$O.{S.CHECKPOINTS_BUCKET}.C.{info.nuid}"
            if damage == "chunks_gone":  # nats-py's get() would wait for them forever
                await js.purge_stream(S.CHECKPOINTS.stream_name, subject=chunks)
            else:  # the digest no longer matches
                await js.publish(chunks, b"not part of the checkpoint")
            # Even with a KV checkpoint to fall back to: an unreadable object is never skipped.
            kv = await js.key_value(S.PAIRING_BUCKET)
            await kv.put("p.2", zlib.compress(PairingState(partition=2).snapshot(), 1))

            svc = await service(url, "reader", partitions=3)
            subscriptions = len(svc.nc._subs)
            with pytest.raises(P.CheckpointUnreadable) as raised:
                await svc.restore(2)
            cause = asyncio.TimeoutError if damage == "chunks_gone" else nats.js.errors.DigestMismatchError
            assert isinstance(raised.value.__cause__, cause), repr(raised.value.__cause__)
            assert sample(svc, "aep_bridge_pairing_checkpoint_errors_total", what="read") == 1
            assert len(svc.nc._subs) == subscriptions, "the reading subscription is gone"
        finally:
            if svc is not None:
                await svc.close()
            await nc.close()

    asyncio.run(asyncio.wait_for(scenario(), BOUND_S))
