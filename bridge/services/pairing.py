"""The pairing service: BRIDGE_MAPPED -> AEP_EVENTS, one active owner per partition.

Theory of operation
-------------------
* Ownership: a partition is owned through a lease in the `aep_leases` KV bucket
  (key `p.<n>`). A replica takes a free lease with KV `create` (atomic: fails
  when the key exists) and keeps it with `update(..., last=revision)` every
  `RENEW_S`. The bucket's max age (`LEASE_TTL_S`) removes a lease nobody renews,
  so a standby's next `create` succeeds and it takes over. All of it is
  JetStream's own compare-and-set and TTL: no home-made consensus. A round's
  renewals are sent together, each bounded (`RENEW_TIMEOUT_S`); one that gets no
  answer (a leader change of the bucket, a node lost) is sent again every `RETRY_S`
  while the lease is still surely ours; one refused (another replica holds it)
  stops that partition at once. A partition fenced or given up gives its lease back
  at once (`release_now`), and /healthz lists only what the fence allows at that
  moment (`owned_now`).
* Fencing: an owner acts on a partition only while its lease is surely alive: less
  than `LEASE_TTL_S - FENCE_MARGIN_S` after the last renewal the server confirmed
  (timed from when that request was sent, by the monotonic clock, which keeps
  running while a process is stopped). Before each read, publish batch, tick,
  progress record and checkpoint the partition checks it; past it the partition is fenced:
  dropped at once, nothing published (`aep_bridge_pairing_fenced_total`). So an
  owner paused (SIGSTOP, a VM stall) past its lease, which a standby took over
  meanwhile, publishes nothing stale when it runs again, and never writes its older
  checkpoint over the new owner's: a checkpoint put checks the lease again right before
  its meta (the commit point; the chunks go first), so a put that straddles the fence
  never commits and its chunks are purged.
* State: the pure state machine (`bridge.core.pairing.PairingState`) per
  partition. Every `CHECKPOINT_EVERY` messages or `CHECKPOINT_S` seconds, once
  every publish up to that point is acked, its snapshot (which records the
  BRIDGE_MAPPED stream sequence it covers), zlib-compressed, is written as the
  object `p.<n>` of the `aep_checkpoints` object store (stream OBJ_aep_checkpoints).
  An object is stored in chunks, so its size is not bound by the server's
  max_payload (1 MiB by default), which a compressed checkpoint passes after ~3 h
  at fleet rate (it grows ~100 B/s per partition until the state's bounds hold it).
  A restore reads that object; when there is none, the KV key `p.<n>` of
  `aep_pairing` (where releases before the object store wrote checkpoints; it is
  left as it was, for a rollback); with neither, a fresh state. An unreadable
  checkpoint (bad digest, a chunk missing, not read within
  `CHECKPOINT_READ_TIMEOUT_S`) is never skipped: the partition stays unowned.
* Reading: one ephemeral pull consumer per replica (no acks: the checkpoint IS the
  position) on the `bridge.mapped.<n>.>` of every partition it owns (`filter_subjects`;
  one filter, `bridge.mapped.>`, when it owns them all: `reader_consumer`),
  from the lowest of their positions + 1; the reader (`read_loop`) puts each message
  into its partition's feed, past what that partition already has, and each partition's
  loop (`run_partition`) folds and publishes its own. A partition taken or dropped starts
  a new reader. After a crash or a takeover the new owner restores the checkpoint and
  replays from there; the replayed output is byte-identical (deterministic ids and seq)
  and `Nats-Msg-Id` makes AEP_EVENTS drop what was already published.
* Time: the owner publishes a tick into its own partition (`bridge.mapped.<n>.__tick__`)
  every `tick_s` (AEP_BRIDGE_TICK_S / `--tick-s`, default 15 s); TTL closure runs when the state machine reads a tick, so time
  travels through the stream and a replay sees exactly the same ticks. A tick also carries
  the mapper's floor (`mapper_floor`): the ack floor of the mapper's durable on HERMES_RAW,
  read once per round right before the ticks are published, so every raw message at or below
  it has its events in BRIDGE_MAPPED before the tick. A held follow-up is released only once
  the floor passed the raw messages before it (its start may be in a mapper replica that
  retries its publishes through an outage: `bridge.core.pairing`, rule 3). When the durable
  cannot be read the tick goes without it (the state keeps the last floor); with no durable
  at all, too (as before the floor existed).
* Output: `aep.hermes.<lane token>.<type>` with `Nats-Msg-Id` = the event id.
* Replays past the duplicate window. A restore replays from the checkpoint, and the
  previous owner may have published up to `CHECKPOINT_EVERY` + one batch of messages
  past it; when the restore comes later than AEP_EVENTS' duplicate window (an owner
  down, or NATS away, for longer than that), JetStream would store those outputs
  again. So after each batch whose publishes are all acked the owner records the
  batch's last position in `aep_pairing` (key `q.<n>`, fire-and-forget: a lost write
  only means more checking). A restore folds the replayed messages up to that
  position into the state without publishing them again, and looks up on AEP_EVENTS
  (`bridge.nats.lookup`) the outputs of the next batch (the one in flight when the
  previous owner stopped) when they are older than half the window. Both count in
  `aep_bridge_pairing_republish_skipped_total`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec
import nats.errors
import structlog
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, ObjectMeta, ObjectMetaOptions
from nats.js.errors import KeyNotFoundError
from nats.js.object_store import ObjectStore
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from bridge.core import deadletter
from bridge.core.aep import PAYLOAD_TYPES, decode_event, encode_event
from bridge.core.ceiling import CapturePolicy, configure
from bridge.core.redaction import Redactor
from bridge.core.deadletter import KNOWN_REASONS as DLQ_REASONS
from bridge.core.pairing import SECOND, PairingConfig, PairingInputError, PairingState, read_tick, tick_body
from bridge.runtime import (SCAN_BUDGET, SERVER_MARGIN_NS, duplicate_window_s, UNANSWERED, AckPublisher, ActivityMetrics, BoundedLabel, Health,
                            Loop, Puller, Service, Settings, Stopper, connect_service, epoch_of, find_msg_id, follow, observe_many,
                            outage, publish_now, stored_ns, until_answered)
from bridge.runtime import streams as S
from bridge.runtime import subjects as subj

log = structlog.get_logger("aep_bridge.pairing")

RENEW_S = 2.0
# How long one renewal waits for its answer (nats-py's would be the JetStream context's 5 s).
# Renewals of a round are sent together and each waits at most this: a leases bucket that
# does not answer (its leader cut off, an election) costs a round this long, not 5 s per
# partition one after the other, which passed the later partitions' fencing deadline: pairing-0
# fenced all eight in a partition of the node that led AEP_EVENTS (issue 42).
RENEW_TIMEOUT_S = RENEW_S
RETRY_S = 0.25  # between a renewal that got no answer and the next
# A batch's publish whose ack has not come this long is sent again (`await_acks`); after
# PUBLISH_GIVE_UP_S the partition is dropped and restored from its checkpoint.
ACK_RESEND_S = 3.0
RESEND_PAUSE_S = 0.5
PUBLISH_GIVE_UP_S = 15.0
RESTORE_AGAIN_S = 5.0  # after a restore failed here, before this replica tries that partition again
CHECKPOINT_EVERY = 5000
FETCH_BATCH = 512
PROGRESS_KEY = "q.{}"  # in the aep_pairing bucket: the last position whose outputs are all acked
CHECKPOINT_KEY = "p.{}"  # the object in aep_checkpoints (and, from older releases, the key in aep_pairing)
# nats-py's default chunk (and Go's); smaller when the server's max_payload is smaller,
# or every chunk publish would be refused.
CHECKPOINT_CHUNK = 128 * 1024
# A checkpoint's read (`read_checkpoint`: the object's meta and chunks by message gets) is
# bounded: a restore runs between two lease renewals (RENEW_S) of
# this replica's other partitions, and leases expire after LEASE_TTL_S (10 s): the bound
# stays well below that. Reading 20 MB from a local server took 0.8 s; checkpoints are a
# few MB.
CHECKPOINT_READ_TIMEOUT_S = 5.0
# A checkpoint encodes and compresses the partition's whole state: its cost grows with the
# state (the soak measured ~10 ms per partition after 90 s at 2,000 events/s, growing); every
# 2 s it took a tenth of the process and grew with time. A takeover replays at most this much
# (folding it into the state; what the previous owner published is not published again).
CHECKPOINT_S = 10.0
# Timed checkpoints of one process start at least this far apart (`PairingService.checkpoint_due`).
CHECKPOINT_SPACING_S = 0.25
# An owner stops acting on a partition this long before its lease could expire (fencing).
# Above RENEW_S: a renewal that got no answer is retried once before the partition stops.
FENCE_MARGIN_S = 3.0
# The reader takes what comes as one burst until nothing new has come for this long (`Puller`'s
# ``gather_s``; at most GATHER_MAX_S after its first message), then hands it to the partitions,
# and does not pause. Pairing's input arrives in
# bursts already: the mapper publishes a batch's events at once, after its own pause when quiet
# (`Linger`). A pause of the reader's own (before: `Linger`, ~32 messages a round) batched them
# no further and only delayed them: ~64 ms on average at 250 events/s.
GATHER_S = 0.005
GATHER_MAX_S = 0.025
TICK_TOKEN = subj.TICK_TOKEN
# The mapper durable's info read before a round of ticks (`mapper_floor`): bounded, so an
# outage of HERMES_RAW's consumer leader delays the ticks this much, not nats-py's 5 s.
FLOOR_TIMEOUT_S = 2.0
_TICK_SUFFIX = "." + TICK_TOKEN
# Lanes' subject prefixes and event types remembered (`PairingService.subject_of`), each cleared when full.
SUBJECT_CACHE = 4096
#: one publish of a batch: (subject, body, headers)
Outgoing = tuple[str, bytes, dict[str, str]]
_PARTITION_TOKEN = subj.MAPPED_PREFIX.count(".") + 1  # bridge.mapped.<n>.<lane>: the index of <n>
# How long the reader's pull request (and a partition loop's wait on its feed) waits for a
# message. Each wait that ends empty costs a request, a status and a wake-up: eight partitions
# at 0.5 s were most of an idle replica's CPU (cost.py --idle: pairing 0.9 % of a core, 0.036 ms
# per event at 250 events/s). A longer wait only delays a fenced loop's exit, never a message.
POLL_S = 2.0
# A partition taken more than this many BRIDGE_MAPPED positions behind the furthest one of its
# replica is read by a consumer of its own until it is within half of it (`restart_reader`).
# A takeover's replay from a checkpoint (CHECKPOINT_S, CHECKPOINT_EVERY) stays under it.
CATCH_UP_GAP = 100_000


class PairingMetrics:
    """Names follow the metrics contract in deploy/README.md (dashboard and alerts read them)."""

    def __init__(self, registry: CollectorRegistry, partitions: int) -> None:
        ns = "aep_bridge_pairing"
        self.events_in = Counter(f"{ns}_events_in_total", "Mapped events read from BRIDGE_MAPPED", ["partition"], registry=registry)
        self.events_out = Counter(f"{ns}_events_total", "Events published to AEP_EVENTS, by type", ["type"], registry=registry)
        self.dead_letters = Counter("aep_bridge_dead_letters_total", "Messages sent to bridge.dlq.<reason>", ["reason"], registry=registry)
        self.owned = Gauge(f"{ns}_partitions_owned", "Partitions this replica owns now", registry=registry)
        self.owned_by_partition = Gauge(f"{ns}_partition_owned", "1 when this replica owns the partition", ["partition"], registry=registry)
        self.configured = Gauge(f"{ns}_partitions", "Configured partition count", registry=registry)
        self.configured.set(partitions)
        self.open = Gauge(f"{ns}_open", "Open pairs, by kind", ["kind"], registry=registry)
        self.orphans = Gauge(f"{ns}_orphans_closed_total", "Open starts closed by the orphan TTL, a sweep or overflow (state counter)", ["kind"], registry=registry)
        self.counters = Gauge(f"{ns}_state_counter", "State machine counters (sweeps, suppressions, duplicates, ...)", ["name"], registry=registry)
        self.takeovers = Counter(f"{ns}_takeovers_total", "Partitions this replica took over", registry=registry)
        self.resent = Counter(f"{ns}_publishes_resent_total", "Publishes sent again because their ack did not come (same Nats-Msg-Id)",
                              registry=registry)
        self.checkpoints = Counter(f"{ns}_checkpoints_total", "Checkpoints written", registry=registry)
        self.checkpoint_errors = Counter(f"{ns}_checkpoint_errors_total", "Checkpoints that could not be written or read", ["what"], registry=registry)
        self.checkpoint_bytes = Gauge(f"{ns}_checkpoint_bytes", "Size of the last checkpoint written (compressed)", ["partition"], registry=registry)
        self.pending = Gauge("aep_bridge_consumer_pending_messages", "JetStream num_pending of the consumers read", ["stream", "consumer"], registry=registry)
        self.redelivered = Gauge("aep_bridge_consumer_redelivered_messages", "JetStream num_redelivered", ["stream", "consumer"], registry=registry)
        self.consumer_gaps = Counter(
            f"{ns}_consumer_gaps_total",
            "Deliveries a replica's consumer sent that never arrived (a jump in its consumer sequence); its "
            "partitions read again from their positions", registry=registry)
        self.floor_unknown = Counter(f"{ns}_mapper_floor_unknown_total",
                                     "Tick rounds sent without the mapper's floor (its durable on HERMES_RAW not read)",
                                     registry=registry)
        self.fenced = Counter(f"{ns}_fenced_total", "Partitions dropped because their lease may have lapsed (nothing more published)",
                              registry=registry)
        self.republish_skipped = Counter(
            f"{ns}_republish_skipped_total", "Replayed outputs already on AEP_EVENTS past its duplicate window (not published again)",
            registry=registry,
        )
        self.batch = Histogram(f"{ns}_batch_size", "Mapped events per batch a partition handled (any partition)",
                               buckets=(1, 4, 16, 64, 128, 256, 512), registry=registry)
        self.latency = Histogram(
            f"{ns}_end_to_end_latency_seconds", "Shim receive time to AEP_EVENTS publish ack",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=registry,
        )
        # Types and reasons come from the mapped stream: bounded (`BoundedLabel`).
        self.type_label = BoundedLabel(known=PAYLOAD_TYPES)
        self.reason_label = BoundedLabel(known=DLQ_REASONS, cap=16, shape=r"[a-z][a-z0-9_]{0,39}")

    def event_out(self, event_type: str) -> Any:
        return self.type_label.child(self.events_out, event_type)

    def count(self, types: dict[str, int]) -> None:
        """Add a batch's tally (type -> events published) to the counter and clear it: one
        locked increment per type and batch, not per event (issue 24)."""
        for event_type, n in types.items():
            self.event_out(event_type).inc(n)
        types.clear()

    def dead_letter(self, reason: str) -> Any:
        return self.dead_letters.labels(reason=self.reason_label(reason))


class CheckpointUnreadable(RuntimeError):
    """A partition's checkpoint exists and cannot be read: the partition must stay unowned."""


