"""Check what the bridge made of a simulated fleet's traffic against the simulator's manifest.

``aep-bridge verify --manifest FILE`` and ``verify()`` (for tests) read HERMES_RAW,
BRIDGE_MAPPED, BRIDGE_DLQ and AEP_EVENTS and check:

1. **No loss.** Every event the manifest says was published or spooled is in
   HERMES_RAW (found by its raw id, or by its marker for real shim processes, which
   mint the id themselves). For every such raw message the events it must produce
   are derived from the deterministic identity: the mapper's events of raw id ``R``
   received at ``ts`` are ``event_id(R, 512 + i, ts_ms)`` for ``i < k``, where ``k``
   is what the pure mapping makes of the envelope (``map_specs``; the count does not
   depend on lanes or capture). Each must be in AEP_EVENTS (pairing keeps every
   input id, possibly rewritten), or the raw message (any of its stream copies) is
   in the DLQ with a reason (mapper stage), or the event is (pairing stage). A miss
   is reported with where it stopped (not mapped / mapped but not paired). Events
   the shim itself reported as dropped (spool cap) or lost (spool unwritable) are
   accounted for as counted edge losses, not silent ones. A real shim that did not get
   its whole input within its deadline (``e``: ``stdin_timeout``, Hermes wrote stdin late)
   published what it read as ``_invalid`` under the id the manifest then names: that
   message must be in the DLQ (``shim_invalid``); the marker was in what it never read.
2. **No duplicates** in AEP_EVENTS by ``(source, id)``, and no event id under two
   sources (a raw duplicate resolved to two lanes).
3. **Order:** per session, the mapped events (slots 512-767) in AEP_EVENTS stream
   order have strictly increasing ``(epoch, seq)``. Events that redelivery put behind
   a later one are reported as backfills: AEP allows them (a consumer inserts a
   position below its high-water mark in order), so they are a violation only
   with ``strict_order``; a reused ``(session, epoch, seq)`` is always one.
4. **Pairing invariants** (``bridge.core.invariants.check_invariants``) over AEP_EVENTS;
   among them: every attention follow-up's ``subject`` is the id of a request of its
   own session (AEP-0002 §7.1).
4b. **Approvals keep their session and their answer** (`approval_problems`): every
   ``post_approval_response`` of the manifest that reached AEP_EVENTS is an
   ``attention.answered`` (followed by ``attention.resolved {answered}``) or an
   ``attention.timeout`` on the session its ``turn_id`` names, whose ``subject`` is a
   request of that session, and that request is never closed ``dismissed``.
4c. **Run totals** (`bridge.core.invariants.check_usage`, issue 40): every statement of a
   run's totals (its terminal, the ``x.hermes.pairing.orphaned`` closing it, an
   ``x.hermes.run.usage`` amendment pairing inserts after a call that reached it after the
   run's end) carries ``model_calls`` and ``gen_ai.usage.*`` equal to the sums over the run's
   ``x.hermes.api.call`` events published before it, and the cost (exact, in nano-units) when
   every one had a cost: no call counted twice or left out. A call published after its run's
   last statement (pairing no longer remembered the run) is reported as ``late``.
5. **Schema validity** of every AEP event (``bridge.core.schemas.generate`` + jsonschema).
6. **No canary** of the manifest anywhere (bodies and headers) in AEP_EVENTS,
   BRIDGE_MAPPED or BRIDGE_DLQ: HERMES_RAW is the only place a secret may be.
7. **The hostile mix** (``simulate --hostile-mix``): every hostile input the manifest
   names (``x`` its kind, ``r`` the reason it is owed, or null when it must map) is in
   BRIDGE_DLQ with exactly that reason, and the pure core agrees (`expected_outcome`,
   the mapper's own checks in its order: ``decode_raw``, ``check_raw``, the subject's
   instance, the mapping); one owed no reason maps like normal traffic (check 1) and is
   not dead-lettered. Raw hostile messages (``v`` "raw": published straight to
   HERMES_RAW) are found by their ``Nats-Msg-Id``, whatever their body holds.

The reading is incremental (``Verifier.collect`` reads only what is new), so a test
can wait for the pipeline to settle by collecting again until nothing is missing.
"""

from __future__ import annotations

import asyncio
import binascii
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import msgspec
from nats.js.api import ConsumerConfig, DeliverPolicy

from bridge.config import Settings
from bridge.core.aep import decode_event
from bridge.core.ceiling import CapturePolicy
from bridge.core.envelope import EnvelopeError, check_raw, decode_raw
from bridge.core.identity import AFTER_SLOT, MAPPED_SLOT, MAX_MAPPED, SLOTS, event_id
from bridge.core.invariants import CARD_ENDINGS, SESSION_ENDS, check_invariants, check_usage
from bridge.core.mapping import map_specs
from bridge.core.pipeline import record_from_raw
from bridge.core.schemas import generate
from bridge.nats.connection import connect_client
from bridge.nats.streams import (AEP_EVENTS, BRIDGE_DLQ, BRIDGE_MAPPED, DLQ_SUBJECTS, EVENTS_SUBJECTS, HERMES_RAW,
                                 MAPPED_SUBJECTS, RAW_SUBJECTS)
