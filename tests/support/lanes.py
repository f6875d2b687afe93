"""A session's first event and a session-less event of the same session, for the lane tests
of the mapper (the race across replicas, redelivery)."""

from __future__ import annotations


SESSION = "20261201_101010_abcdef"


TASK = "task-1"


def envelopes(second: str = "approval") -> list[dict]:
    """The session's first event (it teaches the session and its task alias), then an
    approval (CLI `-q` shape: session_key "default", turn_id prefix) or an execute_code inner call."""
    start = {"hook_event_name": "pre_llm_call", "session_id": SESSION, "tool_name": None, "tool_input": None,
             "cwd": "/tmp", "extra": {"task_id": TASK, "turn_id": f"{SESSION}:{TASK}:0a1b2c3d", "model": "m",
                                      "platform": "cli"}}
    approval = {"hook_event_name": "pre_approval_request", "session_id": "", "tool_name": None, "tool_input": None,
                "cwd": "/tmp", "extra": {"command": "rm -rf /", "description": "delete in root path",
                                         "pattern_key": "rm", "session_key": "default", "surface": "cli",
                                         "turn_id": f"{SESSION}:{TASK}:0a1b2c3d", "tool_call_id": "call_1"}}
    inner = {"hook_event_name": "pre_tool_call", "session_id": "", "tool_name": "terminal",
             "tool_input": {"command": "ls"}, "cwd": "/tmp",
             "extra": {"task_id": TASK, "tool_call_id": "", "turn_id": "", "api_request_id": ""}}
    return [start, approval if second == "approval" else inner]
