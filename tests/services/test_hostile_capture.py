"""Hostile input against the capture policy (issue 13, findings 8, 9, 16, 18).

* 9: the redaction pipeline at `redacted` (the vendored AEP-0003 §9.4 corpus is the
  oracle, plus the gaps the issue found: `curl -u`, `mysql -p`, bearer tokens without a
  digit, values under secret-named keys, a PEM block cut before its END line, `AKIA…`
  after `_`), adversarial megabyte strings (they must complete: no catastrophic regex),
  and the ceiling: `--capture L` is the most any event carries; an override above it is
  clamped, with a warning.
* 16: `aep-bridge map` reports a line it cannot map (line number, reason) and goes on.
* 8 and 18 need NATS: the dead letter carries no more than the ceiling allows, and the
  metrics' label sets stay bounded whatever the raw stream holds (real nats-server, real
  mapper and pairing processes).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import msgspec
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from bridge.core.ceiling import CapturePolicy
from bridge.core.redaction import Redactor
from bridge.core.lanes import MemoryLanes
from bridge.core.pipeline import map_record, record_from_line
from tests.corpus import corpus_path

CASES = json.loads((Path(__file__).parents[1] / "fixtures" / "aep" / "redaction-cases.json").read_text())
SECRET = "[REDACTED:secret]"


def redactor_for(opts: dict) -> Redactor:
    return Redactor(secret_values=tuple(opts.get("secretValues", ())), home=opts.get("home", ""), pii=opts.get("pii", True))


# ---------------------------------------------------------------- 9: the AEP corpus as oracle


@pytest.mark.parametrize("case", CASES["text_cases"], ids=[c["name"] for c in CASES["text_cases"]])
def test_aep_redaction_corpus_text(case):
    out = redactor_for(case.get("opts", {})).text(case["input"])
    for gone in case.get("must_not_contain", []):
        assert gone not in out, out
    for kept in case.get("must_contain", []):
        assert kept in out, out


@pytest.mark.parametrize("case", CASES["value_cases"], ids=[c["name"] for c in CASES["value_cases"]])
def test_aep_redaction_corpus_values(case):
    out = json.dumps(redactor_for(case.get("opts", {})).value(case["input"]))
    for gone in case.get("must_not_contain", []):
        assert gone not in out, out
    for kept in case.get("must_contain", []):
        assert kept in out, out


# ---------------------------------------------------------------- 9: the gaps the issue found

GAPS = [
    ("curl -u", "curl -u deploy:Hunter2Pass https://api.example.test/v1", "Hunter2Pass", "curl -u deploy:"),
    ("curl --user=", "curl --user=deploy:Hunter2Pass https://x.test", "Hunter2Pass", "https://x.test"),
    ("mysql -p", "mysql -h db -u root -pSECRETPASS mydb", "SECRETPASS", "mydb"),
    ("mysqldump -p quoted", "mysqldump -uroot -p'S3cret pass' db > x.sql", "S3cret pass", "db > x.sql"),
    ("bearer without a digit", "curl -H 'Authorization: Bearer abcdefghijklmnopqrstuvwx' https://x.test", "abcdefghijklmnopqrstuvwx", "curl"),
    ("bare Bearer without a digit", "use Bearer ZmFrZXRva2VudmFsdWVzaGFwZQ for it", "ZmFrZXRva2VudmFsdWVzaGFwZQ", "for it"),
    ("Basic without a digit", "Authorization: Basic dXNlcjpwYXNz", "dXNlcjpwYXNz", "Authorization"),
    ("X-Api-Key header", "curl -H 'X-Api-Key: plainkeyvalue' https://x.test", "plainkeyvalue", "https://x.test"),
    ("AWS secret env", "AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY aws s3 ls", "wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY", "aws s3 ls"),
    ("JSON in a string", '{"password": "correct horse battery", "user": "bob"}', "correct horse battery", "bob"),
    ("JSON authorization in a string", '{"authorization": "Basic dXNlcjpwYXNz"}', "dXNlcjpwYXNz", "authorization"),
    ("PEM cut before END", "key:\n-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\nQUJDREVGR0hJSktM", "b3BlbnNzaC1rZXktdjEAAAAA", "key:"),
    ("PEM cut, second line", "-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA7bq\nZzz999ZZ", "Zzz999ZZ", SECRET),
    ("AKIA after _", "AWS_KEY_AKIAIOSFODNN7EXAMPLE set", "AKIAIOSFODNN7EXAMPLE", "set"),
    ("AKIA before _", "id=AKIAIOSFODNN7EXAMPLE_old", "AKIAIOSFODNN7EXAMPLE", "id"),
    ("URL credentials", "git clone https://bob:Sup3rS3cret@git.example.test/r.git", "Sup3rS3cret", "git.example.test/r.git"),
    ("X-Authorization", 'curl -H "X-Authorization: plainheadervalue" https://x.test', "plainheadervalue", "https://x.test"),
    ("password flag with a space", "docker login -u bob --password Tr0ub4dor registry.test", "Tr0ub4dor", "registry.test"),
]


@pytest.mark.parametrize("name,text,gone,kept", GAPS, ids=[g[0] for g in GAPS])
def test_redaction_gaps(name, text, gone, kept):
    out = Redactor().text(text)
    assert gone not in out, out
    assert kept in out, out


SECRET_KEYS = ["password", "secret", "token", "api_key", "X-Api-Key", "authorization", "AWS_SECRET_ACCESS_KEY",
               "client_secret", "Passwd", "privateKey", "accessToken", "Cookie"]


def test_values_under_secret_named_keys_are_redacted():
    value = {"args": {k: f"plain{i}value" for i, k in enumerate(SECRET_KEYS)}, "region": "eu-west-1",
             "headers": [{"name": "X-Api-Key", "value": "headerlistvalue"}, {"name": "Accept", "value": "text/html"}],
             "nested": {"credentials": {"user": "bob", "pass": "deepvalue"}, "secrets": ["listvalue"]},
             "usage": {"input_tokens": 512, "max_tokens": 1024}, "access_tokens": ["tokenlistvalue"], "tokenizer": "cl100k"}
    out = json.dumps(Redactor().value(value))
    for i in range(len(SECRET_KEYS)):
        assert f"plain{i}value" not in out, (SECRET_KEYS[i], out)
    for gone in ("headerlistvalue", "deepvalue", "listvalue", "tokenlistvalue"):
        assert gone not in out, out
    for kept in ("eu-west-1", "text/html", "512", "1024", "cl100k"):
        assert kept in out, out


def test_a_mapped_event_at_redacted_keeps_no_secret():
    """Through the mapping itself: tool arguments at `redacted`."""
    env = {"hook_event_name": "pre_tool_call", "session_id": "s1", "tool_name": "terminal",
           "tool_input": {"command": "curl -u ops:Hunter2Pass https://x.test && mysql -pSECRETPASS",
                          "env": {"API_KEY": "plainkeyvalue", "AWS_SECRET_ACCESS_KEY": "awsplainvalue"}},
           "extra": {"telemetry_schema_version": "hermes.observer.v1"}}
    policy = CapturePolicy(default="redacted", overrides={})
    result = map_record(record_from_line(env, 1, "i", 0), 1, 0, MemoryLanes(), policy)
    out = b"".join(msgspec.json.encode(e) for e in result.events).decode()
    assert "curl -u ops:" in out, "the command stays readable"
    for gone in ("Hunter2Pass", "SECRETPASS", "plainkeyvalue", "awsplainvalue"):
        assert gone not in out, out


def test_deep_structures_are_redacted_without_recursion_errors():
    deep: object = {"password": "deepsecretvalue"}
    for _ in range(5000):
        deep = {"k": [deep]}
    out = json.dumps(Redactor().value(deep))
    assert "deepsecretvalue" not in out


ADVERSARIAL = {
    "letters": "a" * 1_000_000,
    "dash-eyJ": "eyJ-" * 250_000,
    "dot-eyJ": "eyJa." * 200_000,
    "email-local": "a." * 500_000 + "@",
    "email-domain": "a@" + "a." * 500_000,
    "pem-labels": "-----BEGIN " + "KEY " * 250_000,
    "pem-begins": "-----BEGIN RSA PRIVATE KEY-----\n" * 30_000,
    "pem-ends": ("QUJDREVGR0hJSktMTU5PUA==\n" * 20 + "-----END X-----\n") * 2_000,
    "base64-lines": "QUJDREVGR0hJSktMTU5PUA==\n" * 40_000,
    "kv-quotes": 'password="' * 100_000,
    "kv-spaces": "password" + " " * 1_000_000,
    "bearer": "bearer " * 150_000,
    "home": "/home/" + "." * 1_000_000,
    "url": "https://" + "a:" * 500_000,
    "curl-u": "-u a:" * 200_000,
    "mysql": "mysql " + "-p" * 500_000,
    "digits": "1 " * 500_000,
    "underscores": "_" * 1_000_000,
    "akia": "_AKIA" * 200_000,
}


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_megabyte_adversarial_strings_complete(name):
    """Runs the pipeline on 1 MB built to make a backtracking regex quadratic; it must just
    finish (the figure is printed, not asserted)."""
    text = ADVERSARIAL[name]
    started = time.perf_counter()
    out = Redactor().text(text)
    print(f"{name}: {len(text)} chars redacted in {time.perf_counter() - started:.3f} s")
    assert isinstance(out, str) and len(out) > 0


# ---------------------------------------------------------------- 9: the ceiling


def run_map(*args: str, input_path: Path | None = None, env: dict | None = None) -> tuple[list[dict], str, int]:
    import os

    proc = subprocess.run([sys.executable, "-m", "bridge.cli", "map", str(input_path or corpus_path()), *args],
                          capture_output=True, env={**os.environ, "AEP_BRIDGE_CONFIG": os.devnull, **(env or {})})
    events = [json.loads(line) for line in proc.stdout.splitlines()]
    return events, proc.stderr.decode(), proc.returncode


def test_capture_none_is_a_ceiling_the_default_override_cannot_beat():
    events, err, rc = run_map("--capture", "none")
    assert rc == 0, err
    assert any(e["type"].startswith("attention.") for e in events)
    assert {e["capture"] for e in events} == {"none"}, "attention=redacted (the default override) went above --capture none"


def test_capture_metadata_set_explicitly_means_no_free_text_anywhere():
    events, err, rc = run_map(env={"AEP_BRIDGE_CAPTURE": "metadata"})
    assert rc == 0, err
    assert {e["capture"] for e in events} == {"metadata"}


def test_an_override_above_the_ceiling_is_clamped_with_a_warning():
    events, err, rc = run_map("--capture", "metadata", "--capture-override", "tool=full")
    assert rc == 0, err
    tools = [e for e in events if e["type"].startswith("tool.")]
    assert tools and {e["capture"] for e in tools} == {"metadata"}
    assert "tool=full" in err and "ceiling" in err, err


def test_the_default_posture_is_unchanged():
    events, err, rc = run_map()
    assert rc == 0 and "warning" not in err, err
    assert {e["capture"] for e in events if e["type"].startswith("attention.")} == {"redacted"}
    assert {e["capture"] for e in events if not e["type"].startswith("attention.")} == {"metadata"}


# ---------------------------------------------------------------- 16: `aep-bridge map` on hostile lines


def test_map_reports_a_bad_line_and_goes_on(tmp_path):
    path = tmp_path / "hostile.jsonl"
    raw_huge_ts = {"v": 1, "id": "01JZZZZZZZZZZZZZZZZZZZZZZZ", "instance": "i", "ts": 2**80, "hook": "on_session_start",
                   "envelope": {"hook_event_name": "on_session_start", "session_id": "s1"}}
    deep = '{"hook_event_name":"on_session_start","session_id":"s2","extra":' + "[" * 100_000 + "]" * 100_000 + "}"
    good = {"hook_event_name": "on_session_start", "session_id": "s3"}
    path.write_text("\n".join([json.dumps(raw_huge_ts), deep, json.dumps(good), "{not json"]) + "\n")
    events, err, rc = run_map(input_path=path)
    assert "Traceback" not in err, err
    assert rc == 1, "some lines failed: exit 1"
    assert [e["session"] for e in events] == ["s3"], "the good line after the bad ones is mapped"
    for n in (1, 2, 4):
        assert re.search(rf"line {n}: [a-z_]+: ", err), err
    assert "3 line(s) could not be mapped" in err


# ---------------------------------------------------------------- 8: dead letters and the ceiling


def test_a_dead_letter_keeps_no_more_than_the_ceiling_allows(nats_server_fn, tmp_path):
    """Real nats-server, real mapper and pairing at the default capture: a raw message the
    mapper cannot map, one with a held call's reply inbox in its headers, and a mapped
    message pairing cannot read are dead-lettered with their reason and position, and no
    free text, secret or inbox of theirs reaches BRIDGE_DLQ."""
    from tests.natsfixture import JetStreamClient
    from tests.support.services import Service, wait_for

    client = JetStreamClient(nats_server_fn.url)
    client.bootstrap()
    mapper = Service("mapper", nats_server_fn.url, tmp_path).start()
    (tmp_path / "p").mkdir()
    pairing = Service("pairing", nats_server_fn.url, tmp_path / "p").start()
    now = time.time_ns()
    invalid = {"v": 1, "id": "01JH0ST1EE0000000000000001", "instance": "gw1", "ts": now, "hook": "_invalid",
               "error": "not_json: Expecting value",
               "raw": "my plan CANARY-PLAN-1, https://bob:CANARYPASS1@git.test and password=CANARYPW1",
               "raw_encoding": "utf-8", "raw_bytes": 90}
    no_hook = {"v": 1, "id": "01JH0ST1EE0000000000000002", "instance": "gw1", "ts": now, "hook": "pre_tool_call",
               "envelope": {"tool_name": "terminal", "tool_input": {"password": "CANARYPW2", "command": "echo CANARY-CMD-2"},
                            "extra": {"user_message": "free text CANARY-MSG-2", "result": "tool output CANARY-RES-2"}}}
    # The shim's error code names the DLQ subject: a publisher's text there must not.
    coded = {**invalid, "id": "01JH0ST1EE0000000000000004", "error": "password=CANARYPW4: x"}
    held = {"Nats-Msg-Id": no_hook["id"], "Aep-Gate-Reply": "_INBOX.abcdefabcdef.g", "Aep-Gate-Hold-Ms": "55000",
            "X-Reply-To": "_INBOX.zzz", "X-Note": "CANARY-HDR-2"}
    try:
        client.run(client.js.publish("hermes.raw.gw1._invalid", json.dumps(invalid).encode(), headers={"Nats-Msg-Id": invalid["id"]}))
        client.run(client.js.publish("hermes.raw.gw1.pre_tool_call", json.dumps(no_hook).encode(), headers=held))
        client.run(client.js.publish("hermes.raw.gw1._invalid", json.dumps(coded).encode(), headers={"Nats-Msg-Id": coded["id"]}))
        client.run(client.js.publish("bridge.mapped.0.s1", b"not an event CANARY-MAPPED-3"))
        wait_for(lambda: client.stream_info("BRIDGE_DLQ").state.messages >= 4, 60, what="four dead letters")
        dlq = client.fetch("bridge.dlq.>", stream="BRIDGE_DLQ", expected=4, timeout=10)
        raw = {m.seq: m for m in client.fetch("hermes.raw.>", expected=3, timeout=10)}
        for m in dlq:
            everything = m.subject.encode() + m.data + json.dumps(dict(m.headers or {})).encode()
            assert b"CANARY" not in everything, everything
            assert b"_INBOX" not in everything and b"Aep-Gate-Reply" not in everything, everything
            letter = json.loads(m.data)
            assert letter["reason"] == m.headers["Bridge-Dlq-Reason"] and letter["capture"] == "metadata"
            assert "content" not in letter and "content_text" not in letter
            assert letter["original"]["bytes"] > 0 and len(letter["original"]["sha256"]) == 32
        by_reason = {m.headers["Bridge-Dlq-Reason"]: m for m in dlq}
        assert set(by_reason) == {"shim_not_json", "shim_invalid", "no_hook", "bad_mapped"}
        for reason, rid in (("shim_not_json", invalid["id"]), ("no_hook", no_hook["id"]), ("shim_invalid", coded["id"])):
            m = by_reason[reason]
            letter = json.loads(m.data)
            seq = int(m.headers["Bridge-Raw-Seq"])
            assert letter["original"] | {"seq": seq, "id": rid, "stream": "HERMES_RAW"} == letter["original"]
            assert letter["original"]["subject"] == m.headers["Bridge-Raw-Subject"] == raw[seq].subject
            assert letter["original"]["sha256"] == hashlib.sha256(raw[seq].data).hexdigest()[:32]
            assert m.headers["Bridge-Raw-Id"] == rid
        assert by_reason["no_hook"].headers["Bridge-Orig-Aep-Gate-Hold-Ms"] == "55000"
        assert by_reason["bad_mapped"].headers["Bridge-Stage"] == "pairing"
        assert json.loads(by_reason["bad_mapped"].data)["original"]["stream"] == "BRIDGE_MAPPED"
        assert mapper.alive() and pairing.alive()
    finally:
        assert mapper.terminate() == 0, mapper.log()
        pairing.terminate()
        client.close()


@pytest.mark.parametrize("level", ["none", "metadata", "redacted", "full"])
def test_dead_letter_levels(level):
    from bridge.core import deadletter
    from bridge.core.ceiling import configure

    policy, _ = configure(level, "")
    data = json.dumps({"v": 1, "id": "01JX", "hook": "_invalid", "raw": "say hi; password=pw12345678 to bob@example.test"}).encode()
    headers = {"Nats-Msg-Id": "01JX", "Aep-Gate-Reply": "_INBOX.x.g", "Reply-Inbox": "y", "X-Other": "_inbox.z",
               "Aep-Gate-Hold-Ms": "1000", "X-Note": "note text"}
    letter = deadletter.build("mapper", "shim_not_json", "shim_not_json", "not_json: at 'password=pw12345678'",
                              deadletter.Original("HERMES_RAW", 9, "hermes.raw.i._invalid", data, headers), policy)
    body = json.loads(letter.body)
    assert body["capture"] == level and body["original"]["id"] == "01JX" and body["original"]["seq"] == 9
    copied = {k for k in letter.headers if k.startswith("Bridge-Orig-")}
    assert not any(re.search("reply|inbox", k, re.I) or re.search("inbox", v, re.I) for k, v in letter.headers.items() if k in copied)
    everything = json.dumps([body, letter.headers])
    if level in ("none", "metadata"):
        assert "content" not in body and "say hi" not in everything and "note text" not in everything
        assert body["error"] == "shim_not_json" and copied == {"Bridge-Orig-Aep-Gate-Hold-Ms"}
    elif level == "redacted":
        assert "say hi" in body["content"]["raw"] and "pw12345678" not in everything and "bob@example.test" not in everything
        assert "Bridge-Orig-X-Note" in copied
    else:
        assert body["content"] == json.loads(data) and "pw12345678" in body["error"]


# ---------------------------------------------------------------- 18: metric label cardinality


def series(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(name + "{")]


def test_metric_labels_stay_bounded_whatever_the_raw_stream_holds(nats_server_fn, tmp_path):
    """5,000 raw messages, each with its own instance, hook name and drift value, and 100
    distinct shim error codes: the mapper's series stay bounded (known values, a few
    admitted, the rest `other`)."""
    from bridge.core.aep import PAYLOAD_TYPES
    from bridge.core.mapping import HOOKS
    from tests.support.cli import free_port
    from bridge.services import mapper as mapper_service
    from tests.natsfixture import JetStreamClient
    from tests.support.services import Service, wait_for

    client = JetStreamClient(nats_server_fn.url)
    client.bootstrap()
    port = free_port()
    mapper = Service("mapper", nats_server_fn.url, tmp_path, "--metrics-port", str(port)).start()
    MAX_INSTANCE_SERIES = getattr(mapper_service, "MAX_INSTANCE_SERIES", 4096)
    n, now = MAX_INSTANCE_SERIES + 904, time.time_ns()

    async def load() -> None:
        futures = []
        for i in range(n):
            env = {"hook_event_name": f"hook_{i}_x", "session_id": f"s{i}", "extra": {"telemetry_schema_version": f"v{i}"}}
            body = {"v": 1, "id": f"01JCARD{i:019d}", "instance": f"inst{i}", "ts": now + i, "hook": env["hook_event_name"], "envelope": env}
            futures.append(await client.js.publish_async(f"hermes.raw.inst{i}.hook_{i}_x", json.dumps(body).encode()))
        for i in range(100):
            body = {"v": 1, "id": f"01JBAD{i:020d}", "instance": "bad", "ts": now, "hook": "_invalid", "error": f"zz{i}: x",
                    "raw": "x", "raw_encoding": "utf-8", "raw_bytes": 1}
            futures.append(await client.js.publish_async("hermes.raw.bad._invalid", json.dumps(body).encode()))
        await asyncio.gather(*futures)

    def metrics() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return r.read().decode()

    def raw_total() -> float:
        try:
            return sum(float(line.rsplit(" ", 1)[1]) for line in series(metrics(), "aep_bridge_mapper_raw_messages_total"))
        except OSError:
            return 0.0

    try:
        client.run(load())
        wait_for(lambda: raw_total() >= n, 120, what=f"{n} raw messages counted")
        wait_for(lambda: len(series(metrics(), "aep_bridge_dead_letters_total")) > 0, 30, what="dead letters counted")
        text = metrics()
        hooks = series(text, "aep_bridge_mapper_raw_messages_total")
        types = series(text, "aep_bridge_mapper_events_total")
        drift = series(text, "aep_bridge_mapper_drift_total")
        instances = series(text, "aep_bridge_mapper_hermes_instance_last_seen_timestamp_seconds")
        reasons = series(text, "aep_bridge_dead_letters_total")
        print(f"series: hooks {len(hooks)}, types {len(types)}, drift {len(drift)}, instances {len(instances)}, reasons {len(reasons)}")
        assert len(hooks) <= len(HOOKS) + 1 + 16 + 1 and any('hook="other"' in s for s in hooks)
        assert len(types) <= len(PAYLOAD_TYPES) + 1 and any('type="other"' in s for s in types)
        assert len(drift) <= 1 + 8 + 1 and any('seen="other"' in s for s in drift)
        assert len(instances) <= MAX_INSTANCE_SERIES + 1 and any('hermes_instance="other"' in s for s in instances)
        assert len(reasons) <= 16 + 1 + 1, reasons
        assert mapper.alive()
    finally:
        assert mapper.terminate() == 0, mapper.log()
        client.close()


def test_pairing_and_gate_metric_labels_are_bounded():
    from bridge.core.aep import PAYLOAD_TYPES
    from bridge.services.gate.config import GateMetrics
    from bridge.services.pairing import PairingMetrics

    registry = CollectorRegistry()
    pairing = PairingMetrics(registry, 8)
    gate = GateMetrics(registry)
    for i in range(1000):
        pairing.event_out(f"x.hermes.hook{i}").inc()
    pairing.event_out("tool.requested").inc()
    text = generate_latest(registry).decode()
    assert len(series(text, "aep_bridge_pairing_events_total")) == 2, "tool.requested and other"
    for i in range(1000):
        pairing.dead_letter(f"reason_{i}").inc()
        gate.command(f"x.evil.control.c{i}", "dropped").inc()
    text = generate_latest(registry).decode()
    assert len(series(text, "aep_bridge_dead_letters_total")) <= 17
    assert len(series(text, "aep_bridge_gate_commands_total")) == 1
    assert len(PAYLOAD_TYPES) > 10
