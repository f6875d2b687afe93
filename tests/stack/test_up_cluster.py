"""`aep-bridge up --cluster 3`: three embedded nats-servers on loopback, one JetStream cluster,
every stream at R3, every worker given the three servers. Killing one server (the leader of
AEP_EVENTS) with SIGKILL loses nothing: events published after it reach AEP_EVENTS, and a
`tail` started before it goes on. Real processes throughout."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

from bridge.nats.streams import BUCKETS, OBJECT_STORES, STREAMS
from bridge.stack.server import EmbeddedCluster, EmbeddedNats, terminate
from tests.support.cli import free_port
from tests.support.up import ROOT, cli, expected_summary, pid_alive, running_up, totals
from tests.support.services import wait_for

pytestmark = pytest.mark.slow


def stream_names() -> list[str]:
    return [s.name for s in STREAMS] + [spec.stream_name for spec in (*BUCKETS, *OBJECT_STORES)]


async def _stream_infos(info: dict, names: list[str]) -> dict[str, dict]:
    import nats

    shim = info["client_env"]  # every right (the shims' user reads no stream)
    nc = await nats.connect(servers=info["nats_url"].split(","), user=shim["AEP_BRIDGE_NATS_USER"],
                            password=shim["AEP_BRIDGE_NATS_PASSWORD"], connect_timeout=2, max_reconnect_attempts=2)
    try:
        js = nc.jetstream(timeout=3)
        out = {}
        for name in names:
            si = await js.stream_info(name)
            out[name] = {"replicas": si.config.num_replicas, "leader": si.cluster.leader if si.cluster else None,
                         "peers": [r.name for r in (si.cluster.replicas or [])] if si.cluster else [],
                         "messages": si.state.messages}
        return out
    finally:
        await nc.close()


def stream_infos(info: dict, names: list[str]) -> dict[str, dict]:
    return asyncio.run(_stream_infos(info, names))


def worker_nats_url(pid: int) -> str | None:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    for item in env:
        if item.startswith(b"AEP_BRIDGE_NATS_URL="):
            return item.split(b"=", 1)[1].decode()
    return None


def test_up_cluster_three_servers_r3_and_a_killed_leader_loses_nothing(tmp_path):
    with running_up(tmp_path, "--cluster", "3") as (proc, env, info, tmp):
        state = tmp / "state" / "aep-bridge"
        servers = info["nats_servers"]
        assert len(servers) == 3
        urls = [s["url"] for s in servers]
        assert len(set(urls)) == 3 and all(u.startswith("nats://127.0.0.1:") for u in urls), "loopback only"
        assert info["nats_url"] == ",".join(urls) == info["shim_env"]["AEP_BRIDGE_NATS_URL"]
        assert len({s["name"] for s in servers}) == 3
        stores = [Path(s["store"]) for s in servers]
        assert len(set(stores)) == 3 and all(p.is_dir() and state in p.parents for p in stores)
        assert all(pid_alive(s["pid"]) for s in servers)

        # Every worker has the three servers.
        for name, pid in info["workers"].items():
            assert worker_nats_url(pid) == info["nats_url"], name
        # The banner lists all three.
        wait_for(lambda: "Ctrl-C" in (tmp / "up.out").read_text(), 30, what="the banner")
        banner = (tmp / "up.out").read_text()
        for url in urls:
            assert url in banner

        # Every stream, bucket and object store at R3, on all three servers.
        infos = stream_infos(info, stream_names())
        for name, si in infos.items():
            assert si["replicas"] == 3, (name, si)
            assert si["leader"] and len(si["peers"]) == 2, (name, si)

        # A tail that is already following, then the leader of AEP_EVENTS killed.
        tail_out = open(tmp / "tail.out", "w")
        follower = subprocess.Popen([sys.executable, "-m", "bridge.cli", "tail", "--json"], env=env,
                                    stdout=tail_out, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            time.sleep(2)  # let it subscribe (it follows new events only)
            leader = infos["AEP_EVENTS"]["leader"]
            (victim,) = [s for s in servers if s["name"] == leader]
            os.kill(victim["pid"], signal.SIGKILL)
            wait_for(lambda: not pid_alive(victim["pid"]), 10, what="the killed server to exit")

            def new_leaders() -> bool:
                try:
                    now = stream_infos(info, ["HERMES_RAW", "BRIDGE_MAPPED", "AEP_EVENTS"])
                except Exception:
                    return False
                return all(si["leader"] and si["leader"] != leader for si in now.values())

            wait_for(new_leaders, 60, interval=0.5, what="new stream leaders on the two servers left")

            # Events published after the kill go all the way through.
            summary_file = tmp / "summary.json"
            demo = cli("demo", "--json-summary", str(summary_file), env=env)
            assert demo.returncode == 0, demo.stdout + demo.stderr
            summary = json.loads(summary_file.read_text())
            assert summary["shim_failures"] == 0
            assert totals(summary) == expected_summary()
            mine = f"aep://{summary['instance']}/"

            read = cli("tail", "--json", "--all", "--idle-exit", "3", env=env)
            assert read.returncode == 0, read.stderr
            assert sum(1 for line in read.stdout.splitlines() if mine in line) == summary["events"]

            # The tail that was following across the kill saw them too.
            def followed() -> int:
                return sum(1 for line in (tmp / "tail.out").read_text().splitlines() if mine in line)

            wait_for(lambda: followed() >= summary["events"], 60, what="the running tail to see the new events")
            assert followed() == summary["events"]
            assert follower.poll() is None, "the tail goes on"
        finally:
            terminate(follower, 20)
            tail_out.close()

        # up said so, and still stops everything with one SIGINT.
        assert f"nats-server {victim['name']}" in (tmp / "up.out").read_text()
        live = [s["pid"] for s in servers if s is not victim]
        last = json.loads((state / "up.json").read_text())  # (up removes it when it stops)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        # Every worker process this `up` ran: a worker that exited meanwhile has no pid in
        # up.json while up waits to start it again (CI stop 31 read None there), and one
        # started again has a pid of its own in up's "restarted (pid N)" line.
        said = (tmp / "up.out").read_text()
        workers = worker_pids(info, last, said)
        for pid in [*live, *workers]:
            wait_for(lambda pid=pid: not pid_alive(pid), 10, what=f"pid {pid} to exit")
        restarts = [line for line in said.splitlines() if "exited with code" in line and "nats-server" not in line]
        if restarts:  # not a loss (checked above), but a worker that should have ridden the kill: say why
            warnings.warn("a worker exited after the leader's kill:\n" + "\n".join(restarts) + "\n"
                          + worker_errors(state / "logs"), stacklevel=1)


def worker_pids(first: dict[str, Any], last: dict[str, Any], said: str) -> set[int]:
    """The worker pids in up.json at the start and at the end (None: between two starts) and in
    up's "restarted (pid N)" lines."""
    pids = {pid for state in (first, last) for pid in state["workers"].values() if pid is not None}
    pids.update(int(m) for m in re.findall(r" restarted \(pid (\d+)\)", said))
    return pids


