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
  A sink adds its source under the lock ``x.setup`` of the lease bucket (`setup`: a stream
  configuration has no compare-and-set).
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
  sink sees those events again with the same ids, and nothing else twice. A renewal refused
  (another replica holds the lease) stops that partition at once; one that gets no answer
  is tried again next round while the lease is surely alive.
* Fencing (pairing's rule): a partition's worker fetches and sends to the sink only while
  its lease is surely alive: less than ``LEASE_TTL_S - FENCE_MARGIN_S`` after the last
  renewal the server confirmed (timed from when that request was sent, by the monotonic
  clock, which runs on while the process is stopped). Past it the worker stops on its own,
  whatever the renewal loop is doing (a members read or a renewal that hangs, a process
  paused past its lease): a new owner may have recreated the consumer under the same
  name, and the old worker's next fetch would pull from it. A round renews first, then
  reads the members: a failed members read skips the rebalancing, never the renewals.
  While a lease is unsure (a renewal or the members read failed in the last round, or a
  renewal is overdue) the sink says so and the exporter is not ready.
* Delivery: per partition a `SinkWorker` (the one-replica loop: filter, project, deliver,
  ack only what the sink confirmed, retry, dead letters), all of them on one transport (one
  Kafka producer per replica and sink).
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import time
import uuid
from typing import Any

import nats.js.errors
import structlog

from bridge.core.sinks import PARTITIONS, SinkConfig
from bridge.runtime import follow
from bridge.runtime import streams as S
from bridge.services.exporter.sinks import make_sink

log = structlog.get_logger("aep_bridge.exporter")

RENEW_S = 2.0  # lease renewal and rebalancing round (leases expire after S.LEASE_TTL_S)
RELEASE_GRACE_S = 5.0  # a partition given back finishes its batch within this, else it is cancelled
# A worker stops acting on its partition this long before its lease could expire (pairing's
# FENCE_MARGIN_S): above RENEW_S, so a renewal that got no answer is retried once first.
FENCE_MARGIN_S = 3.0
SETUP_LOCK = "x.setup"  # held while a sink changes AEP_EXPORT's sources (never a lease: those are x.<sink>.<n>)


def replica_name() -> str:
    """This process's name in the leases: host, pid and a random part (a restarted process
    never mistakes a lease of its predecessor for its own)."""
    raw = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return re.sub(r"[^A-Za-z0-9_-]", "_", raw)[:96]


class Owned:
    """A partition this replica owns: its worker and task, the lease revision, and when the
    last confirmed create/renewal of the lease was sent (monotonic: the fence counts from it)."""

    __slots__ = ("number", "worker", "task", "revision", "confirmed", "lost")

    def __init__(self, number: int, worker: Any, revision: int, confirmed: float) -> None:
        self.number, self.worker, self.revision, self.confirmed = number, worker, revision, confirmed
        self.task: asyncio.Task[None] = None  # type: ignore[assignment]  # set once the fence is wired
        self.lost = False


async def bind_or_wait(owner: Any, bind: Any) -> bool:
    """``bind()`` and mark ``owner`` (a SinkWorker, a PartitionedSink) bound; or say why not
    (its state, a log line) and wait 2 s. True when bound."""
    try:
        await bind()
    except Exception as exc:
        owner.state = f"bind failed: {exc}"
        log.warning("bind_failed", sink=owner.cfg.name, error=f"{type(exc).__name__}: {exc}")
        await owner.service.stopper.sleep(2.0)
        return False
    owner.bound = True
    return True


class PartitionedSink:
    """The sink's part in this replica: its leases, and a `SinkWorker` per owned partition.
    Looks like a `SinkWorker` to the `Exporter` (cfg, sink, bound, state, run, watch)."""

    def __init__(self, service: Any, cfg: SinkConfig, partitions: int = PARTITIONS, renew_s: float = RENEW_S,
                 lease_ttl_s: float | None = None, worker: Any = None) -> None:
        self.service = service
        # what serves one owned partition: service.SinkWorker, given by the Exporter (partitions.py
        # does not import service.py, which imports this module: no cycle)
        self.worker = worker
        self.cfg = cfg
        self.sink = make_sink(cfg)
        self.partitions = partitions
        self.renew_s = renew_s
        self.lease_ttl_s = lease_ttl_s or S.LEASE_TTL_S
        self.trouble: str | None = None  # why a lease was unsure in the last round (None: all sure)
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
        and the lease bucket.

        A stream's configuration has no compare-and-set: a sink writes the sources it read
        plus its own, and a write based on an older read (two sinks set up at once, one
        write slow on the way) would drop the other's source for good. So the change is
        made under the lock ``x.setup`` of the lease bucket (KV create: one holder; the
        bucket's max age frees it if its holder dies)."""
        js = self.service.js
        self.leases = await follow.kv(js, S.LEASES_BUCKET)
        if await self.has_source(js):  # a restart: nothing to change
            return
        lock = await self.lock_sources()
        try:
            await self.add_source(js)
        finally:
            try:
                await self.leases.delete(SETUP_LOCK, last=lock)
            except Exception:  # it expires
                pass

    async def has_source(self, js: Any) -> bool:
        try:
            stream = (await js.stream_info(S.EXPORT_STREAM)).config
        except nats.js.errors.NotFoundError:
            return False
        return any(S.export_source_sink(src) == self.cfg.name for src in stream.sources or [])

    async def lock_sources(self) -> int:
        deadline = time.monotonic() + self.lease_ttl_s + 5.0
        while True:
            try:
                return int(await self.leases.create(SETUP_LOCK, self.replica.encode()))
            except nats.js.errors.KeyWrongLastSequenceError:  # another sink or replica is at it
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{SETUP_LOCK} of {S.LEASES_BUCKET} held for {self.lease_ttl_s + 5.0:.0f} s") from None
                await asyncio.sleep(0.1)

    async def add_source(self, js: Any) -> None:
        for _ in range(10):  # read, add, write, read again
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

    def lease_deadline(self) -> float:
        return self.lease_ttl_s - FENCE_MARGIN_S

    def fenced(self, own: Owned) -> bool:
        """True (and the partition marked lost) once its lease may have lapsed: past it, another
        replica may own the partition (and have recreated its consumer), so this replica must
        fetch and deliver on it no more. A monotonic clock read: checked before every fetch
        and every send."""
        if own.lost:
            return True
        if time.monotonic() - own.confirmed < self.lease_deadline():
            return False
        own.lost = True
        self.metrics.fenced.labels(sink=self.cfg.name).inc()
        log.warning("export_partition_fenced", sink=self.cfg.name, partition=own.number,
                    since_confirmed_s=round(time.monotonic() - own.confirmed, 1))
        return True

    def unsure(self) -> str | None:
        """Why a lease of this sink may not be this replica's for sure (readiness), or None."""
        if self.trouble:
            return self.trouble
        now = time.monotonic()
        for own in self.owned.values():  # a round that hangs (or a pause): a renewal is overdue
            if now - own.confirmed > 2 * self.renew_s + 1.0:
                return f"lease x.{self.cfg.name}.{own.number} not renewed for {now - own.confirmed:.1f} s"
        return None

    async def renew(self, own: Owned) -> bool:
        """Renew ``own``'s lease. False when it is lost: refused (another replica's now), or
        no answer and no time left to try again before it may lapse."""
        sent = time.monotonic()
        try:
            own.revision = int(await self.leases.update(self.lease_key(own.number), self.replica.encode(), last=own.revision))
            own.confirmed = sent
            return True
        except nats.js.errors.KeyWrongLastSequenceError as exc:
            log.warning("export_lease_lost", sink=self.cfg.name, partition=own.number, error=f"{type(exc).__name__}: {exc}")
            return False
        except Exception as exc:  # no answer (a leader change, a node lost): again next round, while surely ours
            self.trouble = f"lease x.{self.cfg.name}.{own.number} not renewed: {type(exc).__name__}: {exc}"
            if not self.fenced(own) and time.monotonic() + self.renew_s - own.confirmed < self.lease_deadline():
                log.warning("export_lease_renew_retry", sink=self.cfg.name, partition=own.number,
                            error=f"{type(exc).__name__}: {exc}")
                return True
            log.warning("export_lease_lost", sink=self.cfg.name, partition=own.number, error=f"{type(exc).__name__}: {exc}")
            return False

    def drop(self, n: int) -> None:
        own = self.owned.pop(n)
        own.lost = True
        own.worker.released = True
        own.task.cancel()

    async def maintain(self) -> None:
        """One round: renew (every lease, first), announce this replica, then give back above
        the target and take below it. A members read that fails skips only the rebalancing."""
        self.trouble = None
        for n, own in list(self.owned.items()):
            if self.fenced(own):  # however its task ended: the lease may be someone else's now
                self.drop(n)
                try:
                    await self.leases.delete(self.lease_key(n), last=own.revision)  # still ours: given back
                except Exception:
                    pass
                continue
            if own.task.done():
                exc = None if own.task.cancelled() else own.task.exception()
                log.error("partition_task_ended", sink=self.cfg.name, partition=n, error=repr(exc))
                await self.release(n)
                continue
            if not await self.renew(own):
                self.drop(n)
        try:
            await self.leases.put(self.member_key, self.replica.encode())
            target = -(-self.partitions // await self.members())
        except Exception as exc:  # the leases stay renewed; who gets what waits for a round that can tell
            self.trouble = f"members not read: {type(exc).__name__}: {exc}"
            log.warning("export_members_failed", sink=self.cfg.name, error=f"{type(exc).__name__}: {exc}")
            self.finish_round()
            return
        # at once: one by one, a slow batch could hold the other leases' renewals past their TTL
        await asyncio.gather(*(self.release(n) for n in sorted(self.owned, reverse=True)[:max(0, len(self.owned) - target)]))
        for n in range(self.partitions):
            if len(self.owned) >= target:
                break
            if n in self.owned:
                continue
            sent = time.monotonic()
            try:
                revision = int(await self.leases.create(self.lease_key(n), self.replica.encode()))
            except Exception:  # held by another replica (KeyWrongLastSequenceError), or no answer
                continue
            worker = self.worker(self.service, self.cfg, sink=self.sink, partition=n)
            own = Owned(n, worker, revision, sent)
            worker.fence = lambda own=own: self.fenced(own)  # type: ignore[misc]
            own.task = asyncio.create_task(worker.run())
            self.owned[n] = own
            log.info("export_partition_acquired", sink=self.cfg.name, partition=n, replica=self.replica)
        self.finish_round()

    def finish_round(self) -> None:
        self.metrics.partitions.labels(sink=self.cfg.name).set(len(self.owned))
        self.state = f"delivering partitions {sorted(self.owned)} of {self.partitions}"
        if self.trouble:
            self.state += f"; lease unsure: {self.trouble}"

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
            except Exception as exc:  # NATS away: renewals fail, leases lapse, partitions stop (fenced)
                self.trouble = f"lease round failed: {type(exc).__name__}: {exc}"
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
