"""Unit and property tests of the pure core: envelopes, identity, lanes, redaction, digests."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bridge.core import aep
from bridge.core.ceiling import CapturePolicy, parse_overrides
from bridge.core.digest import canonical_json, digest
from bridge.core.redaction import Redactor
from bridge.core.envelope import EnvelopeError, decode_envelope, envelope_from_obj
from bridge.core.identity import Origin, event_id, rfc3339, ulid_from, ulid_time_ms
from bridge.core.lanes import (
    LANE_TOKEN_MAX, UNKNOWN, MemoryLanes, event_lane_token, lane_candidates, lane_from_token, lane_token, learned_from, partition_of, resolve_lane,
)
from bridge.core.mapping import fallback_type, map_envelope, map_specs
from tests.corpus import envelopes

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
HOOKS = ["pre_tool_call", "post_tool_call", "pre_approval_request", "post_approval_response", "on_session_end",
         "subagent_start", "subagent_stop", "pre_llm_call", "on_session_start", "api_request_error", "x_custom"]
extras = st.dictionaries(
    st.sampled_from(["status", "result", "choice", "turn_id", "tool_call_id", "session_key", "task_id", "error",
                     "duration_ms", "interrupted", "completed", "child_session_id", "user_message", "command",
                     "telemetry_schema_version", "pattern_key", "error_type"]),
    json_values, max_size=8,
)
envelope_objs = st.fixed_dictionaries(
    {"hook_event_name": st.sampled_from(HOOKS) | st.text(min_size=1, max_size=12)},
    optional={"tool_name": st.none() | st.sampled_from(["clarify", "terminal"]) | json_values,
              "tool_input": json_values, "session_id": json_values, "cwd": json_values, "extra": extras | json_values},
)
ORIGIN = Origin(raw_id="01JDRAW", raw_seq=7, ts_ns=1_764_543_353_000_000_000, instance="i")
POLICIES = [CapturePolicy(default=lvl, overrides={"attention": lvl}) for lvl in ("none", "metadata", "redacted", "full")]


# ------------------------------------------------------------------- properties

@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(obj=envelope_objs, level=st.integers(0, 3))
def test_mapping_never_raises_and_is_deterministic(obj, level):
    try:
        env = envelope_from_obj(obj)
    except EnvelopeError:
        return
    lanes = MemoryLanes()
    a = map_envelope(env, ORIGIN, lanes, POLICIES[level])
    b = map_envelope(envelope_from_obj(json.loads(json.dumps(obj))), ORIGIN, lanes, POLICIES[level])
    assert [aep.encode_event(e) for e in a.events] == [aep.encode_event(e) for e in b.events]
    for e in a.events:
        aep.decode_event(aep.encode_event(e))  # round-trips through the typed decoder (types, patterns)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=200) | json_values.map(lambda v: json.dumps(v).encode()))
def test_arbitrary_bytes_give_a_clear_error_or_an_envelope(data):
    try:
        env = decode_envelope(data)
    except EnvelopeError as exc:
        assert exc.reason in {"not_json", "not_object", "no_hook"}
        return
    map_envelope(env, ORIGIN, MemoryLanes(), POLICIES[1])


def test_wrong_types_are_reported_not_fatal():
    env = envelope_from_obj({"hook_event_name": "pre_tool_call", "tool_input": [1], "session_id": 5, "extra": "x", "zzz": 1})
    assert env.tool_input is None and env.session_id == "" and env.extra == {}
    assert env.unknown == {"zzz": 1}
    assert any("tool_input" in p for p in env.problems) and any("session_id" in p for p in env.problems)


def test_drift_sentinel_marks_events():
    base = envelopes()[0]
    ok = map_envelope(envelope_from_obj(base), ORIGIN, MemoryLanes(), POLICIES[1])
    assert ok.drift is None and all(e.drift is msgspec.UNSET for e in ok.events)
    moved = json.loads(json.dumps(base))
    moved["extra"]["telemetry_schema_version"] = "hermes.observer.v2"
    r = map_envelope(envelope_from_obj(moved), ORIGIN, MemoryLanes(), POLICIES[1])
    assert r.drift == "hermes.observer.v2" and all(e.drift == "hermes.observer.v2" for e in r.events)
    del moved["extra"]["telemetry_schema_version"]
    assert map_envelope(envelope_from_obj(moved), ORIGIN, MemoryLanes(), POLICIES[1]).events[0].drift == "missing"


# ------------------------------------------------------------------- mapping beyond the pins

def _post(status, error_type=None, tool="terminal"):
    return envelope_from_obj({"hook_event_name": "post_tool_call", "tool_name": tool, "session_id": "s",
                              "extra": {"status": status, "error_type": error_type, "tool_call_id": "c", "duration_ms": 3}})


@pytest.mark.parametrize("status,error_type,want", [
    ("cancelled", "keyboard_interrupt", "keyboard_interrupt"),
    ("timeout", "tool_timeout", "tool_timeout"),
    ("cancelled", None, "cancelled"),
    ("weird", None, "status:weird"),
])
def test_unpinned_statuses_keep_the_vendor_fact(status, error_type, want):
    r = map_envelope(_post(status, error_type), ORIGIN, MemoryLanes(), POLICIES[1])
    assert [e.type for e in r.events] == ["tool.failed"]
    assert r.events[0].data["error"]["type"] == want


def test_cli_timeout_reported_as_deny_stays_deny():
    env = envelope_from_obj({"hook_event_name": "post_approval_response", "session_id": "", "extra": {"choice": "deny", "pattern_key": "p"}})
    assert map_specs(env, POLICIES[1])[0][1].answer.option == "deny"


def test_session_end_without_turn_id_has_no_run():
    env = envelope_from_obj({"hook_event_name": "on_session_end", "session_id": "s", "extra": {"completed": True}})
    r = map_envelope(env, ORIGIN, MemoryLanes(), POLICIES[1])
    assert r.events[0].type == "run.finished" and r.events[0].run is msgspec.UNSET


def test_fallback_type_names():
    assert fallback_type("pre_verify") == "x.hermes.pre.verify"
    assert fallback_type("kanban_task_claimed") == "x.hermes.kanban.task.claimed"
    assert fallback_type("Weird Name!") == "x.hermes.weird.name"
    assert fallback_type("x") == "x.hermes.x.event"
    assert fallback_type("a_" * 59) == "x.hermes." + ".".join("a" * 59)  # 126 characters
    for hostile in ("a_" * 3000, "a_" * 61, "x" * 129):
        with pytest.raises(EnvelopeError) as err:
            fallback_type(hostile)
        assert err.value.reason == "bad_hook"


def test_metadata_clarify_card_has_structural_labels_only():
    env = envelope_from_obj({"hook_event_name": "pre_tool_call", "tool_name": "clarify", "session_id": "s",
                             "tool_input": {"question": "secret plan?", "choices": ["alpha", "beta"]}, "extra": {"tool_call_id": "c"}})
    card = map_specs(env, CapturePolicy(overrides={}))[1][1]
    assert card.fields[0].label == "question 1"
    assert [c.label for c in card.fields[0].choices] == ["1", "2"]


# ------------------------------------------------------------------- identity

def test_event_ids_are_ulids_of_the_receive_time():
    eid = event_id("raw-1", 512, 1_764_543_353_123)
    assert len(eid) == 26 and ulid_time_ms(eid) == 1_764_543_353_123
    assert eid == event_id("raw-1", 512, 1_764_543_353_123) != event_id("raw-1", 513, 1_764_543_353_123)
    assert ulid_from(0, bytes(10)) == "0" * 26


@given(time_ms=st.integers(0, 2**48 - 1), entropy=st.binary(min_size=10, max_size=32))
def test_ulids_are_base32_of_the_entropy_in_crockfords_alphabet(time_ms, entropy):
    """The fast encoding (8 look-ups of 10 bits) gives exactly the ids the first one did:
    RFC 4648 base32 of the first 10 bytes, in Crockford's alphabet (ids are stable across
    versions: a replay by a newer bridge must produce the same ids)."""
    import base64

    reference = base64.b32encode(entropy[:10]).decode().translate(
        str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ234567", "0123456789ABCDEFGHJKMNPQRSTVWXYZ"))
    ulid = ulid_from(time_ms, entropy)
    assert ulid[10:] == reference and ulid_time_ms(ulid) == time_ms


def test_seq_leaves_room_before_and_after():
    o = Origin(raw_id="r", raw_seq=3, ts_ns=0, instance="i")
    assert o.seq_for(0) < o.seq_for(512) < o.seq_for(768) < Origin("r", 4, 0, "i").seq_for(0)


def test_rfc3339():
    assert rfc3339(1_764_543_353_123_456_789) == "2025-11-30T22:55:53.123Z"


@given(ts_ns=st.integers(0, 2**62))
def test_rfc3339_is_the_utc_time_to_the_millisecond(ts_ns):
    """The second's part is cached and the milliseconds formatted: the same text as formatting
    the whole time (a reference with datetime, truncated, never rounded)."""
    import datetime

    dt = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc) + datetime.timedelta(microseconds=ts_ns // 1000)
    assert rfc3339(ts_ns) == dt.strftime("%Y-%m-%dT%H:%M:%S.") + f"{dt.microsecond // 1000:03d}Z"


# ------------------------------------------------------------------- lanes

def _approval(session_key, turn_id="20261130_1:task:abcd1234"):
    return envelope_from_obj({"hook_event_name": "pre_approval_request", "session_id": "",
                              "extra": {"session_key": session_key, "turn_id": turn_id, "pattern_key": "p"}})


class _NoLookups(MemoryLanes):
    def is_known_session(self, session_id: str) -> bool:
        raise AssertionError(f"asked about {session_id!r}")

    def task_session(self, task_id: str) -> str | None:
        raise AssertionError(f"asked about task {task_id!r}")


def test_an_approval_with_a_turn_id_is_filed_by_its_prefix_without_any_lookup():
    """Issue 17: Hermes builds turn_id as {session}:{task}:{hex8} (CLI) or {session}:{session}:{hex8}
    (gateway): the prefix is the session, whatever session_key says and whatever is known. Before,
    a CLI `-q` approval (session_key "default") whose session a racing replica had not written to
    the KV yet went to `unknown`."""
    nothing = _NoLookups()
    assert resolve_lane(_approval("default"), nothing) == "20261130_1"  # CLI -q
    assert resolve_lane(_approval("20261130_1", turn_id="20261130_1:20261130_1:d1fbd352"), nothing) == "20261130_1"
    gateway = "run_f8b2732e46c6449297cbd61972c8d71a"
    assert resolve_lane(_approval(gateway, turn_id="gw_c1:gw_c1:3f6d67cf"), nothing) == "gw_c1"
    assert resolve_lane(_approval("k", turn_id="agent:x:y:task:0a1b2c3d"), nothing) == "agent:x:y"  # ':' in a session id
    assert not lane_candidates(_approval("default"))


def test_lane_resolution_rules():
    lanes = MemoryLanes()
    assert resolve_lane(_approval("20261130_1", turn_id=""), lanes) == UNKNOWN  # nothing known yet
    lanes.add_session("20261130_1")
    assert resolve_lane(_approval("20261130_1", turn_id=""), lanes) == "20261130_1"  # by session_key (no turn id)
    assert resolve_lane(_approval("default"), lanes) == "20261130_1"  # by turn-id prefix
    assert resolve_lane(_approval("default", turn_id="nope"), lanes) == UNKNOWN  # no usable turn id, key unknown
    gateway = "agent:telegram:dm:42"
    assert resolve_lane(_approval(gateway, turn_id="nope"), lanes) == UNKNOWN  # a gateway key never mints a lane
    assert not lanes.is_known_session(gateway)
    inner = envelope_from_obj({"hook_event_name": "pre_tool_call", "session_id": "", "extra": {"task_id": "T"}})
    assert resolve_lane(inner, lanes) == UNKNOWN
    lanes.add_task("T", "20261130_1")
    assert resolve_lane(inner, lanes) == "20261130_1"  # task alias


class _RecordingLanes(MemoryLanes):
    def __init__(self) -> None:
        super().__init__()
        self.asked: set[tuple[str, str]] = set()

    def is_known_session(self, session_id: str) -> bool:
        self.asked.add(("s", session_id))
        return super().is_known_session(session_id)

    def task_session(self, task_id: str) -> str | None:
        self.asked.add(("t", task_id))
        return super().task_session(task_id)


def test_lane_candidates_are_exactly_what_resolution_may_ask():
    """The mapper prefetches `lane_candidates` and waits on them when none is known:
    resolution must never ask the table about anything else."""
    lanes = _RecordingLanes()
    asked_any = 0
    for obj in envelopes():
        env = envelope_from_obj(obj)
        lanes.asked.clear()
        resolve_lane(env, lanes)
        cands = lane_candidates(env)
        allowed = {("s", s) for s in cands.sessions} | ({("t", cands.task_id)} if cands.task_id else set())
        assert lanes.asked <= allowed, obj
        assert bool(cands) == bool(allowed)
        asked_any += bool(lanes.asked)
        if env.session_id:
            assert not cands and not lanes.asked
        lanes.learn(learned_from(env))
    assert asked_any > 0, "the corpus has session-less events that need the table"
    assert not lane_candidates(_approval("default"))  # the turn id names the lane: nothing to ask
    a = lane_candidates(_approval("default", turn_id="nope"))
    assert a.sessions == ("default",) and a.task_id is None
    inner = envelope_from_obj({"hook_event_name": "pre_tool_call", "session_id": "", "extra": {"task_id": "T"}})
    assert lane_candidates(inner).sessions == () and lane_candidates(inner).task_id == "T"
    assert not lane_candidates(envelope_from_obj({"hook_event_name": "transform_tool_result", "session_id": ""}))


def test_lanes_are_bounded():
    lanes = MemoryLanes(max_entries=3)
    for i in range(10):
        lanes.add_session(f"s{i}")
    assert list(lanes.sessions) == ["s7", "s8", "s9"]


@given(st.text(min_size=1, max_size=300))
def test_lane_tokens_are_bounded_subject_safe_and_round_trip_unless_hashed(lane):
    token = lane_token(lane)
    assert len(token) <= LANE_TOKEN_MAX
    assert all(c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_=" for c in token)
    if token.startswith("_h"):
        assert len(lane.encode()) > 95 and token == lane_token(lane)  # deterministic
    else:
        assert lane_from_token(token) == lane
    assert token != "_unknown"
    assert 0 <= partition_of(token, 8) < 8


def test_lane_token_forms():
    assert lane_token("20261130_224954_177c7f") == "20261130_224954_177c7f"  # plain ids keep their token
    assert lane_token("a:b") == "=YTpi"  # as before: stored streams stay valid
    assert lane_token("nl-sess\n") == "=bmwtc2Vzcwo"  # a full match: "\n" is not plain
    assert lane_token("S" * 128) == "S" * 128
    long = lane_token("S" * 5000)
    assert long.startswith("_h") and len(long) == 34 and long != lane_token("S" * 4999)
    assert lane_token("\ud800x").startswith("=")  # a lone surrogate from JSON does not raise


def test_unknown_lane_token():
    # The unknown lane has its own token; a real session named "unknown" is a plain id.
    assert event_lane_token(UNKNOWN, unknown=True) == "_unknown" and lane_from_token("_unknown") == UNKNOWN
    assert lane_token(UNKNOWN) == "unknown" == event_lane_token(UNKNOWN, unknown=False)


# ------------------------------------------------------------------- redaction and digests

@pytest.mark.parametrize("text,gone,kept", [
    ("-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAK\n-----END RSA PRIVATE KEY-----", "MIIEowIBAAK", "[REDACTED:secret]"),
    ("run with AKIAIOSFODNN7EXAMPLE please", "AKIAIOSFODNN7EXAMPLE", "run with"),
    ("Authorization: Bearer abc123.DEF-456_ghi", "abc123.DEF-456_ghi", "[REDACTED:secret]"),
    ("export API_KEY=sk_live_abcdef123456 && run", "sk_live_abcdef123456", "API_KEY="),
    ('{"token": "tok_9f8e7d6c5b4a"}', "tok_9f8e7d6c5b4a", "token"),
    ("password : hunter2sequel", "hunter2sequel", "password"),
    ("session eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0In0.SflKxwRJSMeKKF2QT4fwpM done", "eyJhbGciOiJIUzI1NiJ9", "done"),
    ("clone with ghp_AbCdEfGhIjKlMnOpQrStUvWxYz012345", "ghp_AbCd", "clone"),
    ("copied to /home/alice/project/file.txt", "/home/alice", "~/project/file.txt"),
    ("contact jane.doe+test@example.co.uk now", "jane.doe", "[REDACTED:pii]"),
    ("call +1 (555) 123-4567 tomorrow", "123-4567", "[REDACTED:pii]"),
])
def test_redaction_pipeline(text, gone, kept):
    out = Redactor().text(text)
    assert gone not in out and kept in out


def test_redaction_keeps_prose_and_configured_names():
    r = Redactor(secret_values=("s3cr3t-deploy-key",), home="/srv/op")
    assert r.text("the bearer of good news") == "the bearer of good news"
    assert r.text("with s3cr3t-deploy-key now") == "with [REDACTED:secret] now"
    assert r.text("in /srv/op/x") == "in ~/x"
    assert "[REDACTED:pii]" not in Redactor(pii=False).text("a@b.example")


def test_digest_is_canonical_json_and_passes_stubs_through():
    assert digest({"b": 1, "a": "é"}) == digest({"a": "é", "b": 1})
    value = {"k": ["x", 1, None, True], "é": "ü"}
    assert canonical_json(value) == json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    stub = {"$aep_stub": True, "digest": digest("x" * 100_000), "bytes": 100_002}
    assert digest(stub) == digest("x" * 100_000)


def test_overrides_parse_and_policy_categories():
    assert parse_overrides("attention=redacted, tool=full") == {"attention": "redacted", "tool": "full"}
    with pytest.raises(ValueError):
        parse_overrides("attention=loud")
    p = CapturePolicy(default="metadata", overrides={"attention": "redacted", "api": "full"})
    assert p.ceiling("attention.answered") == 2 and p.ceiling("tool.failed") == 1 and p.ceiling("x.hermes.api.error") == 3


@pytest.mark.parametrize("value", [2**64 - 1, 2**63, 1e300, float("inf"), float("nan"), -1])
def test_a_count_from_the_wire_is_kept_only_where_every_later_stage_can_hold_it(value):
    """A duration past int64 reached the exporter, whose OTLP framing (protobuf int64) then
    failed on it for every restart (issue 13: one hostile value must not stop anything)."""
    def duration(v):
        env = envelope_from_obj({"hook_event_name": "post_tool_call", "session_id": "s", "tool_name": "terminal",
                                 "tool_input": {"command": "ls"}, "extra": {"status": "ok", "duration_ms": v,
                                                                             "tool_call_id": "c1", "result": "x"}})
        (spec,) = map_specs(env, CapturePolicy())
        return spec[1].duration_ms

    assert duration(value) is msgspec.UNSET
    assert duration(2**63 - 1) == 2**63 - 1 and duration(12.9) == 12
