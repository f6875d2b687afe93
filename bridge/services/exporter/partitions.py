"""A sink shared by several exporter replicas (the sink's ``replicas`` > 1).

Theory of operation
-------------------
* Partitions: the work-queue stream ``AEP_EXPORT`` (`streams.export_stream_config`) has one
  source of AEP_EVENTS (aep.hermes.> and aep.ingest.>, in order) per partitioned sink, whose
  subject transform puts each message under ``export.<sink>.<partition(PARTITIONS, lane
  token)>.<its subject>`` (`streams.export_source`): a lane is always in the same partition,
  so one consumer per partition keeps every lane in order (the Kafka key is the lane: one
  Kafka partition per lane). A message leaves the stream once acked, so it holds only what
  the sinks have not confirmed.
* Upgrade from one replica: the sink's first replica adds its source from the sink's
  ``export-<sink>`` ack floor + 1 when that durable exists (from the start otherwise) and
  leaves the durable as it was (going back to ``replicas: 1`` resumes it there: same-id
  duplicates only).
* Ownership: a partition is owned through a lease ``x.<sink>.<n>`` in the `aep_leases` KV
  bucket, as pairing's (`create` takes a free one atomically, `update(last=revision)` every
  `RENEW_S` keeps it, the bucket's max age drops one nobody renews). Each replica also keeps a
  member key ``xm.<sink>.<replica>`` there; with n live members it aims at ceil(PARTITIONS/n)
  partitions: it takes free leases up to that, and gives back what it holds above it (a
  scale-up: the batch in hand is delivered and acked first, then the lease is deleted).
* Takeover: the new owner deletes and recreates the partition's consumer, so what the
  previous owner held unacked (killed mid-batch) is delivered first, in stream order; the
  sink sees those events again with the same ids, and nothing else twice. A replica that
  cannot renew a lease stops that partition at once.
* Delivery: per partition a `SinkWorker` (the one-replica loop: filter, project, deliver,
  ack only what the sink confirmed, retry, dead letters), all of them on one transport (one
  Kafka producer per replica and sink).
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import uuid
from typing import Any

import nats.js.errors
import structlog

from bridge.core.sinks import PARTITIONS, SinkConfig
from bridge.nats import streams as S
from bridge.services.exporter.service import SinkWorker, bind_or_wait
from bridge.services.exporter.sinks import make_sink

log = structlog.get_logger("aep_bridge.exporter")

RENEW_S = 2.0  # lease renewal and rebalancing round (leases expire after S.LEASE_TTL_S)
RELEASE_GRACE_S = 5.0  # a partition given back finishes its batch within this, else it is cancelled


def replica_name() -> str:
    """This process's name in the leases: host, pid and a random part (a restarted process
    never mistakes a lease of its predecessor for its own)."""
    raw = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return re.sub(r"[^A-Za-z0-9_-]", "_", raw)[:96]


class Owned:
    __slots__ = ("worker", "task", "revision")

    def __init__(self, worker: Any, task: asyncio.Task[None], revision: int) -> None:
        self.worker, self.task, self.revision = worker, task, revision


class PartitionedSink:
    """The sink's part in this replica: its leases, and a `SinkWorker` per owned partition.
    Looks like a `SinkWorker` to the `Exporter` (cfg, sink, bound, state, run, watch)."""

    def __init__(self, service: Any, cfg: SinkConfig, partitions: int = PARTITIONS, renew_s: float = RENEW_S) -> None:
        self.service = service
        self.cfg = cfg
        self.sink = make_sink(cfg)
        self.partitions = partitions
        self.renew_s = renew_s
        self.replica = replica_name()
        self.owned: dict[int, Owned] = {}
        self.leases: Any = None
        self.bound = False
        self.state = "starting"
        self.metrics = service.metrics
        self.metrics.partitions.labels(sink=cfg.name).set(0)

    def lease_key(self, n: int) -> str:
        return f"x.{self.cfg.name}.{n}"

    @property
    def member_key(self) -> str:
        return f"xm.{self.cfg.name}.{self.replica}"

    # ------------------------------------------------------------ setup

    async def setup(self) -> None:
        """The sink's source in AEP_EXPORT (the stream created by the first partitioned sink),
        and the lease bucket."""
        js = self.service.js
        for _ in range(10):  # read, add, write, read again: two sinks starting at once both get in
            try:
                stream = (await js.stream_info(S.EXPORT_STREAM)).config
            except nats.js.errors.NotFoundError:
                stream = None
            if stream is not None and any(S.export_source_sink(src) == self.cfg.name for src in stream.sources or []):
                break
            start = None
            try:  # an upgrade: go on from where the one-replica durable is
                legacy = await js.consumer_info(S.AEP_EVENTS, self.cfg.durable)
                start = legacy.ack_floor.stream_seq + 1
            except nats.js.errors.NotFoundError:
                pass
            source = S.export_source(self.cfg.name, self.partitions, start)
            try:
                if stream is None:
                    events = (await js.stream_info(S.AEP_EVENTS)).config
                    await js.add_stream(S.export_stream_config(events, [source]))
                else:
                    stream.sources = [*(stream.sources or []), source]
                    await js.update_stream(stream)
                log.info("export_source_added", sink=self.cfg.name, stream=S.EXPORT_STREAM, start_seq=start)
            except nats.js.errors.BadRequestError as exc:  # another replica or sink changed it meanwhile
                log.info("export_source_retry", sink=self.cfg.name, error=str(exc))
            await asyncio.sleep(0.2)
        else:
            raise RuntimeError(f"the sink's source could not be added to {S.EXPORT_STREAM}")
        self.leases = await js.key_value(S.LEASES_BUCKET)

    # ------------------------------------------------------------ leases

    async def members(self) -> int:
        """Live replicas of this sink (member keys not deleted nor expired), at least 1."""
        bucket = S.LEASES_BUCKET
        info = await self.service.js.stream_info(f"KV_{bucket}", subjects_filter=f"$KV.{bucket}.xm.{self.cfg.name}.*")
        n = 0
        for subject in (info.state.subjects or {}):
            try:
                await self.leases.get(subject[len(f"$KV.{bucket}."):])
                n += 1
            except nats.js.errors.KeyNotFoundError:  # deleted (a replica that stopped)
                pass
        return max(n, 1)

    async def maintain(self) -> None:
        """One round: announce this replica, renew, give back above the target, take below it."""
        await self.leases.put(self.member_key, self.replica.encode())
        target = -(-self.partitions // await self.members())
        for n, own in list(self.owned.items()):
            if own.task.done():
                exc = None if own.task.cancelled() else own.task.exception()
                log.error("partition_task_ended", sink=self.cfg.name, partition=n, error=repr(exc))
                await self.release(n)
                continue
            try:
                own.revision = int(await self.leases.update(self.lease_key(n), self.replica.encode(), last=own.revision))
            except Exception as exc:
                log.warning("export_lease_lost", sink=self.cfg.name, partition=n, error=f"{type(exc).__name__}: {exc}")
                own.task.cancel()
                del self.owned[n]
        # at once: one by one, a slow batch could hold the other leases' renewals past their TTL
        await asyncio.gather(*(self.release(n) for n in sorted(self.owned, reverse=True)[:max(0, len(self.owned) - target)]))
        for n in range(self.partitions):
            if len(self.owned) >= target:
                break
            if n in self.owned:
                continue
            try:
                revision = int(await self.leases.create(self.lease_key(n), self.replica.encode()))
            except Exception:  # held by another replica (KeyWrongLastSequenceError), or no answer
                continue
            worker = SinkWorker(self.service, self.cfg, sink=self.sink, partition=n)
            self.owned[n] = Owned(worker, asyncio.create_task(worker.run()), revision)
            log.info("export_partition_acquired", sink=self.cfg.name, partition=n, replica=self.replica)
        self.metrics.partitions.labels(sink=self.cfg.name).set(len(self.owned))
        self.state = f"delivering partitions {sorted(self.owned)} of {self.partitions}"

    async def release(self, n: int) -> None:
        """Give partition ``n`` back: the batch in hand is delivered and acked (or, past
        RELEASE_GRACE_S, left unacked for the next owner), then the lease is deleted."""
        own = self.owned.pop(n)
        own.worker.released = True
        try:
            await asyncio.wait_for(asyncio.shield(own.task), RELEASE_GRACE_S)
        except BaseException:  # timed out, or the task failed: either way it ends here
            own.task.cancel()
        try:
            await self.leases.delete(self.lease_key(n), last=own.revision)
        except Exception:
            pass  # it expires
        log.info("export_partition_released", sink=self.cfg.name, partition=n, replica=self.replica)

    # ------------------------------------------------------------ the loops

    async def run(self) -> None:
        stopper = self.service.stopper
        while not stopper.stopping:
            if not self.bound and not await bind_or_wait(self, self.setup):
                continue
            self.service.health.beat()
            try:
                await self.maintain()
            except Exception as exc:  # NATS away: renewals fail, leases lapse, partitions stop
                log.warning("export_leases_failed", sink=self.cfg.name, error=f"{type(exc).__name__}: {exc}")
            if await stopper.sleep(self.renew_s):
                break
        await asyncio.gather(*(self.release(n) for n in list(self.owned)))
        try:
            await self.leases.delete(self.member_key)
        except Exception:
            pass

    async def watch(self) -> None:
        while not self.service.stopper.stopping:
            lag = 0
            for own in list(self.owned.values()):
                if own.worker.sub is not None:
                    try:
                        lag += await own.worker.lag()
                    except Exception:
                        pass
            self.metrics.lag.labels(sink=self.cfg.name).set(lag)
            if await self.service.stopper.sleep(5.0):
                return
