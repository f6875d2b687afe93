"""What a new user meets around one running `aep-bridge up` (issue 38): `simulate` against it,
a second `up` on its state directory, `tail | head`, `control pending` without a gate, a worker
that dies; and `up`'s port flags."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bridge.stack.server import terminate
from tests.support.cli import free_port
from tests.support.services import http_json, wait_for
from tests.support.up import ROOT, cli, running_up


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[subprocess.Popen[bytes], dict[str, str], dict[str, Any], Path]]:
    with running_up(tmp_path_factory.mktemp("up"), workers=3) as running:
        yield running


def stderr_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


def test_simulate_uses_ups_credential_and_its_duration(up, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Before: every event spooled on `Authorization Violation` (the server logged ~1,500 failed
    logins a second), the report said complete, exit 0; and the sessions in progress were wound
    down at the traffic's rate (60 instances at 100/s: ~19 s more than --duration 2)."""
    proc, env, info, tmp = up
    done = cli("simulate", "--duration", "2", "--instances", "60", "--rate", "100", "--shim-fraction", "0", "--quiet",
               "--manifest", str(tmp_path / "m.jsonl"), "--spool-dir", str(tmp_path / "spool"), env=env, timeout=120)
    report = json.loads(done.stdout)
    assert done.returncode == 0, (done.stderr, report)
    assert report["outcomes"] == {"published": report["sent"]} and report["landed"] == report["sent"] > 0, report
    assert report["complete"] is True and report["elapsed_s"] < 12, report
    server_log = (tmp / "state" / "aep-bridge" / "logs" / "nats-server.log").read_text(errors="replace")
    assert "Authorization Violation" not in server_log


def test_a_second_up_on_the_same_state_dir_says_who_holds_it(up) -> None:  # type: ignore[no-untyped-def]
    proc, env, info, tmp = up
    done = cli("up", "--port", str(free_port()), "--mapper-port", str(free_port()), "--pairing-port", str(free_port()),
               "--relay-port", str(free_port()), env=env, timeout=60)
    assert done.returncode == 2
    assert f"pid {proc.pid}" in stderr_line(done)


