"""What `aep-bridge map` makes of the real Hermes corpus: schema-valid at every capture
level, capture honoured field by field, and no content leaks at `metadata`."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

from bridge.core.ceiling import LEVEL_RANK
from bridge.core.schemas import generate, render
from tests.corpus import corpus_path, envelopes
from tests.support.validators import validators

ROOT = Path(__file__).resolve().parents[2]
LEVELS = ["none", "metadata", "redacted", "full"]


def run_map(lines: list[str] | Path, *args: str) -> tuple[list[dict], str, int]:
    if isinstance(lines, Path):
        cmd_input, path = None, str(lines)
    else:
        cmd_input, path = ("\n".join(lines) + "\n").encode(), "-"
    proc = subprocess.run(
        [sys.executable, "-m", "bridge.cli", "map", path, "--instance", "test", *args],
        input=cmd_input, capture_output=True, check=False,
    )
    events = [json.loads(line) for line in proc.stdout.splitlines()]
    return events, proc.stderr.decode(), proc.returncode


@lru_cache(maxsize=None)
def corpus_at(level: str, attention: str) -> tuple[dict, ...]:
    events, err, rc = run_map(corpus_path(), "--capture", level, "--capture-override", f"attention={attention}")
    assert rc == 0, err
    return tuple(events)


@lru_cache(maxsize=1)
def schemas():
    envelope, types = validators()
    return envelope, types, generate()


def test_committed_schemas_match_the_generator():
    docs = generate()
    for name, doc in docs.items():
        path = ROOT / "schemas" / name
        assert path.is_file(), f"schemas/{name} missing: run `aep-bridge schemas --out schemas/`"
        assert path.read_bytes() == render(doc), f"schemas/{name} is stale: run `aep-bridge schemas --out schemas/`"
    committed = {str(p.relative_to(ROOT / "schemas")) for p in (ROOT / "schemas").rglob("*.json")}
    assert committed == set(docs), f"unexpected files in schemas/: {committed - set(docs)}"


def test_schemas_check_command_detects_a_stale_file(tmp_path):
    out = tmp_path / "schemas"
    assert subprocess.run([sys.executable, "-m", "bridge.cli", "schemas", "--out", str(out)], capture_output=True).returncode == 0
    assert subprocess.run([sys.executable, "-m", "bridge.cli", "schemas", "--out", str(out), "--check"]).returncode == 0
    (out / "types" / "tool.requested.schema.json").write_text("{}")
    assert subprocess.run([sys.executable, "-m", "bridge.cli", "schemas", "--out", str(out), "--check"], capture_output=True).returncode == 1


def _field_levels(schema: dict, defs: dict) -> dict:
    if "$ref" in schema:
        schema = {**defs[schema["$ref"].split("/")[-1]], **{k: v for k, v in schema.items() if k != "$ref"}}
    return schema


def check_capture(data, schema: dict, defs: dict, ceiling: int, path: str) -> list[str]:
    """Every field present must have x-aep-capture <= the event's capture."""
    problems = []
    schema = _field_levels(schema, defs)
    for key, value in (data or {}).items():
        prop = schema.get("properties", {}).get(key)
        if prop is None:
            problems.append(f"{path}.{key}: not in the type's schema")
            continue
        prop = _field_levels(prop, defs)
        level = LEVEL_RANK[prop.get("x-aep-capture", "metadata")]
        # At `none` only the fields the type requires survive (structure, no content).
        required_at_none = ceiling == 0 and key in schema.get("required", [])
        if level > ceiling and not required_at_none:
            problems.append(f"{path}.{key}: level {prop.get('x-aep-capture')} above capture")
        if isinstance(value, dict) and "properties" in prop:
            problems += check_capture(value, prop, defs, ceiling, f"{path}.{key}")
        if isinstance(value, list) and isinstance(prop.get("items"), dict):
            item_schema = _field_levels(prop["items"], defs)
            for i, item in enumerate(value):
                if isinstance(item, dict):
                    problems += check_capture(item, item_schema, defs, ceiling, f"{path}.{key}[{i}]")
    return problems


@pytest.mark.parametrize("level", LEVELS)
def test_every_event_is_valid_at_every_level(level):
    envelope_v, type_v, docs = schemas()
    events = corpus_at(level, level)
    assert len(events) >= len(envelopes())
    for event in events:
        errors = [e.message for e in envelope_v.iter_errors(event)]
        assert not errors, (event["type"], errors)
        assert event["capture"] == level
        validator = type_v.get(event["type"])
        if validator is None:
            assert event["type"].startswith("x.hermes."), f"core type {event['type']} has no payload schema"
            continue
        errors = [e.message for e in validator.iter_errors(event.get("data", {}))]
        assert not errors, (event["type"], errors)
        doc = docs[f"types/{event['type']}.schema.json"]
        root = doc["$defs"][doc["$ref"].split("/")[-1]]
        assert not check_capture(event.get("data"), root, doc["$defs"], LEVEL_RANK[level], event["type"])


def test_capture_check_can_fail():
    _, _, docs = schemas()
    doc = docs["types/tool.requested.schema.json"]
    root = doc["$defs"]["ToolRequested"]
    assert check_capture({"tool": {"name": "x"}, "args": {"a": 1}}, root, doc["$defs"], LEVEL_RANK["metadata"], "t")


