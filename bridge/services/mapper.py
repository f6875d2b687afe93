"""The mapper service: HERMES_RAW -> BRIDGE_MAPPED, stateless and horizontally scalable.

Theory of operation
-------------------
* Every replica binds the same durable pull consumer on HERMES_RAW, so JetStream
  spreads the raw messages over the replicas.
* A batch is fetched, each raw message is mapped by the pure core
  (`bridge.core.pipeline.map_record`) with its raw stream sequence and message id
  as identity, every resulting event is published to
  `bridge.mapped.<partition>.<lane token>` with `Nats-Msg-Id` = the event id, and
  the raw message is acked only after ALL of its publishes were acked. A crash
  anywhere in between means redelivery; the redelivered message maps to the
  byte-identical events, and BRIDGE_MAPPED's duplicate window drops them.
* Lanes: a KV bucket (`aep_lanes`) of known sessions and task aliases, read
  through a bounded in-process cache (`MemoryLanes`). The lookups the pure
  mapping might need are prefetched before it runs.
* One raw message, one lane: the lane of a raw message that needed a look-up is recorded
  (`aep_lane_facts`, a KV create) before its events are published, the creates of a batch
  in flight together (`release_held`; the batch's later messages are published after
  them, in raw order), and every later attempt maps with exactly that lane
  (`PinnedLane`). A redelivery that cannot read its fact is retried; a fact that cannot be
  recorded maps the message as before (the late look-ups are the backstop).
* An approval names its session in its `turn_id` prefix (`bridge.core.lanes`, rule 2):
  filed there with no look-up and no wait. Only what the envelope cannot name (a tool
  called inside `execute_code`: a task alias; an approval without a turn id: its
  `session_key`) is looked up.
* "A session already seen" means seen EARLIER IN HERMES_RAW, whichever replica
  mapped it. A session-less event whose candidates are not known yet may just be racing the
  replica that holds its session's first event: before filing it under `unknown`,
  the mapper waits until every earlier raw message is acked (the consumer's ack
  floor, plus the messages of its own batch already mapped, whose lanes are in its
  cache) and looks again. A raw message is acked only after its KV puts are, so the
  answer is the one `aep-bridge map` gives over the same stream, on any number of
  replicas. The wait is bounded (`AEP_BRIDGE_LANE_WAIT_MS`, default 2000; 0 = look at
  the floor once, never wait. A waited-for approval can reach pairing after its
  session's end published by the other replica: pairing's late starts handle that. A
  message held back by a retry or a dead replica's ack_wait does not stall the
  batch longer; counted in `aep_bridge_mapper_lane_wait_timeouts_total`).
* The shared durable deleted under a running mapper (issue 44) is created again after the
  raw messages already mapped (`durable_gone`), not from the stream's start; /healthz is
  503 until it is back (`aep_bridge_mapper_consumers_recreated_total`).
* `epoch` = the creation time of HERMES_RAW (milliseconds): it changes, upward, only
  when the stream is recreated, and every replica reads the same value.
* Every raw message is checked first (`check_raw`: `bad_raw`), its body's instance
  against the subject's instance token, which the server authorised
  (`instance_mismatch`); an unknown hook name whose type would exceed the cap is
  `bad_hook`, an event over max_payload `too_large`. Every subject comes from
  `bridge.nats.subjects` (bounded): nothing a message contains can make the server
  close the connection.
* A session belongs to the first instance seen for it (`KvLanes.session_owner`: `o.<lane
  token>` in `aep_lane_facts`, a KV create, so every replica and the gate agree). A raw
  message of another instance filed under that session, by its id or a look-up, is not
  mapped: pairing keys sessions by id and would end or sweep the owner's session
  (`instance_conflict`). A session not known here yet: its record's create is sent and its
  messages held until the batch's end, with the lane facts' (`release_held`, `owner_allows`).
* What cannot be decoded or mapped goes to `bridge.dlq.<reason>`, then the raw message
  is acked. The dead letter (`bridge.core.deadletter`) carries no more than the capture
  policy lets through: the reason, the error's type, the raw message's position
  (`Bridge-Raw-Seq`, subject, id), size and digest; its content only at `redacted`
  (redacted) or `full`; never a reply subject. The DLQ is kept for 30 days and browsed
  by operators; the exact original stays in HERMES_RAW at `Bridge-Raw-Seq` for its
  retention. A message that keeps failing for a reason we did not foresee is
  retried with backoff and dead-lettered once it has been delivered `max_deliver`
  times. Nothing a message contains can stop the loop.
* Resends past the duplicate window (`bridge.nats.lookup`). A shim that sent a
  message but never saw its ack spools it and sends it again later with the same
  id; within HERMES_RAW's duplicate window JetStream drops the copy, after a longer
  outage it is stored twice. So a raw message stored more than half the window
  after its receive time (only spool replays are that late) is looked up in
  HERMES_RAW: an earlier copy with the same `Nats-Msg-Id` on its subject means its
  events were made from that copy; it is acked and counted
  (`aep_bridge_mapper_resends_dropped_total`). Likewise a redelivered raw message
  stored longer ago than half of BRIDGE_MAPPED's window (an earlier attempt may have
  stored some events before its ack was lost) publishes only the events BRIDGE_MAPPED
  does not hold yet: the ids on its lane subject (and on `_unknown` for a look-up lane
  no earlier attempt recorded) stored since the raw message, read once per batch and
  subject, at most LATE_SCAN_BUDGET messages per batch. Lookups cost nothing on the
  normal path; one that fails (an error reply too) or runs out of budget lets the copy
  through (a duplicate at worst, never a loss) and is counted.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

import msgspec
import nats.errors
import nats.js.errors
from nats.js.api import DeliverPolicy
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from bridge.core import deadletter
from bridge.core.aep import PAYLOAD_TYPES, encode_event
from bridge.core.ceiling import CapturePolicy
from bridge.core.deadletter import KNOWN_REASONS as DLQ_REASONS
from bridge.core.envelope import EnvelopeError, check_raw, decode_raw
from bridge.core.lanes import UNKNOWN_TOKEN, event_lane_token, lane_candidates, partition_of
from bridge.core.mapping import HOOKS, INVALID_FIELDS
from bridge.core.pipeline import map_record, record_from_raw
from bridge.runtime import (DEFAULT_MARGIN_NS, FACT_TIMEOUT_S, duplicate_window_s, OTHER, SERVER_MARGIN_NS, UNANSWERED, AckPublisher, ack_many,
                            BoundedLabel, Health, KvLanes, Linger, Loop, PinnedLane, Puller, Service, Settings, Stopper,
                            connect_service, epoch_of, find_msg_id, follow, lane_fact_key, lost_create, load_price_table, msg_ids_on,
                            observe_many, outage, server_list, stored_ns, until_answered, wait_all)
from bridge.runtime import streams as S
from bridge.runtime import subjects as subj

log = structlog.get_logger("aep_bridge.mapper")

HINTS_HEADER = "Bridge-Hints"
RAW_SEQ_HEADER = "Bridge-Raw-Seq"
# An instance silent this long is taken for gone: its last-seen series is dropped. The
# AepBridgeHermesInstanceSilent alert (30 min by default) has fired for most of a day by then.
INSTANCE_FORGET_S = 24 * 3600.0
# Hermes instances with their own last-seen series; more share the series `other`.
MAX_INSTANCE_SERIES = 4096
#: distinct model labels of the usage counters; further models share `other`
MAX_MODEL_SERIES = 64
OUTAGE_RETRY_MAX_S = 5.0  # the longest nak delay of a message that met an outage (an election takes seconds)
# Raw subjects' instance parts (`hermes.raw.<instance>`) whose body instance was checked
# (`handle`). Keyed by the subject without its hook since issue 43: a fleet of 1,000 instances
# sends on ~15,000 subjects, so a cache of 4,096 subjects was emptied over and over, and each
# miss costs check_raw_instance's ~2.3 us.
RAW_INSTANCES_CHECKED = 4096
FINISHED_MAX = 16384  # finished raw seqs remembered above the known ack floor
# BRIDGE_MAPPED messages one batch may read to find the events of its late redeliveries
# (one request each: ~0.4-0.5 ms on a local server, 4-5 s in all). Past it a late copy goes
# through: a duplicate at worst.
LATE_SCAN_BUDGET = 10_000
# A batch of less than a quarter of the fetch size and of fewer than LINGER_TARGET messages, once
# acked, is followed by a pause of AEP_BRIDGE_LINGER_MS, up to AEP_BRIDGE_LINGER_MAX_MS when quiet
# (`bridge.runtime.lifecycle.Linger`): a quiet fleet otherwise costs a batch, its socket writes and
# its acks per message (issue 24: docs/BENCHMARKS.md "Cost"). The mapper is the pipeline's one
# pause: pairing takes each of its batches as one burst (`bridge.services.pairing.GATHER_S`).
# 64, not 32 (with AEP_BRIDGE_LINGER_MAX_MS 300, not 150): cost.py --rates 250,2000, 2 rounds
# alternated, 2026-12-05: mapper + pairing 0.262 / 0.270 -> 0.222 / 0.226 ms per event at
# 250/s, 0.202 / 0.207 -> 0.187 / 0.188 at 2,000/s, flatness 1.29 / 1.30 -> 1.18 / 1.20; e2e p99
# 148 / 147 -> 277 / 278 ms at 250/s and 52 / 53 -> 73 / 74 ms at 2,000/s, what it was before
# pairing stopped pausing (266-281 and 71-75 ms).
LINGER_TARGET = 64


class LastSeen:
    """A gauge family read from a dict at scrape time (prometheus_client's custom collector):
    ``hermes_instance`` -> Unix time. Set by `MapperMetrics.instance_seen` with a dict store."""

    def __init__(self, name: str, documentation: str, values: dict[str, float]) -> None:
        self.name, self.documentation, self.values = name, documentation, values

    def describe(self) -> list[Any]:
        return [GaugeMetricFamily(self.name, self.documentation, labels=["hermes_instance"])]

    def collect(self) -> list[Any]:
        family = GaugeMetricFamily(self.name, self.documentation, labels=["hermes_instance"])
        for label, ts in list(self.values.items()):  # (a copy: the loop may set one meanwhile)
            family.add_metric([label], ts)
        return [family]


class MapperMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        ns = "aep_bridge_mapper"
        self.raw_in = Counter(f"{ns}_raw_messages_total", "Raw messages consumed, by hook", ["hook"], registry=registry)
        self.events_out = Counter(f"{ns}_events_total", "AEP events published to BRIDGE_MAPPED, by type", ["type"], registry=registry)
        self.dead_letters = Counter("aep_bridge_dead_letters_total", "Messages sent to bridge.dlq.<reason>", ["reason"], registry=registry)
        self.unknown_lane = Counter(f"{ns}_unknown_lane_total", "Events filed under the unknown lane", registry=registry)
        # Read at scrape time from `_last_ts` (`LastSeen`), not a Gauge child set per message:
        # at 4,000 events/s from 1,000 instances a batch names nearly one instance a message,
        # and the child's set (a lock and a float) was ~2 % of the mapper's CPU (issue 43).
        self._last_ts: dict[str, float] = {}  # instance label -> Unix time of its last raw message
        self.last_seen = LastSeen(f"{ns}_hermes_instance_last_seen_timestamp_seconds",
                                  "Unix time of the last raw message per Hermes instance", self._last_ts)
        registry.register(self.last_seen)
        self.drift = Counter(f"{ns}_drift_total", "Envelopes whose telemetry_schema_version is not the pinned one", ["seen"], registry=registry)
        self.problems = Counter(f"{ns}_envelope_problems_total", "Envelopes decoded with wrong-typed fields", registry=registry)
        self.latency = Histogram(
            f"{ns}_latency_seconds", "Time to map one raw message (pure core)",
            buckets=(1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3, 0.025), registry=registry,
        )
        self.e2e = Histogram(
            f"{ns}_receive_to_mapped_seconds", "Shim receive time to BRIDGE_MAPPED publish ack",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=registry,
        )
        self.batch = Histogram(f"{ns}_batch_size", "Raw messages per fetched batch", buckets=(1, 4, 16, 64, 128, 256, 512), registry=registry)
        self.pending = Gauge("aep_bridge_consumer_pending_messages", "JetStream num_pending of the consumers read", ["stream", "consumer"], registry=registry)
        self.ack_pending = Gauge("aep_bridge_consumer_ack_pending_messages", "Delivered but not yet acked", ["stream", "consumer"], registry=registry)
        self.redelivered = Gauge("aep_bridge_consumer_redelivered_messages", "JetStream num_redelivered", ["stream", "consumer"], registry=registry)
        self.retries = Counter(f"{ns}_retries_total", "Messages negatively acknowledged for retry", registry=registry)
        self.outage_retries = Counter(f"{ns}_outage_retries_total",
                                      "Retries after an outage (no leader, no responders, a timeout, a lost connection): "
                                      "never dead-lettered, so a lasting one shows here", registry=registry)
        self.resends = Counter(f"{ns}_resends_dropped_total", "Copies recognised as resends past the duplicate window (shim resends on HERMES_RAW, events of a late redelivery)", registry=registry)
        self.resend_checks = Counter(f"{ns}_resend_checks_total", "Late raw messages looked up in HERMES_RAW for an earlier copy", registry=registry)
        self.lane_waits = Counter(f"{ns}_lane_waits_total", "Session-less events whose session was not known yet: checked against the ack floor", registry=registry)
        self.lane_wait_timeouts = Counter(
            f"{ns}_lane_wait_timeouts_total",
            "Lane waits that gave up before every earlier raw message was acked (the event may be filed under unknown)",
            registry=registry,
        )
        self.floor_reads = Counter(
            f"{ns}_ack_floor_reads_total", "Lane waits that asked the server for the consumer's ack floor", registry=registry,
        )
        self.recreated = Counter(f"{ns}_consumers_recreated_total",
                                 "The shared durable on HERMES_RAW found gone and created again", registry=registry)
        self.lane_facts = Counter(
            f"{ns}_lane_facts_total",
            "Lanes of look-up raw messages: recorded by a first attempt, reused from an earlier one, or failed to record",
            ["outcome"], registry=registry,
        )
        self.late_scans_incomplete = Counter(
            f"{ns}_late_scans_incomplete_total",
            "Reads of BRIDGE_MAPPED for a late redelivery that did not cover their stretch (budget spent, or an error)",
            ["reason"], registry=registry,
        )
        self.epoch = Gauge(f"{ns}_epoch", "The AEP epoch in use (HERMES_RAW creation time)", registry=registry)
        # Label values from the wire are bounded (`BoundedLabel`): a hostile raw stream must not
        # grow the series (and the process) without limit.
        self.hook_label = BoundedLabel(known=(*HOOKS, "unknown"), cap=16, shape=r"[a-z][a-z0-9_]{0,47}")
        self.type_label = BoundedLabel(known=PAYLOAD_TYPES)
        self.drift_label = BoundedLabel(known=("missing",), cap=8)
        self.reason_label = BoundedLabel(known=DLQ_REASONS, cap=16, shape=r"[a-z][a-z0-9_]{0,39}")
        self.instance_label = BoundedLabel(cap=MAX_INSTANCE_SERIES, shape=r"[A-Za-z0-9_-]{1,128}")
        self.shim_dropped = Counter(
            "aep_bridge_shim_spool_dropped", "Events the shims dropped at the edge (spool full or unwritable), "
            "as reported in a later raw message's edge.spool_dropped", registry=registry,
        )
        # issue 40: a model call the price table does not price; a token count / duration left out
        self.unpriced = Counter("aep_bridge_model_unpriced_total",
                                "Model calls with no cost: the price table (AEP_BRIDGE_PRICE_TABLE) does not name the model",
                                ["model"], registry=registry)
        self.usage_invalid = Counter("aep_bridge_usage_invalid_total",
                                     "Token counts, durations and call numbers of model calls left out as unusable "
                                     "(negative, fractional, not a number, huge, missing)", ["field"], registry=registry)
        self.model_label = BoundedLabel(cap=MAX_MODEL_SERIES, shape=r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}")
        self.field_label = BoundedLabel(known=INVALID_FIELDS)
        self._instances: dict[str, float] = {}  # instance label -> monotonic time of its last message here
        self._next_forget = 0.0

    def instance_seen(self, instance: str, ts_s: float, now: float) -> None:
        """An instance's last-seen time; past MAX_INSTANCE_SERIES instances they share the
        series `other` (the latest time of any of them)."""
        label = self.instance_label(instance)
        self._instances[label] = now
        if label == OTHER and ts_s <= self._last_ts.get(OTHER, 0.0):
            return
        self._last_ts[label] = ts_s

    def drift_seen(self, seen: str) -> Any:
        return self.drift.labels(seen=self.drift_label(seen))

    def dead_letter(self, reason: str) -> Any:
        return self.dead_letters.labels(reason=self.reason_label(reason))

    def forget_silent_instances(self, now: float, after_s: float = INSTANCE_FORGET_S) -> list[str]:
        """Drop the last-seen series of instances this replica has not heard from for ``after_s``
        (renamed or decommissioned gateways: without this a churning fleet grows the gauge, and
        the process, forever). Checked at most once a minute."""
        if now < self._next_forget:
            return []
        self._next_forget = now + 60.0
        gone = [i for i, t in self._instances.items() if now - t > after_s]
        for instance in gone:
            del self._instances[instance]
            self._last_ts.pop(instance, None)
            self.instance_label.forget(instance)
        return gone

    def edge_seen(self, raw: Any) -> None:
        """Count what a shim reports in ``edge.spool_dropped`` (the shim reports each drop once)."""
        edge = raw.edge if isinstance(raw.edge, dict) else None
        if edge and isinstance(edge.get("spool_dropped"), dict):
            n = edge["spool_dropped"].get("records")
            if type(n) is int and 0 < n < 1 << 40:
                self.shim_dropped.inc(n)

    def hook_in(self, hook: str) -> Any:
        return self.hook_label.child(self.raw_in, hook)

    def event_out(self, event_type: str) -> Any:
        return self.type_label.child(self.events_out, event_type)

    def count(self, hooks: dict[str, int], types: dict[str, int]) -> None:
        """Add a batch's tallies (hook -> raw messages, type -> events) to their counters and
        clear them: one locked increment per label and batch, not per message and event (the
        label look-up and the lock were ~5 % of the mapper's batch, issue 24)."""
        for hook, n in hooks.items():
            self.hook_in(hook).inc(n)
        for event_type, n in types.items():
            self.event_out(event_type).inc(n)
        hooks.clear()
        types.clear()


NOT_PINNED = PinnedLane(None)  # (a held later message's: not read)


class Held(msgspec.Struct):
    """A first attempt waiting for its lane fact's ack before its events are published; or
    (``created`` None) a later message of the batch, published after it in raw order.
    (A Struct: made in C, 0.2-0.3 against 1.1-1.9 us for the NamedTuple it was, and most of a
    batch's messages are held behind its first new session: issue 43.)"""

    created: asyncio.Future | None
    futures: list[asyncio.Future]  # the raw message's futures (its ack waits for them all)
    record: Any
    raw_seq: int
    fact: str
    chosen: PinnedLane
    result: Any
    subject: str
    hints: str
    bodies: list[bytes]
    stored: set[str] | frozenset[str] = frozenset()  # (a later message: its events already stored)
    # A message of a session whose instance is not known here yet: the record's create (or
    # read) under way, shared by the batch's messages of that session (`session_owner`), the
    # message's instance and the message (dead-lettered if the session is another instance's).
    owner: asyncio.Future | None = None
    instance: str = ""
    msg: Any = None
    # The instance ``owner``'s create named: the session's first message's in the batch, which
    # a later message of another instance must be judged by (not by its own).
    named: str = ""


class Mapper(Service):
    name = "mapper"
    grace_s = 20.0
    fast_loop = True  # uvloop (issue 24)
    # How long a batch waits for its lane facts' and session records' creates (one wait per
    # batch): an unanswered lane fact then maps its message as before lane facts, an unanswered
    # session record retries its messages (the request each was before issue 43 waited as long).
    fact_timeout_s = FACT_TIMEOUT_S

    def __init__(self, settings: Settings, policy: CapturePolicy, registry: CollectorRegistry | None = None,
                 batch: int = 256, durable: str = S.MAPPER_DURABLE,
                 before_map: Callable[[bytes], None] | None = None) -> None:
        self.settings = settings
        self.linger = Linger(settings.linger_ms / 1000, settings.linger_max_ms / 1000, target=LINGER_TARGET)
        self.policy = policy
        # the operator's price table: parsed at start (role_settings), else read here; a bad one raises
        self.prices = settings.prices or (load_price_table(settings.price_table) if settings.price_table else None)
        self.registry = registry or CollectorRegistry()
        self.metrics = MapperMetrics(self.registry)
        self.health = Health("mapper")
        self.stopper = Stopper()
        self.batch_size = batch
        self.durable = durable
        self.epoch = 0
        self.nc: Any = None
        self.js: Any = None
        self.lanes: KvLanes | None = None
        self.sub: Any = None
        self.lane_wait_s = settings.lane_wait_ms / 1000.0
        # The batch in progress: messages mapped and waiting for their acks, and the raw
        # sequences already handled (their lanes are in the cache); see `settle_earlier`.
        self._batch_pending: list[tuple[Any, list[asyncio.Future], int]] = []
        self._batch_done: set[int] = set()
        self._floor = 0  # the consumer's ack floor (stream seq) as last read
        self._server_floor = 0  # the same, as `watch_consumer` last read it (kept across binds)
        self._floor_at = 0.0  # monotonic time that read was answered
        self._consumer_created: Any = None  # the bound durable's creation time (`resumable`)
        self._stuck_floor = -1  # an ack floor a wait already gave up on (a dead replica's messages)
        # Raw messages above `_floor` this replica has finished (acked or dead-lettered after
        # their publishes and KV puts): the floor moves over them without asking the server.
        # One replica then never asks (bench_mapper: 2,061 consumer-info round trips per
        # 50,000 messages before); with several, a gap is another replica's message.
        self._finished: set[int] = set()
        self._instances: dict[str, str] = {}  # `hermes.raw.<instance>` -> the body instance last found to match it
        self._subjects: dict[tuple[str, bool], str] = {}  # (lane, unknown) -> its BRIDGE_MAPPED subject
        self._map_times: list[float] = []  # the pure mapping's seconds per message, observed per batch
        # Called with each raw message's bytes before it is mapped; an exception it raises is a
        # failure of that message (retried, dead-lettered after max_deliver). None in the service;
        # the fault tests inject one that fails on a marker (tests/support/poisoned_mapper.py).
        self.before_map = before_map
        # Half of HERMES_RAW's / BRIDGE_MAPPED's duplicate windows (read at bind): older copies are looked up.
        self.late_after_ns = int(S.DUPLICATE_WINDOW_S * 1e9) // 2
        self.mapped_late_after_ns = int(S.DUPLICATE_WINDOW_S * 1e9) // 2
        # What this batch read of BRIDGE_MAPPED for its late redeliveries (`mapped_ids`):
        # subject -> (read from, stored ns; monotonic time read; the ids), and what it may still read.
        self._late_scans: dict[str, tuple[int, float, set[str]]] = {}
        self._late_budget = LATE_SCAN_BUDGET
        # First attempts of look-up raw messages whose lane facts are sent and whose events wait
        # for those acks (`release_held`), and the later messages of the batch behind them.
        self._held: list[Held] = []
        # session -> its instance record's create this batch, and the instance that create named
        self._owner_sends: dict[str, tuple[asyncio.Future, str]] = {}
        # This batch's tallies for the hook and type counters, added once per batch (`count`).
        self._hooks_in: dict[str, int] = {}
        self._types_out: dict[str, int] = {}

    # ------------------------------------------------------------ setup

    async def connect(self) -> None:
        self.nc = await connect_service(self.settings, name=f"aep-bridge-mapper-{self.settings.instance}", role="mapper")
        if (follower := follow.of(self.nc)) is not None:
            follower.lead(S.HERMES_RAW)  # a server that cannot reach its leader is left (bridge.nats.follow)
        self.js = self.nc.jetstream(publish_async_max_pending=4096)
        self.publisher = await AckPublisher(self.nc).start()  # the events' publishes (bridge.nats.publish)

    async def bind(self, start_after: int = 0) -> Any:
        """Bind the shared durable (created when missing: from the stream's start, or, when it
        disappeared under a running mapper, after ``start_after``, the raw messages already
        mapped: `durable_gone`; from the start again when the stream itself is new)."""
        info = await self.js.stream_info(S.HERMES_RAW)
        created = info.created
        if epoch_of(created) != self.epoch:  # a new stream (or the first bind): its sequences start again
            start_after = self._server_floor = 0
        self.epoch = epoch_of(created)
        window = getattr(info.config, "duplicate_window", None)
        if window:
            self.late_after_ns = int(float(window) * 1e9) // 2
        window = await duplicate_window_s(self.js, S.BRIDGE_MAPPED)  # (None: the default assumed)
        if window:
            self.mapped_late_after_ns = int(window * 1e9) // 2
        self.metrics.epoch.set(self.epoch)
        kv = await follow.kv(self.js, S.LANES_BUCKET, leader=True)  # (its role may ask the leader)
        try:
            facts = await follow.kv(self.js, S.LANE_FACTS_BUCKET, leader=True)
        except UNANSWERED:  # an election: asked again, not a mapper without lane facts for its life
            raise
        except Exception as exc:  # a release before lane facts bootstrapped this server: map without them
            log.warning("lane_facts_unavailable", error=f"{type(exc).__name__}: {exc}")
            facts = None
        self.lanes = KvLanes(kv, facts=facts)
        config = S.mapper_consumer_config(self.durable, self.settings.mapper_ack_wait_s)
        if start_after:
            config.deliver_policy, config.opt_start_seq = DeliverPolicy.BY_START_SEQUENCE, start_after + 1
        self._consumer_created = None
        sub = await self.js.pull_subscribe(S.RAW_SUBJECTS, durable=self.durable, stream=S.HERMES_RAW, config=config)
        await self._keep_consumer(sub, config)
        self.sub, self._floor, self._floor_at = sub, 0, 0.0
        self._finished = set()
        return sub

    async def _keep_consumer(self, sub: Any, config: Any) -> None:
        """An existing durable keeps the ack_wait and max_deliver it was created with: set
        AEP_BRIDGE_MAPPER_ACK_WAIT_S's, and the backstop max_deliver (a durable made before
        it was: 7)."""
        try:
            info = await sub.consumer_info()
            self._consumer_created = info.created  # the durable bound (`resumable`)
            have = info.config
            wait_differs = have.ack_wait is not None and abs(float(have.ack_wait) - config.ack_wait) > 1e-3
            if wait_differs or have.max_deliver != config.max_deliver:
                await self.js.add_consumer(S.HERMES_RAW, config=config)
                log.info("mapper_consumer_updated", durable=self.durable, before_s=have.ack_wait, after_s=config.ack_wait,
                         max_deliver_before=have.max_deliver, max_deliver=config.max_deliver)
        except Exception as exc:  # not allowed to, or racing a replica: the durable keeps its own
            log.warning("mapper_consumer_unchanged", durable=self.durable, error=f"{type(exc).__name__}: {exc}")

    # ------------------------------------------------------------ one message

    async def handle(self, msg: Any) -> tuple[list[asyncio.Future], int]:
        """Map one raw message; return the publish futures its ack must wait for, and its receive time."""
        meta = msg.metadata
        raw_seq = meta.sequence.stream
        if self.before_map is not None:
            self.before_map(msg.data)
        try:
            raw = decode_raw(msg.data)
            check_raw(raw)
            # Checked once per instance part and body instance: a part checked has three tokens, so
            # the subject (the part, a dot, a last token with no dot) has four, as check_raw_instance asks.
            part = msg.subject.rpartition(".")[0]
            if self._instances.get(part) != raw.instance:
                subj.check_raw_instance(msg.subject, raw.instance)
                if len(self._instances) >= RAW_INSTANCES_CHECKED:
                    self._instances.clear()
                self._instances[part] = raw.instance
            if raw.instance != (canonical := msg.subject.split(".", 3)[2]):  # one subject, one instance
                raw = msgspec.structs.replace(raw, instance=canonical)
            if raw.ts and self.is_late(msg, raw.ts) and await self.stored_before(msg, raw.id, raw.ts):
                self.metrics.resends.inc()
                log.info("resend_dropped", raw_seq=raw_seq, raw_id=raw.id)
                return [], 0
            hook = raw.hook or "unknown"
            self._hooks_in[hook] = self._hooks_in.get(hook, 0) + 1
            if raw.edge:
                self.metrics.edge_seen(raw)
            record = record_from_raw(raw, checked=True)
            assert self.lanes is not None
            env = record.envelope
            # A lane that only a look-up can give is a fact of the raw message, fixed by its first
            # attempt (`KvLanes.record_lane`) and reused by every later one (docs/ARCHITECTURE.md "Lanes").
            fact = lane_fact_key(msg.subject.split(".")[2], raw.id) \
                if not env.session_id and self.lanes.facts is not None and lane_candidates(env) else None
            pinned = await self.lanes.recorded_lane(fact) if fact is not None and meta.num_delivered > 1 else None
            if pinned is not None:
                self.metrics.lane_facts.labels(outcome="reused").inc()
            elif not env.session_id and await self.lanes.prefetch(env):
                # Its session is not known (yet): settle every earlier raw message, look again
                # (KV misses remembered from before the settling are not believed).
                await self.lanes.prefetch(env, since=await self.settle_earlier(raw_seq))
            result, subject, hints, bodies = self.map_one(record, raw_seq, pinned or self.lanes.cache)
            first = meta.num_delivered <= 1
            if fact is not None and pinned is None and result.events and not first:
                chosen = PinnedLane.of(result)
                try:
                    recorded = await self.lanes.record_lane(fact, chosen)
                except Exception as exc:  # not recorded: published as before lane facts (the scans are the backstop)
                    self.lane_fact_failed(raw_seq, exc)
                    recorded = chosen
                if recorded != chosen:  # an earlier attempt recorded another lane: file it there
                    pinned = recorded
                    self.metrics.lane_facts.labels(outcome="reused").inc()
                    result, subject, hints, bodies = self.map_one(record, raw_seq, recorded)
                else:
                    self.metrics.lane_facts.labels(outcome="recorded").inc()
        except (EnvelopeError, subj.SubjectError) as exc:
            return [await self.dead_letter(msg, exc.reason, exc)], 0
        owner_wait, named = None, ""
        if result.events and not result.unknown and self.lanes.facts is not None:
            owner = self.lanes.cached_owner(result.lane)
            if owner is not None and owner != raw.instance:  # another instance's session: it changes nothing
                return [await self.foreign(msg, owner, raw.instance)], 0
            if owner is None:  # its record's create sent now, answered with the batch (`release_held`)
                sent = self._owner_sends.get(result.lane)
                if sent is None:
                    sent = self._owner_sends[result.lane] = (await self.lanes.send_owner(
                        result.lane, raw.instance, self.publisher.publish), raw.instance)
                owner_wait, named = sent
        futures = await self.lanes.learn(result, self.publisher.publish) if self.lanes.needs_learning(result) else []
        if result.drift:
            self.metrics.drift_seen(result.drift).inc()
        if result.problems:
            self.metrics.problems.inc()
        if result.invalid or result.unpriced:
            self.count_usage_notes(result)
        if fact is not None and pinned is None and result.events and first:
            # A first attempt: its fact is sent now and its events once that is acked, with the
            # other first attempts of the batch (`release_held`: one round trip, not one each).
            chosen = PinnedLane.of(result)
            created = await self.lanes.send_lane(fact, chosen, self.publisher.publish)
            futures.append(created)
            self._held.append(Held(created, futures, record, raw_seq, fact, chosen, result, subject, hints, bodies,
                                   owner=owner_wait, instance=raw.instance, msg=msg, named=named))
            return futures, record.ts_ns
        # `_unknown` is looked at too only for a look-up lane that no earlier attempt recorded
        # (one made by a release before lane facts may have filed it there).
        stored = await self.already_mapped(msg, subject, result.events,
                                           None if result.unknown or pinned is not None else env) \
            if meta.num_delivered > 1 else frozenset()  # (a first delivery is never looked up: no await)
        if self._held or owner_wait is not None:
            # Behind a held first attempt, published after it (`release_held`): its lane is
            # known only from its fact's ack, and may be this message's (a fact an attempt the
            # server forgot recorded), whose events reach BRIDGE_MAPPED in raw order. Still
            # one round trip per batch: the batch's end waits for the facts' acks anyway. So
            # does a message whose session's instance is being recorded.
            self._held.append(Held(None, futures, record, raw_seq, "", NOT_PINNED, result, subject, hints, bodies,
                                   stored, owner=owner_wait, instance=raw.instance, msg=msg, named=named))
            return futures, record.ts_ns
        await self.publish_events(futures, subject, result, bodies, hints, stored)
        return futures, record.ts_ns

    async def publish_events(self, futures: list[asyncio.Future], subject: str, result: Any, bodies: list[bytes],
                             hints: str, stored: set[str] | frozenset[str] = frozenset()) -> None:
        """Publish a mapped raw message's events (but those in ``stored``), pipelined: their
        futures are added to ``futures``."""
        publish, types = self.publisher.publish, self._types_out
        for event, body in zip(result.events, bodies):
            if event.id in stored:
                continue
            futures.append(await publish(subject, body, headers={"Nats-Msg-Id": event.id, HINTS_HEADER: hints}))
            types[event.type] = types.get(event.type, 0) + 1
        if result.unknown:
            self.metrics.unknown_lane.inc(len(result.events))

    async def release_held(self) -> None:
        """Publish the events of the first attempts whose lane facts were sent (`handle`), once
        the facts are acked. A fact found recorded already (an earlier attempt the server did
        not count) is read and the events filed on its lane; a fact that failed otherwise
        publishes nothing: the message is retried (`flush_pending` sees the failed create)."""
        held, self._held = self._held, []
        owners, self._owner_sends = self._owner_sends, {}
        if not held:
            return
        facts = [h.created for h in held if h.created is not None] + [sent for sent, _ in owners.values()]
        if facts:
            await wait_all(facts, timeout=self.fact_timeout_s)
        for h in held:
            if h.owner is not None and not await self.owner_allows(h):
                continue
            created = h.created
            if created is None:  # a later message of the batch: after the held ones before it
                try:
                    await self.publish_events(h.futures, h.subject, h.result, h.bodies, h.hints, h.stored)
                except Exception as exc:  # (the connection going away) retried, like a failed publish ack
                    failed = asyncio.get_running_loop().create_future()
                    failed.set_exception(exc)
                    h.futures.append(failed)
                continue
            unanswered = not created.done()
            if unanswered:  # not recorded: published as before lane facts (below), not retried
                created.cancel()
            elif created.cancelled():
                continue
            result, subject, hints, bodies = h.result, h.subject, h.hints, h.bodies
            error = TimeoutError(f"no answer to the lane fact's create in {self.fact_timeout_s:g} s") \
                if unanswered else created.exception()
            if error is None:
                self.metrics.lane_facts.labels(outcome="recorded").inc()
            elif not lost_create(error):
                # Not recorded (a full bucket, a timeout): published as before lane facts, the
                # late scans are the backstop; retrying would only delay it behind its lane.
                self.lane_fact_failed(h.raw_seq, error)
                h.futures.remove(created)
            else:
                try:
                    recorded = await self.lanes.recorded_lane(h.fact) if self.lanes is not None else None
                    if recorded is None:
                        continue
                    if recorded != h.chosen:
                        result, subject, hints, bodies = self.map_one(h.record, h.raw_seq, recorded)
                except Exception as exc:  # cannot tell (or map) its lane now: retried
                    log.warning("lane_fact_failed", raw_seq=h.raw_seq, error=f"{type(exc).__name__}: {exc}")
                    continue
                h.futures.remove(created)
                self.metrics.lane_facts.labels(outcome="reused").inc()
            try:
                await self.publish_events(h.futures, subject, result, bodies, hints)
            except Exception as exc:  # (the connection going away) retried, like a failed publish ack
                failed = asyncio.get_running_loop().create_future()
                failed.set_exception(exc)
                h.futures.append(failed)

    async def owner_allows(self, h: Held) -> bool:
        """Whether a held message's session is its instance's (its record's create answered):
        if another instance's, the message is dead-lettered; unanswered, it is retried."""
        owner_wait = h.owner
        assert owner_wait is not None
        error: BaseException | None = None
        if not owner_wait.done():
            owner_wait.cancel()
            error = TimeoutError("the session's instance record was not answered")
        elif owner_wait.cancelled():
            error = TimeoutError("the session's instance record was not answered")
        else:
            error = owner_wait.exception()
        if error is None or lost_create(error):
            try:  # the create's answer (the record of another message or replica, when it was not the first)
                owner = await self.lanes.owner_answered(h.result.lane, h.named or h.instance, owner_wait) \
                    if self.lanes is not None else None
            except Exception as exc:  # cannot tell now: retried
                error = exc
            else:
                if owner is None or owner == h.instance:
                    return True
                try:
                    h.futures.append(await self.foreign(h.msg, owner, h.instance))
                except Exception as exc:  # its dead-letter not sent (the connection going away): retried
                    error = exc
                else:
                    return False
        failed = asyncio.get_running_loop().create_future()  # retried, like a failed publish ack
        failed.set_exception(error)
        h.futures.append(failed)
        return False

    async def foreign(self, msg: Any, owner: str, instance: str) -> asyncio.Future:
        """A raw message of another instance than its session's: dead-lettered (`instance_conflict`)."""
        return await self.dead_letter(msg, "instance_conflict", f"session of instance {owner[:100]!r}, "
                                                                f"message from {instance[:100]!r}")

    def count_usage_notes(self, result: Any) -> None:
        m = self.metrics
        for name in result.invalid:
            m.field_label.child(m.usage_invalid, name).inc()
        for model in result.unpriced:
            m.model_label.child(m.unpriced, model).inc()

    def lane_fact_failed(self, raw_seq: int, error: BaseException) -> None:
        self.metrics.lane_facts.labels(outcome="failed").inc()
        log.warning("lane_fact_failed", raw_seq=raw_seq, error=f"{type(error).__name__}: {error}")

    def map_one(self, record: Any, raw_seq: int, lanes: Any) -> tuple[Any, str, str, list[bytes]]:
        """Map one record (pure core) with ``lanes`` as its look-up: the result, its subject,
        hints and event bodies."""
        started = time.perf_counter()
        result = map_record(record, raw_seq, self.epoch, lanes, self.policy, self.prices)
        self._map_times.append(time.perf_counter() - started)  # into the histogram once per batch
        subject = self._subjects.get((result.lane, result.unknown))
        if subject is None:  # (the token's check, crc32 and subject: ~2 % of a message, once per lane)
            token = event_lane_token(result.lane, result.unknown)
            subject = subj.mapped_subject(partition_of(token, self.settings.partitions), token)
            if len(self._subjects) >= 8192:
                self._subjects.clear()
            self._subjects[(result.lane, result.unknown)] = subject
        hints = msgspec.json.encode(result.hints).decode()
        bodies = [encode_event(event) for event in result.events]
        self.check_sizes(bodies, hints)
        return result, subject, hints, bodies

    def check_sizes(self, bodies: list[bytes], hints: str) -> None:
        """``EnvelopeError('too_large')`` when an event would not fit the server's max_payload
        (nats-py would refuse it on every redelivery until max_deliver, hiding why)."""
        limit = getattr(self.nc, "max_payload", 0) or 0
        if not limit or not bodies:
            return
        # Header block: "NATS/1.0\r\n", two "Key: value\r\n" lines, the final "\r\n".
        largest = max(map(len, bodies)) + 26 + len(HINTS_HEADER) + len("Nats-Msg-Id") + 16 + 64
        if largest + 4 * len(hints) <= limit:  # the usual case, without encoding the hints
            return
        size = largest + len(hints.encode())
        if size > limit:
            raise EnvelopeError("too_large", f"an event of {size} bytes with its headers (max_payload {limit})")

    def _advance_floor(self, server_floor: int = 0) -> None:
        """Move the known floor to the server's (when read) and over what this replica finished."""
        floor, finished = max(self._floor, server_floor), self._finished
        if server_floor:
            finished.difference_update([s for s in finished if s <= floor])
        while floor + 1 in finished:
            floor += 1
            finished.discard(floor)
        self._floor = floor
        if len(finished) > FINISHED_MAX:  # other replicas' gaps, no wait to read the floor: keep the newest
            self._finished = set(sorted(finished)[-FINISHED_MAX // 2:])

    def _earlier_settled(self, raw_seq: int) -> bool:
        """Is every raw message before ``raw_seq`` acked or already handled in this batch?"""
        if raw_seq - 1 <= self._floor:
            return True
        # (each seq between the floor and this one handled: a set walk in C, not a generator
        # over the batch for every session-less message, issue 43)
        return self._batch_done.issuperset(range(self._floor + 1, raw_seq))

    async def settle_earlier(self, raw_seq: int) -> float:
        """Wait (bounded) until every raw message before ``raw_seq`` has been mapped, by any
        replica, so that the lanes they teach are in the KV bucket or in our cache. Returns
        the monotonic time from which a KV look-up sees them all."""
        self.metrics.lane_waits.inc()
        if self._earlier_settled(raw_seq):
            return self._floor_at
        deadline = time.monotonic() + self.lane_wait_s
        delay, polls = 0.002, 0
        while True:
            try:
                self.metrics.floor_reads.inc()
                info = await self.sub.consumer_info()
            except Exception as exc:  # cannot tell: go on with what the KV says now
                log.warning("lane_wait_failed", raw_seq=raw_seq, error=f"{type(exc).__name__}: {exc}")
                return time.monotonic()
            self._floor_at = time.monotonic()
            self._advance_floor(int(getattr(info.ack_floor, "stream_seq", 0) or 0))
            if self._earlier_settled(raw_seq):
                return self._floor_at
            # Messages delivered to a replica that died stay unacked for ack_wait (30 s default): wait for
            # a given floor once, not once per event behind it.
            if self._floor_at >= deadline or self._floor == self._stuck_floor:
                self.metrics.lane_wait_timeouts.inc()
                if self._floor != self._stuck_floor:
                    log.info("lane_wait_timeout", raw_seq=raw_seq, ack_floor=self._floor)
                self._stuck_floor = self._floor
                return self._floor_at
            polls += 1
            if polls == 1 and self._batch_pending:
                # Waiting on someone else: first ack our own earlier messages, in case that
                # someone waits on them (a redelivery can put a low seq in a later batch).
                await self.flush_pending()
            else:
                await asyncio.sleep(delay)
                delay = min(0.05, delay * 2)

    def is_late(self, msg: Any, ts_ns: int) -> bool:
        """Stored so long after its receive time that the duplicate window may not cover a first copy."""
        stored = stored_ns(msg)
        return stored is not None and stored - ts_ns > self.late_after_ns

    async def stored_before(self, msg: Any, raw_id: str, ts_ns: int) -> bool:
        """Is an earlier copy of this raw message (same Nats-Msg-Id, same subject) in HERMES_RAW?
        A first attempt is stored around the shim's receive time, so the search starts there."""
        self.metrics.resend_checks.inc()
        seq = msg.metadata.sequence.stream
        try:
            found = await find_msg_id(self.nc, S.HERMES_RAW, msg.subject, raw_id, ts_ns - DEFAULT_MARGIN_NS,
                                      before_seq=seq, until_ns=ts_ns + DEFAULT_MARGIN_NS,
                                      api_prefix=getattr(self.js, "_prefix", "$JS.API"))
        except Exception as exc:  # no permission, a timeout: let the copy through (a duplicate at worst)
            log.warning("resend_check_failed", raw_seq=seq, error=f"{type(exc).__name__}: {exc}")
            return False
        return found is not None

    async def already_mapped(self, msg: Any, subject: str, events: list[Any], envelope: Any = None) -> set[str]:
        """For a redelivered raw message stored longer ago than half of BRIDGE_MAPPED's duplicate
        window: the ids of its events an earlier attempt stored already (not to publish again).

        Looked for on the event's subject, and also on the unknown lane's when the lane of
        ``envelope`` (None: the events are on the unknown lane already) came from a look-up: an
        earlier attempt whose lane wait gave up filed them there. From the raw message's stored
        time (no attempt is earlier) to half a window ago (a younger copy is dropped by the
        window), the whole stretch (`mapped_ids`): a busy lane (`_unknown` collects every
        session's unknown events) holds more than a fixed number of probes would read. First
        deliveries are not looked up (a mapper catching up on a backlog would pay for every
        message); a server that lost the consumer's delivery counts in a crash redelivers as a
        first delivery at once, and those copies, close together, are dropped by pairing's
        dedupe of recent ids."""
        stored = stored_ns(msg)
        if not events or getattr(msg.metadata, "num_delivered", 1) <= 1 or stored is None \
                or time.time_ns() - stored <= self.mapped_late_after_ns:
            return set()  # a first delivery, or any earlier attempt is inside the window
        self.metrics.resend_checks.inc()
        subjects = [subject]
        if envelope is not None and lane_candidates(envelope):
            unknown = subj.mapped_subject(partition_of(UNKNOWN_TOKEN, self.settings.partitions), UNKNOWN_TOKEN)
            if unknown != subject:
                subjects.append(unknown)
        found: set[str] = set()
        for s in subjects:
            ids = await self.mapped_ids(s, stored - SERVER_MARGIN_NS, msg.metadata.sequence.stream)
            found.update(e.id for e in events if e.id in ids)
        if found:
            self.metrics.resends.inc(len(found))
        return found

    async def mapped_ids(self, subject: str, since_ns: int, raw_seq: int) -> set[str]:
        """The ids stored on ``subject`` of BRIDGE_MAPPED from ``since_ns`` to half a window ago,
        read once per batch (a redelivered batch is mostly late messages of a few lanes) and
        reused within it for at most a quarter of the window, so that a copy not seen (younger
        than half a window when read) is still inside the window when the batch publishes. At
        most the batch's budget (LATE_SCAN_BUDGET messages) is read; what is not read is not found."""
        now = time.monotonic()
        scan = self._late_scans.get(subject)
        if scan is not None and scan[0] <= since_ns and now - scan[1] < self.mapped_late_after_ns / 2e9:
            return scan[2]
        try:
            ids, complete = await msg_ids_on(self.nc, S.BRIDGE_MAPPED, subject, since_ns,
                                             time.time_ns() - self.mapped_late_after_ns, max_probes=self._late_budget,
                                             api_prefix=getattr(self.js, "_prefix", "$JS.API"))
        except Exception as exc:  # an error reply, a timeout: let it through, a duplicate at worst, never a loss
            self.metrics.late_scans_incomplete.labels(reason="error").inc()
            log.warning("resend_check_failed", raw_seq=raw_seq, error=f"{type(exc).__name__}: {exc}")
            return set()
        self._late_budget -= len(ids)
        if not complete:
            self.metrics.late_scans_incomplete.labels(reason="budget").inc()
            log.warning("resend_check_incomplete", raw_seq=raw_seq, subject=subject, read=len(ids))
        self._late_scans[subject] = (since_ns, now, ids)
        return ids

    async def dead_letter(self, msg: Any, reason: str, error: BaseException | str) -> asyncio.Future:
        """Publish the dead letter of a raw message (`bridge.core.deadletter`: no more than
        the capture policy lets through, no reply subject) to `bridge.dlq.<reason>`."""
        meta = msg.metadata
        error_type, detail = deadletter.error_parts(error, reason)
        original = deadletter.Original(S.HERMES_RAW, meta.sequence.stream, msg.subject, msg.data, msg.headers)
        letter = deadletter.build("mapper", reason, error_type, detail, original, self.policy)
        self.metrics.dead_letter(reason).inc()
        log.warning("dead_letter", reason=reason, raw_seq=meta.sequence.stream, error=letter.headers["Bridge-Dlq-Error"][:200])
        return await self.publisher.publish(subj.dlq_subject(reason), letter.body, headers=letter.headers)

    # ------------------------------------------------------------ the loop

    async def process_batch(self, msgs: list[Any]) -> None:
        """Map a batch, wait for every publish ack at once, then ack the raw messages.

        A raw message is acked only when all of ITS publishes were acked; one that
        failed is retried (and dead-lettered once past max_deliver).
        """
        self.metrics.batch.observe(len(msgs))
        self._batch_pending, self._batch_done = [], set()
        self._late_scans, self._late_budget = {}, LATE_SCAN_BUDGET
        self._held, self._owner_sends = [], {}
        for msg in msgs:
            try:
                futures, ts_ns = await self.handle(msg)
                self._batch_pending.append((msg, futures, ts_ns))
            except Exception as exc:  # a bug or an outage: retry, then dead-letter
                await self.retry_or_dead_letter(msg, exc)
            # Handled (or given up on for now: a failed message teaches nothing until redelivered).
            self._batch_done.add(msg.metadata.sequence.stream)
        try:
            await self.flush_pending()
        finally:
            self._batch_done = set()
            self.metrics.count(self._hooks_in, self._types_out)
            times, self._map_times = self._map_times, []
            observe_many(self.metrics.latency, times)

    async def flush_pending(self) -> None:
        """Wait for the publish acks of the messages mapped so far, then ack them."""
        await self.release_held()
        pending, self._batch_pending = self._batch_pending, []
        latest: dict[str, int] = {}  # raw subject -> its latest receive time (a subject names one instance)
        for msg, _fs, ts_ns in pending:
            if ts_ns > latest.get(msg.subject, -1):
                latest[msg.subject] = ts_ns
        seen: dict[str, int] = {}
        for subject, ts_ns in latest.items():
            instance = subject.split(".", 3)[2] if subject.count(".") >= 3 else "unknown"
            seen[instance] = max(seen.get(instance, 0), ts_ns)
        mono = time.monotonic()
        for instance, ts_ns in seen.items():
            if ts_ns:
                self.metrics.instance_seen(instance, ts_ns / 1e9, mono)
        self.metrics.forget_silent_instances(mono)
        futures = [f for _, fs, _ in pending for f in fs]
        if futures:
            await wait_all(futures, timeout=10)
            # Nothing times these out by itself: an ack lost with a dying server would leave its
            # future (and its raw message) waiting for ever; cancelled ones are swept (AckPublisher).
            for f in futures:
                if not f.done():
                    f.cancel()
        now = time.time_ns()
        done: list[tuple[Any, int]] = []  # (raw message, receive time): acked together below
        for msg, fs, ts_ns in pending:
            failed = None
            for f in fs:
                if not f.done() or f.cancelled() or f.exception() is not None:
                    failed = f
                    break
            if failed is not None:
                for f in fs:  # the others' errors are retrieved too (asyncio logged each "never retrieved")
                    if f.done() and not f.cancelled():
                        f.exception()
                error = failed.exception() if failed.done() and not failed.cancelled() else TimeoutError("publish ack timed out")
                await self.retry_or_dead_letter(msg, error or RuntimeError("publish failed"))
                continue
            done.append((msg, ts_ns))
        if done:
            try:
                await ack_many(self.nc, [msg for msg, _ in done])  # one write for the batch's acks
            except Exception as exc:  # the raw messages will be redelivered; their events dedupe
                log.warning("ack_failed", error=str(exc), messages=len(done))
                done = [(msg, ts_ns) for msg, ts_ns in done if getattr(msg, "_ackd", False)]  # (acked one by one before it failed)
        for msg, _ in done:
            self._finished.add(msg.metadata.sequence.stream)
        observe_many(self.metrics.e2e, [max(0, now - ts_ns) / 1e9 for _, ts_ns in done if ts_ns > 0])  # receive -> mapped
        if pending:
            self._advance_floor()

    async def retry_or_dead_letter(self, msg: Any, exc: BaseException) -> None:
        """Nak ``msg`` with backoff; dead-letter it (`max_deliver`) on its MAPPER_MAX_DELIVER-th
        failed delivery, unless what failed was the cluster (`outage`: no leader, no
        responders, a timeout, a lost connection). That is not the message's fault: it is
        retried every OUTAGE_RETRY_MAX_S at most for as long as the outage lasts, whatever
        its delivery count, up to the consumer's own backstop (MAPPER_MAX_DELIVER_BACKSTOP)."""
        delivered = msg.metadata.num_delivered
        if outage(exc):
            self.metrics.retries.inc()
            self.metrics.outage_retries.inc()
            log.warning("retry_outage", raw_seq=msg.metadata.sequence.stream, delivered=delivered,
                        error=f"{type(exc).__name__}: {exc}")
            try:
                await msg.nak(delay=min(OUTAGE_RETRY_MAX_S, 0.5 * 2 ** min(delivered, 8)))
            except Exception:
                pass
            return
        if delivered >= S.MAPPER_MAX_DELIVER:
            try:
                fut = await self.dead_letter(msg, "max_deliver", exc)
                await asyncio.wait_for(fut, timeout=10)
                await msg.ack()
            except Exception as inner:
                log.error("dead_letter_failed", error=str(inner))
            return
        self.metrics.retries.inc()
        log.warning("retry", raw_seq=msg.metadata.sequence.stream, delivered=delivered, error=f"{type(exc).__name__}: {exc}")
        try:
            await msg.nak(delay=min(30.0, 0.5 * 2**delivered))
        except Exception:
            pass

    async def resumable(self) -> bool:
        """After a failed fetch: may the mapper go on pulling from the durable it is bound to?
        Yes when the durable answers and is the one bound (its creation time), or when nothing
        answers (an election, a node cut off: the next fetch tells; the consumer's own leader is
        elected apart from the meta group and the other streams). No when it is gone or was
        replaced: then `bind` again. Resuming asks one thing, the durable's own info: a bind asks
        HERMES_RAW's, BRIDGE_MAPPED's and two buckets' stream info too, each waiting on its
        own leader (a partition's heal re-elects them all; issue 42)."""
        try:
            info = await self.js.consumer_info(S.HERMES_RAW, self.durable)
        except nats.js.errors.NotFoundError:
            return False
        except Exception as exc:  # no answer: the same durable, pulled again
            log.info("mapper_resume_unanswered", error=f"{type(exc).__name__}: {exc}")
            return True
        if self._consumer_created is None or info.created != self._consumer_created:
            return False  # another durable of that name (another replica made it after a loss): bind
        self.health.set_ready(True)  # the durable answers: bound as before
        log.info("mapper_resumed", durable=self.durable)
        return True

    async def durable_gone(self) -> int:
        """After a failed fetch: 0 when the shared durable is there (or the server cannot
        tell: another failure, waited out). When it is gone (deleted by hand, or by a role
        that should not have been able to: issue 44) the mapper is not healthy until it is
        back (/healthz 503), and it is created again after the raw messages already mapped
        (this replica's floor, or the server's as last read): returns that floor (0: from the
        start). A replica that binds first creates it; the others bind to that one."""
        try:
            await self.js.consumer_info(S.HERMES_RAW, self.durable)
            return 0
        except nats.js.errors.NotFoundError:
            pass
        except Exception:
            return 0
        self.metrics.recreated.inc()
        self.health.failed = f"consumer {self.durable} on {S.HERMES_RAW} is gone: recreating it"
        floor = max(self._floor, self._server_floor)
        log.error("consumer_gone", stream=S.HERMES_RAW, durable=self.durable, after_seq=floor)
        return floor

    async def watch_consumer(self, sub: Any) -> None:
        while not self.stopper.stopping:
            try:
                sub = self.sub or sub  # (the one bound last)
                info = await sub.consumer_info()
                self._server_floor = max(self._server_floor, int(getattr(info.ack_floor, "stream_seq", 0) or 0))
                labels = {"stream": S.HERMES_RAW, "consumer": self.durable}
                self.metrics.pending.labels(**labels).set(info.num_pending or 0)
                self.metrics.ack_pending.labels(**labels).set(info.num_ack_pending or 0)
                self.metrics.redelivered.labels(**labels).set(info.num_redelivered or 0)
            except Exception:
                pass
            if await self.stopper.sleep(5.0):
                return

    def starting(self) -> dict[str, Any]:
        return {"nats": server_list(self.settings).urls, "partitions": self.settings.partitions}

    async def start(self) -> list[Loop]:
        await self.connect()
        sub = await until_answered(self.bind, what="bind", log=log, nc=self.nc)
        self.health.set_ready(True)
        self.health.info.update(epoch=self.epoch, durable=self.durable)
        log.info("mapper_ready", epoch=self.epoch, durable=self.durable)
        return [self.consume(sub), self.watch_consumer(sub)]

    async def consume(self, sub: Any) -> None:
        puller = Puller(sub, burst=True)  # nothing pushed during the pause (bridge.nats.pull)
        while not self.stopper.stopping:
            self.health.beat()
            try:
                msgs = await puller.fetch(self.batch_size, timeout=1.0)
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                continue
            except Exception as exc:  # connection trouble: stay alive, report not ready
                self.health.set_ready(False, f"fetch failed: {exc}")
                log.warning("fetch_failed", error=f"{type(exc).__name__}: {exc}")
                await self.stopper.sleep(1.0)
                # The same durable still there (a leader change, a server move): pull from it
                # again, asking nothing else (`resumable`). The consumer or the stream gone or
                # replaced (HERMES_RAW recreated, a server that lost its store, the durable
                # deleted): bind again, which also re-reads the epoch.
                if await self.resumable():
                    puller = Puller(sub, burst=True)
                    continue
                try:
                    sub = await self.bind(await self.durable_gone())
                    puller = Puller(sub, burst=True)
                    self.health.set_ready(True)  # bound: the server answers (not only once a message comes)
                    if self.health.failed and self.health.failed.startswith("consumer"):
                        self.health.failed = None
                        log.warning("consumer_recreated", stream=S.HERMES_RAW, durable=self.durable)
                    log.info("mapper_rebound", epoch=self.epoch)
                except Exception as bind_exc:
                    log.warning("rebind_failed", error=f"{type(bind_exc).__name__}: {bind_exc}")
                continue
            self.health.set_ready(True)
            await self.process_batch(msgs)
            # acked already: only the next ones wait (AEP_BRIDGE_LINGER_MS, longer when quiet)
            await self.linger.after(len(msgs), len(msgs) < self.batch_size // 4)
