"""The services started exactly as the chart starts them (its args and environment, Secrets
resolved) against a real nats-server that requires authentication (deploy/nats/nats.conf)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bridge.local.server import free_port
from tests.corpus import envelopes
from tests.natsfixture import JetStreamClient
from tests.support.services import wait_for
from tests.support.shim import compiled_hook, run_hook, shim_env
from tests.test_deploy_chart import workload_env
from tests.test_deploy_nats_permissions import PASSWORDS, SAMPLE_CONF, nats_server_binary

SECRET = "aep-bridge-nats-auth"
SECRETS = {SECRET: {f"{role}-password": PASSWORDS[f"AEP_{role.upper()}_PASSWORD"]
                    for role in ("bootstrap", "mapper", "pairing", "shim", "consumer")}}


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("secured")
    text, n = re.subn(r"(store_dir:\s*)/data\S*", lambda m: f'{m.group(1)}"{tmp / "js"}"', SAMPLE_CONF.read_text())
    assert n == 1
    (tmp / "nats.conf").write_text(text)
    port = free_port()
    log = open(tmp / "server.log", "wb")
    proc = subprocess.Popen([nats_server_binary(), "-c", str(tmp / "nats.conf"), "-a", "127.0.0.1", "-p", str(port), "-m", str(free_port())],
                            env={**os.environ, **PASSWORDS}, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp / "server.log").read_text()
            time.sleep(0.02)
    try:
        yield {"url": f"nats://127.0.0.1:{port}", "tmp": tmp}
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def chart_process(component: str, url: str, tmp: Path, secrets=SECRETS, **popen):  # type: ignore[no-untyped-def]
    w = workload_env(component, {"nats": {"enabled": False, "url": url}}, secrets=secrets, mount_root=tmp / component)
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
        consumer = JetStreamClient(url, user="aep-consumer", password=PASSWORDS["AEP_CONSUMER_PASSWORD"])
        try:
            wait_for(lambda: consumer.stream_info("AEP_EVENTS").state.messages >= len(corpus), 60,
                     what="events on AEP_EVENTS through the authenticated pipeline")
        finally:
            consumer.close()
        for component, p in procs:
            assert p.poll() is None, f"{component} died: " + (tmp / f"{component}.log").read_text()[-2000:]
    finally:
        for _, p in procs:
            p.terminate()
            p.wait(30)


@pytest.mark.parametrize("component", ["mapper", "pairing", "bootstrap"])
def test_wrong_credentials_fail_clearly_and_non_zero(secured, component):
    wrong = {SECRET: {k: "not-the-password" for k in SECRETS[SECRET]}}
    _, cmd, env = chart_process(component, secured["url"], secured["tmp"] / "wrong", secrets=wrong)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    output = (proc.stdout + proc.stderr).lower()
    assert "authorization" in output or "authentication" in output, output[-2000:]
    assert "not-the-password" not in output, "the error names the cause, never the secret"
