"""The shim as Hermes runs it (``python -I -S``), against a real JetStream server:
what lands on HERMES_RAW, edge trimming, invalid and oversized input, fuzzing, auth, failover."""

from __future__ import annotations

import base64
import json
import time
import uuid
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bridge.shim import hook
from tests import corpus
from tests.natsfixture import JetStreamClient, NatsServer
from tests.support.shim import HOOK_SOURCE, dumps, envelope, run_hook, shim_env

DROPPED = set(hook.DROP_EXTRA)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def only_message(js: JetStreamClient, instance: str, timeout: float = 5.0) -> dict:
    msgs = js.fetch(f"hermes.raw.{hook.token(instance)}.>", expected=1, timeout=timeout)
    assert len(msgs) == 1, f"expected one message for {instance}, found {len(msgs)}"
    m = msgs[0]
    body = m.json()
    assert m.headers.get("Nats-Msg-Id") == body["id"]
    assert len(m.data) + len(hook._headers(body["id"])) <= 1024 * 1024
    return {"subject": m.subject, "body": body, "size": len(m.data), "seq": m.seq}


def test_event_lands_on_hermes_raw(nats_server: NatsServer, jetstream: JetStreamClient, tmp_path: Path) -> None:
    instance = unique("gw.one")  # a dot: the subject token differs from the name
    env = envelope("post_tool_call", "sess-1", result="hello", conversation_history=[{"role": "user", "content": "x"}])
    t0 = time.time_ns()
    run = run_hook(dumps(env), shim_env(nats_server.url, tmp_path, instance))
    t1 = time.time_ns()
    assert run.answered_empty_object, run
    assert run.stderr == b""
    got = only_message(jetstream, instance)
    body = got["body"]
    assert got["subject"] == f"hermes.raw.{instance.replace('.', '_')}.post_tool_call"
    assert body["instance"] == instance and body["hook"] == "post_tool_call" and body["v"] == 1
    assert t0 <= body["ts"] <= t1
    # the ULID's time part is the receive time
    n = 0
    for c in body["id"]:
        n = n * 32 + hook._B32.index(c)
    assert n >> 80 == body["ts"] // 1_000_000
    expected = json.loads(json.dumps(env))
    del expected["extra"]["conversation_history"]
    assert body["envelope"] == expected
    assert body["edge"] == {"dropped": ["extra.conversation_history"]}
    assert not any((tmp_path).glob("*.spool")) or (tmp_path / f"{hook.token(instance)}.spool").stat().st_size == 0


def test_source_file_works_as_the_command(nats_server: NatsServer, jetstream: JetStreamClient, tmp_path: Path) -> None:
    """`--mode source` registers hook.py itself; it must behave the same."""
    instance = unique("src")
    cfg_file = tmp_path / "aep.env"
    cfg_file.write_text(f"AEP_BRIDGE_INSTANCE={instance}\nAEP_BRIDGE_NATS_URL=nats://127.0.0.1:1\n")
    env = shim_env(nats_server.url, tmp_path, "overridden-by-env")
    del env["AEP_BRIDGE_INSTANCE"]
    del env["AEP_BRIDGE_NATS_URL"]
    env["AEP_BRIDGE_NATS_URL"] = nats_server.url  # the environment wins over the file
    run = run_hook(dumps(envelope("on_session_start")), env, script=HOOK_SOURCE, args=["--config", str(cfg_file)])
    assert run.answered_empty_object, run
    assert only_message(jetstream, instance)["body"]["hook"] == "on_session_start"


def test_every_observed_envelope_is_published(nats_server: NatsServer, jetstream: JetStreamClient, tmp_path: Path) -> None:
    instance = unique("corpus")
    env = shim_env(nats_server.url, tmp_path, instance)
    sent = []
    for rec in corpus.records():
        run = run_hook(dumps(rec["envelope"]), env)
        assert run.answered_empty_object, run
        sent.append(rec["envelope"])
    msgs = jetstream.fetch(f"hermes.raw.{instance}.>", expected=len(sent), timeout=10)
    assert len(msgs) == len(sent)
    for m, original in zip(msgs, sent):  # one at a time, so stream order = send order
        body = m.json()
        assert m.subject == f"hermes.raw.{instance}.{original['hook_event_name']}"
        expected = json.loads(json.dumps(original))
        expected["extra"] = {k: v for k, v in expected["extra"].items() if k not in DROPPED}
        assert body["envelope"] == expected
        dropped = sorted(f"extra.{k}" for k in original["extra"] if k in DROPPED)
        assert sorted(body.get("edge", {}).get("dropped", [])) == dropped