def worker_errors(logs: Path, last: int = 20) -> str:
    """The last error and warning lines of each worker's log (for a failure's message)."""
    out = []
    for log in sorted(logs.glob("*.log")):
        if log.name.startswith("nats-server"):
            continue
        lines = [line for line in log.read_text(errors="replace").splitlines()
                 if '"level": "error"' in line or '"level": "warning"' in line or "Traceback" in line]
        out += [f"--- {log.name}", *lines[-last:]]
    return "\n".join(out)


def test_up_cluster_refuses_an_external_server_and_too_few_nodes(tmp_path):
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state"), "AEP_BRIDGE_CONFIG": os.devnull}
    both = cli("up", "--cluster", "3", "--nats", "nats://127.0.0.1:1", env=env, timeout=30)
    assert both.returncode == 2 and "--cluster" in both.stderr and "--nats" in both.stderr
    small = cli("up", "--cluster", "2", env=env, timeout=30)
    assert small.returncode == 2 and "at least 3" in small.stderr


async def _heard(rogue_url: str, cluster: EmbeddedCluster, password: str, seconds: float) -> list[bytes]:
    """Publish on the cluster (as up's user) for ``seconds``; what a subscriber on ``rogue_url`` got."""
    import nats

    heard: list[bytes] = []
    spy = await nats.connect(rogue_url)
    pub = await nats.connect(servers=cluster.urls, user="aep-local", password=password)
    try:
        async def hear(msg: Any) -> None:
            heard.append(msg.data)

        await spy.subscribe("hermes.raw.>", cb=hear)
        await spy.flush()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not heard:
            await pub.publish("hermes.raw.gw.pre_tool_call", b"secret")
            await pub.flush()
            await asyncio.sleep(0.2)
    finally:
        await spy.close()
        await pub.close()
    return heard


