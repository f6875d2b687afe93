"""The services started exactly as the chart starts them (its args and environment, Secrets
resolved) against a real nats-server that requires authentication (deploy/nats/nats.conf):
the pipeline (with pairing's ticks, which drive TTL orphan closure), and the opt-in control
plane (the gate as the chart runs it with gate.enabled, the shim's hold and pull as
hermes-shim-control, an operator's `aep-bridge control` as aep-operator)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.cli import free_port
from tests.corpus import envelopes
from tests.natsfixture import JetStreamClient
from tests.support.services import http_json as http_status, wait_for
from tests.support.shim import compiled_hook, envelope, run_hook, shim_env
from tests.support.chart import workload_env
from tests.support.nats_roles import PASSWORDS, configured_server, sample_nats_conf

SECRET = "aep-bridge-nats-auth"
SECRETS = {SECRET: {f"{role}-password": PASSWORDS[f"AEP_{role.upper().replace('-', '_')}_PASSWORD"]
                    for role in ("bootstrap", "mapper", "pairing", "shim", "consumer", "gate", "operator",
                                 "shim-control")}}
# pairing publishes a tick into each partition it owns every AEP_BRIDGE_TICK_S (15 s; the
# chart does not set it): the first one comes ~15 s after it starts.
TICK_WAIT_S = 60


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("secured")
    with configured_server(tmp, sample_nats_conf(tmp / "js")) as url:
        yield {"url": url, "tmp": tmp}


def chart_process(component: str, url: str, tmp: Path, secrets=SECRETS, values=None, **popen):  # type: ignore[no-untyped-def]
    chart_values = {"nats": {"enabled": False, "url": url}, **(values or {})}
    if component == "gate":
        chart_values.setdefault("gate", {"enabled": True})
    w = workload_env(component, chart_values, secrets=secrets, mount_root=tmp / component)
    env = {**os.environ, **w.env, "AEP_BRIDGE_CONFIG": os.devnull}
    if "AEP_BRIDGE_METRICS_PORT" in env:
        env["AEP_BRIDGE_METRICS_PORT"] = str(free_port())  # several pods' ports on one machine
    cmd = [sys.executable, "-m", "bridge.cli", *w.args]
    return w, cmd, env


def test_chart_environment_runs_the_pipeline_with_authentication(secured):
    url, tmp = secured["url"], secured["tmp"]
    w, cmd, env = chart_process("bootstrap", url, tmp)
    assert any(k == "AEP_BRIDGE_NATS_PASSWORD" for k in w.env), "the chart passes the role's password"
    assert "nats://" in w.env["AEP_BRIDGE_NATS_URL"] and "@" not in w.env["AEP_BRIDGE_NATS_URL"], "no credential in the URL"
    boot = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert boot.returncode == 0, boot.stdout + boot.stderr

    procs = []
    try:
        for component in ("mapper", "pairing"):
            _, cmd, env = chart_process(component, url, tmp)
            log = open(tmp / f"{component}.log", "wb")
            procs.append((component, subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)))
        # The shim publishes as its own user, the way a gateway pod would.
        shim = shim_env(url, tmp / "spool", "gw-secure", NATS_USER="hermes-shim", NATS_PASSWORD=PASSWORDS["AEP_SHIM_PASSWORD"])
        corpus = envelopes()[:40]
        for e in corpus:
            assert run_hook(json.dumps(e), shim, script=compiled_hook()).answered_empty_object
        assert not list((tmp / "spool").glob("*.spool")) or all(p.stat().st_size == 0 for p in (tmp / "spool").glob("*.spool")), "nothing spooled: every publish was acked"
        consumer = JetStreamClient(url, user="aep-consumer", password=PASSWORDS["AEP_CONSUMER_PASSWORD"],
                                   inbox_prefix="_INBOX.aep-consumer")  # the only inbox it may hear
        try:
            wait_for(lambda: consumer.stream_info("AEP_EVENTS").state.messages >= len(corpus), 60,
                     what="events on AEP_EVENTS through the authenticated pipeline")
        finally:
            consumer.close()
        # pairing's tick (bridge.mapped.<n>.__tick__, what drives TTL orphan closure) is
        # stored in BRIDGE_MAPPED: aep-pairing may publish it. Read as aep-pairing (it may
        # read BRIDGE_MAPPED's info).
        reader = JetStreamClient(url, user="aep-pairing", password=PASSWORDS["AEP_PAIRING_PASSWORD"],
                                 inbox_prefix="_INBOX.aep-pairing")
        ticks: dict = {}

        def ticked() -> bool:
            info = reader.run(reader.js.stream_info("BRIDGE_MAPPED", subjects_filter="bridge.mapped.*.__tick__"))
            ticks.update(info.state.subjects or {})
            return bool(ticks)

        try:
            wait_for(ticked, TICK_WAIT_S, interval=0.5, what="a pairing tick on BRIDGE_MAPPED")
        finally:
            reader.close()
        assert all(re.fullmatch(r"bridge\.mapped\.\d+\.__tick__", s) for s in ticks), ticks
        for component, p in procs:
            assert p.poll() is None, f"{component} died: " + (tmp / f"{component}.log").read_text()[-2000:]
    finally:
        for _, p in procs:
            p.terminate()
            p.wait(30)
    assert "tick_failed" not in (tmp / "pairing.log").read_text()
    server_log = (tmp / "server.log").read_text(errors="replace")
    refused = [line for line in server_log.splitlines() if "Violation" in line and "user:aep-pairing" in line]
    assert refused == [], refused


@pytest.mark.parametrize("component", ["mapper", "pairing", "bootstrap", "gate"])
def test_wrong_credentials_fail_clearly_and_non_zero(secured, component):
    wrong = {SECRET: {k: "not-the-password" for k in SECRETS[SECRET]}}
    _, cmd, env = chart_process(component, secured["url"], secured["tmp"] / "wrong", secrets=wrong)
    started = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert time.monotonic() - started < 30, "refused credentials fail at once, not after the connect retries"
    output = (proc.stdout + proc.stderr).lower()
    assert "authorization" in output or "authentication" in output, output[-2000:]
    assert "not-the-password" not in output, "the error names the cause, never the secret"




def test_the_gate_with_its_chart_environment_and_the_control_plane_users(secured):
    """gate.enabled as the chart runs it (user aep-gate, key gate-password) becomes ready on
    its /readyz; a held call by the shim as hermes-shim-control is denied by `aep-bridge control` as
    aep-operator; an instruction reaches the shim's next turn. Nothing is refused on the way."""
    url, tmp = secured["url"], secured["tmp"] / "control"
    tmp.mkdir()
    _, cmd, env = chart_process("bootstrap", url, tmp)
    boot = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert boot.returncode == 0, boot.stdout + boot.stderr

    w, cmd, env = chart_process("gate", url, tmp, values={"gate": {"enabled": True, "instruct": True, "probeMs": 300}})
    assert w.args == ["gate"] and w.env["AEP_BRIDGE_NATS_USER"] == "aep-gate"
    assert w.env["AEP_BRIDGE_NATS_PASSWORD"] == PASSWORDS["AEP_GATE_PASSWORD"]
    port = env["AEP_BRIDGE_METRICS_PORT"]
    log = open(tmp / "gate.log", "wb")
    gate = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    operator = {**os.environ, "AEP_BRIDGE_CONFIG": os.devnull, "AEP_BRIDGE_NATS_URL": url,
                "AEP_BRIDGE_NATS_USER": "aep-operator", "AEP_BRIDGE_NATS_PASSWORD": PASSWORDS["AEP_OPERATOR_PASSWORD"]}

    def control(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "bridge.cli", "control", *args], env=operator,
                              capture_output=True, text=True, timeout=60)

    held = None
    try:
        wait_for(lambda: http_status(f"http://127.0.0.1:{port}/readyz")[0] == 200, 60,
                 what="the gate's /readyz")
        status, health = http_status(f"http://127.0.0.1:{port}/healthz")
        assert status == 200 and health["control"]["accepts"] == ["control.attention.respond", "x.hermes.control.instruct"]
        hello = control("hello")
        assert hello.returncode == 0 and json.loads(hello.stdout)["capabilities"]["control"] == health["control"]

        shim = shim_env(url, tmp / "spool", "gw-control", NATS_USER="hermes-shim-control",
                        NATS_PASSWORD=PASSWORDS["AEP_SHIM_CONTROL_PASSWORD"],
                        DEADLINE_MS="2000")
        session = "s-chart-control"
        assert run_hook(json.dumps(envelope("on_session_start", session=session)), shim).answered_empty_object
        assert run_hook(json.dumps(envelope("pre_llm_call", session=session, turn_id=f"{session}:t:1")), shim).answered_empty_object
        call = envelope("pre_tool_call", session=session, turn_id=f"{session}:t:1", tool_call_id="call-1")
        held = subprocess.Popen([sys.executable, "-I", "-S", str(compiled_hook())], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env={**shim, "AEP_HERMES_CONTROL": "1", "AEP_HERMES_HOLD_MS": "30000"})
        held.stdin.write(json.dumps(call).encode())
        held.stdin.close()
        held.stdin = None

        cards: list = []

        def pending() -> bool:
            listed = control("pending", "--json")
            cards[:] = json.loads(listed.stdout) if listed.returncode == 0 else []
            return bool(cards)

        wait_for(pending, 30, interval=0.3, what="the held call in `control pending`")
        assert cards[0]["session"] == session and cards[0]["tool"] == "terminal"
        denied = control("respond", cards[0]["id"], "deny", "--reason", "not from this pod")
        assert denied.returncode == 0 and denied.stdout.startswith("accepted"), denied.stdout + denied.stderr
        out, err = held.communicate(timeout=30)
        assert json.loads(out) == {"action": "block", "message": "not from this pod"}, err

        steer = control("instruct", "--session", session, "keep it short")
        assert steer.returncode == 0, steer.stdout + steer.stderr
        nxt = run_hook(json.dumps(envelope("pre_llm_call", session=session, turn_id=f"{session}:t:2")),
                       {**shim, "AEP_INSTRUCT": "1"})
        assert json.loads(nxt.stdout) == {"context": "keep it short"}, nxt.stderr

        assert gate.poll() is None, (tmp / "gate.log").read_text()[-2000:]
    finally:
        if held is not None and held.poll() is None:
            held.kill()
        gate.terminate()
        code = gate.wait(30)
        log.close()
    assert code == 0, (tmp / "gate.log").read_text()[-2000:]
    text = (tmp / "gate.log").read_text()
    assert "Traceback" not in text and "handle_failed" not in text, text[-2000:]
    server_log = (secured["tmp"] / "server.log").read_text(errors="replace")
    refused = [line for line in server_log.splitlines() if "Violation" in line
               and any(f"user:{u}" in line for u in ("aep-gate", "aep-operator", "hermes-shim-control"))]
    assert refused == [], refused
