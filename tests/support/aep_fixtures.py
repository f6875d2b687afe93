"""The AEP repository's conformance fixtures, vendored in tests/fixtures/aep/ (README there:
source commit): the golden events, and the pinned OCSF class subset with its check."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "aep"
GOLDEN_PATH = FIX / "golden" / "golden.jsonl"


#: AEP-0005 §4.2, written out here independently of bridge/core/bridges/ocsf.py.
OCSF_TYPES = {
    "session.started", "session.ended",
    "tool.requested", "tool.completed", "tool.failed", "tool.denied",
    "attention.requested", "attention.answered", "attention.resolved", "attention.timeout",
}


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def golden() -> list[dict]:
    return jsonl(GOLDEN_PATH)


@lru_cache(maxsize=1)
def ocsf_classes() -> dict:
    return json.loads((FIX / "ocsf" / "ocsf-classes.json").read_text())


def ocsf_problems(record: dict) -> list[str]:
    """The pinned OCSF class subset: only class attributes, enum-legal ids, derived type_uid."""
    pinned = ocsf_classes()
    cls = pinned["classes"].get(str(record.get("class_uid")))
    if cls is None:
        return [f"class_uid {record.get('class_uid')} is not in the pinned subset"]
    problems = [f"attribute {k!r} is not a class attribute" for k in record if k not in cls["attributes"]]
    if record.get("category_uid") != cls["category_uid"]:
        problems.append(f"category_uid {record.get('category_uid')} != {cls['category_uid']}")
    if str(record.get("activity_id")) not in cls["activity"]:
        problems.append(f"activity_id {record.get('activity_id')} not in the enum")
    if str(record.get("severity_id")) not in cls["severity"]:
        problems.append(f"severity_id {record.get('severity_id')} not in the enum")
    if "status_id" in record and str(record["status_id"]) not in cls["status"]:
        problems.append(f"status_id {record['status_id']} not in the enum")
    if "disposition_id" in record:
        if str(record["disposition_id"]) not in cls["disposition"]:
            problems.append(f"disposition_id {record['disposition_id']} not in the enum")
        if "security_control" not in record.get("metadata", {}).get("profiles", []):
            problems.append("a disposition without the security_control profile")
    if record.get("type_uid") != record.get("class_uid", 0) * 100 + record.get("activity_id", 0):
        problems.append(f"type_uid {record.get('type_uid')} is not class_uid * 100 + activity_id")
    if record.get("metadata", {}).get("version") != pinned["version"]:
        problems.append(f"metadata.version {record.get('metadata', {}).get('version')} != {pinned['version']}")
    return problems