def test_cluster_routes_accept_only_their_own_credential(tmp_path):
    """A route sees every message: a server routing to up's cluster without the generated
    route credential is refused and hears nothing; with it, it would (the guard)."""
    password = "client-password-for-this-test"
    auth = f'authorization {{ user: "aep-local", password: "{password}" }}\n'
    cluster = EmbeddedCluster(tmp_path / "cluster", client_config=auth).start()
    try:
        for creds, name in (("", "rogue"), (f"{EmbeddedCluster.ROUTE_USER}:{cluster.route_password}@", "member")):
            rogue = EmbeddedNats(tmp_path / name, log_file=tmp_path / f"{name}.log", extra_args=[
                "--name", name, "--cluster_name", EmbeddedCluster.NAME, "--cluster", f"nats://127.0.0.1:{free_port()}",
                "--routes", f"nats-route://{creds}127.0.0.1:{cluster.route_ports[0]}"]).start()
            try:
                if not creds:
                    wait_for(lambda: "authorization violation" in (tmp_path / "rogue.log").read_text().lower(), 20,
                             what="the route to be refused")
                    assert asyncio.run(_heard(rogue.url, cluster, password, 2.0)) == []
                else:
                    assert asyncio.run(_heard(rogue.url, cluster, password, 20.0)), "a routed server hears it"
            finally:
                rogue.stop()
    finally:
        cluster.stop()


@pytest.mark.parametrize("sync, want", [("always", True), (None, False)])
def test_cluster_nodes_fsync_every_write_as_production_does(tmp_path, sync, want):
    """`up --cluster` runs what deploy/nats/nats.conf and the chart promise: JetStream fsyncs
    every write (`sync_interval: always`), read back from a real node's /varz; ``None`` leaves
    nats-server's default (2m), the contrast that shows the check can fail."""
    import urllib.request

    kwargs = {} if sync == "always" else {"sync_interval": sync}  # the default is what `up` runs
    cluster = EmbeddedCluster(tmp_path / "cluster", **kwargs)
    monitor = free_port()
    cluster.nodes[0].extra_args += ["-m", str(monitor)]
    cluster.start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{monitor}/varz", timeout=5) as r:
            config = json.loads(r.read())["jetstream"]["config"]
        assert bool(config.get("sync_always")) is want, config
        assert config["store_dir"].startswith(str(tmp_path / "cluster")), config  # -sd still wins over the block
    finally:
        cluster.stop()


def test_worker_pids_skip_a_worker_between_two_starts_and_add_the_restarted():
    said = "aep-bridge up: relay exited with code 1; restarting in 1.0s\naep-bridge up: relay restarted (pid 4242)\n"
    first = {"workers": {"mapper": 11, "pairing": 12, "relay": 13}}
    last = {"workers": {"mapper": 11, "pairing": None, "relay": 4242}}
    assert worker_pids(first, last, said) == {11, 12, 13, 4242}
