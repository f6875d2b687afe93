"""AEP-0005 bridges through `aep-bridge export`: the official pins, exactly, and the real corpus.

The pins are the AEP repository's conformance fixtures, vendored in tests/fixtures/aep/
(README there: source commit). Every check goes through the command, as a consumer would.
"""

from __future__ import annotations

import json
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

from tests.support.aep_fixtures import FIX, GOLDEN_PATH, OCSF_TYPES, golden, jsonl, ocsf_problems

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "bridge" / "data" / "observed_sessions.jsonl"


def run(args: list[str], stdin: bytes | None = None) -> tuple[list[dict], str, int]:
    proc = subprocess.run([sys.executable, "-m", "bridge.cli", *args], input=stdin, capture_output=True, check=False)
    return [json.loads(line) for line in proc.stdout.splitlines()], proc.stderr.decode(), proc.returncode


def export(fmt: str, source: Path | list[dict], *args: str) -> tuple[list[dict], str, int]:
    if isinstance(source, Path):
        return run(["export", "--format", fmt, str(source), *args])
    body = "".join(json.dumps(obj) + "\n" for obj in source).encode()
    return run(["export", "--format", fmt, *args], stdin=body)


# ------------------------------------------------------------------- CloudEvents (§1-2)


def test_cloudevents_forward_reproduces_every_pin():
    pins = jsonl(FIX / "ce-roundtrip" / "ce-expected.jsonl")
    # The pins are the mapping itself: no ceiling (the golden corpus has redacted events).
    out, err, rc = export("cloudevents", GOLDEN_PATH, "--max-capture", "full")
    assert rc == 0 and err == "", err
    assert len(pins) == len(golden()) == len(out) == 64
    mismatches = [i for i, (got, pin) in enumerate(zip(out, pins)) if got != pin]
    assert mismatches == []


def test_cloudevents_inverse_restores_every_golden_event():
    pins = jsonl(FIX / "ce-roundtrip" / "ce-expected.jsonl")
    out, err, rc = export("cloudevents", pins, "--inverse", "--max-capture", "full")
    assert rc == 0 and err == "", err
    assert out == golden()


@pytest.mark.parametrize("case_index", [0, 1, 2])
def test_cloudevents_inbound_cases(case_index):
    case = json.loads((FIX / "ce-roundtrip" / "inbound-cases.json").read_text())["cases"][case_index]
    out, err, rc = export("cloudevents", [case["ce"]], "--inverse")
    assert rc == 0, err
    assert out == [case["expected"]], case["name"]
    if "dropped" in case["name"]:
        assert "warning: dropped attribute 'aep_bad'" in err
    else:
        assert err == ""


def test_foreign_cloudevent_is_out_of_scope():
    foreign = {"specversion": "1.0", "id": "F1", "source": "s", "type": "com.example.thing", "time": "2026-07-03T10:00:00Z"}
    out, err, rc = export("cloudevents", [foreign], "--inverse")
    assert out == [] and rc == 1
    assert "line 1: foreign_type" in err


def test_cloudevents_forward_refuses_an_extension_that_would_overwrite_a_ce_attribute():
    event = dict(golden()[1], aepagentid="someone-else")
    out, err, rc = export("cloudevents", [event])
    assert out == [] and rc == 1 and "bad_extension" in err


# ------------------------------------------------------------------- OTLP (§3)


def test_otlp_reproduces_every_pin():
    pins = json.loads((FIX / "otlp" / "otlp-expected.json").read_text())
    out, err, rc = export("otlp-json", GOLDEN_PATH)  # the pins are at the default max_capture, metadata
    assert rc == 0 and err == "", err
    assert len(out) == 64 and len(pins) == 4
    for index, pin in pins.items():
        assert out[int(index)] == pin, index


def test_otlp_severity_table_and_inverse_buckets():
    from bridge.core.bridges.otlp import SEVERITY, severity_from_number

    levels = ["debug", "info", "notice", "warning", "error", "critical"]
    assert {lvl: SEVERITY[lvl] for lvl in levels} == {
        "debug": ("DEBUG", 5), "info": ("INFO", 9), "notice": ("INFO2", 10),
        "warning": ("WARN", 13), "error": ("ERROR", 17), "critical": ("FATAL", 21),
    }
    buckets = [severity_from_number(n) for n in range(1, 25)]
    assert buckets == ["debug"] * 8 + ["info"] + ["notice"] * 3 + ["warning"] * 4 + ["error"] * 4 + ["critical"] * 4
    assert all(severity_from_number(SEVERITY[lvl][1]) == lvl for lvl in levels)
    events = [dict(golden()[3], severity=lvl) for lvl in levels]
    out, err, rc = export("otlp-json", events)
    assert rc == 0, err
    assert [(r["severity_text"], r["severity_number"]) for r in out] == [SEVERITY[lvl] for lvl in levels]


