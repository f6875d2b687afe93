"""AEP-0002 Annex A §A.10 (Hermes): every pinned vector reproduces through `aep-bridge map`.

The vectors are written from the spec text (input envelope -> [{type, data, subject}] at
the default posture: capture metadata, attention.* redacted). They run through the real
command line, one JSON Lines file, and the output is projected to {type, data, subject}.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bridge.core.digest import digest

SESSION = "s_fix_1"
TURN1 = "s_fix_1:t1:aaaa1111"
TURN2 = "s_fix_1:t2:bbbb2222"


def env(hook, extra=None, tool_name=None, tool_input=None, session=SESSION):
    e = {"telemetry_schema_version": "hermes.observer.v1"}
    e.update(extra or {})
    return {
        "hook_event_name": hook,
        "tool_name": tool_name,
        "tool_input": tool_input,
        "session_id": session,
        "cwd": "/home/user/proj",
        "extra": e,
    }


def tool_ref(name, call_id):
    return {"name": name, "call_id": call_id}


def clarify_post(call_id, duration, response, question="Q?", offered=("a", "b"), status="ok"):
    result = json.dumps(
        {"question": question, "choices_offered": list(offered), "user_response": response}, separators=(",", ":")
    )
    return env(
        "post_tool_call",
        {"tool_call_id": call_id, "turn_id": TURN1, "duration_ms": duration, "status": status, "result": result},
        tool_name="clarify",
    ), result


APPROVAL = {"command": "sudo make install", "pattern_key": "terminal:sudo", "session_key": SESSION, "surface": "cli", "turn_id": TURN1}
OPTIONS = [
    {"id": "once", "label": "Allow once"},
    {"id": "session", "label": "Allow for this session"},
    {"id": "always", "label": "Add to permanent allowlist"},
    {"id": "deny", "label": "Deny"},
]
CLI_TIMEOUT = "The user did not provide a response within the time limit. Use your best judgement to make the choice and proceed."


def _vectors():
    v = {}
    v["on_session_start"] = (
        env("on_session_start", {"model": "hermes-4", "platform": "cli"}),
        [{"type": "session.started", "data": {"client": {"name": "hermes"}}}],
    )
    v["pre_llm_call"] = (
        env("pre_llm_call", {"turn_id": TURN1, "task_id": "t1", "user_message": "fix the failing build", "is_first_turn": True}),
        [{"type": "run.started", "data": {"trigger": "user", "message_digest": "fcaa85fdd55703139ec7363834c4063a"}}],
    )
    v["pre_tool_call"] = (
        env("pre_tool_call", {"tool_call_id": "tc_1", "turn_id": TURN1}, "terminal", {"command": "npm test"}),
        [{"type": "tool.requested", "data": {"tool": tool_ref("terminal", "tc_1"), "args_digest": "9178ac939ad908d8fd89e97596cdc0e5"}, "subject": "terminal"}],
    )
    v["post_tool_call_ok"] = (
        env("post_tool_call", {"tool_call_id": "tc_1", "turn_id": TURN1, "result": "ok 42 tests", "duration_ms": 812, "status": "ok"}, "terminal"),
        [{"type": "tool.completed", "data": {"tool": tool_ref("terminal", "tc_1"), "duration_ms": 812, "result_digest": "9623cdc86ee0e1f01e338bc35845417f"}, "subject": "terminal"}],
    )
    v["post_tool_call_error"] = (
        env("post_tool_call", {"tool_call_id": "tc_2", "turn_id": TURN1, "status": "error", "error_type": "FileNotFound", "error_message": "no such file", "duration_ms": 4}, "read_file"),
        [{"type": "tool.failed", "data": {"tool": tool_ref("read_file", "tc_2"), "duration_ms": 4, "error": {"type": "FileNotFound"}}, "subject": "read_file"}],
    )
    v["post_tool_call_blocked"] = (
        env("post_tool_call", {"tool_call_id": "tc_3", "turn_id": TURN1, "status": "blocked", "error_message": "blocked by policy hook", "duration_ms": 1}, "terminal"),
        [{"type": "tool.denied", "data": {"tool": tool_ref("terminal", "tc_3"), "duration_ms": 1, "by": "policy"}, "subject": "terminal"}],
    )
    v["pre_approval_request"] = (
        env("pre_approval_request", APPROVAL, session=""),
        [{"type": "attention.requested", "data": {"kind": "permission", "prompt": "Approval requested: sudo make install", "options": OPTIONS, "respond_via": ["oob"]}, "subject": "terminal:sudo"}],
    )
    v["post_approval_response_deny"] = (
        env("post_approval_response", {**APPROVAL, "choice": "deny"}, session=""),
        [{"type": "attention.answered", "data": {"answer": {"option": "deny"}, "via": "oob"}, "subject": "terminal:sudo"}],
    )
    v["post_approval_response_timeout"] = (
        env("post_approval_response", {**APPROVAL, "command": "curl x | sh", "pattern_key": "terminal:curl", "choice": "timeout"}, session=""),
        [{"type": "attention.timeout", "data": {}, "subject": "terminal:curl"}],
    )
    v["on_session_end_completed"] = (
        env("on_session_end", {"turn_id": TURN1, "task_id": "t1", "completed": True, "interrupted": False}),
        [{"type": "run.finished", "data": {}}],
    )
    v["on_session_end_interrupted"] = (
        env("on_session_end", {"turn_id": TURN2, "task_id": "t2", "completed": False, "interrupted": True}),
        [{"type": "run.cancelled", "data": {"by": "user"}}],
    )
    v["subagent_start"] = (
        env("subagent_start", {"parent_session_id": SESSION, "parent_turn_id": TURN1, "child_session_id": "s_fix_1_sub", "child_role": "researcher", "child_goal": "find the flaky test"}),
        [{"type": "delegation.subagent.started", "data": {"child": {"session": "s_fix_1_sub"}, "role": "researcher"}, "subject": "s_fix_1_sub"}],
    )
    v["subagent_stop"] = (
        env("subagent_stop", {"parent_session_id": SESSION, "parent_turn_id": TURN1, "child_session_id": "s_fix_1_sub", "child_role": "researcher", "child_status": "ok", "child_summary": "found it", "duration_ms": 5100}),
        [{"type": "delegation.subagent.stopped", "data": {"child": {"session": "s_fix_1_sub"}, "status": "ok", "duration_ms": 5100}, "subject": "s_fix_1_sub"}],
    )
    v["api_request_error"] = (
        env("api_request_error", {"turn_id": TURN2, "status_code": 429, "retry_count": 3, "reason": "rate_limited", "error": {"type": "RateLimit", "message": "slow down"}}),
        [{"type": "x.hermes.api.error", "data": {"status_code": 429, "retry_count": 3, "reason": "rate_limited"}}],
    )
    v["on_session_finalize"] = (
        env("on_session_finalize", {"reason": "shutdown", "platform": "cli"}),
        [{"type": "session.ended", "data": {"reason": "normal"}}],
    )
    v["on_session_reset"] = (
        env("on_session_reset", {"reason": "new_session", "platform": "cli"}),
        [{"type": "x.hermes.session.reset", "data": {"reason": "new_session"}}],
    )
    choices_in = [" staging ", {"description": "production"}, "", "staging-eu", "extra-5th", "extra-6th"]
    args = {"question": "Which deployment target?", "choices": choices_in}
    v["clarify_pre_choices"] = (
        env("pre_tool_call", {"tool_call_id": "tc_c1", "turn_id": TURN1}, "clarify", args),
        [
            {"type": "tool.requested", "data": {"tool": tool_ref("clarify", "tc_c1"), "args_digest": "bc093e95015241bcbb7e511880e8a5b1"}, "subject": "clarify"},
            {
                "type": "attention.requested",
                "data": {
                    "kind": "form",
                    "prompt": "hermes asks a question",
                    "fields": [{
                        "id": "1", "type": "select", "label": "Which deployment target?", "required": True, "other": True,
                        "choices": [{"id": "1", "label": "staging"}, {"id": "2", "label": "production"}, {"id": "3", "label": "staging-eu"}, {"id": "4", "label": "extra-5th"}],
                    }],
                    "respond_via": ["oob"],
                },
                "subject": "tc_c1",
            },
        ],
    )
    v["clarify_pre_open"] = (
        env("pre_tool_call", {"tool_call_id": "tc_c2", "turn_id": TURN1}, "clarify", {"question": "Anything else?"}),
        [
            {"type": "tool.requested", "data": {"tool": tool_ref("clarify", "tc_c2"), "args_digest": "b67719229b314e0945fd73c4831d3ef6"}, "subject": "clarify"},
            {"type": "attention.requested", "data": {"kind": "form", "prompt": "hermes asks a question", "fields": [{"id": "1", "type": "string", "label": "Anything else?", "required": True}], "respond_via": ["oob"]}, "subject": "tc_c2"},
        ],
    )
    v["clarify_pre_questionless"] = (
        env("pre_tool_call", {"tool_call_id": "tc_c3", "turn_id": TURN1}, "clarify", {}),
        [{"type": "tool.requested", "data": {"tool": tool_ref("clarify", "tc_c3"), "args_digest": "44136fa355b3678a1146ad16f7e8649e"}, "subject": "clarify"}],
    )

    def post_case(name, duration, response, follow, offered=("a", "b"), question="Q?"):
        e, result = clarify_post("tc_c1", duration, response, question, offered)
        v[name] = (e, [
            {"type": "tool.completed", "data": {"tool": tool_ref("clarify", "tc_c1"), "duration_ms": duration, "result_digest": digest(result)}, "subject": "clarify"},
            {**follow, "subject": "tc_c1"},
        ])

    post_case("clarify_post_choice", 2100, "staging-eu", {"type": "attention.answered", "data": {"answer": {"values": {"1": "3"}}, "via": "oob"}},
              offered=("staging", "production", "staging-eu", "extra-5th"), question="Which deployment target?")
    post_case("clarify_post_other", 900, "ship them both", {"type": "attention.answered", "data": {"answer": {"values": {"1": "ship them both"}}, "via": "oob"}},
              offered=("yes", "no"), question="Ship now?")
    post_case("clarify_post_cli_timeout", 120000, CLI_TIMEOUT, {"type": "attention.timeout", "data": {}})
    post_case("clarify_post_gateway_timeout", 600000, "[user did not respond within 10m]", {"type": "attention.timeout", "data": {}})
    post_case("clarify_post_cancel", 3000, "The user cancelled. Use your best judgement to proceed.", {"type": "attention.resolved", "data": {"resolution": "dismissed"}})
    post_case("clarify_post_undeliverable", 15000, "[clarify prompt could not be delivered]", {"type": "attention.resolved", "data": {"resolution": "dismissed"}})
    v["clarify_post_blocked"] = (
        env("post_tool_call", {"tool_call_id": "tc_c1", "turn_id": TURN1, "duration_ms": 1, "status": "blocked", "error_message": "blocked by policy hook"}, "clarify"),
        [
            {"type": "tool.denied", "data": {"tool": tool_ref("clarify", "tc_c1"), "duration_ms": 1, "by": "policy"}, "subject": "clarify"},
            {"type": "attention.resolved", "data": {"resolution": "dismissed"}, "subject": "tc_c1"},
        ],
    )
    v["fallback_pre_verify"] = (
        env("pre_verify", {"turn_id": TURN2}),
        [{"type": "x.hermes.pre.verify", "data": {}}],
    )
    return v


VECTORS = _vectors()


@pytest.fixture(scope="module")
def mapped(tmp_path_factory):
    """Run every vector through the real CLI in one go; lines map 1:1 to vectors."""
    path = tmp_path_factory.mktemp("annex") / "in.jsonl"
    names = list(VECTORS)
    # A session-start line first, so the approval vectors resolve to a known session.
    lines = [json.dumps(VECTORS["on_session_start"][0])] + [json.dumps(VECTORS[n][0]) for n in names]
    path.write_text("\n".join(lines) + "\n")
    proc = subprocess.run(
        [sys.executable, "-m", "bridge.cli", "map", str(path), "--instance", "fixture"],
        capture_output=True, check=False,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    by_line: dict[int, list[dict]] = {}
    for line in proc.stdout.splitlines():
        event = json.loads(line)
        by_line.setdefault(event["seq"] // 1024, []).append(event)
    return {name: by_line.get(i + 2, []) for i, name in enumerate(names)}


def project(event: dict) -> dict:
    out = {"type": event["type"], "data": event.get("data", {})}
    if "subject" in event:
        out["subject"] = event["subject"]
    return out


@pytest.mark.parametrize("name", list(VECTORS))
def test_pinned_vector(mapped, name):
    assert [project(e) for e in mapped[name]] == VECTORS[name][1]


@pytest.mark.parametrize("name", ["pre_approval_request", "post_approval_response_deny"])
def test_approvals_land_on_the_session_lane(mapped, name):
    assert {e["session"] for e in mapped[name]} == {SESSION}


def test_default_posture_labels_capture(mapped):
    assert {e["capture"] for e in mapped["pre_tool_call"]} == {"metadata"}
    assert {e["capture"] for e in mapped["pre_approval_request"]} == {"redacted"}
