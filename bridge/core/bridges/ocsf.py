"""AEP -> OCSF 1.8.0 (AEP-0005 §4): the security signal of three families.

`to_ocsf` returns the OCSF record of an event in `CLASS_MAP` (§4.2), or None for every
other type: the control plane, progress, presence, messages and vendor `x.*` traffic have
no OCSF record by design. The record is built from the envelope and the payload that
survives the exporter's `max_capture` (`downlevel.exported_payload`), nothing else:

* `class_uid`, `category_uid`, `activity_id`, `type_uid` = class * 100 + activity;
  `status_id` and `disposition_id` from the table; `time` in epoch milliseconds;
  `severity_id` (§4.4); `message` = the AEP type; `metadata` (OCSF version, uid = id,
  original time, product = agent, `correlation_uid` = cause).
* Authentication (3002): `user.name` = agent, `session.uid` = session.
* Process Activity (1007): `actor.app_name` = agent, `process.name` = subject (+ `uid` =
  the tool call id when the surviving payload carries it), `device` = hostname from the
  `source` URI's authority, else `name` = source.
* Detection Finding (2004): `finding_info` = {uid: the attention request's id (its own id
  on `attention.requested`, the `subject` later), title: type}.
* Dispositions only where the wire asserts the outcome (§4.5): `tool.denied` Blocked,
  `attention.timeout` No Action, `attention.resolved` No Action only with
  `resolution: dismissed`; a record with a disposition declares the `security_control`
  profile. An answered resolution carries none: what the answer meant is not on the wire.
* `unmapped.aep` = the source envelope verbatim (every attribute but `data`),
  `unmapped.data` = the surviving payload (absent when there is none).

Model calls (`x.hermes.api.call`, `x.hermes.api.error`, issue 40) have no record: §4.1 gives
vendor `x.*` traffic none by design, and the pinned 1.8.0 subset carries `ai_model` (the
`ai_operation` profile) only on Process Activity, the class of tool calls, which a model call
is not. Their models and token counts go out in OTLP (`gen_ai.*` attributes).
"""

from __future__ import annotations

import re
from typing import Any

from bridge.core.bridges.common import check_event, envelope, time_ns
from bridge.core.ceiling import METADATA
from bridge.core.downlevel import exported_payload

OCSF_VERSION = "1.8.0"

AUTHENTICATION, PROCESS_ACTIVITY, DETECTION_FINDING = 3002, 1007, 2004

#: OCSF class -> its category (3 Identity & Access Management, 1 System Activity, 2 Findings).
CATEGORY = {AUTHENTICATION: 3, PROCESS_ACTIVITY: 1, DETECTION_FINDING: 2}

BLOCKED, NO_ACTION = 2, 16

#: AEP-0005 §4.2: type -> (class_uid, activity_id, status_id or None, disposition_id or None).
CLASS_MAP: dict[str, tuple[int, int, int | None, int | None]] = {
    "session.started": (AUTHENTICATION, 1, 1, None),  # Logon, Success
    "session.ended": (AUTHENTICATION, 2, 1, None),  # Logoff, Success
    "tool.requested": (PROCESS_ACTIVITY, 1, None, None),  # Launch
    "tool.completed": (PROCESS_ACTIVITY, 2, 1, None),  # Terminate, Success
    "tool.failed": (PROCESS_ACTIVITY, 2, 2, None),  # Terminate, Failure
    "tool.denied": (PROCESS_ACTIVITY, 1, 2, BLOCKED),  # Launch, Failure, Blocked
    "attention.requested": (DETECTION_FINDING, 1, 1, None),  # Create, New
    "attention.answered": (DETECTION_FINDING, 2, 2, None),  # Update, In Progress
    "attention.resolved": (DETECTION_FINDING, 3, 4, None),  # Close, Resolved (+ §4.5)
    "attention.timeout": (DETECTION_FINDING, 3, None, NO_ACTION),  # Close, No Action
}

#: AEP-0005 §4.4: AEP severity -> OCSF severity_id.
SEVERITY_ID = {"debug": 1, "info": 1, "notice": 2, "warning": 3, "error": 4, "critical": 5}

SECURITY_CONTROL = "security_control"

_AUTHORITY = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://([^/?#]+)")


def to_ocsf(event: dict[str, Any], max_capture: int = METADATA) -> dict[str, Any] | None:
    """One AEP event -> its OCSF record (a JSON object), or None outside §4.2."""
    check_event(event)
    mapping = CLASS_MAP.get(event["type"])
    if mapping is None:
        return None
    class_uid, activity_id, status_id, disposition_id = mapping
    data = exported_payload(event, max_capture)

    metadata: dict[str, Any] = {
        "version": OCSF_VERSION,
        "uid": event["id"],
        "original_time": event["time"],
        "product": {"name": event["agent"]},
    }
    if "cause" in event:
        metadata["correlation_uid"] = event["cause"]
    record: dict[str, Any] = {
        "class_uid": class_uid,
        "category_uid": CATEGORY[class_uid],
        "activity_id": activity_id,
        "type_uid": class_uid * 100 + activity_id,
        "time": time_ns(event["time"]) // 1_000_000,
        "severity_id": SEVERITY_ID[event.get("severity", "info")],
        "message": event["type"],
        "metadata": metadata,
    }
    if status_id is not None:
        record["status_id"] = status_id

    if class_uid == AUTHENTICATION:
        record["user"] = {"name": event["agent"]}
        if "session" in event:
            record["session"] = {"uid": event["session"]}
    elif class_uid == PROCESS_ACTIVITY:
        record["actor"] = {"app_name": event["agent"]}
        process: dict[str, Any] = {}
        tool = data.get("tool") if data else None
        name = event.get("subject") or (tool.get("name") if isinstance(tool, dict) else None)
        if isinstance(name, str) and name:
            process["name"] = name
        call_id = tool.get("call_id") if isinstance(tool, dict) else None
        if isinstance(call_id, str) and call_id:
            process["uid"] = call_id
        record["process"] = process
        host = _AUTHORITY.match(event["source"])
        record["device"] = {"type_id": 0, "hostname": host.group(1)} if host else {"type_id": 0, "name": event["source"]}
    else:
        request = event["id"] if event["type"] == "attention.requested" else event.get("subject")
        finding: dict[str, Any] = {"uid": request} if request else {}
        finding["title"] = event["type"]
        record["finding_info"] = finding
        if event["type"] == "attention.resolved" and data and data.get("resolution") == "dismissed":
            disposition_id = NO_ACTION

    if disposition_id is not None:
        record["disposition_id"] = disposition_id
        metadata["profiles"] = [SECURITY_CONTROL]
    unmapped: dict[str, Any] = {"aep": envelope(event)}
    if data:
        unmapped["data"] = data
    record["unmapped"] = unmapped
    return record