def from_any_value(value: dict):
    """OTLP/JSON AnyValue -> JSON value (written here from the OTLP/JSON rules, not from the code)."""
    (kind, inner), = value.items() if value else ((None, None),)
    if kind is None:
        return None
    if kind == "intValue":
        assert isinstance(inner, str)  # int64: a decimal string
        return int(inner)
    if kind == "arrayValue":
        return [from_any_value(v) for v in inner["values"]]
    if kind == "kvlistValue":
        return {kv["key"]: from_any_value(kv["value"]) for kv in inner["values"]}
    return inner


def test_otlp_request_carries_the_same_log_records_in_otlp_json():
    records, err, rc = export("otlp-json", GOLDEN_PATH, "--max-capture", "full")
    assert rc == 0, err
    requests, err, rc = export("otlp-json", GOLDEN_PATH, "--max-capture", "full", "--otlp-request")
    assert rc == 0 and err == "", err
    assert len(requests) == len(records) == 64
    for record, request in zip(records, requests):
        (resource_logs,) = request["resourceLogs"]
        assert {kv["key"]: from_any_value(kv["value"]) for kv in resource_logs["resource"]["attributes"]} == record["resource"]
        ((wire,),) = [s["logRecords"] for s in resource_logs["scopeLogs"]]
        assert wire["timeUnixNano"] == str(record["time_unix_nano"])
        assert (wire["eventName"], wire["severityText"], wire["severityNumber"]) == (
            record["event_name"], record["severity_text"], record["severity_number"])
        assert {kv["key"]: from_any_value(kv["value"]) for kv in wire["attributes"]} == record["attributes"]
        assert from_any_value(wire["body"]) == record["body"] if "body" in record else "body" not in wire
        assert (wire.get("traceId"), wire.get("spanId"), wire.get("flags")) == (
            record.get("trace_id"), record.get("span_id"), record.get("flags"))


# ------------------------------------------------------------------- OCSF (§4)


def test_ocsf_reproduces_every_pin_and_only_the_4_2_families_project():
    pins = json.loads((FIX / "ocsf" / "ocsf-expected.json").read_text())
    events = golden()
    out, err, rc = export("ocsf", GOLDEN_PATH)
    assert rc == 0 and err == "", err
    projected = [i for i, e in enumerate(events) if e["type"] in OCSF_TYPES]
    assert len(out) == len(projected) == 19
    by_index = dict(zip(projected, out))
    assert [r["metadata"]["uid"] for r in out] == [events[i]["id"] for i in projected]
    assert len(pins) == 8
    for index, pin in pins.items():
        assert by_index[int(index)] == pin, index
    for i, record in by_index.items():
        assert ocsf_problems(record) == [], (i, record)


def test_ocsf_dispositions_only_where_the_wire_asserts_them():
    events = golden()
    answered = events[9]
    assert answered["type"] == "attention.resolved" and answered["data"]["resolution"] == "answered"
    dismissed = dict(answered, id="01JX9YB9RSV0000000000DISM", data={"resolution": "dismissed"})
    auto = dict(answered, id="01JX9YB9RSV0000000000AUTO", data={"resolution": "auto"})
    out, err, rc = export("ocsf", [answered, dismissed, auto, events[13], events[19]])
    assert rc == 0, err
    assert [r.get("disposition_id") for r in out] == [None, 16, None, 2, 16]
    assert [r["metadata"].get("profiles") for r in out] == [None, ["security_control"], None, ["security_control"], ["security_control"]]
    assert all(ocsf_problems(r) == [] for r in out)


def test_the_class_subset_check_can_fail():
    out, _, _ = export("ocsf", [golden()[3]])
    good = out[0]
    assert ocsf_problems(good) == []
    assert ocsf_problems(dict(good, type_uid=100701)) != []
    assert ocsf_problems(dict(good, tool={"name": "Bash"})) != []
    assert ocsf_problems(dict(good, status_id=7)) != []
    assert ocsf_problems(dict(good, disposition_id=2)) != []  # no security_control profile


