"""A pairing owner stopped (SIGSTOP) for longer than its lease, then let run again (issue 23).

The standby takes the partitions over once the leases lapse and writes its own checkpoints.
When the old owner runs again it must act on those partitions no more: no publish, no tick,
no checkpoint. Before fencing, its partition loops went on where they stopped for a moment
(until the next renewal failed) and wrote their older checkpoints over the new owner's: the
next takeover would then restore a state from the past."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from bridge.nats import streams as S
from bridge.services.pairing import CHECKPOINT_S, CHECKPOINT_SPACING_S
from bridge.sim.sessions import realistic_envelopes
from tests.natsfixture import JetStreamClient
from tests.support.services import Service, publish_all, raw_records, wait_for
from tests.support.streams import count, quiet


def checkpoints(client: JetStreamClient) -> dict[str, tuple[str, str]]:
    """Every checkpoint object: name -> (digest, modification time)."""
    from nats.js.errors import NotFoundError

    async def read() -> dict[str, tuple[str, str]]:
        store = await client.js.object_store(S.CHECKPOINTS_BUCKET)
        try:
            infos = await store.list()
        except NotFoundError:  # none yet
            return {}
        return {i.name: (str(i.digest), str(i.mtime)) for i in infos}

    return client.run(read())


def text(service: Service) -> str:
    return service.log_path.read_text(errors="replace")


@pytest.mark.slow
def test_an_owner_paused_past_its_lease_writes_and_publishes_nothing_when_it_runs_again(nats_server_fn, tmp_path):
    client = JetStreamClient(nats_server_fn.url)
    client.bootstrap()
    client.run(publish_all(client.js, raw_records(realistic_envelopes(8000, seed=23), instance="fence")))
    mapper = Service("mapper", nats_server_fn.url, tmp_path).start()
    quiet(client, "BRIDGE_MAPPED")
    mapper.terminate()
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    # Ticks rare: once the standby has caught up, nothing new reaches any partition, so any
    # checkpoint written after that comes from the old owner.
    owner = Service("pairing", nats_server_fn.url, dirs[0], "--replica", "owner", "--tick-s", "3600").start()
    standby = None
    try:
        wait_for(lambda: count(client, "AEP_EVENTS") > 0, 30, interval=0.02, what="the owner to start publishing")
        owner.proc.send_signal(signal.SIGSTOP)  # mid-backlog
        time.sleep(0.2)
        held = text(owner).count("partition_acquired")
        assert held > 0
        standby = Service("pairing", nats_server_fn.url, dirs[1], "--replica", "standby", "--tick-s", "3600").start()
        wait_for(lambda: text(standby).count("partition_acquired") >= 8, 40, what="the standby to take all 8 over")
        quiet(client, "AEP_EVENTS", settle=3.0, timeout=90)
        # the standby's checkpoints, written CHECKPOINT_S after its last message
        wait_for(lambda: len(checkpoints(client)) == 8, 30, what="a checkpoint of every partition")
        # > CHECKPOINT_S, plus the turns of the 8 partitions' timed checkpoints and a loop's 0.5 s
        # fetch: every partition of the standby checkpointed its end
        time.sleep(CHECKPOINT_S + 8 * CHECKPOINT_SPACING_S + 1.5)
        before = checkpoints(client)
        events = count(client, "AEP_EVENTS")
        owner.proc.send_signal(signal.SIGCONT)
        # the old owner learns it lost them: its renewals are refused (or it fences first)
        wait_for(lambda: text(owner).count("lease_lost") + text(owner).count("partition_fenced") >= held, 20,
                 what="the old owner to drop its partitions")
        time.sleep(1.0)
        assert checkpoints(client) == before, "the old owner wrote its older checkpoints over the standby's"
        assert count(client, "AEP_EVENTS") == events
        assert "partition_fenced" in owner.log(), owner.log()
    finally:
        owner.terminate()
        if standby is not None:
            standby.terminate()
        client.close()


def test_a_partition_loop_that_wakes_past_its_lease_stops_before_it_reads_again(nats_server_fn):
    """The loop itself checks the lease before each fetch, not only before a publish or a
    checkpoint: an owner that wakes from a pause with nothing to publish and nothing to
    checkpoint sent its next pull request to a consumer the server had removed meanwhile
    (inactive for 30 s), and the 503 ended the loop as an error ("partition_task_ended"),
    not as a lapsed lease (the CI failure of the test above, 2026-12-03)."""
    from prometheus_client import CollectorRegistry

    from bridge.config import Settings
    from bridge.services.pairing import PairingService

    client = JetStreamClient(nats_server_fn.url)
    client.bootstrap()

    async def run() -> tuple[list[bool], list[object], float, dict[int, str]]:
        pairing = PairingService(Settings(nats_url=nats_server_fn.url, instance="p"), replica="paused",
                                 registry=CollectorRegistry(), tick_s=3600)
        await pairing.connect()
        parts: list = []
        try:
            await pairing.maintain()
            parts = list(pairing.partitions.values())
            assert len(parts) == 8
            await asyncio.sleep(0.5)  # every loop is waiting for messages (there are none)
            # Partition 0's loop ended on an error from a request sent before the pause (what
            # CI saw): `maintain` must count it fenced, not report it unowned.
            victim = parts[0]
            victim.task.cancel()
            await asyncio.gather(victim.task, return_exceptions=True)

            async def failed() -> None:
                raise RuntimeError("a consumer create sent before the pause timed out")

            victim.task = asyncio.create_task(failed())
            await asyncio.gather(victim.task, return_exceptions=True)
            for part in parts:
                part.confirmed -= 60.0  # as if the process had been stopped for a minute
            done, _ = await asyncio.wait([p.task for p in parts[1:]], timeout=5)
            await pairing.maintain()
            return [p.lost for p in parts[1:]], [p.task.exception() if p.task in done else "running" for p in parts[1:]], \
                pairing.metrics.fenced._value.get(), dict(pairing.unowned)
        finally:
            pairing.stopper.trigger()
            for part in parts:
                part.task.cancel()
            await asyncio.gather(*(p.task for p in parts), return_exceptions=True)
            await pairing.nc.close()

    try:
        lost, ended, fenced, unowned = client.run(run())
    finally:
        client.close()
    assert ended == [None] * 7, "each loop returns on its own, without an error"
    assert lost == [True] * 7
    assert unowned == {}, "a loop that failed after its lease lapsed is fenced, not unowned"
    assert fenced == 8


def test_a_checkpoint_put_that_straddles_the_fence_leaves_the_new_owners_checkpoint(nats_server_fn):
    """Issue 39 item 4. A checkpoint is written in chunks, then its meta (the commit point).
    The put is shielded (a cancelled put would leave chunks nothing refers to), so a put
    that began while the lease was sure completed however long it took: here the owner's
    lease lapses while its chunks go out, and a new owner writes its checkpoint meanwhile.
    The old owner's meta must not go out over it: its chunks are purged, the new owner's
    checkpoint stays."""
    import nats
    from prometheus_client import CollectorRegistry

    from bridge.config import Settings
    from bridge.services.pairing import PairingService

    client = JetStreamClient(nats_server_fn.url)
    client.bootstrap()

    async def run() -> tuple[str, str, object, int]:
        pairing = PairingService(Settings(nats_url=nats_server_fn.url, instance="p"), replica="old",
                                 registry=CollectorRegistry(), tick_s=3600)
        await pairing.connect()
        other = await nats.connect(nats_server_fn.url)
        parts: list = []
        try:
            await pairing.maintain()
            parts = list(pairing.partitions.values())
            part = pairing.partitions[0]
            new_owner = await other.jetstream().object_store(S.CHECKPOINTS_BUCKET)
            publish = pairing.js.publish
            seen = {"chunks": 0}

            async def straddling(subject: str, *args: object, **kwargs: object) -> object:
                if subject.startswith(f"$O.{S.CHECKPOINTS_BUCKET}.C.") and not seen["chunks"]:
                    seen["chunks"] += 1
                    part.confirmed -= 60.0  # the owner stalls mid-put, past its lease
                    await new_owner.put("p.0", b"the new owner's checkpoint")
                return await publish(subject, *args, **kwargs)

            pairing.js.publish = straddling  # type: ignore[method-assign]
            part.position += 1  # something to checkpoint
            error: object = None
            try:
                await pairing.checkpoint(part)
            except Exception as exc:  # noqa: BLE001 - what it raises is reported, not required
                error = exc
            got = await new_owner.get("p.0")
            info = await other.jetstream().stream_info(f"OBJ_{S.CHECKPOINTS_BUCKET}")
            return got.data.decode(errors="replace"), str(error), seen["chunks"], info.state.messages
        finally:
            pairing.stopper.trigger()
            tasks = [p.task for p in parts] + pairing.readers + list(pairing.old_readers)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await pairing.nc.close()
            await other.close()

    try:
        data, error, chunks, stored = client.run(run())
    finally:
        client.close()
    assert chunks == 1
    assert data == "the new owner's checkpoint", f"the old owner's put went through ({error})"
    assert stored == 2, "the new owner's chunk and meta only: the old owner's chunks are purged"
