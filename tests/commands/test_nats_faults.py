"""A NATS that is wrong (nothing listens, the password is wrong) met the same way by every command
(issue 38): a client command ends within seconds with one line saying what, where and what to
do; a service keeps retrying, says so in its log and on /healthz, and obeys SIGTERM at once,
also while it connects."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bridge.stack.server import terminate
from tests.support.cli import free_port
from tests.support.auth_server import USER, AuthServer
from tests.support.services import http_json, wait_for
from tests.support.up import ROOT, cli

#: each client command with --nats {url}; {tmp}: the test's directory
CLIENTS = {
    "tail": ["tail", "--nats", "{url}"],
    "demo": ["demo", "--nats", "{url}", "--timeout", "5"],
    "simulate": ["simulate", "--nats", "{url}", "--duration", "1", "--instances", "2", "--rate", "10",
                 "--shim-fraction", "0", "--quiet", "--manifest", "{tmp}/m.jsonl", "--spool-dir", "{tmp}/spool"],
    "control": ["control", "pending", "--nats", "{url}"],
    "verify": ["verify", "--nats", "{url}", "--manifest", "{tmp}/m.jsonl", "--wait", "1"],
}


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthServer]:
    server = AuthServer(tmp_path_factory.mktemp("auth"), "right-password").start()
    try:
        yield server
    finally:
        server.stop()


def run_client(name: str, url: str, env: dict[str, str], tmp: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    (tmp / "m.jsonl").write_text('{"meta": {"version": 1}}\n')
    started = time.monotonic()
    done = cli(*[a.format(url=url, tmp=tmp) for a in CLIENTS[name]], env=env, timeout=60)
    return done, time.monotonic() - started


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


@pytest.mark.parametrize("name", CLIENTS)
def test_a_client_command_ends_in_one_line_when_nothing_listens(name: str, clean_env: dict[str, str], tmp_path: Path) -> None:
    port = free_port()
    done, took = run_client(name, f"nats://127.0.0.1:{port}", clean_env, tmp_path)
    assert done.returncode != 0 and took < 15, (took, done.stdout, done.stderr)
    line = one_line(done)
    assert f"127.0.0.1:{port}" in line and "aep-bridge up" in line, line


@pytest.mark.parametrize("name", CLIENTS)
def test_a_client_command_ends_in_one_line_on_a_wrong_password(name: str, auth_server: AuthServer,
                                                                 clean_env: dict[str, str], tmp_path: Path) -> None:
    done, took = run_client(name, f"nats://{USER}:wrong@127.0.0.1:{auth_server.port}", clean_env, tmp_path)
    assert done.returncode != 0 and took < 15, (took, done.stdout, done.stderr)
    line = one_line(done)
    assert f"127.0.0.1:{auth_server.port}" in line and "AEP_BRIDGE_NATS_PASSWORD" in line and "wrong" not in line, line


SERVICES = {
    "mapper": ["--metrics-port", "{port}"],
    "pairing": ["--metrics-port", "{port}"],
    "gate": ["--metrics-port", "{port}"],
    "exporter": ["--metrics-port", "{port}", "--sink", "otlp+http://127.0.0.1:9/v1/logs"],
    "relay": ["--listen", "127.0.0.1:{port}"],
}


def test_every_service_retries_says_so_and_obeys_sigterm_while_connecting(clean_env: dict[str, str], tmp_path: Path) -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    procs, ports = {}, {}
    for name, extra in SERVICES.items():
        ports[name] = free_port()
        out = open(tmp_path / f"{name}.log", "w")
        procs[name] = subprocess.Popen([sys.executable, "-m", "bridge.cli", name, "--nats", url,
                                        *[a.format(port=ports[name]) for a in extra]],
                                       env=clean_env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        out.close()

    def log(name: str) -> str:
        return (tmp_path / f"{name}.log").read_text()

    try:
        for name in SERVICES:  # each says it cannot reach NATS and retries (not only `*_starting`)
            wait_for(lambda: "nats_unreachable" in log(name) or procs[name].poll() is not None, 60,
                     what=f"{name} to say it cannot reach NATS")
            assert procs[name].poll() is None, log(name)
            assert url.split("//")[1] in log(name), log(name)
        status, body = http_json(f"http://127.0.0.1:{ports['mapper']}/healthz")
        assert body.get("nats") == "connecting" and url.split("//")[1] in body.get("nats_error", ""), (status, body)
        took = {}
        for name, proc in procs.items():
            started = time.monotonic()
            terminate(proc, 15)
            took[name] = (round(time.monotonic() - started, 1), proc.returncode)
        assert all(t < 15 and code == 0 for t, code in took.values()), took
    finally:
        for proc in procs.values():
            terminate(proc, 5, 9)