class Feed:
    """A partition's messages, as the replica's one reader (`PairingService.read_loop`) put them.

    ``last``: the stream sequence up to which every message of the partition was put here (at
    first, the position the partition was restored at; then the last message its reader's
    consumer delivered, of any of its partitions): the reader puts only later ones, and a new
    consumer of the reader starts after the lowest ``last`` of the partitions it reads, so a
    message is never put twice nor skipped when the reader starts over (a partition added or
    dropped, a delivery lost, an error)."""

    __slots__ = ("last", "msgs", "_waiter")

    def __init__(self, last: int) -> None:
        self.last = last
        self.msgs: list[Any] = []
        self._waiter: asyncio.Future | None = None

    def put(self, msgs: list[Any]) -> None:
        self.msgs += msgs
        self.last = msgs[-1].metadata.sequence.stream
        self.wake()

    def wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self, batch: int, timeout: float) -> list[Any]:
        """Up to ``batch`` messages; [] when none came within ``timeout`` (or `wake`)."""
        if not self.msgs:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                async with asyncio.timeout(timeout):
                    await self._waiter
            except TimeoutError:
                return []
            finally:
                self._waiter = None
        msgs = self.msgs
        if len(msgs) <= batch:
            self.msgs = []
            return msgs
        self.msgs = msgs[batch:]
        return msgs[:batch]


class LeaseLapsed(Exception):
    """A checkpoint's commit refused: the partition's lease may have lapsed meanwhile."""


class _FencedMeta:
    """The JetStream context an `ObjectStore.put` of a checkpoint sees: the same, except that
    the meta publish (``meta_prefix``...) raises `LeaseLapsed` once ``fenced()`` says so."""

    def __init__(self, js: Any, meta_prefix: str, fenced: Callable[[], bool]) -> None:
        self._inner, self._meta_prefix, self._fenced = js, meta_prefix, fenced

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def publish(self, subject: str, *args: Any, **kwargs: Any) -> Any:
        if subject.startswith(self._meta_prefix) and self._fenced():
            raise LeaseLapsed(subject)
        return await self._inner.publish(subject, *args, **kwargs)


