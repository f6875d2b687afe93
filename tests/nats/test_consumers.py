"""The bridge's durable consumers are declared as data beside the streams (issue 38): the
mapper's, the gate's two and the exporter's come from `bridge.nats.streams.CONSUMERS`, each
reading a declared stream through subjects that stream holds, and they build the same
ConsumerConfig the services built inline before (a changed config would make a running
durable's next bind fail or silently differ)."""

from __future__ import annotations

from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from bridge.nats import streams as S
from bridge.nats import subjects as subj
from bridge.services.gate import config as gate


def covered(subject: str, pattern: str) -> bool:
    """Whether every subject matching `subject` (a filter) matches `pattern` (a stream's)."""
    a, b = subject.split("."), pattern.split(".")
    for i, tok in enumerate(b):
        if tok == ">":
            return len(a) > i
        if i >= len(a) or (tok != "*" and tok != a[i]) or (tok == "*" and a[i] == ">"):
            return False
    return len(a) == len(b)


def test_every_consumer_reads_a_declared_stream_through_subjects_it_holds() -> None:
    streams = {s.name: s.subjects for s in S.STREAMS}
    assert {c.name for c in S.CONSUMERS} == {S.MAPPER_DURABLE, gate.RAW_DURABLE, gate.COMMAND_DURABLE, S.EXPORT_DURABLE_PREFIX}
    for c in S.CONSUMERS:
        assert c.stream in streams, c
        assert c.filters and all(any(covered(f, p) for p in streams[c.stream]) for f in c.filters), (c, streams[c.stream])


def test_the_gate_reads_the_hooks_it_handles() -> None:
    assert S.GATE_HOOKS == gate.RAW_HOOKS
    assert S.GATE_RAW_CONSUMER.name == gate.RAW_DURABLE and S.GATE_COMMAND_CONSUMER.name == gate.COMMAND_DURABLE


def test_the_table_builds_the_configs_the_services_built_inline() -> None:
    gate_raw = ConsumerConfig(durable_name=gate.RAW_DURABLE, description="aep-bridge gate: held calls and session boundaries",
                              deliver_policy=DeliverPolicy.NEW, ack_policy=AckPolicy.EXPLICIT, ack_wait=30.0,
                              filter_subjects=[subj.raw_filter(hook=h) for h in gate.RAW_HOOKS])
    gate_commands = ConsumerConfig(durable_name=gate.COMMAND_DURABLE, description="aep-bridge gate: control commands",
                                   deliver_policy=DeliverPolicy.NEW, ack_policy=AckPolicy.EXPLICIT, ack_wait=30.0,
                                   filter_subjects=list(subj.COMMAND_FILTERS))
    assert S.GATE_RAW_CONSUMER.config().as_dict() == gate_raw.as_dict()
    assert S.GATE_COMMAND_CONSUMER.config().as_dict() == gate_commands.as_dict()
    mapper = S.mapper_consumer_config("m", 12.0).as_dict()
    assert mapper == ConsumerConfig(
        durable_name="m", description="aep-bridge mapper (shared by every replica)", deliver_policy=DeliverPolicy.ALL,
        ack_policy=AckPolicy.EXPLICIT, ack_wait=12.0, max_deliver=S.MAPPER_MAX_DELIVER_BACKSTOP,
        max_ack_pending=S.MAPPER_MAX_ACK_PENDING, filter_subject=S.RAW_SUBJECTS).as_dict()
    sink = S.exporter_consumer_config("export-k", "", 64, None, 9.0).as_dict()
    assert sink == ConsumerConfig(
        durable_name="export-k", description="aep-bridge exporter sink export-k", deliver_policy=DeliverPolicy.ALL,
        ack_policy=AckPolicy.EXPLICIT, ack_wait=9.0, max_deliver=-1, max_ack_pending=64,
        filter_subjects=[S.EVENTS_SUBJECTS, S.INGEST_SUBJECTS]).as_dict()
    part = S.export_partition_consumer_config("export-k-3", "k", 3).as_dict()
    assert part["filter_subjects"] == [f"{S.EXPORT_PARTITION_PREFIX}.k.3.>"] and part["max_deliver"] == -1
