"""`aep-bridge up` driven as a user would, for the tests of up and of what it runs: the CLI as a
process, `running_up` (up with free ports and its own state directory, until its workers run),
whether a pid is alive, and the demo's expected summary against up's."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

from bridge.stack.server import terminate
from tests.support.cli import free_port
from tests.corpus import records
from tests.support.services import wait_for
from tests.support.cli import ROOT, cli as support_cli
from functools import partial



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


#: up's tests give the whole environment (running_up removed the variables up must not see)
cli = partial(support_cli, inherit=False)


@contextlib.contextmanager
def running_up(tmp_path: Path, *extra: str, workers: int = 3):
    """`aep-bridge up` with free ports and its own state directory, until `workers` workers run."""
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state"), "AEP_BRIDGE_CONFIG": os.devnull}
    for var in ("AEP_BRIDGE_NATS_URL", "AEP_HERMES_CONTROL", "AEP_INSTRUCT", "AEP_HERMES_HOLD_MS"):
        env.pop(var, None)
    state = tmp_path / "state" / "aep-bridge"
    port = free_port()
    out = open(tmp_path / "up.out", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "bridge.cli", "up", "--port", str(port), "--mapper-port", str(free_port()),
         "--pairing-port", str(free_port()), "--relay-port", str(free_port()), *extra],
        env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
    )
    info_path = state / "up.json"

    def started() -> bool:
        if not info_path.exists():
            return False
        pids = json.loads(info_path.read_text())["workers"]
        return len(pids) == workers and all(pids.values())

    try:
        wait_for(started, 60, what="up to be running")
        yield proc, env, json.loads(info_path.read_text()), tmp_path
    finally:
        terminate(proc, 60, signal.SIGINT)
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
