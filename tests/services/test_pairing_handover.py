"""Pairing hands over quickly and truthfully (issue 42 item 3): renewals that get no answer do
not queue behind each other, a fenced partition's lease goes back at once, and /healthz lists
at every moment only the partitions the fence lets the replica act on."""

from __future__ import annotations

import asyncio
import time

from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue
from prometheus_client import CollectorRegistry

from bridge.config import Settings
from bridge.nats import streams as S
from bridge.services import pairing as P
from tests.natsfixture import JetStreamClient


async def _service(url: str, replica: str) -> P.PairingService:
    svc = P.PairingService(Settings(nats_url=url, instance="h"), replica=replica, registry=CollectorRegistry(),
                           tick_s=3600)
    await svc.connect()
    return svc


async def _stop(svc: P.PairingService) -> None:
    svc.stopper.trigger()
    for part in list(svc.partitions.values()):
        if part.task is not None:
            part.task.cancel()
    for task in svc.readers:
        task.cancel()
    await asyncio.gather(*(p.task for p in svc.partitions.values() if p.task), *svc.readers, return_exceptions=True)
    await svc.nc.close()


def test_renewals_that_get_no_answer_do_not_queue_and_do_not_fence(nats_server_fn):
    """The leases bucket stops answering (a leader cut off): the round's eight renewals wait
    together, each a bounded time, and are sent again until answered. Before: one after the
    other, 5 s each (nats-py's JetStream timeout): the round took 40 s and the later partitions
    passed their fencing deadline (pairing-0 fenced all eight, issue 42)."""
    client = JetStreamClient(nats_server_fn.url)
    client.bootstrap()

    async def run() -> tuple[float, list[bool], list[int], float]:
        svc = await _service(nats_server_fn.url, "mute-kv")
        try:
            await svc.maintain()
            assert len(svc.partitions) == 8
            real = svc.leases
            # A bucket whose requests reach a subscriber that never answers: no answer, no 503.
            swallow = await svc.nc.subscribe("$KV.mute.>")
            svc.leases = KeyValue(name=S.LEASES_BUCKET, stream=f"KV_{S.LEASES_BUCKET}", pre="$KV.mute.",
                                  js=svc.js, direct=False)

            async def answer_again_after(seconds: float) -> None:
                await asyncio.sleep(seconds)
                svc.leases = real  # the bucket's new leader answers

            t0 = time.monotonic()
            back = asyncio.create_task(answer_again_after(3.0))
            await asyncio.wait_for(svc.maintain(), 15)  # before: 8 x 5 s
            took = time.monotonic() - t0
            await back
            await swallow.unsubscribe()
            return took, [p.lost for p in svc.partitions.values()], svc.health.healthz()[1]["partitions"], \
                svc.metrics.fenced._value.get()
        finally:
            await _stop(svc)

    try:
        took, lost, owned, fenced = client.run(run())
    finally:
        client.close()
    print(f"a round of renewals with the bucket silent for 3 s took {took:.1f} s")
    assert lost == [False] * 8 and owned == list(range(8)) and fenced == 0, (lost, owned, fenced)


def test_a_fenced_partition_is_released_at_once_and_healthz_follows_the_fence(nats_server_fn):
    """Past its deadline a partition is not in /healthz (without waiting for the next round),
    and its lease is deleted at once: the other replica takes it at its next round instead of
    waiting out the TTL. Before: /healthz listed it until the next round (the issue saw it ~10 s
    after the log said fenced) and the lease stayed until its TTL."""
    client = JetStreamClient(nats_server_fn.url)
    client.bootstrap()

    async def run() -> tuple[list[int], list[int], bool, list[int]]:
        a = await _service(nats_server_fn.url, "a")
        b = await _service(nats_server_fn.url, "b")
        try:
            await a.maintain()
            assert sorted(a.partitions) == list(range(8))
            for part in a.partitions.values():
                part.confirmed -= 60.0  # as if its renewals had gone unanswered for a minute
            shown = a.health.healthz()[1]["partitions"]  # no round has run since
            victim = a.partitions[0]
            assert a.fenced(victim)
            gone = False
            for _ in range(50):  # the release is sent at once (its own task)
                await asyncio.sleep(0.02)
                try:
                    await a.leases.get("p.0")
                except KeyNotFoundError:
                    gone = True
                    break
            await b.maintain()  # the other replica's next round: partition 0 is free now
            return shown, a.health.healthz()[1]["partitions"], gone, sorted(b.partitions)
        finally:
            await _stop(a)
            await _stop(b)

    try:
        shown, owned, gone, taken = client.run(run())
    finally:
        client.close()
    assert shown == [] and owned == [], "/healthz lists no partition the fence forbids"
    assert gone, "the fenced partition's lease was deleted at once"
    assert 0 in taken, f"the other replica took partition 0 at its next round: {taken}"