@dataclass
class Partition:
    number: int
    state: PairingState
    revision: int = 0  # lease revision
    confirmed: float = 0.0  # monotonic time the last confirmed create/renew of the lease was sent
    position: int = 0  # last BRIDGE_MAPPED sequence folded into `state`
    checkpointed: int = 0
    since_checkpoint: int = 0
    last_checkpoint: float = field(default_factory=time.monotonic)
    task: asyncio.Task | None = None
    lost: bool = False
    events_in: Any = None  # this partition's labelled counter
    published: int = 0  # replayed positions up to this one were published by the previous owner
    recheck_left: int = 0  # then this many messages (its batch in flight) are looked up on AEP_EVENTS
    feed: Feed | None = None  # its messages from the replica's reader (made when its loop starts)
    folded: int = 0  # inputs folded since its batch began: added to ``events_in`` once per batch

    @property
    def progress_subject(self) -> str:
        """Where its progress (the last position whose outputs are acked) is written."""
        return subj.kv_subject(S.PAIRING_BUCKET, PROGRESS_KEY.format(self.number))


class PairingService(Service):
    name = "pairing"
    fast_loop = True  # uvloop (issue 24)

    def __init__(self, settings: Settings, replica: str | None = None, registry: CollectorRegistry | None = None,
                 lease_ttl_s: float | None = None, tick_s: float | None = None, policy: CapturePolicy | None = None) -> None:
        self.settings = settings
        # Only for dead letters (the mapped events are capture-gated by the mapper already).
        self.policy = policy or configure(settings.capture, settings.capture_overrides, (), Redactor(
            secret_values=settings.secret_values(), home=os.path.expanduser("~")))[0]
        self.replica = replica or f"{socket.gethostname()}-{os.getpid()}"
        self.registry = registry or CollectorRegistry()
        self.metrics = PairingMetrics(self.registry, settings.partitions)
        self.activity = ActivityMetrics(self.registry)
        self.health = Health("pairing")
        self.stopper = Stopper()
        self.partitions: dict[int, Partition] = {}
        self.lease_ttl_s = lease_ttl_s
        self.tick_s = tick_s or settings.tick_s
        self.pairing_config = PairingConfig(hold_ns=int(settings.pairing_hold_s * SECOND))
        self.checkpoint_s = settings.pairing_checkpoint_s  # (AEP_BRIDGE_PAIRING_CHECKPOINT_S; CHECKPOINT_S by default)
        self.nc: Any = None
        self.js: Any = None
        self.leases: Any = None
        self.checkpoints: Any = None  # the aep_checkpoints object store
        self.pairing_kv: Any = None  # the aep_pairing KV bucket: progress q.<n>, checkpoints of older releases
        self.late_after_ns = int(S.DUPLICATE_WINDOW_S * 1e9) // 2  # half of AEP_EVENTS' duplicate window (read at connect)
        # Partitions this replica should own and does not (its lease was free or is its own, and
        # taking it or restoring it failed): why. Not empty -> /readyz is false. A partition a
        # live lease of another replica holds is not ours to own (a standby owns none, ready).
        self.unowned: dict[int, str] = {}
        self._checkpoint_slot = 0.0  # monotonic time before which no partition starts a checkpoint (`checkpoint_due`)
        self.readers: list[asyncio.Task] = []  # `read_loop`s, for the partitions owned now (`restart_reader`)
        self.old_readers: set[asyncio.Task] = set()  # cancelled ones, still ending (awaited by `stop`)
        self.reading: set[int] = set()  # the partitions the readers were started for
        self.reader_error: str | None = None  # why a reader's last consumer failed (until a read succeeds)
        self.reader_failing_since: float | None = None  # monotonic time of its first failure in a row
        self._releases: set[asyncio.Task] = set()  # leases given back at once (`release_now`)
        self._lane_prefixes: dict[tuple[Any, bool], str] = {}  # (session, unknown lane) -> "aep.hermes.<token>." (`subject_of`)
        self._types_checked: set[str] = set()  # event types `subj.event_subject` took (`subject_of`)
        self._floor_epoch: tuple[Any, int] | None = None  # (the mapper durable's creation time, HERMES_RAW's epoch)
        self._floor_error: str | None = None  # why the last `mapper_floor` read failed (logged once per cause)
        self._restore_again: dict[int, float] = {}  # partition -> monotonic time its failed restore may be tried again
        self.health.live["partitions"] = self.owned_now  # at every moment, the fence's own rule

    # ------------------------------------------------------------ leases

    async def try_acquire(self, n: int) -> int | None:
        from nats.js.errors import KeyWrongLastSequenceError

        try:
            return int(await self.leases.create(f"p.{n}", self.replica.encode()))
        except KeyWrongLastSequenceError:  # someone holds it: another replica, or an earlier us
            try:
                entry = await self.leases.get(f"p.{n}")
            except Exception:  # gone meanwhile, or no answer: the next round tells
                return None
            if entry is not None and entry.value == self.replica.encode():
                self.unowned.setdefault(n, "its lease is held under this replica's name (an earlier process "
                                           "that did not release it, or a failed restore): taken when it expires")
            else:
                self.unowned.pop(n, None)
            return None
        except Exception as exc:  # no answer: we cannot tell who owns it
            self.unowned[n] = f"lease: {type(exc).__name__}: {exc}"
            return None

    def lease_deadline(self) -> float:
        return (self.lease_ttl_s or S.LEASE_TTL_S) - FENCE_MARGIN_S

    def fenced(self, part: Partition) -> bool:
        """True (and the partition marked lost) once the lease may have lapsed: past it, a
        standby may own the partition, so this owner must act on it no more."""
        if part.lost:
            return True
        if time.monotonic() - part.confirmed < self.lease_deadline():
            return False
        part.lost = True
        self.metrics.fenced.inc()
        log.warning("partition_fenced", partition=part.number,
                    since_confirmed_s=round(time.monotonic() - part.confirmed, 1), action="lease released")
        self.release_now(part)
        return True

    def release_now(self, part: Partition) -> None:
        """Give the lease back now, not at the next round (nor leave it to its TTL): the other
        replica takes the partition at its next round. A delete with ``last=revision``: refused
        when the lease is another's already, so it never removes a newer owner's."""
        try:
            task = asyncio.get_running_loop().create_task(self.release(part))
        except RuntimeError:  # no loop (a test's direct call)
            return
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    def owned_now(self) -> list[int]:
        """The partitions this replica may act on at this moment: owned, not lost, and within
        the fencing deadline (the rule `fenced` applies). /healthz reads it from its own thread."""
        now, deadline = time.monotonic(), self.lease_deadline()
        return sorted(n for n, p in dict(self.partitions).items() if not p.lost and now - p.confirmed < deadline)

    async def renew(self, part: Partition) -> bool:
        """Renew the lease. False when it is lost: refused (someone else's now), or no answer
        before it may lapse.

        A renewal that gets no answer within RENEW_TIMEOUT_S is sent again every RETRY_S until
        one is answered or the fencing deadline passes: a leases bucket electing a leader (a
        node cut off, the heal after it: 4-9 s of nats-server's election timeout) is ridden
        through when it answers in time, not given up at the next round. One that was stored
        but whose answer was lost makes the next one refused (``last`` is behind): when the key
        still holds this replica's name, it is ours, at the revision read, confirmed as of the
        first unanswered send (the earliest it can have been stored). A read that gets no answer
        tells nothing: the renewal is tried again (before, the partition was dropped: pairing-0
        dropped six so at a heal in a partition run, 2026-12-07 18:13)."""
        from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

        first = time.monotonic()
        while True:
            sent = time.monotonic()
            left = self.lease_deadline() - (sent - part.confirmed)
            if left <= 0 or self.fenced(part):
                log.warning("lease_lost", partition=part.number, error="no renewal answered before the fencing deadline")
                return False
            try:
                async with asyncio.timeout(min(RENEW_TIMEOUT_S, left)):
                    revision = await self.leases.update(f"p.{part.number}", self.replica.encode(), last=part.revision)
                part.revision = int(revision)
                part.confirmed = sent
                return True
            except KeyWrongLastSequenceError as exc:
                try:
                    async with asyncio.timeout(min(RENEW_TIMEOUT_S, max(0.1, left))):
                        entry = await self.leases.get(f"p.{part.number}")
                except KeyNotFoundError:
                    entry = None
                except Exception as read_exc:  # no answer (the bucket electing): whose it is is not known yet
                    log.warning("lease_renew_retry", partition=part.number,
                                error=f"refused, then its read: {type(read_exc).__name__}: {read_exc}")
                    if await self.stopper.sleep(RETRY_S):
                        return True  # stopping: `stop` gives the leases back
                    continue
                if entry is not None and entry.value == self.replica.encode() and sent > first:
                    part.revision = int(entry.revision)
                    part.confirmed = first
                    return True
                log.warning("lease_lost", partition=part.number, error=f"{type(exc).__name__}: {exc}")
                return False
            except Exception as exc:  # no answer (a leader change, a node lost): again soon
                log.warning("lease_renew_retry", partition=part.number, error=f"{type(exc).__name__}: {exc}")
                if await self.stopper.sleep(RETRY_S):
                    return True  # stopping: `stop` gives the leases back

    async def release(self, part: Partition) -> None:
        await self.release_lease(part.number, part.revision)

    async def release_lease(self, n: int, revision: int) -> None:
        """Delete the lease of partition ``n`` if it is still at ``revision`` (ours)."""
        try:
            await self.leases.delete(f"p.{n}", last=revision)
        except Exception:
            pass

    # ------------------------------------------------------------ checkpoints

    async def read_checkpoint(self, n: int) -> bytes | None:
        """The compressed checkpoint of partition `n` from the object store; None when there is
        no object. Raises when it exists and cannot be read (DigestMismatchError: a chunk
        missing or added; a timeout).

        Read with the checkpoints stream leader's message gets (``STREAM.MSG.GET``: the
        object's meta, then each chunk by ``next_by_subj``), not with nats-py's
        ``ObjectStore.get``, whose ordered consumer is created through the meta group: after a
        partition's heal the meta group elected its leader after the checkpoints stream had
        one, and each partition's restore waited its CHECKPOINT_READ_TIMEOUT_S out in turn
        (two partitions' reads timed out 5 and 10 s after the stream's leader was back: the
        pipeline moved again 13 s later; issue 42)."""
        return await asyncio.wait_for(self._read_object(CHECKPOINT_KEY.format(n)), CHECKPOINT_READ_TIMEOUT_S)

    async def _read_object(self, name: str) -> bytes | None:
        import base64
        import hashlib
        import json

        from nats.js.api import ObjectInfo
        from nats.js.errors import DigestMismatchError, NotFoundError

        stream, bucket = S.CHECKPOINTS.stream_name, S.CHECKPOINTS_BUCKET
        meta = f"$O.{bucket}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"
        try:
            msg = await self.js.get_msg(stream, subject=meta)  # the last one of the subject
        except NotFoundError:
            return None
        info = ObjectInfo.from_response(json.loads(msg.data or b"{}"))
        if info.deleted:
            return None
        if not info.size:
            return b""
        chunks, digest, seq = f"$O.{bucket}.C.{info.nuid}", hashlib.sha256(), 1
        buf = bytearray()
        while len(buf) <= info.size:  # up to the first message past the last chunk: none
            try:
                chunk = await self.js.get_msg(stream, seq=seq, subject=chunks, next=True)
            except NotFoundError:
                break
            buf += chunk.data or b""
            digest.update(chunk.data or b"")
            seq = int(chunk.seq) + 1
        want = base64.urlsafe_b64decode((info.digest or "").replace("SHA-256=", "").replace("sha-256=", ""))
        if len(buf) != info.size or digest.digest() != want:
            raise DigestMismatchError
        return bytes(buf)

    async def restore(self, n: int) -> Partition:
        """The partition's state from its checkpoint; a fresh state only when there is none.

        The checkpoint is the object `p.<n>` of aep_checkpoints; with no such object, the
        key `p.<n>` of aep_pairing that releases before the object store wrote (an upgrade
        must not replay seven days). An unreadable checkpoint raises: the partition then
        stays unowned (and the "partitions unowned" alert fires) rather than silently
        replaying seven days.
        """
        try:
            blob = await self.read_checkpoint(n)
        except Exception as exc:
            self.metrics.checkpoint_errors.labels(what="read").inc()
            why = f"not read within {CHECKPOINT_READ_TIMEOUT_S} s" if isinstance(exc, asyncio.TimeoutError) else (
                f"{type(exc).__name__}: {exc}")
            log.error("checkpoint_unreadable", partition=n, error=why)
            raise CheckpointUnreadable(f"checkpoint {CHECKPOINT_KEY.format(n)} of partition {n}: {why}") from exc
        if blob is None:
            try:
                entry = await self.pairing_kv.get(CHECKPOINT_KEY.format(n))
            except KeyNotFoundError:
                entry = None
            blob = entry.value if entry is not None else None
            if blob:
                log.info("checkpoint_from_kv", partition=n, bytes=len(blob))
        if not blob:
            state = PairingState(self.pairing_config, partition=n)
        else:
            try:
                state = PairingState.restore(zlib.decompress(blob), self.pairing_config, partition=n)
            except Exception:
                self.metrics.checkpoint_errors.labels(what="read").inc()
                raise
        part = Partition(number=n, state=state, events_in=self.metrics.events_in.labels(partition=str(n)),
                         recheck_left=FETCH_BATCH)
        part.position = part.checkpointed = state.position
        try:
            progress = await self.pairing_kv.get(PROGRESS_KEY.format(n))
            part.published = int(progress.value or 0) if progress is not None else 0
        except KeyNotFoundError:
            pass
        except Exception as exc:  # unreadable: every replayed output older than half the window is looked up
            log.warning("progress_unreadable", partition=n, error=f"{type(exc).__name__}: {exc}")
            part.recheck_left = CHECKPOINT_EVERY + FETCH_BATCH
        return part

    def checkpoint_due(self, part: Partition) -> bool:
        """Is it ``part``'s turn to checkpoint? CHECKPOINT_EVERY messages since its last one: yes
        (the bound a takeover's replay and `restore`'s recheck count on). CHECKPOINT_S since its
        last one: yes once this process's next slot is reached. A checkpoint's snapshot holds
        the loop for the partition's whole state, and a process's partitions are taken together
        and wake together (fed by one reader): they fell due in one turn, and eight snapshots
        back to back stalled every partition ~200 ms every CHECKPOINT_S (soak.py p99 240 ms at
        2,000 events/s, 2026-12-04). So timed checkpoints start at most one per
        CHECKPOINT_SPACING_S in a process: due ones wait their turn (7 x 0.25 s at most with 8
        partitions) and stay spread afterwards."""
        if part.since_checkpoint >= CHECKPOINT_EVERY:
            return True
        now = time.monotonic()
        if not part.since_checkpoint or now - part.last_checkpoint <= self.checkpoint_s or now < self._checkpoint_slot:
            return False
        self._checkpoint_slot = now + CHECKPOINT_SPACING_S
        return True

    async def checkpoint(self, part: Partition) -> None:
        """Write the state once every output up to its position is acked (zlib: ~5x smaller).

        One object per partition, in chunks of at most max_payload: no size limit. A put
        costs a meta lookup, one acked publish per chunk (in sequence), the meta publish and
        a purge of the previous chunks: a few round trips for a checkpoint of a few MB,
        every CHECKPOINT_S per partition at most.
        """
        if part.position == part.checkpointed:
            return
        # Every output up to part.position was acked (handle_batch moves it only then), and this
        # partition has no publish in flight between its batches: nothing to wait for.
        try:
            # zlib releases the GIL: compressed in a worker thread, the loop goes on serving the
            # other partitions (the soak at 2,000 events/s: snapshot ~8 ms, zlib ~16 ms for 1.3
            # MB of state; eight of them on the loop in one turn made p99 240 ms). The snapshot
            # (msgspec holds the GIL) stays on the loop: the state must not move under it.
            blob = await asyncio.to_thread(zlib.compress, part.state.snapshot(), 1)
        except Exception as exc:  # a state no checkpoint can hold: never let it stop the partition
            # (process() refuses such inputs; this is the last line). The partition goes on, and
            # tries again after CHECKPOINT_S; a takeover meanwhile replays from the last good one.
            self.metrics.checkpoint_errors.labels(what="encode").inc()
            log.error("checkpoint_unencodable", partition=part.number, error=f"{type(exc).__name__}: {exc}")
            part.since_checkpoint = 0
            part.last_checkpoint = time.monotonic()
            return
        if self.fenced(part):  # never an older state over a new owner's checkpoint
            return
        name = CHECKPOINT_KEY.format(part.number)
        chunk = min(CHECKPOINT_CHUNK, self.nc.max_payload)
        meta = ObjectMeta(name=name, options=ObjectMetaOptions(max_chunk_size=chunk))
        # The put writes the chunks, then the meta (the commit point): the lease is checked
        # again right before the meta goes out, so a put that straddles the fence (a stall
        # while its chunks went out) never commits; nats-py purges its chunks.
        store = ObjectStore(name=S.CHECKPOINTS_BUCKET, stream=S.CHECKPOINTS.stream_name,
                            js=_FencedMeta(self.js, f"$O.{S.CHECKPOINTS_BUCKET}.M.", lambda: self.fenced(part)))
        try:
            # Shielded: a partition task cancelled (lease lost, shutdown) in the middle of a put
            # would leave chunks no object refers to, and they never expire (the stream has no
            # max age). The put completes or fails (nats-py then purges its chunks) on its own.
            await asyncio.shield(store.put(name, blob, meta=meta))
        except LeaseLapsed:
            return
        except Exception:
            self.metrics.checkpoint_errors.labels(what="write").inc()
            raise
        self.metrics.checkpoints.inc()
        self.metrics.checkpoint_bytes.labels(partition=str(part.number)).set(len(blob))
        part.checkpointed = part.position
        part.since_checkpoint = 0
        part.last_checkpoint = time.monotonic()

    # ------------------------------------------------------------ one partition

    def publish(self, events: list[Any], msg: Any, outgoing: list[Outgoing], published: list[Any]) -> None:
        """Add the publishes of ``events`` (the outputs of the BRIDGE_MAPPED message ``msg``) to
        its batch's ``outgoing``, and the events to ``published`` (not the dead-lettered ones):
        `handle_batch` sends them together once the batch is folded (`AckPublisher.publish_many`)
        and counts them then (`count_published`)."""
        limit = getattr(self.nc, "max_payload", 0) or 0
        for event in events:
            body = encode_event(event)
            try:
                subject = self.subject_of(event)
                if limit and len(body) + len(event.id) + 64 > limit:
                    raise subj.SubjectError("too_large", f"an event of {len(body)} bytes (max_payload {limit})")
            except subj.SubjectError as exc:  # never onto the wire: nats-server would close the connection
                outgoing.append(self.dead_letter_event(event, body, exc.reason, str(exc), msg))
                continue
            outgoing.append((subject, body, {"Nats-Msg-Id": event.id}))
            published.append(event)

    def count_published(self, events: list[Any]) -> None:
        """The metrics of a batch's events once they are sent: the activity metrics (model calls,
        tokens, cost, tools, approvals, runs: bridge/runtime/activity.py) and one increment of
        the events counter per type and batch (issue 24)."""
        types: dict[str, int] = {}
        seen = self.activity.seen
        for event in events:
            seen(event)
            types[event.type] = types.get(event.type, 0) + 1
        self.metrics.count(types)

    def subject_of(self, event: Any) -> str:
        """`subj.event_subject`, its lane's part remembered per session (``aep.hermes.<lane
        token>.``: the token is a regex, a base64 or a SHA-256 of the session id, checked) and
        the types already checked, so a session's next event of any type costs two look-ups.
        Anything not remembered, or a subject past the length cap, takes `subj.event_subject`
        (which raises what it raised: a subject refused is never remembered). Bounded: each
        cleared when full."""
        key = (event.session, event.lane == "unknown")
        prefix = self._lane_prefixes.get(key)
        etype = event.type
        if prefix is not None and etype in self._types_checked and len(prefix) + len(etype) <= subj.MAX_SUBJECT_CHARS:
            return prefix + etype
        subject = subj.event_subject(event)
        if len(self._lane_prefixes) >= SUBJECT_CACHE:
            self._lane_prefixes.clear()
        if len(self._types_checked) >= SUBJECT_CACHE:
            self._types_checked.clear()
        self._lane_prefixes[key] = subject[: len(subject) - len(etype)]
        self._types_checked.add(etype)
        return subject

    async def await_acks(self, part: Partition, futures: list[asyncio.Future], sent: list[Outgoing]) -> None:
        """Wait for the acks of a batch's publishes, in order. One that has not come within
        ACK_RESEND_S, or failed as an outage (a 503 while its stream elects, a connection
        between servers), is sent again, with the same ``Nats-Msg-Id`` (AEP_EVENTS drops a
        second copy), with the others not acked yet, while the lease holds: a publish the
        cut-off leader never acked is not lost with its partition (before: the batch waited
        15 s, then the partition was dropped and restored from its checkpoint, a stall of 15 s
        and more for every partition of the replica; issue 42). After PUBLISH_GIVE_UP_S the
        last error propagates (the partition is dropped, as before). ``futures`` (the acks of
        ``sent``, in the same order) is updated in place to the ones in flight (the caller
        cancels them on an error)."""
        give_up = time.monotonic() + PUBLISH_GIVE_UP_S
        while True:
            try:
                async with asyncio.timeout(max(0.05, min(ACK_RESEND_S, give_up - time.monotonic()))):
                    for f in futures:
                        await f
                return
            except Exception as exc:
                if not outage(exc) or time.monotonic() >= give_up or self.stopper.stopping or self.fenced(part):
                    raise
                why = f"{type(exc).__name__}: {exc}"
                answered = not isinstance(exc, TimeoutError)
            if answered:  # an answer (503): the stream has no leader yet
                await asyncio.sleep(RESEND_PAUSE_S)
            again = [i for i, f in enumerate(futures) if not f.done() or f.cancelled() or f.exception() is not None]
            if self.fenced(part):
                raise TimeoutError(f"fenced while waiting for acks ({why})")
            for i in again:
                if not futures[i].done():
                    futures[i].cancel()
            for i, f in zip(again, await self.publisher.publish_many([sent[i] for i in again])):
                futures[i] = f
            self.metrics.resent.inc(len(again))
            log.warning("publish_resent", partition=part.number, publishes=len(again), error=why[:200])

    def dead_letter_event(self, event: Any, body: bytes, reason: str, error: str, msg: Any = None) -> Outgoing:
        """An output that cannot be published: its publish to the DLQ (`bridge.core.deadletter`, within the
        lowest ceiling, like every dead letter), its position the input ``msg`` it came from
        (the input is consumed as usual; the event can be made again from it)."""
        seq = msg.metadata.sequence.stream if msg is not None else 0
        original = deadletter.Original(S.BRIDGE_MAPPED, seq, msg.subject if msg is not None else "", body)
        letter = deadletter.build("pairing", reason, reason, error, original, self.policy)
        # one letter per output event (one input may yield several)
        headers = {**letter.headers, "Nats-Msg-Id": f"dlq:{S.AEP_EVENTS}:{event.id}"}
        self.metrics.dead_letter(reason).inc()
        log.error("pairing_dead_letter", reason=reason, event_id=event.id, error=headers["Bridge-Dlq-Error"][:200])
        body = letter.body
        limit = getattr(self.nc, "max_payload", 0) or 0
        if limit and len(body) + 1024 > limit:  # content at `full` can be as large as the event
            body = deadletter.build("pairing", reason, reason, error, original, CapturePolicy(default="metadata", overrides={})).body
        return subj.dlq_subject(reason), body, headers

    async def handle(self, part: Partition, msg: Any, outgoing: list[Outgoing], published: list[Any]) -> int | None:
        """Fold one message into the state and add the publishes of what it yields to
        ``outgoing`` (the caller sends a whole batch's at once and awaits their acks).

        Returns the shim receive time. A message the state machine cannot take is dead-lettered and
        skipped. The caller moves the partition's position only once the batch's
        publishes are acked; a failed publish raises, and the partition is then dropped
        and re-acquired from its last checkpoint, because its in-memory state is ahead
        of what was published.
        """
        position = msg.metadata.sequence.stream
        if position <= part.position:
            return None  # already folded into the restored state
        ts_ns = None
        try:
            if msg.subject.endswith(_TICK_SUFFIX):
                now_ns, mapped = read_tick(msg.data)
                out = part.state.tick(now_ns, position, mapped)
            else:
                event = decode_event(msg.data)
                hints = msgspec.json.decode((msg.headers or {}).get("Bridge-Hints", "{}"))
                if not isinstance(hints, dict):
                    hints = {}
                ts_ns = hints.get("ts")
                out = part.state.process(event, hints, position)
                part.folded += 1
        except Exception as exc:  # decode errors, or an input the state machine rejects
            reason = "bad_mapped" if isinstance(exc, (msgspec.DecodeError, msgspec.ValidationError, PairingInputError)) \
                else "pairing_error"
            log.error("pairing_dead_letter", partition=part.number, position=position, error=type(exc).__name__)
            await self.dead_letter(msg, reason, exc)
            return None
        if position <= part.published:  # the previous owner published these and saw the acks
            if out:
                self.metrics.republish_skipped.inc(len(out))
            return None
        if part.recheck_left > 0:
            part.recheck_left -= 1
            out = await self.not_yet_published(msg, out)
        if out:
            self.publish(out, msg, outgoing, published)
        return ts_ns if isinstance(ts_ns, int) else None

    async def not_yet_published(self, msg: Any, events: list[Any]) -> list[Any]:
        """The outputs of a replayed message that a previous owner did not publish, when that
        owner may have published them longer ago than AEP_EVENTS' duplicate window."""
        stored = stored_ns(msg)
        if not events or stored is None or time.time_ns() - stored <= self.late_after_ns:
            return events  # a first publish (after `stored`) is inside the window: JetStream dedupes
        missing = []
        for event in events:
            try:
                subject = subj.event_subject(event)
                found = await find_msg_id(self.nc, S.AEP_EVENTS, subject, event.id, stored - SERVER_MARGIN_NS,
                                          max_probes=SCAN_BUDGET, api_prefix=getattr(self.js, "_prefix", "$JS.API"))
            except Exception as exc:  # let it through: a duplicate at worst, never a loss
                log.warning("republish_check_failed", error=f"{type(exc).__name__}: {exc}")
                found = None
            if found is None:
                missing.append(event)
            else:
                self.metrics.republish_skipped.inc()
        return missing

    async def handle_batch(self, part: Partition, msgs: list[Any]) -> None:
        if self.fenced(part):
            return
        self.metrics.batch.observe(len(msgs))
        outgoing: list[Outgoing] = []
        published: list[Any] = []  # the events of ``outgoing`` (`count_published`)
        receive_times: list[int] = []
        try:
            for msg in msgs:
                ts_ns = await self.handle(part, msg, outgoing, published)
                if ts_ns:
                    receive_times.append(ts_ns)
        finally:
            if part.folded:
                part.events_in.inc(part.folded)
                part.folded = 0
        futures: list[asyncio.Future] = []
        # The lease may have lapsed while the batch was folded: then none of it goes out.
        if outgoing and not self.fenced(part):
            # All of the batch's publishes at once (one call, not one coroutine each), then one
            # wait for their acks.
            futures = await self.publisher.publish_many(outgoing)
            self.count_published(published)
            try:
                # One after the other under one timeout, not wait_for(gather(...)): acks come in
                # order, so after the first wait the rest are mostly done already, and a batch
                # costs no gathering future, task or callback per future (uvloop, 3.11: 10 against
                # 21 us for a batch of five).
                await self.await_acks(part, futures, outgoing)
            except BaseException:  # the partition is dropped: its other publishes are not waited for
                for f in futures:
                    if not f.done():
                        f.cancel()  # (then swept by the publisher; a late ack finds nothing)
                    elif not f.cancelled():
                        f.exception()  # seen: asyncio logs a failure nobody retrieved
                raise
        now = time.time_ns()
        observe_many(self.metrics.latency, [max(0, now - ts_ns) / 1e9 for ts_ns in receive_times])
        last = msgs[-1].metadata.sequence.stream
        if last > part.position:
            part.since_checkpoint += sum(1 for m in msgs if m.metadata.sequence.stream > part.position)
            part.position = last
            if futures and not self.fenced(part):  # every output up to `last` is acked: say so, for a later restore
                # Fire and forget (no reply subject: JetStream stores it and answers nothing): a
                # lost write only means more checking after a late restore, so it costs one
                # socket write per batch, not an ack to wait for and a timer (issue 24); written as
                # the outputs are (`bridge.nats.wire`: nats-py's bytes and checks, one step).
                await publish_now(self.nc, ((part.progress_subject, str(last).encode(), "", None),))

    async def dead_letter(self, msg: Any, reason: str, error: BaseException | str) -> None:
        """Publish the dead letter of a mapped message (`bridge.core.deadletter`: no more than
        the capture policy lets through) to `bridge.dlq.<reason>`."""
        error_type, detail = deadletter.error_parts(error, reason)
        original = deadletter.Original(S.BRIDGE_MAPPED, msg.metadata.sequence.stream, msg.subject, msg.data)
        letter = deadletter.build("pairing", reason, error_type, detail, original, self.policy)
        self.metrics.dead_letter(reason).inc()
        await self.js.publish(subj.dlq_subject(reason), letter.body, headers=letter.headers)

    async def reader_consumer(self, feeds: dict[int, Feed], made: list[Any] | None = None) -> Any:
        """An ephemeral consumer of the partitions of ``feeds``, from the message after the
        lowest of their ``last``: one consumer for all the partitions this replica reads.

        One filter when it can: ``bridge.mapped.>`` for every partition, the partition's own for
        one. nats-server delivers a consumer with several filters (``filter_subjects``) far more
        slowly: `bench_pairing.py --n 30000` (one replica owning all 8 partitions), 2026-12-05,
        7,500-8,900 msg/s with the server at a full core, against 20,300 with one filter (ratio
        to the bare relay 0.55-0.66 -> 1.48; 1.49 with a consumer per partition, 22d51e8)."""
        start = min(f.last for f in feeds.values())
        every = set(feeds) >= set(range(self.settings.partitions))
        one = f"{subj.MAPPED_PREFIX}.>" if every else subj.mapped_filter(min(feeds)) if len(feeds) == 1 else None
        config = ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE if start else DeliverPolicy.ALL,
            opt_start_seq=start + 1 if start else None,
            ack_policy=AckPolicy.NONE,
            inactive_threshold=30.0,
            filter_subject=one,
            filter_subjects=None if one else [subj.mapped_filter(n) for n in sorted(feeds)],
            max_ack_pending=-1,
        )
        if made is not None:
            made.append(config)  # (nats-py sets ``config.name`` before it sends the create)
        return await self.js.pull_subscribe(config.filter_subject or subj.mapped_filter(min(feeds)), stream=S.BRIDGE_MAPPED, config=config)

    async def delete_consumer_named(self, name: str) -> None:
        """Delete the consumer ``name`` on BRIDGE_MAPPED, if it exists (errors ignored)."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(2):
                await self.js.delete_consumer(S.BRIDGE_MAPPED, name)

    async def remove_consumer(self, sub: Any) -> None:
        """Unsubscribe, and delete the consumer rather than leave it to its inactive threshold
        (30 s): a reader started again as partitions come and go would otherwise leave one
        behind each time."""
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
        await self.delete_consumer_named(sub._consumer)  # (a reader's consumer is on BRIDGE_MAPPED)

    @staticmethod
    def dispatch(feeds: dict[int, Feed], msgs: list[Any]) -> None:
        """Put each message into its partition's feed, past the feed's ``last`` only (a new
        consumer starts at the lowest ``last``: the others' messages up to theirs come again)."""
        groups: dict[int, list[Any]] = {}
        for msg in msgs:
            try:
                n = int(msg.subject.split(".", _PARTITION_TOKEN + 1)[_PARTITION_TOKEN])
            except (IndexError, ValueError):
                continue  # not a partition's subject: the consumer's filters let none through
            feed = feeds.get(n)
            if feed is not None and msg.metadata.sequence.stream > feed.last:
                groups.setdefault(n, []).append(msg)
        for n, group in groups.items():
            feeds[n].put(group)

    async def read_loop(self, parts: dict[int, Partition], catch_up: bool = False) -> None:
        """Read the partitions ``parts`` through one consumer and put each message into its
        partition's feed; the partitions' loops (`run_partition`) fold and publish.

        One consumer per replica, not one per partition: a round is one pull request, one
        status and one read of the replies for all of them, where eight partitions each paid
        their own (the CPU-time profile at 250 events/s: the read loop, Puller.fetch and the
        flusher were 65 of pairing's 183 us per event, against 33 of 119 at 2,000/s; issue 24).
        `maintain` starts the readers again (`restart_reader`) whenever the partitions it owns
        change. A delivery lost on the way, a partition fenced, or an error starts a new
        consumer from the lowest ``last`` of the feeds left. ``catch_up``: a partition far
        behind the others, read on its own until it is near them (`CATCH_UP_GAP`)."""
        pending = self.metrics.pending.labels(stream=S.BRIDGE_MAPPED, consumer="pairing")  # set per batch
        parts = dict(parts)  # (`read` drops the fenced ones)
        sub = None
        try:
            while parts and not self.stopper.stopping and not self.nc.is_closed:
                again = False  # a lost delivery or a partition fenced: a new consumer at once
                made: list[Any] = []  # the consumer's config, named by nats-py before its create is sent
                try:
                    feeds = {n: p.feed for n, p in parts.items() if p.feed is not None}
                    sub = await self.reader_consumer(feeds, made=made)
                    log.info("reader_started", partitions=sorted(feeds), from_position=min(f.last for f in feeds.values()),
                             catch_up=catch_up)
                    outcome = await self.read(sub, parts, pending, catch_up)
                    if outcome == "caught_up":  # near the others now: read with them
                        asyncio.get_running_loop().call_soon(self.restart_reader)
                        return
                    again = outcome == "again"
                    if not again:
                        return
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # no consumer (an election, a node lost), a 503, ...
                    self.reader_error = f"{type(exc).__name__}: {exc}"
                    if self.reader_failing_since is None:
                        self.reader_failing_since = time.monotonic()
                    log.warning("reader_failed", error=self.reader_error, action="a new consumer")
                finally:
                    if sub is not None:
                        await self.remove_consumer(sub)
                        sub = None
                    elif made and made[0].name:
                        # Its create was sent but not answered in time, or this reader was
                        # cancelled meanwhile: the server may have made it. Deleted by its name,
                        # not left to its inactive threshold beside the next one (CI, 2026-12-07).
                        await self.delete_consumer_named(made[0].name)
                if not again and await self.stopper.sleep(0.5):
                    return
        finally:
            for part in parts.values():  # the loops see a stop at once, not after their wait
                if part.feed is not None:
                    part.feed.wake()

    async def read(self, sub: Any, parts: dict[int, Partition], pending: Any, catch_up: bool) -> str:
        """`read_loop`'s rounds on the consumer ``sub``: "stop" (a stop, or no partition left),
        "again" (a new consumer is wanted: a lost delivery, a partition fenced and dropped from
        ``parts``) or, ``catch_up``, "caught_up"."""
        puller = Puller(sub, gather_s=GATHER_S, gather_max_s=GATHER_MAX_S)
        feeds = {n: p.feed for n, p in parts.items() if p.feed is not None}
        # The consumer takes no acks: the server moves on once it has sent a message, so a
        # delivery lost on the way (a connection or route torn down by a node's restart) is
        # never sent again. Its consumer sequence numbers each delivery 1, 2, 3, ... (never a
        # redelivery): a jump is a lost delivery, and the reader reads again from the message
        # after the last one it put into each feed (the rolling-restart scenario lost
        # BRIDGE_MAPPED 1679 and folded 1688, 2026-12-04). `delivered`: the consumer sequence
        # of the last message taken.
        delivered = 0
        while not self.stopper.stopping:
            # The leases are checked before every read (a monotonic clock read each): a reader
            # that wakes from a pause past them must not pull for partitions a standby may own
            # now (nor send its pull to a consumer the server removed meanwhile).
            fenced = [n for n, p in parts.items() if self.fenced(p)]
            if fenced:
                for n in fenced:
                    del parts[n]
                return "again" if parts else "stop"
            # A partition whose loop is slower than the stream (a long checkpoint, a publish
            # stall, a replay's look-ups) holds the reader back rather than gathering messages
            # without bound (a catch-up: ~100 wake-ups a second while its feed is full).
            while any(len(f.msgs) >= 2 * FETCH_BATCH and self.running(parts[n]) for n, f in feeds.items()):
                if await self.stopper.sleep(0.01):
                    return "stop"
            try:
                msgs = await puller.fetch(FETCH_BATCH, timeout=POLL_S)
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                msgs = []
            self.reader_error = None
            self.reader_failing_since = None
            gap = next((i for i, m in enumerate(msgs) if m.metadata.sequence.consumer != delivered + 1 + i), None)
            if gap is not None:
                msgs, got = msgs[:gap], msgs[gap].metadata.sequence.consumer
            delivered += len(msgs)
            if msgs:
                self.dispatch(feeds, msgs)
                # The consumer delivers its subjects in stream order: every partition it reads has
                # had everything up to this message, whether or not one of its own came (a new
                # consumer for them starts after it, not after a quiet partition's last message).
                top = msgs[-1].metadata.sequence.stream
                for feed in feeds.values():
                    if feed.last < top:
                        feed.last = top
                try:
                    pending.set(msgs[-1].metadata.num_pending)
                except Exception:
                    pass
            if gap is not None:
                self.metrics.consumer_gaps.inc()
                log.warning("consumer_gap", positions={n: f.last for n, f in feeds.items()}, expected=delivered + 1,
                            got=got, action="read again from the last message put into each partition")
                return "again"
            if catch_up and msgs and min(f.last for f in feeds.values()) >= self.head() - CATCH_UP_GAP // 2:
                return "caught_up"
        return "stop"

    def head(self) -> int:
        """The furthest position any owned partition's feed has reached."""
        return max((p.feed.last for p in self.partitions.values() if p.feed is not None and not p.lost), default=0)

    @staticmethod
    def running(part: Partition | None) -> bool:
        """Is ``part`` owned and its loop still taking from its feed?"""
        return part is not None and not part.lost and part.task is not None and not part.task.done()

    def restart_reader(self) -> None:
        """New readers for the partitions owned now (none: no reader): one consumer for them
        all, and one each for a partition far behind the others (`CATCH_UP_GAP`), which joins
        the others once it is near them. The old readers are cancelled: what they took and did
        not put into a feed is read again (a new consumer starts after each feed's ``last``)."""
        for task in self.readers:
            task.cancel()
        self.old_readers = {t for t in self.old_readers | set(self.readers) if not t.done()}
        self.readers = []
        self.reader_error = None
        self.reader_failing_since = None
        parts = {n: p for n, p in self.partitions.items() if p.feed is not None and not p.lost}
        self.reading = set(parts)
        if not parts or self.stopper.stopping:
            return
        # Without this, a partition taken far behind the others (no checkpoint: a partition
        # count raised; an old one) would make the one consumer send the others everything
        # again from its position, and hold them back until it caught up.
        head = self.head()
        near = {n: p for n, p in parts.items() if p.feed is not None and p.feed.last >= head - CATCH_UP_GAP}
        self.readers.append(asyncio.create_task(self.read_loop(near)))
        for n, part in parts.items():
            if n not in near:
                log.info("partition_catching_up", partition=n, position=part.position, head=head)
                self.readers.append(asyncio.create_task(self.read_loop({n: part}, catch_up=True)))

    async def run_partition(self, part: Partition) -> None:
        """Fold and publish what the reader puts into the partition's feed, until a stop or
        its lease may have lapsed (checked before every batch too, a monotonic clock read)."""
        feed = part.feed
        assert feed is not None
        log.info("partition_started", partition=part.number, from_position=part.position)
        while not self.stopper.stopping and not self.fenced(part):
            msgs = await feed.get(FETCH_BATCH, POLL_S)
            if msgs:
                await self.handle_batch(part, msgs)
            if part.since_checkpoint and self.checkpoint_due(part):
                await self.checkpoint(part)
        if not part.lost:  # a clean stop: everything handled was published
            await self.checkpoint(part)

    # ------------------------------------------------------------ the supervisor loop

    def export_state(self) -> None:
        totals: dict[str, int] = {}
        opens: dict[str, int] = {}
        for part in self.partitions.values():
            for k, v in part.state.counters.items():
                totals[k] = totals.get(k, 0) + int(v)
            for k, v in part.state.open_pairs().items():
                opens[k] = opens.get(k, 0) + int(v)
        orphans: dict[str, int] = {}
        for k, v in totals.items():
            if k.startswith("orphaned."):
                kind = k.rsplit(".", 1)[-1]
                orphans[kind] = orphans.get(kind, 0) + v
            else:
                self.metrics.counters.labels(name=k).set(v)
        for kind, v in orphans.items():
            self.metrics.orphans.labels(kind=kind).set(v)
        for k, v in opens.items():
            self.metrics.open.labels(kind=k).set(v)
        self.metrics.owned.set(len(self.partitions))
        # What the state holds, summed over the owned partitions (in /healthz; memory investigations).
        sizes = {"sessions": 0, "ended_remembered": 0, "held_now": 0}
        for part in self.partitions.values():
            m = part.state.metrics()
            for k in sizes:
                sizes[k] += int(m.get(k, 0))
        self.health.info["state"] = sizes

    async def maintain(self) -> None:
        """Renew held leases, then try to take free ones. Runs every RENEW_S.

        Renewals come first, all of them: a takeover's restore can take seconds (a checkpoint
        read, KV reads), and a partition renewed after it could pass its fencing deadline
        (LEASE_TTL_S - FENCE_MARGIN_S since its last renewal) although its lease was fine."""
        dropped = set()
        renewing: list[Partition] = []
        for n in sorted(self.partitions):
            part = self.partitions[n]
            # Fenced first, however its loop ended: after a pause past the lease a loop may
            # also have failed on a request sent before it (a consumer create that timed
            # out); the partition is then another replica's, not one to report unowned.
            if self.fenced(part):  # its loop stopped publishing; the lease may be someone else's
                if part.task:
                    if part.task.done() and not part.task.cancelled() and part.task.exception() is not None:
                        exc = part.task.exception()
                        log.warning("partition_task_ended_fenced", partition=n, error=f"{type(exc).__name__}: {exc}")
                    part.task.cancel()
                await self.release(part)
                del self.partitions[n]
                self.metrics.owned_by_partition.labels(partition=str(n)).set(0)
                dropped.add(n)
                continue
            if part.task is not None and part.task.done():
                exc = part.task.exception() if not part.task.cancelled() else None
                log.error("partition_task_ended", partition=n, error=str(exc))
                self.unowned[n] = f"its loop ended: {type(exc).__name__}: {exc}"
                await self.release(part)
                del self.partitions[n]
                self.metrics.owned_by_partition.labels(partition=str(n)).set(0)
                dropped.add(n)
                continue
            renewing.append(part)
        # All renewals at once, each bounded (RENEW_TIMEOUT_S): none waits behind another's.
        for part, kept in zip(renewing, await asyncio.gather(*(self.renew(p) for p in renewing))):
            if not kept:
                n = part.number
                if not part.lost:
                    part.lost = True
                    self.release_now(part)  # (refused when it is another's already)
                if part.task:
                    part.task.cancel()
                self.partitions.pop(n, None)
                self.metrics.owned_by_partition.labels(partition=str(n)).set(0)
                dropped.add(n)
        # A reader failing for longer than a lease lives without a renewal: this replica cannot
        # read its partitions. They go back (unowned here: not ready), for another replica to
        # take, or this one again from the next round.
        if self.reader_failing_since is not None and time.monotonic() - self.reader_failing_since > self.lease_deadline():
            log.error("reader_failing", error=self.reader_error, action="partitions released", partitions=sorted(self.partitions))
            for n, part in list(self.partitions.items()):
                part.lost = True  # (nothing more from it: its loop is cancelled, its checkpoint is the last one written)
                if part.task:
                    part.task.cancel()
                await self.release(part)
                del self.partitions[n]
                self.metrics.owned_by_partition.labels(partition=str(n)).set(0)
                self.unowned[n] = f"its consumer failed for {self.lease_deadline():.0f} s: {self.reader_error}"
                dropped.add(n)
        for n in range(self.settings.partitions):
            if n in self.partitions or n in dropped:  # a dropped one is tried again next round
                continue
            if self._restore_again.get(n, 0.0) > time.monotonic():  # its restore failed here a moment ago
                continue
            sent = time.monotonic()
            revision = await self.try_acquire(n)
            if revision is None:
                continue
            try:
                part = await self.restore(n)
            except Exception as exc:  # e.g. CheckpointUnreadable: stays unowned, and not ready
                self.unowned[n] = f"restore: {type(exc).__name__}: {exc}"
                log.error("partition_restore_failed", partition=n, error=self.unowned[n], action="lease released")
                # Given back at once, for the other replica's next round: kept, it blocked the
                # partition until its TTL (10 s; eight partitions so in a partition run, 2026-12-07
                # 18:30). This replica tries it again after RESTORE_AGAIN_S (a checkpoint that stays
                # unreadable is not read every round by both).
                await self.release_lease(n, revision)
                self._restore_again[n] = time.monotonic() + RESTORE_AGAIN_S
                continue
            self._restore_again.pop(n, None)
            part.revision = revision
            part.confirmed = sent
            # The restore may have taken seconds: renewed before the loop starts, so its fencing
            # deadline counts from now, not from before the restore (refused: taken meanwhile).
            if not await self.renew(part):
                await self.release(part)
                continue
            self.unowned.pop(n, None)
            part.feed = Feed(part.position)
            part.task = asyncio.create_task(self.run_partition(part))
            self.partitions[n] = part
            self.metrics.owned_by_partition.labels(partition=str(n)).set(1)
            self.metrics.takeovers.inc()
            log.info("partition_acquired", partition=n, replica=self.replica, position=part.position)
        ended = [t for t in self.readers if t.done()]
        for task in ended:
            if not task.cancelled() and task.exception() is not None:
                exc = task.exception()
                log.error("reader_ended", error=f"{type(exc).__name__}: {exc}")
        # The readers read what is owned now: started again when that changed, or one ended.
        if {n for n, p in self.partitions.items() if not p.lost} != self.reading or ended or (self.partitions and not self.readers):
            self.restart_reader()
        self.health.info["unowned"] = {str(n): why[:200] for n, why in sorted(self.unowned.items())}
        if self.unowned:
            self.health.set_ready(False, f"partitions {sorted(self.unowned)} should be owned here and are not")
        elif self.reader_error is not None and self.readers:
            self.health.set_ready(False, f"the partitions' consumer fails: {self.reader_error}"[:300])
        else:
            self.health.set_ready(True)
        self.export_state()

    async def tick_loop(self) -> None:
        while not self.stopper.stopping:
            if await self.stopper.sleep(self.tick_s):
                return
            if not self.partitions:
                continue
            mapped = await self.mapper_floor()  # before the ticks: what it covers is in the stream before them
            now = time.time_ns()
            body = tick_body(now, mapped)
            for n, part in list(self.partitions.items()):
                if self.fenced(part):
                    continue
                try:
                    slot = now // int(self.tick_s * 1e9)
                    await self.js.publish(
                        subj.tick_subject(n),
                        body,
                        headers={"Nats-Msg-Id": f"tick:{n}:{slot}"},
                    )
                except Exception as exc:
                    log.warning("tick_failed", partition=n, error=str(exc))

    async def mapper_floor(self) -> tuple[int, int] | None:
        """``(epoch, raw seq)``: every raw message of HERMES_RAW up to it was mapped, and the
        mapper acks a raw message only after its events' publishes to BRIDGE_MAPPED were acked,
        so they are all in the stream before a tick published after this read. The durable's
        ack floor; when nothing is pending or unacked, its last delivered message (the floor
        need not move past messages no one will deliver). None when it cannot be read (an
        outage: the state keeps the floor it has; a tick does not wait for it) or there is no
        durable (no mapper deployed yet; being recreated, issue 44). The epoch (HERMES_RAW's
        creation time, the events' ``epoch``) is read again when the durable is a new one."""
        try:
            info = await self.js.consumer_info(S.HERMES_RAW, S.MAPPER_DURABLE, timeout=FLOOR_TIMEOUT_S)
            created = getattr(info, "created", None)
            if self._floor_epoch is None or self._floor_epoch[0] != created:
                stream = await asyncio.wait_for(self.js.stream_info(S.HERMES_RAW), FLOOR_TIMEOUT_S)
                self._floor_epoch = (created, epoch_of(stream.created))
        except Exception as exc:  # (nats.js.errors.NotFoundError: no durable)
            self.metrics.floor_unknown.inc()
            why = f"{type(exc).__name__}: {exc}"[:200]
            if why != self._floor_error:  # once per cause, not every round
                log.info("mapper_floor_unknown", error=why)
            self._floor_error = why
            return None
        self._floor_error = None
        floor = int(getattr(info.ack_floor, "stream_seq", 0) or 0)
        if not info.num_pending and not info.num_ack_pending:
            floor = max(floor, int(getattr(info.delivered, "stream_seq", 0) or 0))
        return self._floor_epoch[1], floor

    async def connect(self) -> None:
        self.nc = await connect_service(self.settings, name=f"aep-bridge-pairing-{self.replica}", role="pairing")
        if (follower := follow.of(self.nc)) is not None:
            follower.lead(S.BRIDGE_MAPPED)  # a server that cannot reach its leader is left (bridge.nats.follow)
        self.js = self.nc.jetstream(publish_async_max_pending=4096)
        self.publisher = await AckPublisher(self.nc).start()  # the events' publishes (bridge.nats.publish)
        await until_answered(self.bind, what="bind", log=log, nc=self.nc)

    async def bind(self) -> None:
        """The buckets and the object store it uses, and AEP_EVENTS' duplicate window."""
        # Read from the leaders, not any replica: a direct get can be lost to a replica cut off
        # from its peers (bridge.nats.follow.leader_kv).
        self.leases = await follow.leader_kv(self.js, S.LEASES_BUCKET)
        self.pairing_kv = await follow.leader_kv(self.js, S.PAIRING_BUCKET)
        self.checkpoints = await self.js.object_store(S.CHECKPOINTS_BUCKET)
        window = await duplicate_window_s(self.js, S.AEP_EVENTS)  # (None: the default assumed)
        self.late_after_ns = int((window or S.DUPLICATE_WINDOW_S) * 1e9) // 2

    def starting(self) -> dict[str, Any]:
        return {"replica": self.replica, "partitions": self.settings.partitions}

    def stopping(self) -> dict[str, Any]:
        return {"partitions": sorted(self.partitions)}

    async def start(self) -> list[Loop]:
        await self.connect()
        self.health.set_ready(True)
        return [self.maintain_loop(), self.tick_loop()]

    async def maintain_loop(self) -> None:
        while not self.stopper.stopping:
            self.health.beat()
            try:
                await self.maintain()
            except Exception as exc:
                self.health.set_ready(False, f"maintain failed: {type(exc).__name__}: {exc}")
                log.warning("maintain_failed", error=f"{type(exc).__name__}: {exc}")
            if await self.stopper.sleep(RENEW_S):
                return

    async def stop(self) -> None:
        """Partition loops see `stopping`, finish the batch in hand, checkpoint and return; then
        the leases go back."""
        tasks = [p.task for p in self.partitions.values() if p.task]
        done, still = await asyncio.wait(tasks, timeout=20) if tasks else (set(), set())
        for task in still:
            task.cancel()
        readers = [*self.readers, *self.old_readers]  # (each returns on the stop, after its fetch in hand)
        if readers:
            done, still = await asyncio.wait(readers, timeout=5)
            for task in still:
                task.cancel()
        for part in list(self.partitions.values()):
            await self.release(part)