# ------------------------------------------------------------------- the ceiling


def test_an_event_at_full_exported_at_metadata_loses_its_free_text():
    canary = "CANARY-free-text: rm -rf /home/alice/secret-project"
    event = dict(golden()[3], capture="full", data={**golden()[3]["data"], "result": canary, "gen_ai.output.text": canary})
    for fmt in ("cloudevents", "otlp-json", "ocsf"):
        out, err, rc = export(fmt, [event])
        assert rc == 0, err
        assert len(out) == 1 and canary not in json.dumps(out), fmt
        out, err, rc = export(fmt, [event], "--max-capture", "full")
        assert rc == 0 and canary in json.dumps(out), fmt
    ce, _, _ = export("cloudevents", [event])
    assert "data" not in ce[0] and "datacontenttype" not in ce[0] and ce[0]["aepcapture"] == "none"
    otlp, _, _ = export("otlp-json", [event])
    assert "body" not in otlp[0] and not any(k.startswith("gen_ai.") for k in otlp[0]["attributes"])
    assert otlp[0]["attributes"]["aep.capture"] == "full"  # the source's claim, as §3.2 maps it
    ocsf, _, _ = export("ocsf", [event])
    assert "data" not in ocsf[0]["unmapped"] and ocsf[0]["process"] == {"name": "Bash"}
    assert ocsf[0]["unmapped"]["aep"]["capture"] == "full"


def test_capture_none_exports_the_envelope_only():
    event = dict(golden()[24], capture="none")  # agent.presence with data {state: online}
    out, err, rc = export("otlp-json", [event], "--max-capture", "full")
    assert rc == 0, err
    assert "body" not in out[0]


# ------------------------------------------------------------------- the command


def test_export_reports_bad_lines_and_keeps_going():
    good = json.dumps(golden()[0])
    no_agent = json.dumps({k: v for k, v in golden()[0].items() if k != "agent"})
    bad_time = json.dumps(dict(golden()[0], time="yesterday"))
    bad_capture = json.dumps(dict(golden()[0], capture="everything"))
    body = "\n".join([good, "{not json", "[1, 2]", no_agent, bad_time, bad_capture, "", good]) + "\n"
    for fmt in ("cloudevents", "otlp-json", "ocsf"):
        out, err, rc = run(["export", "--format", fmt], stdin=body.encode())
        assert rc == 1, fmt
        assert len(out) == 2, fmt
        for line, reason in [(2, "not_json"), (3, "not_object"), (4, "bad_envelope"), (5, "bad_time"), (6, "bad_envelope")]:
            assert f"line {line}: {reason}" in err, (fmt, line, err)
        assert "line 1:" not in err and "line 8:" not in err


def test_inverse_and_otlp_request_belong_to_their_format():
    _, err, rc = run(["export", "--format", "ocsf", "--inverse"], stdin=b"")
    assert rc == 2 and "--inverse" in err
    _, err, rc = run(["export", "--format", "cloudevents", "--otlp-request"], stdin=b"")
    assert rc == 2 and "--otlp-request" in err


# ------------------------------------------------------------------- the real corpus


@lru_cache(maxsize=None)
def corpus_events(capture: str = "metadata") -> tuple[dict, ...]:
    out, err, rc = run(["map", str(CORPUS), "--instance", "gw-1", "--capture", capture])
    assert rc == 0, err
    return tuple(out)


def write_jsonl(path: Path, events: list[dict]) -> Path:
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return path


