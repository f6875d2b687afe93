"""Zombies (issue 13, finding 3): a NATS connection that is closed, or unusable for good, must
never leave a service that consumes nothing while its probes say it is fine.

* The server closes every service connection (a credential rotation: the server's config is
  reloaded with another password, and nats-py never reconnects a connection the server closed
  with an error). The services exit non-zero, `aep-bridge up` restarts them (they keep failing,
  visibly, while the credential is wrong), and once the credential is right again the stream
  continues: an event sent afterwards reaches AEP_EVENTS.
* `/healthz` says the connection's state (and is 503 once it is closed); `/readyz` is false while
  the server is away.
* `/readyz` of pairing is false while it owns no partition although it should (here: the only
  partition's checkpoint cannot be read, so the partition stays unowned).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


from bridge.nats.streams import MAPPER_DURABLE
from bridge.stack.server import terminate
from tests.support.cli import free_port
from tests.natsfixture import JetStreamClient
from tests.support.auth_server import USER, AuthServer
from tests.support.services import Service, http_json, wait_for
from tests.support.shim import dumps, envelope, run_hook, shim_env

ROOT = Path(__file__).resolve().parents[2]


def _env(tmp: Path, password: str) -> dict[str, str]:
    env = {**os.environ, "XDG_STATE_HOME": str(tmp / "state"), "AEP_BRIDGE_CONFIG": os.devnull,
           "AEP_BRIDGE_NATS_USER": USER, "AEP_BRIDGE_NATS_PASSWORD": password, "AEP_BRIDGE_LOG_FORMAT": "json"}
    for var in ("AEP_BRIDGE_NATS_URL", "AEP_BRIDGE_NATS_TOKEN", "AEP_HERMES_CONTROL", "AEP_INSTRUCT"):
        env.pop(var, None)
    return env


async def _session_started(url: str, password: str, session: str, timeout: float) -> bool:
    import nats

    nc = await nats.connect(url, user=USER, password=password, connect_timeout=3, allow_reconnect=False)
    try:
        sub = await nc.jetstream().subscribe(f"aep.hermes.{session}.session.started", ordered_consumer=True)
        try:
            await sub.next_msg(timeout=timeout)
            return True
        except Exception:
            return False
    finally:
        await nc.close()


def _send(url: str, tmp: Path, password: str, session: str) -> None:
    env = shim_env(url, tmp / "spool", "gw-health", DEADLINE_MS="3000", NATS_USER=USER, NATS_PASSWORD=password)
    r = run_hook(dumps(envelope("on_session_start", session=session)), env)
    assert r.answered_empty_object and r.stderr == b"", r.stderr


def test_a_connection_closed_by_the_server_is_replaced_and_the_stream_continues(tmp_path: Path) -> None:
    """Before the fix: after the server closed the connections, every worker stayed up
    (mapper: `fetch_failed` forever; pairing: every partition ended; the gate: `fetch_failed`),
    /healthz said ok, and the event sent after the credential was right again was never mapped."""
    server = AuthServer(tmp_path, "pw-1").start()
    mapper_port, pairing_port, gate_port = free_port(), free_port(), free_port()
    out = open(tmp_path / "up.out", "w")
    up = subprocess.Popen([sys.executable, "-m", "bridge.cli", "up", "--nats", server.url, "--mapper-port", str(mapper_port),
                           "--pairing-port", str(pairing_port), "--gate", "--gate-port", str(gate_port)],
                          env=_env(tmp_path, "pw-1"), stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    state = tmp_path / "state" / "aep-bridge" / "up.json"
    try:
        for port in (mapper_port, pairing_port, gate_port):
            wait_for(lambda port=port: http_json(f"http://127.0.0.1:{port}/readyz")[0] == 200, 60, what="workers ready")
        _send(server.url, tmp_path, "pw-1", "s-before")
        assert asyncio.run(_session_started(server.url, "pw-1", "s-before", 30)), "the pipeline flows"
        before = json.loads(state.read_text())["workers"]

        server.rotate("pw-2")  # the server closes every connection of the old credential
        time.sleep(4)  # meanwhile the workers cannot connect: they exit and up restarts them, with backoff
        server.rotate("pw-1")  # the credential is right again

        _send(server.url, tmp_path, "pw-1", "s-after")
        assert asyncio.run(_session_started(server.url, "pw-1", "s-after", 60)), (
            "the stream did not continue after the server closed the connections:\n"
            + (tmp_path / "up.out").read_text()[-2000:])
        after = json.loads(state.read_text())["workers"]
        assert all(after[name] != before[name] for name in ("mapper", "pairing", "gate")), (before, after)
        for port in (mapper_port, pairing_port, gate_port):
            wait_for(lambda port=port: http_json(f"http://127.0.0.1:{port}/readyz")[0] == 200, 60, what="ready again")
            status, health = http_json(f"http://127.0.0.1:{port}/healthz")
            assert status == 200 and health["nats"] == "connected", health
        printed = (tmp_path / "up.out").read_text()
        for name in ("mapper", "pairing", "gate"):
            assert f"{name} exited with code 1" in printed, printed
        logs = (tmp_path / "state" / "aep-bridge" / "logs" / "mapper.log").read_text()
        assert "nats_connection_lost" in logs
    finally:
        terminate(up, 60, signal.SIGINT)
        out.close()
        server.stop()


def test_healthz_reports_the_connection_and_readyz_is_false_while_the_server_is_away(tmp_path: Path) -> None:
    """Before the fix /healthz did not say the connection's state, and pairing's /readyz stayed
    true while NATS was gone."""
    server = AuthServer(tmp_path, "pw").start()
    env = {"AEP_BRIDGE_NATS_USER": USER, "AEP_BRIDGE_NATS_PASSWORD": "pw"}
    subprocess.run([sys.executable, "-m", "bridge.cli", "bootstrap"], check=True, capture_output=True, cwd=ROOT,
                   env={**os.environ, "AEP_BRIDGE_CONFIG": os.devnull, "AEP_BRIDGE_NATS_URL": server.url, **env})
    ports = {"mapper": free_port(), "pairing": free_port()}
    services = [Service(name, server.url, tmp_path, env=env) for name in ports]
    for svc in services:  # --metrics-port 0: the real port is in the start-up log line
        svc.start()
    try:
        urls = {}
        for svc in services:
            wait_for(lambda svc=svc: "metrics_port" in svc.log(), 30, what=f"{svc.name} started")
            line = next(l for l in svc.log().splitlines() if "metrics_port" in l)
            urls[svc.name] = f"http://127.0.0.1:{json.loads(line)['metrics_port']}"
        for name, url in urls.items():
            wait_for(lambda url=url: http_json(url + "/readyz")[0] == 200, 30, what=f"{name} ready")
            status, health = http_json(url + "/healthz")
            assert status == 200 and health["nats"] == "connected", health
        server.stop()  # NATS away: nats-py reconnects (not closed), the services are not ready
        for name, url in urls.items():
            wait_for(lambda url=url: http_json(url + "/readyz")[0] == 503, 20, what=f"{name} not ready")
            status, health = http_json(url + "/healthz")
            assert health["nats"] in ("reconnecting", "disconnected"), (name, health)
        server.start()
        for name, url in urls.items():
            wait_for(lambda url=url: http_json(url + "/readyz")[0] == 200, 60, what=f"{name} ready again")
        assert all(svc.alive() for svc in services)
    finally:
        for svc in services:
            svc.terminate()
        server.stop()


def test_pairing_is_not_ready_while_it_owns_no_partition_although_it_should(tmp_path: Path) -> None:
    """The only partition's checkpoint cannot be read: pairing keeps it unowned (it must not
    replay seven days) and says so. Before the fix /readyz stayed 200."""
    import nats

    server = AuthServer(tmp_path, "pw").start()
    env = {"AEP_BRIDGE_NATS_USER": USER, "AEP_BRIDGE_NATS_PASSWORD": "pw"}
    subprocess.run([sys.executable, "-m", "bridge.cli", "bootstrap"], check=True, capture_output=True, cwd=ROOT,
                   env={**os.environ, "AEP_BRIDGE_CONFIG": os.devnull, "AEP_BRIDGE_NATS_URL": server.url, **env})

    async def corrupt() -> None:
        nc = await nats.connect(server.url, user=USER, password="pw")
        try:
            store = await nc.jetstream().object_store("aep_checkpoints")
            await store.put("p.0", b"not a zlib stream")
        finally:
            await nc.close()

    asyncio.run(corrupt())
    svc = Service("pairing", server.url, tmp_path, "--partitions", "1", env=env).start()
    try:
        wait_for(lambda: "metrics_port" in svc.log(), 30, what="pairing started")
        line = next(l for l in svc.log().splitlines() if "metrics_port" in l)
        url = f"http://127.0.0.1:{json.loads(line)['metrics_port']}"
        wait_for(lambda: "partition_restore_failed" in svc.log() or "maintain_failed" in svc.log(), 30,
                 what="a restore attempt")
        time.sleep(5)  # several maintain rounds
        assert "partition_acquired" not in svc.log()
        assert http_json(url + "/readyz")[0] == 503
        status, health = http_json(url + "/healthz")
        assert status == 200 and health["partitions"] == [] and "0" in health.get("unowned", {}), health
    finally:
        svc.terminate()
        server.stop()


def test_no_credential_of_the_nats_url_reaches_a_log(nats_server, tmp_path):
    """The mapper logged AEP_BRIDGE_NATS_URL as given, `user:password@` included."""
    url = nats_server.url.replace("nats://", "nats://aep-mapper:S3CRET-IN-URL@")
    mapper = Service("mapper", url, tmp_path, "--metrics-port", "0").start()

    def whole_log() -> str:  # not Service.log()'s last 4,000 characters: on the session's shared server
        try:  # the mapper may map (and log) what earlier tests left, past its start line
            return mapper.log_path.read_text(errors="replace")
        except OSError:
            return ""

    try:
        wait_for(lambda: "mapper_starting" in whole_log(), 30, what="the mapper's start line")
    finally:
        mapper.terminate()
    assert "S3CRET-IN-URL" not in whole_log() and "mapper_starting" in whole_log()


def test_a_mapper_whose_consumer_was_deleted_binds_again_and_is_ready_with_nothing_to_map(nats_server_fn, tmp_path: Path) -> None:
    """The durable deleted under a running mapper: its fetch fails, it binds again (recreating
    the durable) and is ready again, although no message came since. Before the fix /readyz
    stayed 503 until the next raw message (in a cluster a fresh durable's first fetch can fail
    the same way, and the mapper never became ready)."""
    client = JetStreamClient(nats_server_fn.url)
    client.bootstrap()
    svc = Service("mapper", nats_server_fn.url, tmp_path).start()
    try:
        wait_for(lambda: "metrics_port" in svc.log(), 30, what="mapper started")
        line = next(l for l in svc.log().splitlines() if "metrics_port" in l)
        url = f"http://127.0.0.1:{json.loads(line[line.index('{'):])['metrics_port']}/readyz"
        wait_for(lambda: http_json(url)[0] == 200, 30, what="mapper ready")
        client.run(client.js.delete_consumer("HERMES_RAW", MAPPER_DURABLE))
        wait_for(lambda: "mapper_rebound" in svc.log(), 30, what="the mapper to bind again")
        wait_for(lambda: http_json(url)[0] == 200, 10, what="the mapper ready again with nothing to map")
    finally:
        svc.terminate()
        client.close()
