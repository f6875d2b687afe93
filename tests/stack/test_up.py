"""`aep-bridge up`, `demo` and `tail` driven as a user would: real processes, a real nats-server.
`aep-bridge up --gate` also runs the opt-in control plane: its gate answers /healthz and /readyz,
holds a real shim's call until `aep-bridge control` answers it, is restarted like the other
workers and stopped by the same Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from bridge.stack.server import terminate
from tests.support.cli import free_port
from tests.corpus import records
from tests.support.services import http_json as http_get, wait_for
from tests.support.up import cli, expected_summary, pid_alive, running_up, totals

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def up(tmp_path):
    with running_up(tmp_path) as running:
        yield running


def test_up_demo_tail_restart_and_clean_stop(up):
    proc, env, info, tmp = up
    url = info["nats_url"]
    summary_file = tmp / "summary.json"
    # The control plane is opt-in: no gate without --gate.
    assert set(info["workers"]) == {"mapper", "pairing", "relay"} and "gate" not in info["metrics"] and "control" not in info

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

    # The relay serves the same events to any AEP consumer, with the token up generated.
    relay = info["relay"]
    assert len(relay["token"]) >= 24 and relay["token"] in (tmp / "up.out").read_text()  # the banner gives it
    stream = f"{relay['url']}/stream?from=all&live=0&filter=" + urllib.parse.quote(json.dumps({"session": session}))
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(stream, timeout=10)
    assert refused.value.code == 401
    req = urllib.request.Request(stream, headers={"Authorization": f"Bearer {relay['token']}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        sse = r.read().decode()
    data = [json.loads(line[6:]) for line in sse.splitlines() if line.startswith("data: ")]
    assert data and {e["session"] for e in data} == {session}
    assert sum(1 for e in data if e["type"] == "run.started") == summary["sessions"][session]["runs"]["started"]

    # Kill the workers: up restarts them and no event is lost.
    for name in ("mapper", "pairing", "relay"):
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


def test_up_gate_runs_the_control_plane_and_stops_it_with_the_rest(tmp_path):
    from tests.support.shim import compiled_hook, dumps, envelope, run_hook, shim_env

    gate_port = free_port()
    with running_up(tmp_path, "--gate", "--gate-port", str(gate_port), workers=4) as (proc, env, info, tmp):
        url = info["nats_url"]
        state = tmp / "state" / "aep-bridge"
        assert set(info["workers"]) == {"mapper", "pairing", "gate", "relay"}
        assert info["metrics"]["gate"] == f"http://127.0.0.1:{gate_port}/metrics"
        accepts = ["control.attention.respond", "x.hermes.control.instruct"]
        # the shim settings carry up's generated NATS credential (finding 17 of issue 13), of the
        # control shim's user, not the operator's (issue 44 item 4)
        control_shim = info["control"]["shim_env"]
        assert info["control"] == {"accepts": accepts, "shim_env": {
            **control_shim, "AEP_HERMES_CONTROL": "1", "AEP_HERMES_HOLD_MS": "55000", "AEP_INSTRUCT": "1"}}
        assert control_shim["AEP_BRIDGE_NATS_USER"] == "aep-shim-control" != info["client_env"]["AEP_BRIDGE_NATS_USER"]
        assert control_shim["AEP_BRIDGE_NATS_URL"] == url and control_shim["AEP_BRIDGE_NATS_PASSWORD"]
        wait_for(lambda: http_get(f"http://127.0.0.1:{gate_port}/readyz")[0] == 200, 30, what="the gate's /readyz")
        status, health = http_get(f"http://127.0.0.1:{gate_port}/healthz")
        assert status == 200 and health["service"] == "gate" and health["control"]["accepts"] == accepts
        assert (state / "logs" / "gate.log").stat().st_size > 0
        wait_for(lambda: "Ctrl-C" in (tmp / "up.out").read_text(), 30, what="the banner")
        banner = (tmp / "up.out").read_text()
        assert f"http://127.0.0.1:{gate_port}/metrics" in banner
        nats = " ".join(f"{k}={v}" for k in ("AEP_BRIDGE_NATS_URL", "AEP_BRIDGE_NATS_USER", "AEP_BRIDGE_NATS_PASSWORD")
                        for v in [control_shim[k]])
        exe = Path(sys.executable).parent / "aep-bridge"  # a full path: works without the venv on PATH
        assert (f"{nats} AEP_HERMES_CONTROL=1 AEP_HERMES_HOLD_MS=55000 AEP_INSTRUCT=1 "
                f"{exe} hermes install") in banner
        assert f"{exe} control pending" in banner

        # A worker like the others: killed, it is restarted.
        os.kill(info["workers"]["gate"], signal.SIGKILL)
        wait_for(lambda: (p := json.loads((state / "up.json").read_text())["workers"]["gate"]) not in (None, info["workers"]["gate"])
                 and pid_alive(p), 30, what="the gate restarted")
        wait_for(lambda: http_get(f"http://127.0.0.1:{gate_port}/readyz")[0] == 200, 30, what="the restarted gate's /readyz")

        # The shim, set up as the banner says, is held until an operator answers.
        shim = {**shim_env(url, tmp / "spool", "up-gate", DEADLINE_MS="2000"), **info["control"]["shim_env"]}
        session = "s-up-gate"
        for hook in ("on_session_start", "pre_llm_call"):
            assert run_hook(dumps(envelope(hook, session=session, turn_id=f"{session}:t:1")), shim).answered_empty_object
        held = subprocess.Popen([sys.executable, "-I", "-S", str(compiled_hook())], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=shim)
        held.stdin.write(dumps(envelope("pre_tool_call", session=session, turn_id=f"{session}:t:1", tool_call_id="c1")))
        held.stdin.close()
        held.stdin = None
        try:
            cards: list = []

            def pending() -> bool:
                r = cli("control", "pending", "--json", "--nats", url, env=env)
                cards[:] = json.loads(r.stdout) if r.returncode == 0 else []
                return bool(cards)

            wait_for(pending, 30, interval=0.3, what="the held call")
            answer = cli("control", "respond", cards[0]["id"], "allow", "--nats", url, env=env)
            assert answer.returncode == 0 and answer.stdout.startswith("accepted"), answer.stdout + answer.stderr
            out, err = held.communicate(timeout=30)
            assert out == b"{}\n", err
        finally:
            if held.poll() is None:
                held.kill()

        # One SIGINT stops the gate with the rest.
        workers = json.loads((state / "up.json").read_text())["workers"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        for name, pid in workers.items():
            wait_for(lambda pid=pid: not pid_alive(pid), 10, what=f"{name} (pid {pid}) to exit")
        assert http_get(f"http://127.0.0.1:{gate_port}/healthz")[0] == 0, "nothing answers on the gate's port"
        assert not (state / "up.json").exists()
        assert "gate restarted" in (tmp / "up.out").read_text()


# A command in the banner: optional VAR=value assignments, then `aep-bridge ...`, up to a run of
# spaces, a parenthesis or the end of the line (what a user selects and pastes).
BANNER_COMMAND = re.compile(r"(?:(?<=\s)|^)(?:[A-Z][A-Z0-9_]*=\S+ )*(?:/\S*/)?aep-bridge\s[^()]*?(?=\s{2,}|\)|$)")


def banner_commands(text: str) -> list[str]:
    start = text.index("\n  NATS ")
    block = text[start:text.index("  stop           Ctrl-C", start)]
    return [m.group(0).strip() for line in block.splitlines() for m in BANNER_COMMAND.finditer(line)]


def test_every_command_the_gate_banner_prints_works_when_pasted_into_a_clean_shell(tmp_path):
    """Issue 25 item 6: each command line of `up --gate`'s banner, run as printed by a shell whose
    environment knows nothing of this `up` (a fresh HOME: no up.json where `control`, `demo` and
    `tail` would look, no AEP_BRIDGE_* variable). Before the fix the control line had no
    credential (exit 2, Authorization Violation) and was not one command. Issue 38: the commands
    needed the venv's bin on PATH (`aep-bridge: command not found`); this shell has /usr/bin:/bin."""
    with running_up(tmp_path, "--gate", "--gate-port", str(free_port()), workers=4) as (proc, env, info, tmp):
        wait_for(lambda: "Ctrl-C" in (tmp / "up.out").read_text(), 30, what="the banner")
        commands = banner_commands((tmp / "up.out").read_text())
        assert any(" control " in c for c in commands) and any(c.endswith("aep-bridge demo") for c in commands), commands
        home = tmp / "home"
        home.mkdir()
        clean = {"PATH": "/usr/bin:/bin", "HOME": str(home)}
        if os.environ.get("PYTHONPATH"):  # the code under test (not the user's environment)
            clean["PYTHONPATH"] = os.environ["PYTHONPATH"]

        def shell(command: str, **kw) -> subprocess.Popen[str]:  # type: ignore[no-untyped-def]
            # Ctrl-C works in the user's shell: SIGINT at its default there, whatever this run
            # inherited. A run started in the background ignores SIGINT, its children inherit
            # that, and Python leaves an ignored SIGINT ignored: tail never saw the test's Ctrl-C
            # (the clean-clone CI runs of 873249d and 7037abb; `tail` with SIGINT ignored hangs)
            return subprocess.Popen(["bash", "-c", command], env=clean, cwd=home, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), **kw)

        # `tail` follows the stream until Ctrl-C: it works when it shows the demo's events and
        # Ctrl-C ends it with 0.
        def following() -> int:
            """Consumers on AEP_EVENTS that deliver new events only: tail's (the relay starts at a sequence)."""
            import asyncio

            import nats
            from nats.js.api import DeliverPolicy

            async def count() -> int:
                nc = await nats.connect(info["nats_url"], user=info["client_env"]["AEP_BRIDGE_NATS_USER"],
                                        password=info["client_env"]["AEP_BRIDGE_NATS_PASSWORD"])
                try:
                    found = await nc.jetstream().consumers_info("AEP_EVENTS")
                    return sum(1 for c in found if c.config.deliver_policy == DeliverPolicy.NEW)
                finally:
                    await nc.close()

            return asyncio.run(count())

        followers = {c: shell(c, start_new_session=True) for c in commands if re.search(r"(^|[\s/])aep-bridge tail\b", c)}
        failed = {}
        try:
            # each follower has its consumer on AEP_EVENTS (it follows new events only) before the
            # demo runs, or has exited (and fails below)
            wait_for(lambda: following() >= len(followers) or any(p.poll() is not None for p in followers.values()),
                     60, interval=0.2, what="the tails to subscribe")
            for c in commands:
                if c in followers:
                    continue
                p = shell(c)
                out, err = p.communicate(timeout=300)
                if p.returncode != 0:
                    failed[c] = (p.returncode, (out + err)[-600:])
            outputs: dict[str, str] = {}
            for c, p in followers.items():
                os.killpg(p.pid, signal.SIGINT)
                out, err = p.communicate(timeout=30)
                outputs[c] = out
                if p.returncode != 0 or not out.strip():
                    failed[c] = (p.returncode, (out + err)[-600:])
        finally:
            for p in followers.values():
                if p.poll() is None:
                    p.kill()
        assert not failed, "\n".join(f"{c}\n  -> exit {rc}: {text}" for c, (rc, text) in failed.items())