def test_the_real_corpus_exports_in_every_format(tmp_path):
    events = list(corpus_events())
    assert len(events) > 100
    mapped = write_jsonl(tmp_path / "mapped.jsonl", events)
    ce, err, rc = export("cloudevents", mapped)
    assert rc == 0 and err == "", err
    assert len(ce) == len(events)
    assert all(c["type"] == "dev.aep." + e["type"] and c["id"] == e["id"] for c, e in zip(ce, events))
    assert all(c.get("aepcapture") == "none" for c, e in zip(ce, events) if e.get("capture") == "redacted")
    lossless, err, rc = export("cloudevents", mapped, "--max-capture", "full")
    assert rc == 0 and err == "", err
    back, err, rc = export("cloudevents", lossless, "--inverse", "--max-capture", "full")
    assert rc == 0 and err == "", err
    assert back == events

    otlp, err, rc = export("otlp-json", mapped)
    assert rc == 0 and err == "", err
    assert [r["attributes"]["aep.event_id"] for r in otlp] == [e["id"] for e in events]

    ocsf, err, rc = export("ocsf", mapped)
    assert rc == 0 and err == "", err
    expected = [e for e in events if e["type"] in OCSF_TYPES]
    assert [r["metadata"]["uid"] for r in ocsf] == [e["id"] for e in expected]
    assert {r["class_uid"] for r in ocsf} >= {3002, 1007}
    problems = [(r["metadata"]["uid"], p) for r in ocsf for p in ocsf_problems(r)]
    assert problems == []


def test_the_real_corpus_at_full_exported_at_metadata_has_no_free_text(tmp_path):
    full = list(corpus_events("full"))
    mapped = write_jsonl(tmp_path / "mapped-full.jsonl", full)
    above = [e for e in full if e.get("capture") in ("redacted", "full")]
    assert above, "the corpus mapped at full has content above metadata"

    def strings(value):
        if isinstance(value, str):
            yield value
        elif isinstance(value, dict):
            for v in value.values():
                yield from strings(v)
        elif isinstance(value, list):
            for v in value:
                yield from strings(v)

    envelope_text = {s for e in full for k, v in e.items() if k != "data" for s in strings(v)}
    free_text = {s for e in above for s in strings(e.get("data", {})) if len(s) >= 12 and s not in envelope_text}
    assert free_text
    for fmt in ("cloudevents", "otlp-json", "ocsf"):
        out, err, rc = export(fmt, mapped)
        assert rc == 0, err
        text = "\n".join(json.dumps(r) for r in out)
        leaked = sorted(s for s in free_text if json.dumps(s)[1:-1] in text)
        assert leaked == [], (fmt, leaked[:3])
        out, _, _ = export(fmt, mapped, "--max-capture", "full")
        text = "\n".join(json.dumps(r) for r in out)
        assert any(json.dumps(s)[1:-1] in text for s in free_text), fmt


def paired_corpus() -> list[dict]:
    """The corpus as AEP_EVENTS carries it: mapped, then paired per partition (in process)."""
    import msgspec

    from bridge.core.aep import encode_event
    from bridge.core.ceiling import CapturePolicy
    from bridge.core.lanes import MemoryLanes, lane_token, partition_of
    from bridge.core.pairing import HOUR, PairingState
    from bridge.core.pipeline import map_record, record_from_line

    base_ns = 1_764_543_353_000 * 1_000_000
    policy, lanes, parts = CapturePolicy(), MemoryLanes(), {}
    for n, line in enumerate(CORPUS.read_bytes().splitlines(), start=1):
        record = record_from_line(msgspec.json.decode(line), n, "gw-1", base_ns)
        result = map_record(record, n, 0, lanes, policy)
        lanes.learn(result.learned)
        parts.setdefault(partition_of(lane_token(result.lane), 8), []).extend((ev, dict(result.hints)) for ev in result.events)
    events = []
    for _, messages in sorted(parts.items()):
        state = PairingState()
        for position, (ev, hints) in enumerate(messages, start=1):
            events += state.process(ev, hints, position)
        events += state.tick(base_ns + 24 * HOUR, len(messages) + 1)
    return [json.loads(encode_event(ev)) for ev in events]


def test_ocsf_findings_of_the_paired_corpus_share_the_request_identity(tmp_path):
    events = paired_corpus()
    requests = {e["id"] for e in events if e["type"] == "attention.requested"}
    assert requests
    out, err, rc = export("ocsf", write_jsonl(tmp_path / "paired.jsonl", events))
    assert rc == 0 and err == "", err
    assert [r["metadata"]["uid"] for r in out] == [e["id"] for e in events if e["type"] in OCSF_TYPES]
    findings = [r for r in out if r["class_uid"] == 2004]
    assert {r["message"] for r in findings} >= {"attention.requested", "attention.answered", "attention.resolved"}
    assert [r["finding_info"] for r in findings if r["finding_info"].get("uid") not in requests] == []
    assert {r["finding_info"]["uid"] for r in findings} == requests
    assert [(r["metadata"]["uid"], p) for r in out for p in ocsf_problems(r)] == []
