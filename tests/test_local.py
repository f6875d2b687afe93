"""`aep-bridge up`, `demo` and `tail` driven as a user would: real processes, a real nats-server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from bridge.local.server import free_port
from tests.corpus import records
from tests.support.services import wait_for

ROOT = Path(__file__).resolve().parent.parent


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a zombie is gone for our purposes
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def cli(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bridge.cli", *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.fixture
def up(tmp_path):
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state"), "AEP_BRIDGE_CONFIG": os.devnull}
    env.pop("AEP_BRIDGE_NATS_URL", None)
    state = tmp_path / "state" / "aep-bridge"
    port = free_port()
    out = open(tmp_path / "up.out", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "bridge.cli", "up", "--port", str(port), "--mapper-port", str(free_port()),
         "--pairing-port", str(free_port())],
        env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
    )
    info_path = state / "up.json"
    try:
        wait_for(lambda: info_path.exists() and all(json.loads(info_path.read_text())["workers"].values()), 60, what="up to be running")
        yield proc, env, json.loads(info_path.read_text()), tmp_path
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        out.close()


def expected_summary() -> dict[str, int]:
    envs = [r["envelope"] for r in records()]
    c = Counter(e["hook_event_name"] for e in envs)
    status = Counter(e["extra"].get("status") for e in envs if e["hook_event_name"] == "post_tool_call")
    return {
        "runs_started": c["pre_llm_call"],
        "tools_completed": status["ok"],
        "tools_failed": status["error"] + status["cancelled"] + status["timeout"],
        "tools_denied": status["blocked"],
        "approvals": c["pre_approval_request"],
        "subagents_started": c["subagent_start"],
        "subagents_stopped": c["subagent_stop"],
    }


def totals(summary: dict) -> dict[str, int]:
    t: Counter[str] = Counter()
    for s in summary["sessions"].values():
        t["runs_started"] += s["runs"].get("started", 0)
        t["tools_completed"] += s["tools"].get("completed", 0)
        t["tools_failed"] += s["tools"].get("failed", 0)
        t["tools_denied"] += s["tools"].get("denied", 0)
        t["approvals"] += s["approvals"].get("requested", 0)
        t["subagents_started"] += s["subagents"].get("started", 0)
        t["subagents_stopped"] += s["subagents"].get("stopped", 0)
    return dict(t)


def test_up_demo_tail_restart_and_clean_stop(up):
    proc, env, info, tmp = up
    url = info["nats_url"]
    summary_file = tmp / "summary.json"

    started = time.monotonic()
    demo = cli("demo", "--json-summary", str(summary_file), env=env)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert time.monotonic() - started < 60, "demo events flow through all three stages within a minute"
    summary = json.loads(summary_file.read_text())
    assert summary["shim_failures"] == 0 and summary["hook_runs"] == len(records())
    assert totals(summary) == expected_summary()
    assert "unknown" in summary["sessions"], "approvals without a known session are visible on the unknown lane"
    assert "per-session summary" in demo.stdout

    # tail --json sees the same events (ephemeral ordered consumer: nothing acked away).
    tail = cli("tail", "--nats", url, "--json", "--all", "--idle-exit", "2", env=env)
    assert tail.returncode == 0, tail.stderr
    mine = [json.loads(line) for line in tail.stdout.splitlines() if f"aep://{summary['instance']}/" in line]
    assert len(mine) == summary["events"]

    # Readable tail of one known session, grouped by lane; the unknown lane is shown.
    session = next(k for k in summary["sessions"] if k.startswith("20261130_224954_177c7f"))
    text = cli("tail", "--nats", url, "--all", "--session", session, "--idle-exit", "2", "--color", "never", env=env).stdout
    lines = text.splitlines()
    assert lines[0] == f"── lane {session} ──"
    assert sum(1 for line in lines if "run.started" in line) == summary["sessions"][session]["runs"]["started"]
    assert any("attention.requested" in line and "kind=permission" in line for line in lines)
    everything = cli("tail", "--nats", url, "--all", "--idle-exit", "2", "--color", "never", env=env).stdout
    assert "── lane unknown ──" in everything

    # Kill the workers: up restarts them and no event is lost.
    for name in ("mapper", "pairing"):
        os.kill(info["workers"][name], signal.SIGKILL)
    state = tmp / "state" / "aep-bridge" / "up.json"
    wait_for(lambda: all(p is not None and pid_alive(p) and p not in info["workers"].values()
                         for p in json.loads(state.read_text())["workers"].values()), 30, what="restarted workers")
    demo2 = cli("demo", "--json-summary", str(summary_file), env=env)
    assert demo2.returncode == 0, demo2.stdout + demo2.stderr
    assert totals(json.loads(summary_file.read_text())) == expected_summary()
    restarted = json.loads(state.read_text())["workers"]

    # One SIGINT stops everything: no worker, no nats-server left behind.
    server_pids = [int(p) for p in subprocess.run(["pgrep", "-f", f"nats-server.*-p {url.rsplit(':', 1)[1]}"], capture_output=True, text=True).stdout.split()]
    assert server_pids, "the embedded server runs"
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 0
    for pid in [*restarted.values(), *server_pids]:
        wait_for(lambda pid=pid: not pid_alive(pid), 10, what=f"pid {pid} to exit")
    output = (tmp / "up.out").read_text()
    assert "restarted" in output and "stopped" in output
    assert not state.exists()