def test_default_posture_splits_attention_from_the_rest():
    events, err, rc = run_map(corpus_path())
    assert rc == 0, err
    for e in events:
        want = "redacted" if e["type"].startswith("attention.") else "metadata"
        assert e["capture"] == want, e


# ------------------------------------------------------------------- canaries

CANARIES = {
    "args": "CANARYARGSzq81",
    "result": "CANARYRESULTzq82",
    "user_message": "CANARYUSERzq83",
    "command": "CANARYCOMMANDzq84",
    "error": "CANARYERRORzq85",
    "goal": "CANARYGOALzq86",
    "assistant": "CANARYASSISTANTzq87",
}


def planted_corpus() -> list[str]:
    lines = []
    for e in envelopes():
        e = copy.deepcopy(e)
        x = e.get("extra") or {}
        if isinstance(e.get("tool_input"), dict):
            e["tool_input"] = {**e["tool_input"], "note": CANARIES["args"]}
            if "question" in e["tool_input"]:
                e["tool_input"]["question"] += CANARIES["args"]
        if "result" in x:
            x["result"] = f"{x['result']} {CANARIES['result']}"
        if "user_message" in x:
            x["user_message"] = f"{x['user_message']} {CANARIES['user_message']}"
        if "command" in x:
            x["command"] = f"{x['command']} {CANARIES['command']}"
        if "error_message" in x:
            x["error_message"] = f"{x['error_message']} {CANARIES['error']}"
        if "child_goal" in x:
            x["child_goal"] = f"{x['child_goal']} {CANARIES['goal']}"
        if "assistant_response" in x:
            x["assistant_response"] = f"{x['assistant_response']} {CANARIES['assistant']}"
        lines.append(json.dumps(e))
    # A clarify round trip with free text, so answers are covered too.
    lines.append(json.dumps({"hook_event_name": "post_tool_call", "tool_name": "clarify", "tool_input": {"question": "Q?"}, "session_id": "s", "cwd": "/", "extra": {"tool_call_id": "c", "status": "ok", "result": json.dumps({"question": "Q?", "choices_offered": None, "user_response": CANARIES["user_message"]})}}))
    return lines


def test_no_content_at_metadata():
    lines = planted_corpus()
    events, err, rc = run_map(lines, "--capture", "metadata", "--capture-override", "attention=metadata")
    assert rc == 0, err
    blob = "\n".join(json.dumps(e) for e in events)
    for name, canary in CANARIES.items():
        assert canary not in blob, f"{name} canary leaked at metadata"


def test_canaries_do_appear_at_full():
    """The canary test can fail: at `full` the planted content is there."""
    events, err, rc = run_map(planted_corpus(), "--capture", "full", "--capture-override", "attention=full")
    assert rc == 0, err
    blob = "\n".join(json.dumps(e) for e in events)
    for name in ("args", "result", "user_message", "command", "error", "goal"):
        assert CANARIES[name] in blob, name


def test_secrets_never_pass_the_default_posture():
    secret = "AKIAZZZZ9999CANARY01"
    line = {"hook_event_name": "pre_approval_request", "tool_name": None, "tool_input": None, "session_id": "", "cwd": "/",
            "extra": {"command": f"AWS_KEY={secret} deploy", "pattern_key": "p", "session_key": "x", "turn_id": "x:t:1"}}
    events, err, rc = run_map([json.dumps(line)])
    assert rc == 0, err
    assert secret not in json.dumps(events)
    assert "[REDACTED:secret]" in events[0]["data"]["prompt"]


# ------------------------------------------------------------------- the command

def test_map_reports_bad_lines_and_keeps_going():
    good = json.dumps(envelopes()[0])
    events, err, rc = run_map([good, "{not json", "[1, 2]", json.dumps({"tool_name": "x"}), good])
    assert rc == 1
    assert "line 2" in err and "not_json" in err
    assert "line 3" in err and "not_object" in err
    assert "line 4" in err and "no_hook" in err
    assert [e["seq"] // 1024 for e in events] == [1, 5]


def test_map_is_byte_identical_across_runs():
    a = subprocess.run([sys.executable, "-m", "bridge.cli", "map", str(corpus_path()), "--instance", "i"], capture_output=True)
    b = subprocess.run([sys.executable, "-m", "bridge.cli", "map", str(corpus_path()), "--instance", "i"], capture_output=True)
    assert a.returncode == 0 and a.stdout == b.stdout and a.stdout


def test_map_accepts_raw_messages_with_their_identity():
    env = envelopes()[0]
    raw = {"v": 1, "id": "01JDZZZZZZZZZZZZZZZZZZZZZZ", "instance": "gw-1", "ts": 1_764_543_353_123_000_000, "hook": env["hook_event_name"], "envelope": env}
    events, err, rc = run_map([json.dumps(raw)])
    assert rc == 0, err
    assert events[0]["time"] == "2025-11-30T22:55:53.123Z"
    assert events[0]["source"].startswith("aep://gw-1/agent/hermes/session/")
    assert events[0]["id"].startswith("01KB")  # ULID time part is the receive time