from bridge.nats.subjects import check_raw_instance

# Outcomes in the manifest for events the shim believed would reach HERMES_RAW.
DELIVERED = ("published", "spooled", "unknown")
EDGE_LOSS = ("dropped", "lost")
MAX_EXAMPLES = 10


@lru_cache(maxsize=1)
def _validators() -> tuple[Any, dict[str, Any]]:
    import jsonschema


    docs = generate()
    env = jsonschema.Draft202012Validator(docs["aep-event.schema.json"])
    types = {n[6:-12]: jsonschema.Draft202012Validator(d) for n, d in docs.items() if n.startswith("types/")}
    return env, types


@lru_cache(maxsize=1)
def _count_policy() -> Any:
    # The number of events does not depend on the ceiling; `none` skips the redaction work.
    return CapturePolicy(default="none", overrides={})


def expected_mapped(raw: Any, subject: str | None = None) -> int | str:
    """How many events the mapper makes of a decoded raw message, or the DLQ reason it
    must be dead-lettered with. With the ``subject`` it was stored under, the instance
    check too (a body naming another instance: ``instance_mismatch``)."""
    try:
        check_raw(raw)
        if subject is not None:
            check_raw_instance(subject, raw.instance)
        record = record_from_raw(raw, checked=True)
        return min(len(map_specs(record.envelope, _count_policy())), MAX_MAPPED)
    except EnvelopeError as exc:  # also bad_hook, from the mapping itself
        return exc.reason


def expected_outcome(data: bytes, subject: str) -> int | str:
    """`expected_mapped` of the bytes stored on HERMES_RAW under ``subject`` (``bad_raw``
    for bytes that are no raw message at all)."""
    try:
        raw = decode_raw(data)
    except EnvelopeError as exc:
        return exc.reason
    return expected_mapped(raw, subject)


# ---------------------------------------------------------------- reading streams


class StreamReader:
    """Reads a stream from the beginning, incrementally: each ``read_new`` follows an ordered
    push consumer (~3x faster than pull fetches here) from the last position read up to the
    stream's last sequence at the time of the call."""

    def __init__(self, js: Any, stream: str, subjects: str) -> None:
        self.js = js
        self.stream = stream
        self.subjects = subjects
        self.position = 0  # last stream seq read
        self.count = 0

    async def read_new(self, on_msg: Any, stall_s: float = 3.0) -> int:
        info = await self.js.stream_info(self.stream)
        last = info.state.last_seq
        if last <= self.position or not info.state.messages:
            return 0
        done = asyncio.Event()
        n = 0
        errors: list[BaseException] = []

        async def cb(m: Any) -> None:
            nonlocal n
            seq = m.metadata.sequence.stream
            if seq <= self.position:
                return
            try:
                on_msg(m)
            except BaseException as exc:  # surface it from read_new, not from the callback
                errors.append(exc)
                done.set()
                return
            self.position = seq
            n += 1
            if seq >= last:
                done.set()

        config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=self.position + 1)
        sub = await self.js.subscribe(self.subjects, stream=self.stream, cb=cb, ordered_consumer=True, config=config,
                                      pending_msgs_limit=1_000_000, pending_bytes_limit=1 << 31)
        try:
            seen = -1
            while not done.is_set():
                try:
                    await asyncio.wait_for(done.wait(), timeout=stall_s)
                except asyncio.TimeoutError:
                    if n == seen:  # no progress: the messages up to `last` that remain were all read
                        break
                    seen = n
        finally:
            try:
                await sub.unsubscribe()
            except Exception:
                pass
        if errors:
            raise errors[0]
        self.count += n
        return n

    async def close(self) -> None:
        pass


# ---------------------------------------------------------------- the report


