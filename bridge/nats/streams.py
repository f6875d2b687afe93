"""Every JetStream stream, KV bucket and object store of the bridge, as data, and the
mapper's and the exporters' durable consumers (the gate's two durables are its own:
``bridge/services/gate/``).

One place for the names, subjects and limits of docs/ARCHITECTURE.md; services
import the names from here, ``aep-bridge bootstrap`` (``bridge.nats.bootstrap``)
creates or updates STREAMS, BUCKETS and OBJECT_STORES from the specs (the control
plane's CONTROL_BUCKETS are created by the gate at start), and tests compare
against them. Limits are explicit on purpose (max age, max bytes, duplicate
window, discard policy): a stream without limits is an outage scheduled for the
day the disk fills. Replicas are a deployment choice: ``replicas=`` here,
``--replicas`` / ``AEP_BRIDGE_STREAM_REPLICAS`` on the command line (1 for a
single server, 3 for a cluster).

Changing a spec here changes what ``bootstrap`` converges a running system to:
limits update in place; storage type and retention cannot be changed on an
existing stream (the server refuses, bootstrap says so).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)

from bridge.nats.subjects import (
    COMMAND_FILTERS,
    DLQ_PREFIX,
    EVENTS_PREFIX,
    INGEST_PREFIX,
    MAPPED_PREFIX,
    RAW_PREFIX,
    kv_subject,
    object_store_subjects,
    raw_filter,
)

DAY = 24 * 3600.0
GiB = 1024**3
MiB = 1024**2

# ---------------------------------------------------------------- names (imported by the services)

HERMES_RAW = "HERMES_RAW"
BRIDGE_MAPPED = "BRIDGE_MAPPED"
BRIDGE_DLQ = "BRIDGE_DLQ"
AEP_EVENTS = "AEP_EVENTS"

RAW_SUBJECTS = f"{RAW_PREFIX}.>"
MAPPED_SUBJECTS = f"{MAPPED_PREFIX}.>"
DLQ_SUBJECTS = f"{DLQ_PREFIX}.>"
EVENTS_SUBJECTS = f"{EVENTS_PREFIX}.>"
INGEST_SUBJECTS = f"{INGEST_PREFIX}.>"  # events other AEP emitters post to the relay (POST /events)

LANES_BUCKET = "aep_lanes"  # s.<token> = known session, t.<task id token> = task alias
PAIRING_BUCKET = "aep_pairing"  # pairing progress q.<partition>; p.<partition>: checkpoints of older releases
CHECKPOINTS_BUCKET = "aep_checkpoints"  # object store: pairing checkpoints, object p.<partition>
RELAY_BUCKET = "aep_relay"  # relay replicas: claim.<lane token>.<replica>.<conn>, src.<digest>
LEASES_BUCKET = "aep_leases"  # partition ownership leases, key p.<partition>; expire after LEASE_TTL_S
LANES_TTL_S = 7 * DAY
# r.<instance token>.<raw id token> = the lane of a raw message whose lane came from a look-up
# (docs/ARCHITECTURE.md "Lanes"); kept for the redeliveries after a mapper outage of hours.
LANE_FACTS_BUCKET = "aep_lane_facts"
LANE_FACTS_TTL_S = 6 * 3600.0
LEASE_TTL_S = 10.0  # a lease nobody renews for this long is gone (pairing renews every 2 s)

MAPPER_DURABLE = "mapper"
MAPPER_MAX_DELIVER = 5  # the mapper dead-letters a message on its 5th failed delivery
MAPPER_MAX_DELIVER_BACKSTOP = 1000  # the mapper durable's own max_deliver (`mapper_consumer_config`)
MAPPER_ACK_WAIT_S = 30.0
MAPPER_MAX_ACK_PENDING = 8192

DUPLICATE_WINDOW_S = 120.0

__all__ = [
    "AEP_EVENTS", "BRIDGE_DLQ", "BRIDGE_MAPPED", "BUCKETS", "BucketSpec", "CHECKPOINTS_BUCKET", "CONTROL_BUCKET",
    "CONTROL_BUCKETS", "HERMES_RAW", "INSTRUCT_BUCKET",
    "LANES_BUCKET", "LANE_FACTS_BUCKET", "LEASES_BUCKET", "LEASE_TTL_S", "MAPPER_DURABLE", "MAPPER_MAX_DELIVER", "MAPPER_MAX_DELIVER_BACKSTOP", "OBJECT_STORES",
    "ObjectStoreSpec", "PAIRING_BUCKET", "RELAY", "RELAY_BUCKET", "STREAMS", "StreamSpec", "all_stream_configs",
    "mapper_consumer_config", "reserved_bytes",
]


@dataclass(frozen=True)
class StreamSpec:
    """A stream with limits retention, file storage and explicit limits."""

    name: str
    subjects: tuple[str, ...]
    description: str
    max_age_s: float
    max_bytes: int
    duplicate_window_s: float = DUPLICATE_WINDOW_S
    max_msg_size: int = -1
    discard: str = "old"  # limits: the oldest messages go when max_age/max_bytes is reached

    def config(self, replicas: int = 1, duplicate_window_s: float | None = None) -> Any:
        return StreamConfig(
            name=self.name,
            description=self.description,
            subjects=list(self.subjects),
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            discard=DiscardPolicy(self.discard),
            max_age=self.max_age_s,
            max_bytes=self.max_bytes,
            max_msgs=-1,
            max_msg_size=self.max_msg_size,
            max_consumers=-1,
            duplicate_window=self.duplicate_window_s if duplicate_window_s is None else duplicate_window_s,
            num_replicas=replicas,
        )


@dataclass(frozen=True)
class BucketSpec:
    """A KV bucket, i.e. the stream ``KV_<bucket>`` configured the way every NATS client
    expects a KV stream (rollup headers, deny delete, discard new, history per key)."""

    bucket: str
    description: str
    ttl_s: float = 0.0  # 0: keys never expire
    history: int = 1
    max_bytes: int = GiB
    max_value_size: int = -1
    allow_msg_ttl: bool = False  # keys may carry their own TTL (a Nats-TTL header; nats-server 2.11+)

    @property
    def stream_name(self) -> str:
        return f"KV_{self.bucket}"

    def config(self, replicas: int = 1) -> Any:
        return StreamConfig(
            name=self.stream_name,
            description=self.description,
            subjects=[kv_subject(self.bucket, ">")],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            discard=DiscardPolicy.NEW,
            allow_rollup_hdrs=True,
            deny_delete=True,
            allow_direct=True,
            max_age=self.ttl_s,
            max_bytes=self.max_bytes,
            max_msgs=-1,
            max_msg_size=self.max_value_size,
            max_msgs_per_subject=self.history,
            max_consumers=-1,
            duplicate_window=min(DUPLICATE_WINDOW_S, self.ttl_s) if self.ttl_s else DUPLICATE_WINDOW_S,
            num_replicas=replicas,
            **({"allow_msg_ttl": True} if self.allow_msg_ttl else {}),
        )


@dataclass(frozen=True)
class ObjectStoreSpec:
    """An object store bucket, i.e. the stream ``OBJ_<bucket>`` configured the way NATS
    clients create one (ADR-20): chunks on ``$O.<bucket>.C.<nuid>``, the metadata of each
    object on ``$O.<bucket>.M.<name>`` (replaced with a rollup), discard new, direct get.
    An object is split into 128 KiB chunks (nats-py's default), so its size is not bound
    by the server's max_payload."""

    bucket: str
    description: str
    max_bytes: int = GiB

    @property
    def stream_name(self) -> str:
        return f"OBJ_{self.bucket}"

    def config(self, replicas: int = 1) -> Any:
        return StreamConfig(
            name=self.stream_name,
            description=self.description,
            subjects=list(object_store_subjects(self.bucket)),
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            discard=DiscardPolicy.NEW,
            allow_rollup_hdrs=True,
            deny_delete=False,
            allow_direct=True,
            max_age=0.0,  # objects never expire: a partition idle for long keeps its checkpoint
            max_bytes=self.max_bytes,
            max_msgs=-1,
            max_msg_size=-1,
            max_msgs_per_subject=-1,
            max_consumers=-1,
            duplicate_window=DUPLICATE_WINDOW_S,
            num_replicas=replicas,
        )


RAW_STREAM = StreamSpec(
    HERMES_RAW, (RAW_SUBJECTS,), "Hermes hook envelopes as the shim stamped them (docs/ARCHITECTURE.md)",
    max_age_s=7 * DAY, max_bytes=10 * GiB,
)
MAPPED_STREAM = StreamSpec(
    BRIDGE_MAPPED, (MAPPED_SUBJECTS,), "AEP events from the mapper, partitioned by lane, before pairing",
    max_age_s=7 * DAY, max_bytes=10 * GiB,
)
DLQ_STREAM = StreamSpec(
    BRIDGE_DLQ, (DLQ_SUBJECTS,), "dead letters: inputs the mapper or pairing could not handle, with the reason",
    max_age_s=30 * DAY, max_bytes=1 * GiB,
)
EVENTS_STREAM = StreamSpec(
    AEP_EVENTS, (EVENTS_SUBJECTS, INGEST_SUBJECTS), "the consumer-facing AEP event stream",
    max_age_s=30 * DAY, max_bytes=20 * GiB,
)
STREAMS: tuple[StreamSpec, ...] = (RAW_STREAM, MAPPED_STREAM, DLQ_STREAM, EVENTS_STREAM)

LANES = BucketSpec(LANES_BUCKET, "known sessions (s.<token>) and task aliases (t.<token>)", ttl_s=LANES_TTL_S, max_bytes=GiB)
PAIRING = BucketSpec(
    PAIRING_BUCKET, "pairing progress per partition (q.<n>); checkpoints of older releases (p.<n>)", max_bytes=GiB,
)
LEASES = BucketSpec(LEASES_BUCKET, "pairing partition leases (p.<n>)", ttl_s=LEASE_TTL_S, max_bytes=16 * MiB)
# The relay replicas' shared state: claim.<lane token>.<replica>.<connection> the live claims of
# their WebSocket emitters (each with a per-message TTL, renewed while its socket lives) and
# src.<digest> the operator token a command source belongs to (kept as long as AEP_EVENTS keeps
# the decisions a reused (source, id) could read).
RELAY = BucketSpec(RELAY_BUCKET, "relay replicas: emitter claims (claim.) and command sources' tokens (src.)",
                   ttl_s=30 * DAY, max_bytes=256 * MiB, allow_msg_ttl=True)
# ~170 B a fact: at 2,000 raw messages/s of which ~5 % need a look-up (the simulated fleet),
# ~0.35 GB per TTL. A full bucket refuses new facts: those messages are mapped as before facts.
LANE_FACTS = BucketSpec(LANE_FACTS_BUCKET, "the lane of each look-up raw message (r.<instance>.<raw id>)",
                        ttl_s=LANE_FACTS_TTL_S, max_bytes=GiB)
BUCKETS: tuple[BucketSpec, ...] = (LANES, PAIRING, LEASES, RELAY, LANE_FACTS)
# The opt-in control plane's buckets: the gate creates them at start (bootstrap does not, so an
# observe-only deployment has none of them).
CONTROL_BUCKET = BucketSpec("aep_control", "control plane: commands (cmd.), held calls (card.), seq. and sess. per session",
                            ttl_s=7 * DAY, max_bytes=GiB)
INSTRUCT_BUCKET = BucketSpec("aep_instruct", "steering: instruction queues per session (q.<lane token>)",
                             ttl_s=30 * DAY, max_bytes=GiB)
CONTROL_BUCKETS: tuple[BucketSpec, ...] = (CONTROL_BUCKET, INSTRUCT_BUCKET)
# One checkpoint per partition (object p.<n>). At fleet rate a compressed checkpoint grows
# ~100 B/s per partition until the state's bounds hold it (idle sessions 30 min, 100,000 ended-session
# digests): a few MB each, so 1 GiB holds every partition's plus the rewrite in flight.
CHECKPOINTS = ObjectStoreSpec(CHECKPOINTS_BUCKET, "pairing checkpoints per partition (object p.<n>)", max_bytes=GiB)
OBJECT_STORES: tuple[ObjectStoreSpec, ...] = (CHECKPOINTS,)


def all_stream_configs(replicas: int = 1, duplicate_window_s: float | None = None) -> list[Any]:
    """The StreamConfig of every stream, KV bucket and object store, in bootstrap order.

    ``duplicate_window_s`` overrides the streams' duplicate window (default
    DUPLICATE_WINDOW_S). The fault tests shorten it so that "an outage longer than the
    window" fits in a short test; an operator whose shims may spool for longer than two
    minutes can lengthen it (at the cost of server memory: one entry per message id
    within the window)."""
    return ([s.config(replicas, duplicate_window_s) for s in STREAMS] + [b.config(replicas) for b in BUCKETS]
            + [o.config(replicas) for o in OBJECT_STORES])


@dataclass(frozen=True)
class Consumer:
    """A durable pull consumer of the bridge, declared as data beside the streams (issue 38):
    the stream it reads, its subjects, where it starts, how long a message may stay
    unacknowledged, how many may be outstanding. ``config()`` builds its ConsumerConfig; a
    service names its durable (one per exporter sink or partition) and may narrow the filters.
    Every one acknowledges explicitly; the readers that do not (pairing's, the relay's, tail,
    demo, usage, verify) are ephemeral ordered reads, not durables."""

    name: str  # the durable name (a prefix for the exporter's: export-<sink>)
    stream: str
    filters: tuple[str, ...]
    description: str
    deliver: DeliverPolicy = DeliverPolicy.ALL
    ack_wait_s: float = 30.0
    max_deliver: int | None = None  # None: the server's default (unlimited)
    max_ack_pending: int | None = None  # None: the server's default
    one_filter: bool = False  # filter_subject (one subject) rather than filter_subjects

    def config(self, durable: str | None = None, *, description: str | None = None, filters: list[str] | None = None,
               ack_wait_s: float | None = None, max_ack_pending: int | None = None) -> Any:
        subjects = list(filters or self.filters)
        return ConsumerConfig(
            durable_name=durable or self.name,
            description=description or self.description,
            deliver_policy=self.deliver,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.ack_wait_s if ack_wait_s is None else ack_wait_s,
            max_deliver=self.max_deliver,
            max_ack_pending=self.max_ack_pending if max_ack_pending is None else max_ack_pending,
            filter_subject=subjects[0] if self.one_filter else None,
            filter_subjects=None if self.one_filter else subjects,
        )


EXPORT_DURABLE_PREFIX = "export-"  # one durable consumer per exporter sink: export-<sink name>
EXPORT_ACK_WAIT_S = 60.0  # the exporter reports progress (+WPI) while a sink holds a batch
EXPORT_MAX_ACK_PENDING = 4096
GATE_HOOKS = ("pre_tool_call", "pre_llm_call", "on_session_start", "on_session_finalize")  # what the gate reads

#: The mapper dead-letters a message that fails by itself on its MAPPER_MAX_DELIVER-th delivery,
#: and retries one that met an outage (a leader election, a lost server) every 5 s at most for as
#: long as it lasts; the consumer's own ``max_deliver`` is only a backstop
#: (MAPPER_MAX_DELIVER_BACKSTOP, over an hour of retries) for a message that can be neither
#: published nor dead-lettered: the server gives it up then with a MAX_DELIVERIES advisory.
MAPPER_CONSUMER = Consumer(MAPPER_DURABLE, HERMES_RAW, (RAW_SUBJECTS,), "aep-bridge mapper (shared by every replica)",
                           ack_wait_s=MAPPER_ACK_WAIT_S, max_deliver=MAPPER_MAX_DELIVER_BACKSTOP,
                           max_ack_pending=MAPPER_MAX_ACK_PENDING, one_filter=True)
GATE_RAW_CONSUMER = Consumer("gate", HERMES_RAW, tuple(raw_filter(hook=h) for h in GATE_HOOKS),
                             "aep-bridge gate: held calls and session boundaries", deliver=DeliverPolicy.NEW)
GATE_COMMAND_CONSUMER = Consumer("gate-commands", AEP_EVENTS, COMMAND_FILTERS, "aep-bridge gate: control commands",
                                 deliver=DeliverPolicy.NEW)
#: An exporter sink's (one per sink: a slow sink never stalls another). Every event from the start
#: of the stream; acked only once the sink confirmed delivery, so ``max_deliver`` is unlimited: an
#: event waits for its sink, it is never dropped by the server. The bridge's own events and those
#: other AEP emitters post to the relay (aep.ingest.>) alike: a sink's filter may leave some out.
#: A partitioned sink's replicas read AEP_EXPORT the same way, one durable per partition.
EXPORT_CONSUMER = Consumer(EXPORT_DURABLE_PREFIX, AEP_EVENTS, (EVENTS_SUBJECTS, INGEST_SUBJECTS),
                           "aep-bridge exporter sink", ack_wait_s=EXPORT_ACK_WAIT_S, max_deliver=-1,
                           max_ack_pending=EXPORT_MAX_ACK_PENDING)
CONSUMERS = (MAPPER_CONSUMER, GATE_RAW_CONSUMER, GATE_COMMAND_CONSUMER, EXPORT_CONSUMER)


def mapper_consumer_config(durable: str = MAPPER_DURABLE, ack_wait: float = MAPPER_ACK_WAIT_S) -> Any:
    """The mapper's shared durable pull consumer on HERMES_RAW (``ack_wait``:
    AEP_BRIDGE_MAPPER_ACK_WAIT_S): MAPPER_CONSUMER's."""
    return MAPPER_CONSUMER.config(durable, ack_wait_s=ack_wait)


def exporter_consumer_config(durable: str, description: str = "", max_ack_pending: int = EXPORT_MAX_ACK_PENDING,
                             filter_subjects: list[str] | None = None, ack_wait: float = EXPORT_ACK_WAIT_S) -> Any:
    """An exporter sink's durable pull consumer on AEP_EVENTS (EXPORT_CONSUMER's; ``ack_wait``:
    AEP_BRIDGE_EXPORT_ACK_WAIT_S)."""
    return EXPORT_CONSUMER.config(durable, description=description or f"aep-bridge exporter sink {durable}",
                                  filters=filter_subjects, ack_wait_s=ack_wait, max_ack_pending=max_ack_pending)


#: the partitioned sinks' work-queue stream (one source of AEP_EVENTS per sink with replicas > 1);
#: its subjects are export.<sink>.<partition>.<the AEP_EVENTS subject>
EXPORT_STREAM = "AEP_EXPORT"
EXPORT_PARTITION_PREFIX = "export"
#: AEP_EXPORT holds at most this much unconfirmed backlog (all partitioned sinks together); when
#: full, sourcing waits (discard new) and the events stay in AEP_EVENTS, as a lagging
#: one-replica durable's do
EXPORT_STREAM_MAX_BYTES = 2 * GiB


def reserved_bytes() -> int:
    """What JetStream reserves up front for the bridge (each stream's, bucket's and store's
    max_bytes, AEP_EXPORT's included): a server's max_file_store must hold it."""
    specs = (*STREAMS, *BUCKETS, *OBJECT_STORES, CONTROL_BUCKET, INSTRUCT_BUCKET)
    return sum(spec.max_bytes for spec in specs) + EXPORT_STREAM_MAX_BYTES


def export_source(sink: str, partitions: int, start_seq: int | None = None) -> Any:
    """A partitioned sink's source of AEP_EVENTS in AEP_EXPORT: aep.hermes.> and aep.ingest.>
    in order (from ``start_seq``, else the start), each subject prefixed with
    ``export.<sink>.<partition>.``, the partition being the server's ``partition(n, lane
    token)`` transform: a lane always lands in the same partition."""
    from nats.js.api import StreamSource, SubjectTransform

    return StreamSource(name=AEP_EVENTS, opt_start_seq=start_seq, subject_transforms=[
        SubjectTransform(src=f"{prefix}.*.>", dest=f"{EXPORT_PARTITION_PREFIX}.{sink}.{{{{partition({partitions},1)}}}}"
                                                    f".{prefix}.{{{{wildcard(1)}}}}.>")
        for prefix in (EVENTS_PREFIX, INGEST_PREFIX)])


def export_source_sink(source: Any) -> str | None:
    """The sink an AEP_EXPORT source is for (None: not one of `export_source`'s)."""
    transforms = getattr(source, "subject_transforms", None) or []
    dest = getattr(transforms[0], "dest", "") if transforms else ""
    parts = dest.split(".")
    return parts[1] if len(parts) > 2 and parts[0] == EXPORT_PARTITION_PREFIX else None


def export_stream_config(events: Any, sources: list[Any]) -> Any:
    """AEP_EXPORT: the partitioned sinks' events until their partition's consumer acked them
    (work queue: the stream holds only what a sink has not confirmed, at most
    EXPORT_STREAM_MAX_BYTES); storage, replicas and max age are AEP_EVENTS' own (``events``,
    its StreamConfig)."""
    from nats.js.api import DiscardPolicy, RetentionPolicy, StreamConfig

    return StreamConfig(
        name=EXPORT_STREAM,
        description="aep-bridge exporter: AEP_EVENTS in lane partitions per sink, until the sink confirmed them",
        retention=RetentionPolicy.WORK_QUEUE,
        storage=events.storage,
        num_replicas=events.num_replicas,
        max_age=events.max_age,
        max_bytes=min(EXPORT_STREAM_MAX_BYTES, events.max_bytes or EXPORT_STREAM_MAX_BYTES),
        discard=DiscardPolicy.NEW,
        sources=sources,
    )


def export_partition_consumer_config(durable: str, sink: str, partition: int, description: str = "",
                                     max_ack_pending: int = EXPORT_MAX_ACK_PENDING,
                                     ack_wait: float = EXPORT_ACK_WAIT_S) -> Any:
    """A partitioned sink's durable pull consumer of one partition on AEP_EXPORT: what
    `exporter_consumer_config` is for one replica, for ``export.<sink>.<partition>.>``."""
    return exporter_consumer_config(durable, description or f"aep-bridge exporter partition {partition}",
                                    max_ack_pending, [f"{EXPORT_PARTITION_PREFIX}.{sink}.{partition}.>"], ack_wait)