def test_tail_into_head_exits_quietly(up) -> None:  # type: ignore[no-untyped-def]
    proc, env, info, tmp = up
    wait_for(lambda: len(cli("tail", "--all", "--count", "2", "--idle-exit", "5", env=env).stdout.splitlines()) >= 2,
             60, interval=1, what="events on AEP_EVENTS")
    done = subprocess.run(["bash", "-c", f'"{sys.executable}" -m bridge.cli tail --all --idle-exit 20 | head -2; '
                           'echo "exit ${PIPESTATUS[0]}" >&2'], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert len(done.stdout.splitlines()) == 2, done.stdout
    assert done.stderr.strip() == "exit 141", done.stderr  # a Unix tool's SIGPIPE exit, and nothing else


def test_control_pending_without_a_gate_says_how_to_start_one(up) -> None:  # type: ignore[no-untyped-def]
    proc, env, info, tmp = up
    done = cli("control", "pending", env=env, timeout=60)
    assert done.returncode == 2
    line = stderr_line(done)
    assert "no gate" in line and "aep-bridge up --gate" in line and "None" not in line, line


def test_status_shows_the_workers_the_streams_and_no_gate(up) -> None:  # type: ignore[no-untyped-def]
    proc, env, info, tmp = up
    done = cli("status", "--json", env=env, timeout=60)
    out = json.loads(done.stdout)
    assert done.returncode == 0 and out["healthy"] and out["up_pid"] == proc.pid, (done.stderr, out)
    assert {"mapper", "pairing", "relay"} <= set(out["workers"]) and all(w["healthy"] for w in out["workers"].values()), out
    assert out["workers"]["relay"]["clients"] is not None and out["held_calls"] is None, out
    assert {"HERMES_RAW", "BRIDGE_MAPPED", "AEP_EVENTS"} <= set(out["streams"]), out
    assert "mapper" in out["streams"]["HERMES_RAW"]["consumers"], out
    text = cli("status", env=env, timeout=60).stdout
    assert "HERMES_RAW" in text and "held calls     no gate has run" in text, text


def test_status_without_nats_says_so_and_exits_1(clean_env: dict[str, str]) -> None:
    done = cli("status", "--nats", f"nats://127.0.0.1:{free_port()}", env=clean_env, timeout=60)
    assert done.returncode == 1 and "no running `aep-bridge up`" in done.stdout
    assert "cannot connect to NATS" in stderr_line(done)


def test_the_banner_prints_full_paths(up) -> None:  # type: ignore[no-untyped-def]
    proc, env, info, tmp = up
    banner = (tmp / "up.out").read_text()
    watch = next(line for line in banner.splitlines() if line.strip().startswith("watch"))
    assert f"{Path(sys.executable).parent / 'aep-bridge'} tail" in watch, watch


def test_an_exporter_to_a_dead_kafka_says_so_quietly_and_stops_at_once(up, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Before: /healthz "ok" with the sink "starting", ~12 log lines a second, and SIGTERM took
    ~20 s (a batch waiting 30 s for Kafka's reports, the loops' 15 s grace, a 5 s flush)."""
    proc, env, info, tmp = up
    port, kafka = free_port(), free_port()
    log = tmp_path / "exporter.log"
    with open(log, "w") as out:
        exporter = subprocess.Popen([sys.executable, "-m", "bridge.cli", "exporter", "--nats", info["nats_url"],
                                     "--metrics-port", str(port), "--sink", f"kafka://127.0.0.1:{kafka}/t"],
                                    env={**env, **info["client_env"]}, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        wait_for(lambda: http_json(f"http://127.0.0.1:{port}/healthz")[1].get("sinks", {}).get("kafka-t") == "failing",
                 60, what="the sink to be failing on /healthz")
        status, body = http_json(f"http://127.0.0.1:{port}/healthz")
        assert f"127.0.0.1:{kafka}" in body["sink_errors"]["kafka-t"] or "brokers are down" in body["sink_errors"]["kafka-t"], body
        before = len(log.read_text().splitlines())
        time.sleep(5)
        assert len(log.read_text().splitlines()) - before <= 3, log.read_text()[-2000:]
        started = time.monotonic()
        code = terminate(exporter, 30)
        assert code == 0 and time.monotonic() - started < 12, (code, time.monotonic() - started)
    finally:
        terminate(exporter, 5, signal.SIGKILL)


@pytest.mark.parametrize(("service", "flag"), [("relay", "--listen"), ("mapper", "--metrics-port")])
def test_a_service_on_a_taken_port_exits_2_in_one_line(up, service: str, flag: str) -> None:  # type: ignore[no-untyped-def]
    """Exit 2 (a setting it cannot use), which `up` does not restart; before: exit 1, restarted for ever."""
    proc, env, info, tmp = up
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        value = f"127.0.0.1:{port}" if flag == "--listen" else str(port)
        done = cli(service, "--nats", info["nats_url"], flag, value, env={**env, **info["client_env"]}, timeout=60)
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("aep-bridge: ") and f"{port}" in last and "Traceback" not in done.stderr, done.stderr[-2000:]


def test_a_worker_that_dies_says_why_in_ups_terminal(up) -> None:  # type: ignore[no-untyped-def]
    """Last in this module: it restarts pairing. `up` prints the last line of the worker's log."""
    proc, env, info, tmp = up
    log = tmp / "state" / "aep-bridge" / "logs" / "pairing.log"
    os.kill(info["workers"]["pairing"], signal.SIGKILL)
    wait_for(lambda: "pairing exited with code -9" in (tmp / "up.out").read_text(), 30, what="up to see pairing die")
    line = next(l for l in (tmp / "up.out").read_text().splitlines() if "pairing exited with code -9" in l)
    said = line.split(f"log: {log}): ", 1)[-1]
    assert said != line and said in log.read_text(), line


def test_up_refuses_a_port_out_of_range_in_one_line(clean_env: dict[str, str]) -> None:
    done = cli("up", "--port", "99999", env=clean_env, timeout=60)
    assert done.returncode == 2 and "--port 99999" in stderr_line(done)


def test_up_refuses_a_relay_port_that_is_taken_in_one_line(clean_env: dict[str, str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = cli("up", "--port", str(free_port()), "--relay-port", str(port), env=clean_env, timeout=60)
    assert done.returncode == 2 and f"--relay-port {port}" in stderr_line(done)