@pytest.mark.parametrize(("variable", "worker"), [("AEP_BRIDGE_RELAY_QUEUE", "relay"),
                                                  ("AEP_BRIDGE_TRACEMALLOC_FRAMES", "(mapper|pairing|relay)")])
def test_a_worker_refusing_a_bad_setting_stops_up_with_its_message(tmp_path, variable, worker):
    """A worker that exits 2 (a setting it cannot use) would exit 2 again on every restart: `up`
    stops, says which worker and repeats its message, and leaves no process behind (issue 22)."""
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state"), "AEP_BRIDGE_CONFIG": os.devnull, variable: "abc"}
    env.pop("AEP_BRIDGE_NATS_URL", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "bridge.cli", "up", "--port", str(free_port()), "--mapper-port", str(free_port()),
         "--pairing-port", str(free_port()), "--relay-port", str(free_port()), "--no-follow"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        terminate(proc, 60, signal.SIGINT)
        out, _ = proc.communicate()
        pytest.fail("`up` kept restarting a worker that refuses its settings:\n" + out)
    assert proc.returncode == 2, out
    assert re.search(f"up: {worker} exited with code 2", out) and "restarting" not in out, out
    assert f"{variable} must be an integer" in out and "got 'abc'" in out, out
    assert not (tmp_path / "state" / "aep-bridge" / "up.json").exists()
