"""The shim's pure parts, in-process: JSON via _json, digests, ULIDs, tokens, edge trimming,
invalid-input wrapping, payload fitting, configuration, URL parsing."""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bridge import config as bridge_config
from bridge.core import digest as core_digest
from bridge.shim import hook

json_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text()
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5),
    max_leaves=25,
)


def stdlib_canonical(v: object) -> bytes:
    return json.dumps(v, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


# ---------------------------------------------------------------- JSON without the json module


def test_hot_path_imports_no_expensive_modules(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The import budget: a whole invocation (parse, stamp, connect attempt, spool) under
    ``-I -S`` loads none of json, re, os, socket, asyncio, hashlib, ssl, encodings.idna."""
    probe = (
        "import sys\n"
        f"sys.path.insert(0, {str(hook.__file__.rsplit('/', 1)[0])!r})\n"
        "import hook\n"
        "cfg = hook.Config({'AEP_BRIDGE_NATS_URL': 'nats://localhost:1', 'AEP_BRIDGE_CONFIG': '/nonexistent',\n"
        f"                  'AEP_BRIDGE_SPOOL_DIR': {str(tmp_path)!r}, 'AEP_BRIDGE_INSTANCE': 'probe'}})\n"
        "outcome = hook.run(b'{\"hook_event_name\": \"pre_tool_call\", \"extra\": {}}', cfg)\n"
        "bad = sorted({'json', 're', 'os', 'socket', 'asyncio', 'hashlib', 'ssl', 'base64', 'enum',\n"
        "              'encodings.idna', 'urllib.parse'} & set(sys.modules))\n"
        "print(outcome, ','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-I", "-S", "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["spooled"], f"outcome and unexpected imports: {out.stdout.strip()}"


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_json_helpers_match_the_stdlib(value: object) -> None:
    assert hook.dumps(value) == json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    assert hook.canonical(value) == stdlib_canonical(value)
    assert hook.loads(json.dumps(value)) == value
    assert hook.loads(" \n" + json.dumps(value, indent=2) + "\t\r\n") == value


@pytest.mark.parametrize("text", ["", "   ", "[1,", '{"a":1} x', '{"a":1}{"b":2}', "nul", '"\\ud800', "01"])
def test_loads_rejects_what_json_rejects(text: str) -> None:
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    with pytest.raises((ValueError, StopIteration)):
        hook.loads(text)


def test_encode_survives_lone_surrogates() -> None:
    value = {"a": "\ud800x"}
    body = hook.encode(value)
    assert json.loads(body) == value  # ASCII escapes, still the same value


# ---------------------------------------------------------------- digests


@settings(max_examples=200, deadline=None)
@given(json_values)
def test_digest_is_the_architecture_formula(value: object) -> None:
    expected = hashlib.sha256(stdlib_canonical(value)).hexdigest()[:32]
    assert hook.digest(value) == expected
    stub = hook.stub(value)
    assert stub == {"$aep_stub": True, "digest": expected, "bytes": len(stdlib_canonical(value))}


no_float_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**60), 2**60) | st.text(),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(no_float_values)
def test_digest_equals_the_core_digest(value: object) -> None:
    """Shim stubs carry digests the core passes through: both must hash the same bytes."""
    assert hook.digest(value) == core_digest.digest(value)
    assert core_digest.digest(hook.stub(value)) == core_digest.digest(value)


# ---------------------------------------------------------------- identity and subjects


def test_ulid_layout_and_time() -> None:
    ms = int(time.time() * 1000)
    u = hook.ulid(ms, bytes(range(10)))
    assert len(u) == 26 and set(u) <= set(hook._B32)
    n = 0
    for c in u:
        n = n * 32 + hook._B32.index(c)
    assert n >> 80 == ms
    assert n & ((1 << 80) - 1) == int.from_bytes(bytes(range(10)), "big")
    assert hook.ulid(ms) < hook.ulid(ms + 1)  # lexicographic order follows time
    assert hook.ulid() != hook.ulid()


@pytest.mark.parametrize(
    ("value", "token"),
    [
        ("pre_tool_call", "pre_tool_call"),
        ("gw-01", "gw-01"),
        ("host.example.com", "host_example_com"),
        ("a b*c>d", "a_b_c_d"),
        ("é漢", "__"),
        ("", "_"),
        ("x" * 500, "x" * 200),
    ],
)
def test_token(value: str, token: str) -> None:
    assert hook.token(value) == token


def test_subjects_module_shares_the_rule() -> None:
    from bridge.nats import subjects

    assert subjects.raw_subject("my.host", "pre_tool_call") == "hermes.raw.my_host.pre_tool_call"
    assert subjects.raw_filter("my.host") == "hermes.raw.my_host.*"
    assert subjects.token is hook.token


# ---------------------------------------------------------------- edge trimming


LIMIT = 1024


def test_small_envelope_is_untouched_apart_from_drops() -> None:
    env = {
        "hook_event_name": "pre_llm_call",
        "tool_name": None,
        "tool_input": None,
        "session_id": "s",
        "cwd": "/x",
        "extra": {"user_message": "hi", "conversation_history": [{"role": "user"}], "request": {"a": 1}, "x": 1},
    }
    out, dropped, stubbed = hook.trim_envelope(env, LIMIT)
    assert dropped == ["extra.conversation_history", "extra.request"]
    assert stubbed == []
    assert out["extra"] == {"user_message": "hi", "x": 1}
    assert "conversation_history" in env["extra"]  # the input is not modified


def test_stubs_cover_whole_fields_and_single_strings() -> None:
    big = "é" * 800  # 1602 bytes of canonical JSON
    tool_input = {"command": big, "n": 1}
    env = {
        "hook_event_name": "post_tool_call",
        "tool_input": tool_input,
        "session_id": "s",
        "cwd": big,
        "extra": {
            "result": big,
            "user_message": "short",
            "child_summary": big,
            "middleware_trace": [{"note": big, "ok": "small"}],
            "response": "dropped",
            "status": "ok",
        },
    }
    original = json.loads(json.dumps(env))
    out, dropped, stubbed = hook.trim_envelope(env, LIMIT)
    assert env == original
    assert dropped == ["extra.response"]
    assert sorted(stubbed) == sorted(
        ["tool_input", "cwd", "extra.result", "extra.child_summary", "extra.middleware_trace.0.note"]
    )
    # whole-field stub over the ORIGINAL value, digest of its canonical JSON
    assert out["tool_input"] == {"$aep_stub": True, "digest": hook.digest(tool_input), "bytes": len(stdlib_canonical(tool_input))}
    assert out["extra"]["result"]["digest"] == hashlib.sha256(stdlib_canonical(big)).hexdigest()[:32]
    assert out["extra"]["middleware_trace"][0]["ok"] == "small"
    assert out["extra"]["user_message"] == "short"
    assert out["extra"]["status"] == "ok"


def test_whole_field_made_of_small_strings_is_stubbed_whole() -> None:
    tool_input = {f"k{i}": "v" * 100 for i in range(20)}  # no single string is big, the field is
    out, _, stubbed = hook.trim_envelope({"hook_event_name": "pre_tool_call", "tool_input": tool_input}, LIMIT)
    assert stubbed == ["tool_input"]
    assert out["tool_input"]["digest"] == hook.digest(tool_input)


def _record(env: dict, limit: int = 65536) -> hook.Record:
    cfg = hook.Config({"AEP_BRIDGE_INSTANCE": "unit", "AEP_BRIDGE_MAX_FIELD_BYTES": str(limit), "AEP_BRIDGE_CONFIG": "/nonexistent"})
    return hook.build_record(json.dumps(env).encode(), cfg)


def test_record_layout() -> None:
    t0 = time.time_ns()
    rec = _record({"hook_event_name": "on_session_start", "session_id": "s", "extra": {"model": "m"}})
    msg = json.loads(rec.body)
    assert list(msg) == ["v", "id", "instance", "ts", "hook", "envelope"]  # no edge when unchanged
    assert msg["v"] == 1 and msg["id"] == rec.id and msg["instance"] == "unit" and msg["hook"] == "on_session_start"
    assert t0 <= msg["ts"] <= time.time_ns()
    assert rec.subject == "hermes.raw.unit.on_session_start"
    assert b"\n" not in rec.body and b" " not in rec.body.replace(b'"', b"")[:0]


def test_missing_hook_name_keeps_the_envelope() -> None:
    rec = _record({"session_id": "s"})
    msg = json.loads(rec.body)
    assert msg["hook"] == "_unknown" and msg["envelope"] == {"session_id": "s"}


@pytest.mark.parametrize(
    ("data", "code", "encoding"),
    [
        (b"", "empty", "utf-8"),
        (b" \n\t", "empty", "utf-8"),
        (b"not json", "not_json", "utf-8"),
        (b'{"a": 1', "not_json", "utf-8"),
        (b"[1, 2]", "not_object", "utf-8"),
        (b'"text"', "not_object", "utf-8"),
        (b"null", "not_object", "utf-8"),
        (b"\xff\xfe{}", "not_utf8", "base64"),
        (b"[" * 100000, "not_json", "utf-8"),
        (b"1" * 5000, "not_json", "utf-8"),  # over Python's int digit limit
    ],
)
def test_invalid_input_is_wrapped_with_its_reason(data: bytes, code: str, encoding: str) -> None:
    cfg = hook.Config({"AEP_BRIDGE_INSTANCE": "unit", "AEP_BRIDGE_CONFIG": "/nonexistent"})
    rec = hook.build_record(data, cfg)
    msg = json.loads(rec.body)
    assert msg["hook"] == "_invalid" and rec.subject == "hermes.raw.unit._invalid"
    assert msg["error"].startswith(code + ": ")
    assert msg["raw_encoding"] == encoding and msg["raw_bytes"] == len(data)
    raw = msg["raw"]
    if isinstance(raw, dict):  # stubbed because huge
        assert raw["digest"] == hook.digest(data.decode())
    elif encoding == "base64":
        assert base64.b64decode(raw) == data
    else:
        assert raw.encode() == data


def test_huge_invalid_input_is_stubbed() -> None:
    data = b"x" * 200_000
    cfg = hook.Config({"AEP_BRIDGE_INSTANCE": "unit", "AEP_BRIDGE_CONFIG": "/nonexistent"})
    msg = json.loads(hook.build_record(data, cfg).body)
    assert msg["raw"] == {"$aep_stub": True, "digest": hook.digest("x" * 200_000), "bytes": 200_002}
    assert msg["edge"] == {"stubbed": ["raw"]}


# ---------------------------------------------------------------- fitting max_payload


def _walk_stubs(trimmed: object, original: object, path: str = "") -> int:
    """Check every stub against the value at the same place in the original; count them."""
    if isinstance(trimmed, dict) and trimmed.get("$aep_stub") is True:
        assert trimmed["digest"] == hook.digest(original), path
        assert trimmed["bytes"] == len(stdlib_canonical(original)), path
        return 1
    if isinstance(trimmed, dict):
        return sum(_walk_stubs(v, original[k], f"{path}.{k}") for k, v in trimmed.items())
    if isinstance(trimmed, list):
        return sum(_walk_stubs(v, original[i], f"{path}.{i}") for i, v in enumerate(trimmed))
    assert trimmed == original, path
    return 0


@pytest.mark.parametrize("max_payload", [256 * 1024, 64 * 1024, 16 * 1024])
def test_fit_shrinks_until_the_message_fits(max_payload: int) -> None:
    env = {
        "hook_event_name": "post_tool_call",
        "tool_input": {"path": "/x"},
        "session_id": "s",
        "extra": {"notes": ["n%03d" % i + "y" * 30000 for i in range(40)], "result": "ok"},  # 1.2 MB of small-ish strings
    }
    rec = _record(env)
    assert len(rec.body) > max_payload
    hook.fit(rec, max_payload, 65536)
    assert len(rec.body) + len(hook._headers(rec.id)) <= max_payload
    msg = json.loads(rec.body)
    assert msg["edge"]["stubbed"]
    assert _walk_stubs(msg["envelope"], env) >= 1


def test_fit_with_many_tiny_fields_stubs_extra_whole() -> None:
    env = {"hook_event_name": "pre_llm_call", "session_id": "s", "extra": {f"k{i}": i for i in range(20000)}}
    rec = _record(env)
    hook.fit(rec, 8192, 65536)
    msg = json.loads(rec.body)
    assert len(rec.body) + len(hook._headers(rec.id)) <= 8192
    assert msg["envelope"]["extra"] == hook.stub(env["extra"])
    assert msg["envelope"]["hook_event_name"] == "pre_llm_call" and "extra" in msg["edge"]["stubbed"]


# ---------------------------------------------------------------- configuration


def test_config_file_then_environment(tmp_path) -> None:  # type: ignore[no-untyped-def]
    f = tmp_path / "env"
    f.write_text(
        "# comment\nexport AEP_BRIDGE_INSTANCE='from-file'\nAEP_BRIDGE_DEADLINE_MS=100\n"
        'AEP_BRIDGE_NATS_URL="nats://a:1, nats://b:2"\nAEP_BRIDGE_SPOOL_DIR=~/spool\n'
    )
    cfg = hook.Config({"AEP_BRIDGE_CONFIG": str(f), "AEP_BRIDGE_DEADLINE_MS": "300", "HOME": "/home/u"})
    assert cfg.instance == "from-file"
    assert cfg.deadline_ms == 300  # the environment wins
    assert cfg.servers == ["nats://a:1", "nats://b:2"]
    assert cfg.spool_dir == "/home/u/spool"
    # --config names the file explicitly (what the installer passes)
    cfg2 = hook.Config({"AEP_BRIDGE_CONFIG": "/nonexistent", "HOME": "/h"}, config_path=str(f))
    assert cfg2.instance == "from-file"
    # and bridge/config.py reads the same file the same way
    s = bridge_config.Settings.from_env({"AEP_BRIDGE_CONFIG": str(f), "AEP_BRIDGE_DEADLINE_MS": "300", "HOME": "/home/u"})
    assert (s.instance, s.deadline_ms, s.servers) == (cfg.instance, cfg.deadline_ms, cfg.servers)


def test_defaults_agree_with_bridge_config() -> None:
    cfg = hook.Config({"AEP_BRIDGE_CONFIG": "/nonexistent", "HOME": "/home/u"})
    s = bridge_config.Settings.from_env({"AEP_BRIDGE_CONFIG": "/nonexistent", "HOME": "/home/u"})
    assert cfg.servers == s.servers
    assert cfg.deadline_ms == s.deadline_ms == hook.DEFAULT_DEADLINE_MS
    assert cfg.max_field_bytes == s.max_field_bytes
    assert cfg.spool_max_bytes == s.spool_max_bytes
    assert cfg.instance == s.instance
    assert cfg.spool_dir == "/home/u/.local/state/aep-bridge/spool"
    xdg = hook.Config({"AEP_BRIDGE_CONFIG": "/nonexistent", "HOME": "/h", "XDG_STATE_HOME": "/st"})
    assert xdg.spool_dir == "/st/aep-bridge/spool"


@pytest.mark.parametrize(
    ("url", "parsed"),
    [
        ("nats://127.0.0.1:4222", ("nats", "127.0.0.1", 4222, None, None, None)),
        ("localhost", ("nats", "localhost", 4222, None, None, None)),
        ("nats://u:p%40ss@h:5", ("nats", "h", 5, "u", "p@ss", None)),
        ("nats://s3cret@h", ("nats", "h", 4222, None, None, "s3cret")),
        ("tls://[::1]:7422", ("tls", "::1", 7422, None, None, None)),
        ("nats://h:4222/", ("nats", "h", 4222, None, None, None)),
    ],
)
def test_parse_server_url(url: str, parsed: tuple) -> None:
    assert hook.parse_server_url(url) == parsed
