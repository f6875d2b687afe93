"""The shim's choice of server (issue 23): a dead or black-holed server must not cost every
hook run its deadline. The server that acked last goes first (``<token>.server`` beside the
spool); a server that is not the last to try has a share of the deadline to answer; instances
start at different places in the list."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from bridge.shim import hook
from tests.clusterfixture import BlackHole, Cluster
from tests.natsfixture import JetStreamClient, NatsServer, free_port
from tests.support.shim import dumps, envelope, run_hook, shim_env

DEADLINE_MS = 1000  # roomy for a loaded machine: the assertions count connections, not time


@pytest.fixture
def black_hole() -> Iterator[BlackHole]:
    bh = BlackHole()
    try:
        yield bh
    finally:
        bh.close()


def instance_starting_at(servers: str, first: str, prefix: str, tmp_path: Path) -> str:
    """An instance name whose own place in the list (no server remembered yet) is ``first``."""
    for _ in range(1000):
        name = f"{prefix}-{uuid.uuid4().hex[:8]}"
        cfg = hook.Config(environ=shim_env(servers, tmp_path, name))
        if hook.server_order(cfg)[0] == first:
            return name
    raise AssertionError("no instance name starts at " + first)


def spooled(tmp_path: Path) -> int:
    return sum(p.stat().st_size for p in tmp_path.rglob("*.spool"))


def test_a_black_holed_first_server_costs_one_run_at_most(
        nats_server: NatsServer, jetstream: JetStreamClient, black_hole: BlackHole, tmp_path: Path) -> None:
    servers = f"{black_hole.url},{nats_server.url}"
    instance = instance_starting_at(servers, black_hole.url, "bh", tmp_path)
    env = shim_env(servers, tmp_path, instance, deadline_ms=DEADLINE_MS)
    first = run_hook(dumps(envelope(session="bh-1")), env)
    assert first.answered_empty_object and first.stderr == b"", first
    assert spooled(tmp_path) == 0  # the black hole had a share of the deadline, the healthy one the rest
    assert black_hole.accepted == 1
    for i in range(2, 5):
        run = run_hook(dumps(envelope(session=f"bh-{i}")), env)
        assert run.answered_empty_object and run.stderr == b"", run
    assert black_hole.accepted == 1  # runs 2-4 went straight to the server that answered
    assert spooled(tmp_path) == 0
    assert len(jetstream.fetch(f"hermes.raw.{hook.token(instance)}.>", expected=4)) == 4


def test_a_dead_first_server_is_skipped(nats_server: NatsServer, jetstream: JetStreamClient, tmp_path: Path) -> None:
    dead = f"nats://127.0.0.1:{free_port()}"  # nothing listens: refused at once
    servers = f"{dead},{nats_server.url}"
    instance = instance_starting_at(servers, dead, "dead", tmp_path)
    env = shim_env(servers, tmp_path, instance, deadline_ms=DEADLINE_MS)
    for i in range(3):
        run = run_hook(dumps(envelope(session=f"d-{i}")), env)
        assert run.answered_empty_object and run.stderr == b"", run
    assert spooled(tmp_path) == 0
    assert len(jetstream.fetch(f"hermes.raw.{hook.token(instance)}.>", expected=3)) == 3
    cfg = hook.Config(environ=env)
    assert hook.server_order(cfg)[0] == nats_server.url  # remembered


def test_the_remembered_server_going_dark_moves_the_shim_on(
        nats_server: NatsServer, jetstream: JetStreamClient, black_hole: BlackHole, tmp_path: Path) -> None:
    servers = f"{nats_server.url},{black_hole.url}"
    instance = instance_starting_at(servers, nats_server.url, "dark", tmp_path)
    cfg = hook.Config(environ=shim_env(servers, tmp_path, instance))
    hook.remember_server(cfg, black_hole.url)  # it answered last, then went dark
    assert hook.server_order(cfg)[0] == black_hole.url
    env = shim_env(servers, tmp_path, instance, deadline_ms=DEADLINE_MS)
    for i in range(3):
        run = run_hook(dumps(envelope(session=f"k-{i}")), env)
        assert run.answered_empty_object and run.stderr == b"", run
    assert black_hole.accepted == 1 and spooled(tmp_path) == 0
    assert hook.server_order(cfg)[0] == nats_server.url
    assert len(jetstream.fetch(f"hermes.raw.{hook.token(instance)}.>", expected=3)) == 3


def test_the_remembered_server_keeps_no_credentials(tmp_path: Path) -> None:
    servers = "nats://alice:s3cret@10.0.0.1:4222,nats://tok3n@10.0.0.2:4222"
    cfg = hook.Config(environ=shim_env(servers, tmp_path, "creds"))
    second = [s for s in hook.server_order(cfg)][1]
    hook.remember_server(cfg, second)
    assert hook.server_order(cfg)[0] == second
    kept = b"".join(p.read_bytes() for p in tmp_path.glob("*.server"))
    assert kept and b"s3cret" not in kept and b"tok3n" not in kept and b"alice" not in kept
    three = hook.Config(environ=shim_env("nats://a:1,nats://b:2,nats://c:3", tmp_path, "creds"))
    start = hook.server_order(three)
    hook.remember_server(three, start[1])  # round the list from the remembered one
    assert hook.server_order(three) == start[1:] + start[:1]
    hook.remember_server(cfg, "nats://elsewhere:1")  # not in the list: ignored when read
    assert sorted(hook.server_order(cfg)) == sorted(cfg.servers)


def test_instances_spread_over_the_servers_the_same_way_in_every_process(tmp_path: Path) -> None:
    servers = "nats://a:1,nats://b:2,nats://c:3"
    names = [f"gw-{i}" for i in range(30)]
    firsts = [hook.server_order(hook.Config(environ=shim_env(servers, tmp_path, n)))[0] for n in names]
    assert set(firsts) == {"nats://a:1", "nats://b:2", "nats://c:3"}
    for n in names[:3]:  # each order is the whole list, rotated
        order = hook.server_order(hook.Config(environ=shim_env(servers, tmp_path, n)))
        i = order.index("nats://a:1")
        assert order[i:] + order[:i] == ["nats://a:1", "nats://b:2", "nats://c:3"]
    # not Python's randomised str hash: another interpreter (another hash seed) agrees
    code = ("import sys; sys.path.insert(0, %r); from bridge.shim import hook; "
            "print(','.join(hook.server_order(hook.Config(environ={'AEP_BRIDGE_CONFIG': '/dev/null', "
            "'AEP_BRIDGE_NATS_URL': %r, 'AEP_BRIDGE_SPOOL_DIR': %r, 'AEP_BRIDGE_INSTANCE': n}))[0] for n in %r))"
            % (str(Path(hook.__file__).parents[2]), servers, str(tmp_path), names))
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30,
                           env={"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"})
    assert other.returncode == 0, other.stderr
    assert other.stdout.strip().split(",") == firsts


def test_one_server_reads_no_file(tmp_path: Path) -> None:
    cfg = hook.Config(environ=shim_env("nats://only:4222", tmp_path, "solo"))
    (tmp_path / f"{hook.token('solo')}.server").write_text("nats://other:1\n")
    assert hook.server_order(cfg) == ["nats://only:4222"]


@pytest.mark.slow
def test_a_paused_cluster_node_does_not_spool(nats_cluster: Cluster, tmp_path: Path) -> None:
    """The real thing: three servers at R3, the first SIGSTOPped (accepts, never answers).
    It is a follower of HERMES_RAW: pausing the stream's leader stops every publish until
    the cluster elects another (seconds), whichever server the shim picks."""
    nats_cluster.bootstrap(replicas=3)
    leader = nats_cluster.wait_leader("HERMES_RAW")
    paused = next(n for n in nats_cluster.nodes if n.name not in (leader, nats_cluster.meta_leader()))
    servers = ",".join([paused.url] + [n.url for n in nats_cluster.nodes if n is not paused])
    instance = instance_starting_at(servers, paused.url, "paused", tmp_path)
    env = shim_env(servers, tmp_path, instance, deadline_ms=DEADLINE_MS)
    assert run_hook(dumps(envelope(session="p-0")), env).answered_empty_object  # warm: the stream has a leader
    paused.pause()
    try:
        for i in range(1, 4):
            run = run_hook(dumps(envelope(session=f"p-{i}")), env)
            assert run.answered_empty_object and run.stderr == b"", run
        assert spooled(tmp_path) == 0
    finally:
        paused.resume()
    nats_cluster.wait_ready(60)  # the resumed node back in the meta group before anything asks it
    c = nats_cluster.client()
    try:
        assert len(c.fetch(f"hermes.raw.{hook.token(instance)}.>", expected=4, timeout=20)) == 4
    finally:
        c.close()