@dataclass
class Report:
    manifest_events: int = 0
    expected_delivered: int = 0
    edge_loss_counted: int = 0
    inputs_cut: int = 0  # real shims that did not get their whole input in time (manifest "e")
    raw_messages: int = 0
    raw_duplicates: int = 0
    mapped_messages: int = 0
    mapped_duplicates: int = 0
    aep_events: int = 0
    dlq_messages: int = 0
    dlq_reasons: Counter[str] = field(default_factory=Counter)
    accounted_in_dlq: int = 0
    expected_events: int = 0
    lost: list[str] = field(default_factory=list)  # descriptions
    lost_count: int = 0
    lost_where: Counter[str] = field(default_factory=Counter)
    duplicates: list[str] = field(default_factory=list)
    duplicate_count: int = 0
    id_under_two_sources: int = 0
    order_violations: list[str] = field(default_factory=list)
    order_violation_count: int = 0
    backfills: int = 0
    backfill_examples: list[str] = field(default_factory=list)
    seq_reused: int = 0
    invariant_problems: list[str] = field(default_factory=list)
    invariant_count: int = 0
    approvals_checked: int = 0
    approval_problems: list[str] = field(default_factory=list)
    approval_count: int = 0
    usage_runs: int = 0
    usage_calls: int = 0
    usage_late: int = 0
    usage_amended: int = 0
    usage_problems: list[str] = field(default_factory=list)
    usage_count: int = 0
    schema_problems: list[str] = field(default_factory=list)
    schema_count: int = 0
    schema_checked: int = 0
    canary_hits: list[str] = field(default_factory=list)
    canary_count: int = 0
    canaries: int = 0
    canaries_planted: int = 0
    hostile_sent: int = 0  # hostile inputs of the mix the manifest expects on HERMES_RAW
    hostile_kinds: Counter[str] = field(default_factory=Counter)
    hostile_in_dlq: Counter[str] = field(default_factory=Counter)  # reason -> inputs found there with it
    hostile_mapped: int = 0  # owed no reason: mapped like normal traffic
    hostile_problems: list[str] = field(default_factory=list)
    hostile_count: int = 0
    sessions: int = 0
    types: Counter[str] = field(default_factory=Counter)
    strict_order: bool = False
    complete: bool = True
    elapsed_s: float = 0.0

    @property
    def violations(self) -> dict[str, int]:
        v = {
            "lost": self.lost_count,
            "duplicates": self.duplicate_count + self.id_under_two_sources,
            "seq_reused": self.seq_reused,
            "pairing_invariants": self.invariant_count,
            "approvals": self.approval_count,
            "usage": self.usage_count,
            "schema": self.schema_count,
            "canaries": self.canary_count,
            "hostile": self.hostile_count,
        }
        if self.strict_order:
            v["order"] = self.order_violation_count
        return v

    @property
    def ok(self) -> bool:
        return not any(self.violations.values())

    def render(self) -> str:
        lines = []
        add = lines.append
        add(f"aep-bridge verify: {'OK' if self.ok else 'FAILED'}  ({self.elapsed_s:.1f} s)")
        add(f"  manifest     {self.manifest_events} events sent, {self.expected_delivered} expected on HERMES_RAW, "
            f"{self.edge_loss_counted} counted as edge losses by the shims (spool full/unwritable)"
            + (f", {self.inputs_cut} inputs the shims did not get in time (published as _invalid, "
               f"dead-lettered shim_invalid)" if self.inputs_cut else ""))
        add(f"  HERMES_RAW   {self.raw_messages} messages, {self.raw_duplicates} stored twice (resends past the duplicate window)")
        add(f"  BRIDGE_MAPPED {self.mapped_messages} messages, {self.mapped_duplicates} duplicate event ids")
        add(f"  AEP_EVENTS   {self.aep_events} events in {self.sessions} sessions; {self.expected_events} mapped events expected")
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(self.dlq_reasons.items())) or "-"
        add(f"  BRIDGE_DLQ   {self.dlq_messages} dead letters ({reasons}); {self.accounted_in_dlq} sent events accounted for there")
        add(f"  loss         {self.lost_count}" + (f"  ({', '.join(f'{k}: {v}' for k, v in self.lost_where.items())})" if self.lost_count else ""))
        for x in self.lost[:MAX_EXAMPLES]:
            add(f"      {x}")
        add(f"  duplicates   {self.duplicate_count} by (source, id), {self.id_under_two_sources} ids under two sources")
        for x in self.duplicates[:MAX_EXAMPLES]:
            add(f"      {x}")
        order = "violation" if self.strict_order else "allowed by AEP (backfill), reported"
        add(f"  order        {self.seq_reused} (session, epoch, seq) reused; {self.backfills} mapped events behind a later "
            f"one in their session ({order})")
        for x in (self.order_violations or self.backfill_examples)[:MAX_EXAMPLES]:
            add(f"      {x}")
        add(f"  pairing      {self.invariant_count} invariant problems" + ("" if self.complete else " (sessions left open: completeness not required)"))
        for x in self.invariant_problems[:MAX_EXAMPLES]:
            add(f"      {x}")
        add(f"  approvals    {self.approval_count} problems in {self.approvals_checked} answers (session, subject, never dismissed)")
        for x in self.approval_problems[:MAX_EXAMPLES]:
            add(f"      {x}")
        add(f"  run totals   {self.usage_count} problems in {self.usage_runs} runs ({self.usage_calls} model calls counted "
            f"once each; {self.usage_amended} totals amended by a call after its run's end); "
            f"{self.usage_late} calls in no total")
        for x in self.usage_problems[:MAX_EXAMPLES]:
            add(f"      {x}")
        add(f"  schema       {self.schema_count} invalid of {self.schema_checked} checked")
        for x in self.schema_problems[:MAX_EXAMPLES]:
            add(f"      {x}")
        add(f"  canaries     {self.canary_count} hits of {self.canaries} canary strings ({self.canaries_planted} events carried one)")
        for x in self.canary_hits[:MAX_EXAMPLES]:
            add(f"      {x}")
        if self.hostile_sent or self.hostile_count:
            dlq = ", ".join(f"{k}={v}" for k, v in sorted(self.hostile_in_dlq.items())) or "-"
            add(f"  hostile      {self.hostile_sent} inputs of {len(self.hostile_kinds)} kinds: "
                f"{sum(self.hostile_in_dlq.values())} in BRIDGE_DLQ with their reason ({dlq}), "
                f"{self.hostile_mapped} mapped as they must; {self.hostile_count} problems")
            for x in self.hostile_problems[:MAX_EXAMPLES]:
                add(f"      {x}")
        top = ", ".join(f"{t}={n}" for t, n in self.types.most_common(12))
        add(f"  types        {top}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items()}
        d["violations"] = self.violations
        d["ok"] = self.ok
        return json.loads(json.dumps(d, default=lambda o: dict(o) if isinstance(o, Counter) else str(o)))


# ---------------------------------------------------------------- the verifier


def read_manifest(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
    meta: dict[str, Any] = {}
    end: dict[str, Any] = {}
    entries: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            obj = json.loads(line)
            if "meta" in obj:
                meta = obj["meta"]
            elif "end" in obj:
                end = obj["end"]
            else:
                entries.append(obj)
    return meta, entries, end


class _Raw(msgspec.Struct):
    """What the verifier keeps of a raw message."""

    seqs: list[int]
    ts: int
    k: int | str  # mapped events expected, or the DLQ reason expected


class Verifier:
    """Incremental reader of the four streams plus the checks. ``await collect()`` then ``check()``."""

    def __init__(self, nc: Any, manifest: str | Path, *, strict_order: bool = False,
                 schema_sample: int | None = None) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.meta, self.entries, self.end = read_manifest(manifest)
        self.strict_order = strict_order
        self.schema_sample = schema_sample
        self.canaries = [c.encode() for c in self.meta.get("canaries", [])]
        self.marker_key = self.meta.get("marker_key", "x_aep_sim")
        self.ids = {e["id"] for e in self.entries if e.get("id")}
        # Raw hostile messages: found by Nats-Msg-Id (their body may hold no id, or another one).
        self.raw_hostile = {e["id"] for e in self.entries if e.get("v") == "raw" and e.get("id")}
        self.markers = {e["m"] for e in self.entries if e.get("m")}
        self.readers = {
            "raw": StreamReader(self.js, HERMES_RAW, RAW_SUBJECTS),
            "mapped": StreamReader(self.js, BRIDGE_MAPPED, MAPPED_SUBJECTS),
            "dlq": StreamReader(self.js, BRIDGE_DLQ, DLQ_SUBJECTS),
            "aep": StreamReader(self.js, AEP_EVENTS, EVENTS_SUBJECTS),
        }
        self.raw: dict[str, _Raw] = {}
        self.answers: dict[str, tuple[str, str]] = {}  # answer raw id -> (session its turn_id names, instance)
        # Instances that lost events at the edge (spool full, an input cut): an answer's request may be among them.
        self.lossy = {e.get("i") for e in self.entries if e.get("o") in EDGE_LOSS or e.get("e")}
        self.marker_to_id: dict[str, str] = {}
        self.raw_copies = 0
        self.mapped_ids: set[str] = set()
        self.mapped_dups = 0
        self.mapped_count = 0
        self.dlq_raw_seqs: dict[int, str] = {}
        self.dlq_event_ids: dict[str, str] = {}
        self.dlq_reasons: Counter[str] = Counter()
        self.events: list[Any] = []
        self.aep_ids: dict[str, str] = {}  # id -> source of its first copy
        self.dup_examples: list[str] = []
        self.dup_count = 0
        self.two_sources = 0
        self.canary_hits: list[str] = []
        self.canary_count = 0
        self.schema_problems: list[str] = []
        self.schema_count = 0
        self.schema_checked = 0
        self.types: Counter[str] = Counter()
        self._schema_seen: Counter[str] = Counter()
        self._decode_raw = msgspec.json.Decoder()
        self._event_decoder = None

    # ------------------------------------------------------------ reading

    def _scan(self, where: str, m: Any) -> None:
        if not self.canaries:
            return
        blobs = [m.data]
        if b'"raw_encoding":"base64"' in m.data or b'"content_base64"' in m.data:  # kept as base64: look inside
            try:
                doc = json.loads(m.data)
                inner = doc.get("content") if isinstance(doc.get("content"), dict) else doc  # a dead letter's content
                for b64 in (inner.get("raw"), doc.get("content_base64")):
                    if isinstance(b64, str):
                        blobs.append(binascii.a2b_base64(b64))
            except (ValueError, KeyError, TypeError, AttributeError):
                pass
        if m.headers:
            blobs.extend(v.encode("utf-8", "replace") for v in m.headers.values() if isinstance(v, str))
        for blob in blobs:
            for c in self.canaries:
                if c in blob:
                    self.canary_count += 1
                    if len(self.canary_hits) < MAX_EXAMPLES:
                        i = blob.find(c)
                        self.canary_hits.append(f"{where} seq {m.metadata.sequence.stream} {m.subject}: "
                                                f"...{blob[max(0, i - 60):i + len(c) + 20].decode('utf-8', 'replace')}...")

    def _on_raw(self, m: Any) -> None:
        seq = m.metadata.sequence.stream
        hid = (m.headers or {}).get("Nats-Msg-Id") if self.raw_hostile else None
        if hid is not None and hid in self.raw_hostile:
            known = self.raw.get(hid)
            if known is not None:
                known.seqs.append(seq)
                self.raw_copies += 1
            else:
                self.raw[hid] = _Raw([seq], 0, expected_outcome(m.data, m.subject))
            return
        try:
            raw = decode_raw(m.data)
        except EnvelopeError:
            return  # not the shim's: nothing in the manifest can point at it
        rid = raw.id
        if rid not in self.ids:
            marker = None
            env = raw.envelope
            if isinstance(env, dict) and isinstance(env.get("extra"), dict):
                marker = env["extra"].get(self.marker_key)
            if not isinstance(marker, str) or marker not in self.markers:
                return  # another producer's message
            self.marker_to_id.setdefault(marker, rid)
        known = self.raw.get(rid)
        if known is not None:
            known.seqs.append(seq)
            self.raw_copies += 1
            return
        self.raw[rid] = _Raw([seq], raw.ts, expected_mapped(raw, m.subject))
        env = raw.envelope
        if raw.hook == "post_approval_response" and isinstance(env, dict) and isinstance(env.get("extra"), dict):
            from bridge.core.lanes import turn_session_prefix

            turn = env["extra"].get("turn_id")
            session = turn_session_prefix(turn) if isinstance(turn, str) and turn else None
            if session:
                self.answers[rid] = (session, raw.instance)

    def _on_mapped(self, m: Any) -> None:
        self._scan("BRIDGE_MAPPED", m)
        if m.subject.endswith(".__tick__"):
            return
        self.mapped_count += 1
        eid = (m.headers or {}).get("Nats-Msg-Id")
        if eid is None:
            try:
                eid = json.loads(m.data).get("id")
            except ValueError:
                return
        if eid in self.mapped_ids:
            self.mapped_dups += 1
        else:
            self.mapped_ids.add(eid)

    def _on_dlq(self, m: Any) -> None:
        self._scan("BRIDGE_DLQ", m)
        h = m.headers or {}
        reason = h.get("Bridge-Dlq-Reason", m.subject.rsplit(".", 1)[-1])
        self.dlq_reasons[reason] += 1
        if h.get("Bridge-Stage") == "pairing":
            eid = h.get("Bridge-Event-Id")  # the event's id (bridge.core.deadletter); its body holds no event
            if eid is None:
                try:
                    eid = (json.loads(m.data).get("original") or {}).get("id")
                except (ValueError, AttributeError):
                    return
            if isinstance(eid, str):
                self.dlq_event_ids[eid] = reason
        elif h.get("Bridge-Stage") == "mapper" and h.get("Bridge-Raw-Seq", "").isdigit():
            # (an exporter's letter is downstream of AEP_EVENTS: it accounts for nothing here)
            self.dlq_raw_seqs[int(h["Bridge-Raw-Seq"])] = reason

    def _on_aep(self, m: Any) -> None:
        self._scan("AEP_EVENTS", m)
        try:
            ev = decode_event(m.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.schema_count += 1
            if len(self.schema_problems) < MAX_EXAMPLES:
                self.schema_problems.append(f"seq {m.metadata.sequence.stream}: {exc}")
            return
        self.types[ev.type] += 1
        first = self.aep_ids.get(ev.id)
        if first is not None:
            if first == ev.source:
                self.dup_count += 1
                if len(self.dup_examples) < MAX_EXAMPLES:
                    self.dup_examples.append(f"{ev.id} {ev.type} in {ev.source} (stream seq {m.metadata.sequence.stream})")
            else:
                self.two_sources += 1
                if len(self.dup_examples) < MAX_EXAMPLES:
                    self.dup_examples.append(f"{ev.id} {ev.type} under {first} and {ev.source}")
            return
        self.aep_ids[ev.id] = ev.source
        self.events.append(ev)
        self._schema(m.data, ev.type)

    def _schema(self, data: bytes, event_type: str) -> None:
        if self.schema_sample is not None:
            self._schema_seen[event_type] += 1
            n = self._schema_seen[event_type]
            # every event of a type up to the sample size, then one in 50
            if n > self.schema_sample and n % 50:
                return
        env_v, type_v = _validators()
        doc = json.loads(data)
        self.schema_checked += 1
        errors = [e.message for e in env_v.iter_errors(doc)]
        tv = type_v.get(doc.get("type", ""))
        if tv is not None:
            errors += [e.message for e in tv.iter_errors(doc.get("data", {}))]
        if errors:
            self.schema_count += 1
            if len(self.schema_problems) < MAX_EXAMPLES:
                self.schema_problems.append(f"{doc.get('id')} {doc.get('type')}: {errors[0][:200]}")

    async def collect(self) -> dict[str, int]:
        """Read what is new on the four streams; returns how many messages each gave."""
        got = {}
        got["raw"] = await self.readers["raw"].read_new(self._on_raw)
        got["dlq"] = await self.readers["dlq"].read_new(self._on_dlq)
        got["mapped"] = await self.readers["mapped"].read_new(self._on_mapped)
        got["aep"] = await self.readers["aep"].read_new(self._on_aep)
        return got

    async def close(self) -> None:
        for r in self.readers.values():
            await r.close()

    # ------------------------------------------------------------ checking

    def unended(self) -> list[str]:
        """Cards that should have ended (the run is complete and their session ended) and have not."""
        return unended_requests(self.events) if self.end.get("complete", False) else []

    def missing(self, limit: int | None = None) -> tuple[int, list[str], Counter[str], int, int]:
        """(lost, examples, where, expected mapped events, accounted in DLQ)."""
        lost = 0
        where: Counter[str] = Counter()
        examples: list[str] = []
        expected = 0
        in_dlq = 0

        def miss(kind: str, text: str) -> None:
            nonlocal lost
            lost += 1
            where[kind] += 1
            if len(examples) < (limit or MAX_EXAMPLES):
                examples.append(text)

        for e in self.entries:
            if e.get("o") not in DELIVERED:
                continue
            if e.get("x") and e.get("r"):  # a hostile input owed a reason: `hostile()` checks it
                continue
            rid = e.get("id") or self.marker_to_id.get(e.get("m") or "")
            raw = self.raw.get(rid) if rid else None
            if raw is None:
                miss("not on HERMES_RAW", f"{e.get('h')} of {e.get('i')} ({e.get('v')}, {e.get('o')}) id={rid or e.get('m')}: not on HERMES_RAW")
                continue
            reason = next((self.dlq_raw_seqs[s] for s in raw.seqs if s in self.dlq_raw_seqs), None)
            if reason is not None:
                in_dlq += 1
                continue
            if isinstance(raw.k, str):
                miss("expected in the DLQ", f"{e.get('h')} raw {rid} (seq {raw.seqs}): must be dead-lettered ({raw.k}), is not")
                continue
            ms = raw.ts // 1_000_000
            for i in range(raw.k):
                expected += 1
                eid = event_id(rid, MAPPED_SLOT + i, ms)
                if eid in self.aep_ids or eid in self.dlq_event_ids:
                    continue
                if eid in self.mapped_ids:
                    miss("mapped, not paired", f"{e.get('h')} raw {rid} (seq {raw.seqs}) event {eid}: on BRIDGE_MAPPED, not on AEP_EVENTS")
                else:
                    miss("not mapped", f"{e.get('h')} raw {rid} (seq {raw.seqs}) event {eid}: not on BRIDGE_MAPPED")
        return lost, examples, where, expected, in_dlq

    def hostile(self) -> tuple[list[str], Counter[str], Counter[str], int, int]:
        """(problems, kinds delivered, reason -> found in the DLQ with it, mapped, awaited):
        every hostile input of the mix is in BRIDGE_DLQ with the reason the manifest owes it
        (and the pure core gives it that reason), or, owed none, maps and is not
        dead-lettered. ``awaited``: problems the pipeline may still resolve (not there yet)."""
        problems: list[str] = []
        kinds: Counter[str] = Counter()
        in_dlq: Counter[str] = Counter()
        mapped = awaited = 0
        # `session_unknown` is one session id, `unknown`, in every instance that draws it: it
        # belongs to the first instance seen for it (HERMES_RAW order), the others' are
        # dead-lettered as instance_conflict (docs/ARCHITECTURE.md, a session's instance).
        firsts = [(min(raw.seqs), e.get("i")) for e in self.entries
                  if e.get("x") == "session_unknown" and e.get("o") in DELIVERED
                  and (raw := self.raw.get(e.get("id") or self.marker_to_id.get(e.get("m") or "") or "")) and raw.seqs]
        unknown_owner = min(firsts)[1] if firsts else None
        for e in self.entries:
            kind = e.get("x")
            if not kind or e.get("o") not in DELIVERED:
                continue
            kinds[kind] += 1
            owed = e.get("r")
            rid = e.get("id") or self.marker_to_id.get(e.get("m") or "")
            raw = self.raw.get(rid) if rid else None
            what = f"hostile {kind} of {e.get('i')} id={rid or e.get('m')}"
            if raw is None:
                problems.append(f"{what}: not on HERMES_RAW")
                awaited += 1
                continue
            core = raw.k if isinstance(raw.k, str) else None
            if kind == "session_unknown" and e.get("i") != unknown_owner:
                owed = core = "instance_conflict"  # the core maps one message; the session is another instance's
            if core != owed:
                problems.append(f"{what} (seq {raw.seqs}): the core gives it {core or 'a mapping'}, "
                                f"the manifest owes it {owed or 'a mapping'}")
            got = next((self.dlq_raw_seqs[s] for s in raw.seqs if s in self.dlq_raw_seqs), None)
            if owed is None:
                if got is not None:
                    problems.append(f"{what} (seq {raw.seqs}): must map, was dead-lettered ({got})")
                elif isinstance(raw.k, int):
                    mapped += 1  # its events: check 1
            elif got is None:
                problems.append(f"{what} (seq {raw.seqs}): not in BRIDGE_DLQ (owed {owed})")
                awaited += 1
            elif got != owed:
                problems.append(f"{what} (seq {raw.seqs}): dead-lettered as {got}, owed {owed}")
            else:
                in_dlq[got] += 1
        return problems, kinds, in_dlq, mapped, awaited

    def check(self, elapsed: float = 0.0) -> Report:
        rep = Report(strict_order=self.strict_order, elapsed_s=elapsed)
        rep.manifest_events = len(self.entries)
        rep.expected_delivered = sum(1 for e in self.entries if e.get("o") in DELIVERED)
        rep.edge_loss_counted = sum(1 for e in self.entries if e.get("o") in EDGE_LOSS)
        rep.inputs_cut = sum(1 for e in self.entries if e.get("e"))
        rep.raw_messages = len(self.raw) + self.raw_copies
        rep.raw_duplicates = self.raw_copies
        rep.mapped_messages = self.mapped_count
        rep.mapped_duplicates = self.mapped_dups
        rep.aep_events = len(self.events) + self.dup_count + self.two_sources
        rep.dlq_messages = sum(self.dlq_reasons.values())
        rep.dlq_reasons = self.dlq_reasons
        rep.lost_count, rep.lost, rep.lost_where, rep.expected_events, rep.accounted_in_dlq = self.missing()
        rep.duplicate_count, rep.id_under_two_sources, rep.duplicates = self.dup_count, self.two_sources, self.dup_examples

        # order: per session, mapped events in stream order
        last: dict[str, tuple[int, int, str]] = {}
        seen_pos: set[tuple[str, int, int]] = set()
        for ev in self.events:
            if ev.session is msgspec.UNSET or ev.seq is msgspec.UNSET:
                continue
            epoch = ev.epoch if ev.epoch is not msgspec.UNSET else 0
            pos = (ev.session, epoch, ev.seq)
            if pos in seen_pos:
                rep.seq_reused += 1
                if len(rep.order_violations) < MAX_EXAMPLES:
                    rep.order_violations.append(f"{ev.id} {ev.type}: (epoch, seq) ({epoch}, {ev.seq}) reused in {ev.session}")
            seen_pos.add(pos)
            if not MAPPED_SLOT <= ev.seq % SLOTS < AFTER_SLOT:
                continue
            prev = last.get(ev.session)
            if prev is not None and (epoch, ev.seq) <= prev[:2]:
                rep.backfills += 1
                text = (f"{ev.id} {ev.type} (raw seq {ev.seq // SLOTS}) after {prev[2]} (raw seq {prev[1] // SLOTS}) "
                        f"in {ev.session}")
                if len(rep.backfill_examples) < MAX_EXAMPLES:
                    rep.backfill_examples.append(text)
                continue
            last[ev.session] = (epoch, ev.seq, ev.id)
        rep.order_violation_count = rep.backfills
        if self.strict_order:
            rep.order_violations += rep.backfill_examples
        rep.sessions = len({ev.session for ev in self.events if ev.session is not msgspec.UNSET})

        rep.complete = bool(self.end.get("complete", False))
        # check_invariants promises "ends before the next session end in stream order" only for
        # input in order; after a reordering (backfills) the (epoch, seq) form is the one that holds.
        problems = check_invariants(self.events, complete=False, stream_order=rep.backfills == 0)
        if rep.complete:
            problems += self.unended()
        rep.invariant_count, rep.invariant_problems = len(problems), problems[:MAX_EXAMPLES]
        expected = {}
        for rid, (session, instance) in self.answers.items():
            raw = self.raw[rid]
            if instance not in self.lossy and not any(s in self.dlq_raw_seqs for s in raw.seqs):
                expected[event_id(rid, MAPPED_SLOT, raw.ts // 1_000_000)] = session
        approvals = approval_problems(self.events, expected)
        rep.approvals_checked = sum(1 for eid in expected if eid in self.aep_ids)
        rep.approval_count, rep.approval_problems = len(approvals), approvals[:MAX_EXAMPLES]
        usage = check_usage(self.events)
        rep.usage_runs, rep.usage_calls, rep.usage_late, rep.usage_amended = usage.runs, usage.calls, usage.late, usage.amended
        rep.usage_count, rep.usage_problems = len(usage.problems), usage.problems[:MAX_EXAMPLES]
        rep.schema_count, rep.schema_problems, rep.schema_checked = self.schema_count, self.schema_problems, self.schema_checked
        rep.canary_count, rep.canary_hits = self.canary_count, self.canary_hits
        rep.canaries = len(self.canaries)
        rep.canaries_planted = sum(1 for e in self.entries if e.get("c"))
        problems, rep.hostile_kinds, rep.hostile_in_dlq, rep.hostile_mapped, _ = self.hostile()
        rep.hostile_sent = sum(rep.hostile_kinds.values())
        rep.hostile_count, rep.hostile_problems = len(problems), problems[:MAX_EXAMPLES]
        rep.types = self.types
        return rep


def approval_problems(events: list[Any], answers: dict[str, str]) -> list[str]:
    """What became of each approval answer: ``answers`` maps the id of the event a
    ``post_approval_response`` was mapped to (slot 512 of its raw message) to the session its
    ``turn_id`` names. Each one present must be an ``attention.answered`` (with an
    ``attention.resolved {answered}`` after it) or ``attention.timeout`` filed on that session,
    ``subject`` = a request of that session, and the request must never be closed
    ``dismissed`` (a security backend would read a dismissed prompt where an approval
    happened). Answers not in ``events`` are the loss check's business."""
    by_id = {e.id: e for e in events}
    resolutions: dict[Any, list[str]] = {}
    for e in events:
        if e.type == "attention.resolved" and e.subject is not msgspec.UNSET:
            resolutions.setdefault(e.subject, []).append((e.data or {}).get("resolution", ""))
    out = []
    for eid, session in answers.items():
        ev = by_id.get(eid)
        if ev is None:
            continue
        where = f"answer {eid} of session {session}"
        if ev.type not in ("attention.answered", "attention.timeout"):
            out.append(f"{where}: is {ev.type} in {ev.session}, not attention.answered / attention.timeout")
            continue
        if ev.session != session:
            out.append(f"{where}: filed under {ev.session}")
            continue
        request = by_id.get(ev.subject) if isinstance(ev.subject, str) else None
        if request is None or request.type != "attention.requested" or request.session != session:
            out.append(f"{where}: subject {ev.subject!r} is not a request of its session")
            continue
        ends = resolutions.get(request.id, [])
        if "dismissed" in ends:
            out.append(f"{where}: its request {request.id} was closed dismissed")
        if ev.type == "attention.answered" and "answered" not in ends:
            out.append(f"{where}: no attention.resolved {{answered}} for request {request.id}")
    return sorted(out)


def unended_requests(events: list[Any]) -> list[str]:
    """Completeness, for a run whose sessions all finished: every ``attention.requested`` is
    ended (``attention.resolved`` / ``attention.timeout`` with subject = its id) when a session
    end (``session.ended`` / ``x.hermes.session.finalized``) follows it in (epoch, seq). A
    session that never ends (a subagent's own session: Hermes finalizes only the parent) keeps
    its open cards until their TTL, which is not a violation."""
    ended = {e.subject for e in events if e.type in CARD_ENDINGS and e.subject is not msgspec.UNSET}
    last_end: dict[Any, tuple[int, int]] = {}
    for e in events:
        if e.type in SESSION_ENDS:
            pos = (e.epoch if e.epoch is not msgspec.UNSET else 0, e.seq)
            if e.session not in last_end or pos > last_end[e.session]:
                last_end[e.session] = pos
    out = []
    for e in events:
        if e.type == "attention.requested" and e.id not in ended:
            end = last_end.get(e.session)
            if end is not None and (e.epoch if e.epoch is not msgspec.UNSET else 0, e.seq) < end:
                out.append(f"request {e.id} never ends although its session {e.session} ended")
    return out


async def verify_async(nc: Any, manifest: str | Path, *, wait: float = 0.0, settle: float = 2.0,
                       strict_order: bool = False, schema_sample: int | None = None,
                       progress: Any = None) -> Report:
    """Read everything, and while something is still missing keep collecting for up to
    ``wait`` seconds (the pipeline may still be working: redeliveries, held terminals);
    then return the full report."""
    started = time.monotonic()
    v = Verifier(nc, manifest, strict_order=strict_order, schema_sample=schema_sample)
    try:
        got = await v.collect()
        if progress:
            progress(f"read {got}")
        deadline = started + wait
        quiet_since = time.monotonic()
        while time.monotonic() < deadline:
            lost = v.missing(limit=1)[0] + v.hostile()[4]
            # Not BRIDGE_MAPPED: pairing's ticks land there every few seconds whatever else
            # happens (with a short AEP_BRIDGE_TICK_S the run never looked quiet), and every
            # mapped event shows up on AEP_EVENTS anyway.
            new = got["raw"] + got["dlq"] + got["aep"]
            if new:
                quiet_since = time.monotonic()
            # A card that reached pairing after its session's end closes on pairing's own timer
            # (hold_ns after its receive time, at the next tick): nothing is lost meanwhile, but
            # it is not done either, so a complete run waits for it too.
            unended = len(v.unended()) if lost == 0 else 0
            if lost == 0 and not unended and time.monotonic() - quiet_since >= settle:
                break
            if progress:
                progress(f"{lost} event(s) not there yet, {unended} card(s) not ended yet; reading again")
            await asyncio.sleep(1.0)
            got = await v.collect()
        return v.check(time.monotonic() - started)
    finally:
        await v.close()


def verify(target: Any, manifest: str | Path, **kwargs: Any) -> Report:
    """Synchronous wrapper: connect (``target``: a NATS URL or `bridge.config.Settings`) and run
    `verify_async`."""
    settings = target if isinstance(target, Settings) else Settings(nats_url=target)

    async def main() -> Report:
        nc = await connect_client(settings, name="aep-bridge-verify", timeout=5)
        try:
            return await verify_async(nc, manifest, **kwargs)
        finally:
            await nc.close()

    return asyncio.run(main())