def test_a_publish_whose_ack_does_not_come_is_sent_again_not_the_partition_dropped(nats_server_fn):
    """The acks of a batch do not come (a stream leader cut off: the publishes were stored or
    not, nothing says which): after ACK_RESEND_S the batch's unacked publishes go out again with
    the same Nats-Msg-Id, the partition carries on, and AEP_EVENTS holds each event once.
    Before: the batch waited 15 s and the partition was dropped and restored from its
    checkpoint, a stall of 15 s or more."""
    from tests.support.pairing_service import bootstrapped, publish_sessions, service

    url = bootstrapped(nats_server_fn.url)

    async def run() -> tuple[int, int, bool, float, int]:
        svc = await service(url, "deaf", partitions=1)
        try:
            base = time.time_ns()
            await publish_sessions(svc.js, range(40), base)
            reply = svc.publisher._reply
            deaf_until = time.monotonic() + 1.0

            async def deaf(msg):  # the acks of the first second are lost on the way
                if time.monotonic() < deaf_until:
                    return
                await reply(msg)

            svc.publisher._sub._cb = deaf
            await svc.maintain()
            part = svc.partitions[0]
            t0 = time.monotonic()
            while part.position < 40 and time.monotonic() - t0 < 10 and not part.task.done():
                await asyncio.sleep(0.05)
            took = time.monotonic() - t0
            stored = (await svc.js.stream_info(S.AEP_EVENTS)).state.messages
            if part.task.done():
                print("task:", part.task.exception() if not part.task.cancelled() else "cancelled")
            return part.position, stored, part.lost or part.task.done(), took, \
                int(svc.registry.get_sample_value("aep_bridge_pairing_publishes_resent_total") or 0)
        finally:
            await _stop(svc)

    position, stored, dropped, took, resent = asyncio.run(run())
    print(f"40 messages through after {took:.1f} s, {resent} publishes resent")
    assert position == 40 and not dropped, (position, dropped, took)
    assert stored == 40, "each event once (the second copies dropped by Nats-Msg-Id)"
    assert resent > 0


def test_a_refused_renewal_whose_read_gets_no_answer_is_tried_again_not_lost(nats_server_fn):
    """A renewal sent, stored, its answer lost (a leader change), and the next one refused
    (``last`` behind): the key is read to see whose it is. When that read gets no answer either
    (the bucket still electing), the partition is not dropped: the renewal is tried again until
    one is answered or the fencing deadline passes. Before, an unanswered read counted as
    another's lease: in a partition run (2026-12-07 18:13) pairing-0 dropped six partitions so at
    a heal, and AEP_EVENTS waited for the other replica to restore them."""
    client = JetStreamClient(nats_server_fn.url)
    client.bootstrap()

    async def run() -> tuple[bool, int, int, list[str]]:
        svc = await _service(nats_server_fn.url, "keeps")
        try:
            await svc.maintain()
            part = svc.partitions[0]
            real = svc.leases
            calls: list[str] = []

            class Flaky:
                """The real bucket, but: the first update is stored and its answer lost; the
                first read after the refusal gets no answer."""

                async def update(self, key: str, value: bytes, last: int) -> int:
                    calls.append("update")
                    revision = await real.update(key, value, last=last)
                    if calls.count("update") == 1:
                        raise asyncio.TimeoutError()  # stored, the answer lost
                    return revision

                async def get(self, key: str) -> object:
                    calls.append("get")
                    if calls.count("get") == 1:
                        raise asyncio.TimeoutError()
                    return await real.get(key)

            svc.leases = Flaky()
            kept = await asyncio.wait_for(svc.renew(part), 10)
            svc.leases = real
            stored = (await real.get(f"p.{part.number}")).revision
            return kept, part.revision, stored, calls
        finally:
            await _stop(svc)

    try:
        kept, revision, stored, calls = client.run(run())
    finally:
        client.close()
    assert kept and calls[:3] == ["update", "update", "get"], calls
    assert revision == stored, (revision, stored, calls)


def test_a_partition_whose_restore_fails_gives_its_lease_back_and_is_taken_next_round(nats_server_fn):
    """A restore that fails (its checkpoint unreadable while the checkpoints stream elects)
    leaves the partition unowned: its lease goes back at once, for the other replica's next
    round; this one tries it again after RESTORE_AGAIN_S.
    Before, the lease stayed under the replica's name until its TTL (10 s) and no replica could
    take the partition meanwhile: in a partition run (2026-12-07 18:30) pairing's eight
    partitions waited 10 s so, from a restore failed 2 s after the checkpoints had a leader."""
    client = JetStreamClient(nats_server_fn.url)
    client.bootstrap()

    async def run() -> tuple[bool, list[int], list[int], list[int]]:
        svc = await _service(nats_server_fn.url, "restores")
        try:
            real = svc.restore
            failed: list[int] = []

            async def restore_fails_once(n: int) -> P.Partition:
                if n == 0 and not failed:
                    failed.append(n)
                    raise P.CheckpointUnreadable("checkpoint p.0: 503 (the stream electing)")
                return await real(n)

            svc.restore = restore_fails_once  # type: ignore[method-assign]
            await svc.maintain()
            first = sorted(svc.partitions)
            try:
                await svc.leases.get("p.0")
                held = True
            except KeyNotFoundError:
                held = False
            await svc.maintain()  # the next round: this replica waits RESTORE_AGAIN_S (the other would take it)
            again = sorted(svc.partitions)
            svc._restore_again[0] = 0.0  # as if RESTORE_AGAIN_S had passed
            await svc.maintain()
            return held, first, again, sorted(svc.partitions)
        finally:
            await _stop(svc)

    try:
        held, first, again, later = client.run(run())
    finally:
        client.close()
    assert first == list(range(1, 8)), first
    assert not held, "the lease of the partition whose restore failed was given back"
    assert again == list(range(1, 8)), f"not tried again here at once: {again}"
    assert later == list(range(8)), f"taken once RESTORE_AGAIN_S passed: {later}"
