"""The shim's choice of server (issue 23): a dead or black-holed server must not cost every
hook run its deadline. The server that acked last goes first (``<token>.server`` beside the
spool); a server that is not the last to try has a share of the deadline to answer; instances
start at different places in the list."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from bridge.shim import hook
from tests.clusterfixture import BlackHole, Cluster
from tests.natsfixture import JetStreamClient, NatsServer
from tests.support.cli import free_port
from tests.support.mute import MuteServer
from tests.support.partition import Partitioner, partitioned_cluster
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


# ---------------------------------------------------------------- a server that answers but never acks (issue 39)


@pytest.fixture
def mute() -> Iterator[MuteServer]:
    m = MuteServer()
    try:
        yield m
    finally:
        m.close()


def landed(jetstream: JetStreamClient, instance: str, expected: int, timeout: float = 5.0) -> list[str]:
    """The sessions of the instance's messages on HERMES_RAW (in stream order); checks that
    no message id is there twice."""
    msgs = jetstream.fetch(f"hermes.raw.{hook.token(instance)}.>", expected=expected, timeout=timeout)
    ids = [m.headers.get("Nats-Msg-Id") for m in msgs]
    assert len(set(ids)) == len(ids), ids
    return [m.json()["envelope"]["session_id"] for m in msgs]


MARGIN_S = 2.0  # process start on a loaded 2-core machine; not a timing assertion, a bound on "waits for ever"


def test_a_mute_first_server_is_left_within_its_share_and_remembered_as_bad(
        nats_server: NatsServer, jetstream: JetStreamClient, mute: MuteServer, tmp_path: Path) -> None:
    """The stub accepts, sends INFO, answers PING and never acks a publish (a node cut off from
    the stream's leader). Listed first, for instances whose own place is it: every event lands
    on HERMES_RAW once, each run answers within its deadline, and only each instance's first
    run goes to the stub."""
    servers = f"{mute.url},{nats_server.url}"
    instances = [instance_starting_at(servers, mute.url, f"mute{k}", tmp_path) for k in range(3)]
    for name in instances:
        env = shim_env(servers, tmp_path, name, deadline_ms=DEADLINE_MS)
        for i in range(3):
            run = run_hook(dumps(envelope(session=f"{name}-{i}")), env)
            assert run.answered_empty_object and run.stderr == b"", run
            assert run.elapsed < DEADLINE_MS / 1000 + MARGIN_S, run
        assert hook.server_order(hook.Config(environ=env))[0] == nats_server.url  # moved off the stub
    assert spooled(tmp_path) == 0
    for name in instances:
        assert landed(jetstream, name, 3) == [f"{name}-{i}" for i in range(3)]
    assert mute.connections == len(instances)  # each instance's first run only
    assert mute.publishes == len(instances)  # and it was given the publish, then left


def test_a_spool_replay_leaves_a_mute_server_for_the_next(
        nats_server: NatsServer, jetstream: JetStreamClient, mute: MuteServer, tmp_path: Path) -> None:
    """A non-empty spool with the mute server first: the replay (and the run's own event behind
    it) goes through the second server in the same run; nothing is left in the spool."""
    servers = f"{mute.url},{nats_server.url}"
    instance = instance_starting_at(servers, mute.url, "mutespool", tmp_path)
    env = shim_env(servers, tmp_path, instance, deadline_ms=DEADLINE_MS)
    cfg = hook.Config(environ=env)
    hook.Spool(cfg.spool_dir, instance).append(
        [hook.build_record(dumps(envelope(session=f"old-{i}")), cfg) for i in range(5)])
    run = run_hook(dumps(envelope(session="new")), env)
    assert run.answered_empty_object and run.stderr == b"", run
    assert run.elapsed < DEADLINE_MS / 1000 + MARGIN_S, run
    assert hook.Spool(cfg.spool_dir, instance).pending() == 0 and spooled(tmp_path) == 0
    assert landed(jetstream, instance, 6) == [f"old-{i}" for i in range(5)] + ["new"]
    assert hook.server_order(cfg)[0] == nats_server.url
    assert mute.connections == 1


def test_a_spool_replay_leaves_a_server_that_answers_no_responders_for_the_next(
        nats_server: NatsServer, jetstream: JetStreamClient, tmp_path: Path) -> None:
    """A server that answers every publish at once with 503 "no responders" (no stream behind
    it: a node cut off from its peers answered that in the partition test, issue 42), first in
    the list, with a non-empty spool: the replay goes on to the next server in the same run.
    Before the fix the replay stopped there (a short answer with no error read as "the replay's
    share is spent"), the run's event was spooled behind it, and so was every later run's for as
    long as the node stayed cut (0 of 34 runs acked in a cut, where the same instances' runs
    with an empty spool were)."""
    from tests.natsfixture import ProcessNats

    empty = ProcessNats()  # JetStream on, no stream: every raw publish answers 503 no responders
    empty.start()
    try:
        servers = f"{empty.url},{nats_server.url}"
        instance = instance_starting_at(servers, empty.url, "noresp", tmp_path)
        env = shim_env(servers, tmp_path, instance, deadline_ms=DEADLINE_MS)
        cfg = hook.Config(environ=env)
        hook.Spool(cfg.spool_dir, instance).append(
            [hook.build_record(dumps(envelope(session=f"old-{i}")), cfg) for i in range(3)])
        run = run_hook(dumps(envelope(session="new")), env)
        assert run.answered_empty_object, run
        assert hook.Spool(cfg.spool_dir, instance).pending() == 0 and spooled(tmp_path) == 0, run
        assert landed(jetstream, instance, 4) == [f"old-{i}" for i in range(3)] + ["new"]
        assert hook.server_order(cfg)[0] == nats_server.url  # remembered: the next run starts there
    finally:
        empty.close()


def test_a_mute_server_that_stored_the_publish_makes_no_duplicate(
        nats_server: NatsServer, jetstream: JetStreamClient, tmp_path: Path) -> None:
    """The stub passes the publish on to the real server (stored) and loses the ack: the shim's
    second try, on the real server, carries the same Nats-Msg-Id and is dropped as a duplicate."""
    relay = MuteServer(store_to=nats_server.url)
    try:
        servers = f"{relay.url},{nats_server.url}"
        instance = instance_starting_at(servers, relay.url, "mutestored", tmp_path)
        env = shim_env(servers, tmp_path, instance, deadline_ms=DEADLINE_MS)
        run = run_hook(dumps(envelope(session="once")), env)
        assert run.answered_empty_object and run.stderr == b"", run
        assert relay.publishes == 1 and spooled(tmp_path) == 0
        assert landed(jetstream, instance, 1) == ["once"]
        assert landed(jetstream, instance, 2, timeout=1.0) == ["once"]  # waited for a second one: none came
    finally:
        relay.close()


def test_no_server_acks_the_spool_keeps_the_event_and_memory_moves_off_the_mute_one(
        mute: MuteServer, tmp_path: Path) -> None:
    """Two mute servers: nothing acks, the run still answers in time and spools; the next run
    starts at the second (the first is remembered as bad)."""
    other = MuteServer()
    try:
        servers = f"{mute.url},{other.url}"
        instance = instance_starting_at(servers, mute.url, "allmute", tmp_path)
        env = shim_env(servers, tmp_path, instance, deadline_ms=300)
        run = run_hook(dumps(envelope(session="m")), env)
        assert run.answered_empty_object, run
        assert run.elapsed < 0.3 + MARGIN_S, run
        assert b"spooled" in run.stderr
        cfg = hook.Config(environ=env)
        assert hook.Spool(cfg.spool_dir, instance).status()["pending_records"] == 1
        assert (mute.connections, other.connections) == (1, 1)  # both tried in the one run
        assert hook.server_order(cfg)[0] == other.url
    finally:
        other.close()


def test_spool_drain_leaves_a_mute_server_for_the_next(
        nats_server: NatsServer, jetstream: JetStreamClient, mute: MuteServer, tmp_path: Path) -> None:
    """`aep-bridge spool drain` is a replay too: with the mute server first it drains through
    the second (before: it waited its whole --timeout on the stub and said "stalled")."""
    servers = f"{mute.url},{nats_server.url}"
    instance = instance_starting_at(servers, mute.url, "mutedrain", tmp_path)
    env = shim_env(servers, tmp_path, instance)
    cfg = hook.Config(environ=env)
    hook.Spool(cfg.spool_dir, instance).append(
        [hook.build_record(dumps(envelope(session=f"d-{i}")), cfg) for i in range(20)])
    out = subprocess.run([sys.executable, "-m", "bridge.cli", "spool", "drain", "--timeout", "4", "--quiet"],
                         env={**os.environ, **env}, capture_output=True, text=True, timeout=60,
                         cwd=Path(hook.__file__).parents[2])
    assert out.returncode == 0, out.stderr
    assert landed(jetstream, instance, 20) == [f"d-{i}" for i in range(20)]
    assert hook.Spool(cfg.spool_dir, instance).status()["pending_records"] == 0
    assert hook.server_order(cfg)[0] == nats_server.url
    assert mute.connections == 1


@pytest.fixture
def cut_cluster() -> Iterator[tuple[Cluster, Partitioner]]:
    if os.geteuid() != 0:
        pytest.skip("partitions need root (cgroups and nftables); CI runs as root")
    with partitioned_cluster() as pair:
        yield pair


@pytest.mark.slow
def test_a_node_cut_off_from_its_peers_does_not_capture_the_shims(
        cut_cluster: tuple[Cluster, Partitioner], tmp_path: Path) -> None:
    """The real thing for issue 39: a three-node R3 cluster, one node's routes cut (nftables on
    its cgroup, tests/support/partition.py) while it still serves clients. It is a follower of
    HERMES_RAW and not the meta leader, so the majority keeps its leaders. Instances whose first
    server is the cut node land every event through the majority, within their deadlines."""
    cluster, cuts = cut_cluster
    cluster.bootstrap(replicas=3)
    leader = cluster.wait_leader("HERMES_RAW")
    cut = next(n for n in cluster.nodes if n.name not in (leader, cluster.meta_leader()))
    majority = [n.url for n in cluster.nodes if n is not cut]
    servers = ",".join([cut.url] + majority)
    instances = [instance_starting_at(servers, cut.url, f"cut{k}", tmp_path) for k in range(3)]
    cuts.isolate(cut.name)
    # the cut is real: the node takes the connection and sends INFO, but no ack comes
    probe = hook.Config(environ=shim_env(cut.url, tmp_path / "probe", "probe"))
    errors: list[str] = []
    record = hook.build_record(dumps(envelope(session="probe")), probe)
    assert hook.publish_one(probe, record, time.monotonic() + 1.0, errors) is False
    assert errors and not any("cannot connect" in e or "INFO" in e for e in errors), errors
    for name in instances:
        env = shim_env(servers, tmp_path, name, deadline_ms=DEADLINE_MS)
        for i in range(3):
            run = run_hook(dumps(envelope(session=f"{name}-{i}")), env)
            assert run.answered_empty_object and run.stderr == b"", run
            assert run.elapsed < DEADLINE_MS / 1000 + MARGIN_S, run
        assert hook.server_order(hook.Config(environ=env))[0] != cut.url  # moved off the cut node
    assert spooled(tmp_path) == 0
    c = JetStreamClient(majority)  # type: ignore[arg-type]  # nats.connect takes a list
    try:  # stored by the majority while the node is still cut (the stream leader answers)
        for name in instances:
            info = c.run(c.js.stream_info("HERMES_RAW", subjects_filter=f"hermes.raw.{hook.token(name)}.>"))
            assert sum((info.state.subjects or {}).values()) == 3, name
    finally:
        c.close()
    cuts.heal()
    cluster.wait_ready(60)
    c = cluster.client()
    try:  # once each (an ephemeral consumer needs the whole cluster: read after the heal)
        for name in instances:
            assert landed(c, name, 3, timeout=20) == [f"{name}-{i}" for i in range(3)]
    finally:
        c.close()
