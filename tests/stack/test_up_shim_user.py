"""Issue 44 item 4: `aep-bridge up --gate` hands the shims a user of their own, with the shim's
rights only. Before the fix the banner's "wire Hermes" line, up.json's ``shim_env`` and the
control plane's shim settings all carried ``aep-local`` (every right): with it an agent whose
tools run as the shim's user approved its own held call, read HERMES_RAW and read the held
calls' bucket. Now, with the credential `up` gives a shim: a command answering a held call,
HERMES_RAW and aep_control are refused, and the shim still delivers (its events reach the
stream, a held call waits for the operator, who answers with `up`'s own credential)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import nats

from bridge.commands.control import build_command
from bridge.core import control as C
from bridge.core.aep import encode_event
from bridge.core.lanes import lane_token
from tests.support.cli import free_port
from tests.support.services import http_json as http_get, wait_for
from tests.support.shim import compiled_hook, dumps, envelope, run_hook, shim_env
from tests.support.up import cli, running_up


async def attempts(url: str, env: dict[str, str], session: str) -> dict[str, str]:
    """What an agent holding the shim's settings tries; each outcome (a refusal names it)."""
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    nc = await nats.connect(url, user=env["AEP_BRIDGE_NATS_USER"], password=env["AEP_BRIDGE_NATS_PASSWORD"],
                            inbox_prefix="_INBOX.hermes.agent", error_cb=on_error, allow_reconnect=False)
    js = nc.jetstream(timeout=1.5)
    out: dict[str, str] = {}
    try:
        cmd = build_command(C.RESPOND, session, {"answer": {"option": "allow"}}, sender="agent", subject="any")
        subject = f"aep.hermes.{lane_token(session)}.control.attention.respond"
        for what, coro in (("approve", js.publish(subject, encode_event(cmd))),
                           ("raw", js.stream_info("HERMES_RAW")),
                           ("raw_consumer", js.pull_subscribe("hermes.raw.>", durable="agent", stream="HERMES_RAW")),
                           ("cards", js.key_value("aep_control"))):
            try:
                await coro
                out[what] = "allowed"
            except Exception as exc:
                out[what] = f"{type(exc).__name__}: {exc}"
        await asyncio.sleep(0.3)
        out["violations"] = " | ".join(e for e in errors if "ermissions" in e)
    finally:
        await nc.close()
    return out


def test_up_gives_shims_a_user_with_the_shims_rights_only(tmp_path) -> None:
    with running_up(tmp_path, "--gate", "--gate-port", str(free_port()), workers=4) as (proc, env, info, tmp):
        url = info["nats_url"]
        observe, control = info["shim_env"], info["control"]["shim_env"]
        operator = info.get("client_env") or info["shim_env"]  # before the fix: one user, in shim_env
        wait_for(lambda: "Ctrl-C" in (tmp / "up.out").read_text(), 30, what="the banner")
        readyz = info["metrics"]["gate"].replace("/metrics", "/readyz")
        wait_for(lambda: http_get(readyz)[0] == 200, 30, what="the gate's /readyz")  # its raw consumer takes new ones
        banner = (tmp / "up.out").read_text()

        session = f"s-up-shim-{time.time_ns()}"
        shim = {**shim_env(url, tmp / "spool", "up-shim", DEADLINE_MS="2000"), **control}
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
            # The agent, with each credential up hands a shim, tries to answer its own call,
            # read the raw stream and the held calls.
            for name, creds in (("shim_env", observe), ("control.shim_env", control)):
                got = asyncio.run(attempts(url, creds, session))
                print(name, got)
                assert all(got[k] != "allowed" for k in ("approve", "raw", "raw_consumer", "cards")), (name, got)
                for subject in ("control.attention.respond", "$JS.API.STREAM.INFO.HERMES_RAW",
                                "$JS.API.STREAM.INFO.KV_aep_control"):
                    assert subject.lower() in got["violations"].lower(), (name, subject, got)
            # Still held: nothing the agent sent answered it. The operator's deny does.
            assert held.poll() is None
            answer = cli("control", "respond", cards[0]["id"], "deny", "--nats", url, env=env)
            assert answer.returncode == 0 and answer.stdout.startswith("accepted"), answer.stdout + answer.stderr
            out, err = held.communicate(timeout=30)
            assert json.loads(out)["action"] == "block", (out, err)
        finally:
            if held.poll() is None:
                held.kill()
        wire = next(line for line in banner.splitlines() if "wire Hermes" in line)
        assert f"AEP_BRIDGE_NATS_PASSWORD={observe['AEP_BRIDGE_NATS_PASSWORD']} " in wire, wire
        assert operator["AEP_BRIDGE_NATS_PASSWORD"] not in wire
        for env_ in (observe, control):
            assert env_["AEP_BRIDGE_NATS_USER"] != operator["AEP_BRIDGE_NATS_USER"], info
            assert env_["AEP_BRIDGE_NATS_PASSWORD"] != operator["AEP_BRIDGE_NATS_PASSWORD"], info
        # The observe-only shim user delivers too: its event reaches the stream.
        plain = {**shim_env(url, tmp / "spool-plain", "up-plain", DEADLINE_MS="2000"), **observe}
        run = run_hook(dumps(envelope("on_session_start", session=session + "-plain")), plain)
        assert run.answered_empty_object, run.stderr
        assert not any(p.stat().st_size for p in (tmp / "spool-plain").glob("*.spool")), run.stderr
        tail = cli("tail", "--nats", url, "--json", "--all", "--idle-exit", "2", env=env)
        assert f"/session/{session}-plain" in tail.stdout, tail.stdout[-2000:] + tail.stderr
