"""The relay's NATS connection watched like every service's (issue 22): credentials the server
refuses when the relay reconnects make it exit 1, so its supervisor starts it on a new
connection, instead of a relay whose /healthz says ok while it can never read AEP_EVENTS again."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import nats

from bridge.services.relay.config import RelayConfig
from bridge.services.relay.service import Relay
from bridge.stack.server import terminate
from tests.support.cli import free_port
from tests.support.auth_server import USER, AuthServer
from tests.support.services import http_json, wait_for

ROOT = Path(__file__).resolve().parents[3]


def test_credentials_refused_on_reconnect_make_the_relay_exit_1(tmp_path: Path) -> None:
    """Before the fix the relay checked only whether its connection was closed: reconnecting
    forever on 'Authorization Violation', it kept answering /healthz 200."""
    server = AuthServer(tmp_path, "pw-1").start()
    env = {**os.environ, "AEP_BRIDGE_CONFIG": os.devnull, "AEP_BRIDGE_LOG_FORMAT": "json",
           "AEP_BRIDGE_NATS_URL": server.url, "AEP_BRIDGE_NATS_USER": USER, "AEP_BRIDGE_NATS_PASSWORD": "pw-1"}
    for var in ("AEP_BRIDGE_NATS_TOKEN", "AEP_BRIDGE_RELAY_TOKEN", "AEP_BRIDGE_RELAY_TOKENS_FILE"):
        env.pop(var, None)
    subprocess.run([sys.executable, "-m", "bridge.cli", "bootstrap"], check=True, capture_output=True, cwd=ROOT, env=env)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "relay.log"
    with open(log_path, "wb") as log:
        relay = subprocess.Popen([sys.executable, "-m", "bridge.cli", "relay", "--listen", f"127.0.0.1:{port}"],
                                 stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        wait_for(lambda: http_json(url + "/readyz")[0] == 200, 60, what="the relay ready")
        status, health = http_json(url + "/healthz")
        assert status == 200 and health["service"] == "relay" and health["nats"] == "connected", health
        server.stop()  # away: nats-py reconnects; /healthz says so (still live: the server may come back)
        wait_for(lambda: http_json(url + "/healthz")[1].get("nats") in ("reconnecting", "disconnected"), 30,
                 what="the relay's /healthz to report the connection away")
        status, health = http_json(url + "/healthz")
        assert status == 200 and health["status"] == "ok" and "position" in health, health
        server.write("pw-2")
        server.start()
        wait_for(lambda: relay.poll() is not None or http_json(url + "/healthz")[0] == 503, 60,
                 what="the relay to see its credentials refused (exit, or /healthz 503)")
        assert relay.wait(30) == 1, log_path.read_text(errors="replace")[-2000:]
        logs = log_path.read_text(errors="replace")
        assert "nats_connection_lost" in logs and "refused the credentials" in logs, logs[-2000:]
    finally:
        terminate(relay, 10)
        server.stop()


def test_the_relays_healthz_is_the_runtimes_health(nats_server) -> None:  # type: ignore[no-untyped-def]
    """/healthz answers from the runtime's Health: the connection's state, and 503 with the reason
    once the runtime has found the connection unusable (credentials refused while reconnecting,
    `watch_connection`), not only once the connection is closed."""

    async def go() -> list[tuple[int, dict]]:
        nc = await nats.connect(nats_server.url)
        relay = Relay(RelayConfig(port=0), js=None, nc=nc)
        runner = await relay.start()
        seen = []
        try:
            async with aiohttp.ClientSession() as s:
                for failure in (None, "NATS refused the credentials while reconnecting (test)"):
                    relay.health.failed = failure
                    async with s.get(f"http://127.0.0.1:{relay.cfg.port}/healthz") as r:
                        seen.append((r.status, await r.json()))
        finally:
            await runner.cleanup()
            await nc.close()
        return seen

    (ok, healthy), (bad, failed) = asyncio.run(go())
    assert ok == 200 and healthy["status"] == "ok" and healthy["nats"] == "connected", healthy
    assert bad == 503 and failed["status"] == "failed" and "refused the credentials" in failed["error"], failed
