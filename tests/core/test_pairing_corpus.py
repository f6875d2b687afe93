"""Pairing over the real Hermes sessions (the corpus of tests/corpus.py: bridge/data/observed_sessions.jsonl).

The corpus is mapped with the real mapper (bridge.core.pipeline), split into
partitions by lane token as the service splits BRIDGE_MAPPED, and fed to one
PairingState per partition; a final tick far in the future closes what is left.
"""

from __future__ import annotations

import random
from functools import lru_cache
from typing import Any

import msgspec
import pytest

from bridge.core.aep import Event, encode_event
from tests.support.validators import validators
from bridge.core.ceiling import CapturePolicy, parse_overrides
from bridge.core.redaction import Redactor
from bridge.core.lanes import MemoryLanes, lane_token, partition_of
from bridge.core.invariants import check_invariants
from bridge.core.pairing import HOUR, PairingState
from bridge.core.pipeline import map_record, record_from_line
from tests.corpus import corpus_path

BASE_NS = 1_764_543_353_000 * 1_000_000
PARTITIONS = 8

Message = tuple[Event, dict[str, Any]]


@lru_cache(maxsize=None)
def mapped(capture: str = "metadata", overrides: str = "attention=redacted") -> dict[int, tuple[Message, ...]]:
    """The corpus as the mapper publishes it: partition -> messages in stream order."""
    policy = CapturePolicy(default=capture, overrides=parse_overrides(overrides), redactor=Redactor())
    lanes = MemoryLanes()
    parts: dict[int, list[Message]] = {}
    for n, line in enumerate(corpus_path().read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        record = record_from_line(msgspec.json.decode(line), n, "dev", BASE_NS)
        result = map_record(record, n, 0, lanes, policy)
        lanes.learn(result.learned)
        part = partition_of(lane_token(result.lane), PARTITIONS)
        for ev in result.events:
            parts.setdefault(part, []).append((ev, dict(result.hints)))
    return {p: tuple(msgs) for p, msgs in parts.items()}


def run_partitions(parts: dict[int, list[Message] | tuple[Message, ...]]) -> dict[int, list[Event]]:
    out: dict[int, list[Event]] = {}
    for part, msgs in sorted(parts.items()):
        state = PairingState()
        got: list[Event] = []
        position = 0
        for ev, h in msgs:
            position += 1
            got += state.process(ev, h, position)
        got += state.tick(BASE_NS + 24 * HOUR, position + 1)
        out[part] = got
    return out


def assert_schema_valid(events: list[Event]) -> None:
    envelope, payloads = validators()
    for e in events:
        obj = msgspec.json.decode(encode_event(e))
        envelope.validate(obj)
        if e.type in payloads:
            payloads[e.type].validate(obj.get("data", {}))


@pytest.mark.parametrize(
    "capture, overrides", [("metadata", "attention=redacted"), ("metadata", ""), ("none", ""), ("full", "")]
)
def test_corpus_output_holds_every_invariant(capture: str, overrides: str) -> None:
    parts = mapped(capture, overrides)
    out = run_partitions(parts)
    every = [e for events in out.values() for e in events]
    for part, events in out.items():
        assert check_invariants(events, complete=True, linked=True, stream_order=True) == [], part
    assert check_invariants(every, complete=True, linked=True) == []
    assert_schema_valid(every)
    inputs = {ev.id for msgs in parts.values() for ev, _ in msgs}
    assert inputs <= {e.id for e in every}  # nothing lost: every mapped event is published (maybe rewritten)


def test_corpus_pairs_what_real_hermes_sent() -> None:
    out = [e for events in run_partitions(mapped()).values() for e in events]
    by_id = {e.id: e for e in out}
    kinds = [e.type for e in out]
    # every approval answer and its inserted resolution name the request
    answers = [e for e in out if e.type == "attention.answered"]
    assert len(answers) == 6
    for a in answers:
        assert by_id[a.subject].type == "attention.requested" and a.cause == a.subject  # type: ignore[index]
    resolved = [e for e in out if e.type == "attention.resolved"]
    assert sorted(by_id[e.cause].type for e in resolved) == ["attention.answered"] * 6  # type: ignore[index]
    # the subagent_stop that came after the parent's session.ended is linked to its start
    stop = next(e for e in out if e.type == "delegation.subagent.stopped" and e.session == "20261130_224936_760ef1")
    assert by_id[stop.cause].type == "delegation.subagent.started"  # type: ignore[index]
    ended = next(e for e in out if e.type == "session.ended" and e.session == stop.session)
    assert out.index(ended) < out.index(stop)
    # the synthetic session reports a run as finished AND cancelled: one terminal, one vendor event
    closed = [e for e in out if e.type == "x.hermes.run.closed"]
    assert len(closed) == 1 and closed[0].data == {"completed": False, "interrupted": True}
    # nothing was left open, nothing was orphaned in this corpus
    assert "x.hermes.pairing.orphaned" not in kinds
    assert kinds.count("session.ended") == 9


def test_corpus_output_is_deterministic() -> None:
    a = run_partitions(mapped())
    b = run_partitions(mapped())
    assert {p: [encode_event(e) for e in v] for p, v in a.items()} == {
        p: [encode_event(e) for e in v] for p, v in b.items()
    }


def _reorder(msgs: tuple[Message, ...], rng: random.Random, window: int) -> list[Message]:
    """What N mapper replicas do to one partition: each message may overtake up to `window` others."""
    keyed = [(i + rng.uniform(0, window), i, m) for i, m in enumerate(msgs)]
    return [m for _, _, m in sorted(keyed)]


def ambiguous(problem: str, events: list[Event]) -> bool:
    """The synthetic session reuses one (session_key, pattern_key, tool_call_id) for four approvals:
    reordered, which answer belongs to which request is undecidable, and an answer whose request
    was taken by another answer goes out unlinked (its own request is still dismissed in time)."""
    by_id = {e.id: e for e in events}
    eid = problem.split(" ", 1)[0]
    e = by_id.get(eid)
    return (
        e is not None
        and e.type == "attention.answered"
        and problem.endswith("subject is not a request")
        and e.session == "20261130_224433_a80cff"
    )


@pytest.mark.parametrize("seed", range(25))
def test_corpus_reordered_by_mapper_replicas_still_holds(seed: int) -> None:
    rng = random.Random(seed)
    parts = {p: _reorder(msgs, rng, 4) for p, msgs in mapped().items()}
    out = run_partitions(parts)
    for part, events in out.items():
        # stream order may legitimately differ; (epoch, seq) order is the contract
        problems = check_invariants(events, complete=True, linked=True, stream_order=False)
        assert [p for p in problems if not ambiguous(p, events)] == [], (seed, part)
    every = [e for events in out.values() for e in events]
    assert not [e for e in every if e.type == "x.hermes.session.finalized"]
    inputs = {ev.id for msgs in parts.values() for ev, _ in msgs}
    assert inputs <= {e.id for e in every}