@pytest.mark.parametrize(
    ("data", "code"),
    [(b"", "empty"), (b"nope", "not_json"), (b"[1,2]", "not_object"), (b'{"a":\xff}', "not_utf8")],
)
def test_invalid_input_is_published_wrapped(
    nats_server: NatsServer, jetstream: JetStreamClient, tmp_path: Path, data: bytes, code: str
) -> None:
    instance = unique("bad")
    run = run_hook(data, shim_env(nats_server.url, tmp_path, instance))
    assert run.answered_empty_object, run
    got = only_message(jetstream, instance)
    body = got["body"]
    assert got["subject"] == f"hermes.raw.{instance}._invalid"
    assert body["error"].startswith(code + ":")
    raw = base64.b64decode(body["raw"]) if body["raw_encoding"] == "base64" else body["raw"].encode()
    assert raw == data and body["raw_bytes"] == len(data)


def test_oversized_input_fits_the_servers_max_payload(nats_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    server = nats_factory("max_payload: 65536")
    assert server.info()["max_payload"] == 65536
    js = JetStreamClient(server.url)
    try:
        js.bootstrap()
        instance = unique("big")
        tool_input = {"content": "é" * 150_000, "path": "/x"}
        result = "r" * 300_000
        notes = [f"{i}:" + "n" * 20_000 for i in range(30)]  # each under 64 KiB, 600 KB together
        env = envelope("post_tool_call", result=result, notes=notes, request={"body": "z" * 100_000})
        env["tool_input"] = tool_input
        run = run_hook(dumps(env), shim_env(server.url, tmp_path, instance))
        assert run.answered_empty_object, run
        msgs = js.fetch(f"hermes.raw.{instance}.>", expected=1)
        assert len(msgs) == 1
        body = msgs[0].json()
        assert len(msgs[0].data) + len(hook._headers(body["id"])) <= 65536
        out = body["envelope"]
        assert out["tool_input"] == hook.stub(tool_input)
        assert out["extra"]["result"] == hook.stub(result)
        assert "request" not in out["extra"]
        assert "extra.request" in body["edge"]["dropped"]
        assert {"tool_input", "extra.result"} <= set(body["edge"]["stubbed"])
        for note, trimmed in zip(notes, out["extra"]["notes"]):
            assert trimmed == note or trimmed == hook.stub(note)
    finally:
        js.close()


def test_huge_inputs_answer_in_bounded_time(nats_server: NatsServer, jetstream: JetStreamClient, tmp_path: Path) -> None:
    import os

    instance = unique("huge")
    env = shim_env(nats_server.url, tmp_path, instance)
    history = [{"role": "user", "content": "c" * 1000} for _ in range(5000)]  # 5 MB, dropped
    big = envelope("pre_llm_call", conversation_history=history, user_message="u" * 2_000_000)
    for data in (dumps(big), os.urandom(8 << 20), b'{"x": "' + b"a" * (4 << 20) + b'"}'):
        run = run_hook(data, env)
        assert run.answered_empty_object, run
        assert run.elapsed < 10, f"{run.elapsed:.2f}s for {len(data)} bytes"
    msgs = jetstream.fetch(f"hermes.raw.{instance}.>", expected=3)
    assert [m.subject.rsplit(".", 1)[1] for m in msgs] == ["pre_llm_call", "_invalid", "_unknown"]
    assert all(len(m.data) < 1024 * 1024 for m in msgs)
    assert msgs[0].json()["envelope"]["extra"]["user_message"] == hook.stub("u" * 2_000_000)


# ---------------------------------------------------------------- fuzzing

garbage = st.one_of(
    st.binary(max_size=3000),
    st.text(max_size=2000).map(lambda s: s.encode("utf-8", "surrogatepass")),
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=50),
        lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=10), c, max_size=4),
        max_leaves=30,
    ).map(lambda v: json.dumps(v).encode()),
    st.builds(
        lambda rec, cut, noise: dumps(rec["envelope"])[:cut] + noise,
        st.sampled_from(corpus.records()),
        st.integers(0, 4000),
        st.binary(max_size=20),
    ),
    st.dictionaries(
        st.sampled_from(["hook_event_name", "tool_input", "extra", "session_id", "cwd", "tool_name"]),
        st.none() | st.integers() | st.text(max_size=300) | st.lists(st.integers(), max_size=3)
        | st.dictionaries(st.text(max_size=5), st.text(max_size=100_000), max_size=3),
    ).map(lambda d: json.dumps(d).encode()),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=garbage)
def test_fuzz_garbage_always_answers_and_is_published(
    nats_server: NatsServer, jetstream: JetStreamClient, tmp_path_factory, data: bytes  # type: ignore[no-untyped-def]
) -> None:
    instance = unique("fuzz")
    spool = tmp_path_factory.mktemp("fuzz")
    run = run_hook(data, shim_env(nats_server.url, spool, instance, max_field_bytes=4096))
    assert run.answered_empty_object, run
    assert run.elapsed < 5.0
    got = only_message(jetstream, instance)
    body = got["body"]
    assert got["size"] <= nats_server.info()["max_payload"]
    try:
        parsed = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        parsed = None
    if isinstance(parsed, dict) and not body["hook"] == "_invalid":
        name = parsed.get("hook_event_name")
        assert body["hook"] == (name if isinstance(name, str) and name else "_unknown")
    else:
        assert body["hook"] == "_invalid"
        raw = body["raw"]
        if isinstance(raw, dict):
            assert raw["$aep_stub"] is True
        else:
            decoded = base64.b64decode(raw) if body["raw_encoding"] == "base64" else raw.encode("utf-8", "surrogatepass")
            assert decoded == data


# ---------------------------------------------------------------- servers, auth, failover


def test_no_stream_means_spooled_not_lost(nats_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    server = nats_factory()  # JetStream on, but bootstrap never ran: no stream takes hermes.raw.>
    instance = unique("nostream")
    run = run_hook(dumps(envelope()), shim_env(server.url, tmp_path, instance))
    assert run.answered_empty_object, run
    assert b"spooled" in run.stderr
    st_ = hook.Spool(str(tmp_path), instance).status()
    assert st_["pending_records"] == 1


AUTH_USERS = """
authorization {
  users = [
    {user: alice, password: "s3cret pass"}
  ]
}
"""


def test_user_password_in_url_and_env(nats_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    server = nats_factory(AUTH_USERS)
    js = JetStreamClient(server.url, user="alice", password="s3cret pass")
    try:
        js.bootstrap()
        a, b, c = unique("url"), unique("env"), unique("wrong")
        r1 = run_hook(dumps(envelope()), shim_env(server.url_with("alice:s3cret%20pass"), tmp_path / "1", a))
        env = shim_env(server.url_with("alice:wrong"), tmp_path / "2", b, nats_user="alice", nats_password="s3cret pass")
        r2 = run_hook(dumps(envelope()), env)  # the environment overrides the URL's credentials
        r3 = run_hook(dumps(envelope()), shim_env(server.url_with("alice:wrong"), tmp_path / "3", c))
        assert r1.answered_empty_object and r2.answered_empty_object and r3.answered_empty_object
        assert len(js.fetch(f"hermes.raw.{a}.>", expected=1)) == 1
        assert len(js.fetch(f"hermes.raw.{b}.>", expected=1)) == 1
        assert js.fetch(f"hermes.raw.{c}.>") == []
        assert b"Authorization Violation" in r3.stderr
        assert hook.Spool(str(tmp_path / "3"), c).status()["pending_records"] == 1
    finally:
        js.close()


def test_token_auth(nats_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    server = nats_factory('authorization { token: "t0ken" }')
    js = JetStreamClient(server.url, token="t0ken")
    try:
        js.bootstrap()
        a, b = unique("tok-url"), unique("tok-env")
        assert run_hook(dumps(envelope()), shim_env(server.url_with("t0ken"), tmp_path / "1", a)).answered_empty_object
        assert run_hook(dumps(envelope()), shim_env(server.url, tmp_path / "2", b, nats_token="t0ken")).answered_empty_object
        assert len(js.fetch(f"hermes.raw.{a}.>", expected=1)) == 1
        assert len(js.fetch(f"hermes.raw.{b}.>", expected=1)) == 1
    finally:
        js.close()


def test_servers_are_tried_in_order(nats_server: NatsServer, jetstream: JetStreamClient, tmp_path: Path) -> None:
    from tests.support.cli import free_port

    instance = unique("failover")
    urls = f"nats://127.0.0.1:{free_port()}, {nats_server.url}"
    run = run_hook(dumps(envelope()), shim_env(urls, tmp_path, instance))
    assert run.answered_empty_object and run.stderr == b""
    assert len(jetstream.fetch(f"hermes.raw.{instance}.>", expected=1)) == 1


def test_tls(nats_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """TLS with a private CA: ``tls://`` plus AEP_BRIDGE_TLS_CA (the ssl import is its documented cost)."""
    pytest.importorskip("cryptography", reason="needs cryptography to mint a test CA")
    ca, cert, key = _mint_certs(tmp_path)
    server = nats_factory(f'tls {{\n  cert_file: "{cert}"\n  key_file: "{key}"\n}}')
    import ssl

    ctx = ssl.create_default_context(cafile=str(ca))
    js = JetStreamClient(f"tls://localhost:{server.port}", tls=ctx)
    try:
        js.bootstrap()
        instance = unique("tls")
        env = shim_env(f"tls://localhost:{server.port}", tmp_path, instance, tls_ca=ca)
        run = run_hook(dumps(envelope()), env)
        assert run.answered_empty_object and run.stderr == b"", run
        assert len(js.fetch(f"hermes.raw.{instance}.>", expected=1)) == 1
        # without the CA the server's certificate is not trusted: spooled, with the reason
        bad = unique("tls-bad")
        run = run_hook(dumps(envelope()), shim_env(f"tls://localhost:{server.port}", tmp_path / "b", bad))
        assert run.answered_empty_object and b"TLS handshake" in run.stderr
    finally:
        js.close()


def _mint_certs(d: Path) -> tuple[Path, Path, Path]:
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "aep test ca")])
    ca_cert = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    import ipaddress

    cert = (
        x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
        .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    paths = d / "ca.pem", d / "server.pem", d / "server.key"
    paths[0].write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return paths


def test_one_reader_parses_every_message_form_of_the_protocol() -> None:
    """MSG and HMSG, each with and without a reply subject, the PING it answers, the PONG it
    reports, the -ERR it raises on: what publish, next_msg and read_pong all read through."""
    import socket as socketlib

    ours, server = socketlib.socketpair()
    try:
        conn = hook.NatsConnection(ours, {}, "test")
        deadline = time.monotonic() + 2
        server.sendall(b"MSG a.b 1 5\r\nhello\r\n" b"MSG a.c 1 r.1 2\r\nhi\r\n"
                       b"PING\r\n+OK\r\n" b"HMSG a.d 1 12 14\r\nNATS/1.0\r\n\r\nok\r\n"
                       b"HMSG a.e 1 r.2 16 16\r\nNATS/1.0 503\r\n\r\n\r\n" b"PONG\r\n" b"-ERR 'Permissions Violation'\r\n")
        assert conn._read_msg(deadline) == (b"a.b", None, b"", b"hello")
        assert conn._read_msg(deadline) == (b"a.c", b"r.1", b"", b"hi")
        assert conn._read_msg(deadline) == (b"a.d", None, b"NATS/1.0\r\n\r\n", b"ok")
        assert server.recv(64) == b"PONG\r\n"  # the PING was answered on the way
        assert conn._read_msg(deadline) == (b"a.e", b"r.2", b"NATS/1.0 503\r\n\r\n", b"")
        assert conn._read_msg(deadline) is None  # the PONG
        with pytest.raises(hook.NatsError, match="Permissions Violation"):
            conn._read_msg(deadline)
        assert conn.next_msg(time.monotonic() + 0.05) is None  # nothing more: the deadline, not an error
    finally:
        ours.close()
        server.close()
