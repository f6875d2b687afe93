"""The cluster fault suite (issue 23): one scenario per test, each on a fresh three-node
cluster, every client given the full server list. See tests/cluster/harness.py for the run
and the checks each scenario ends with; each scenario also checks that its fault happened."""

from __future__ import annotations

import time

import pytest

from tests.cluster.harness import ClusterRun


@pytest.fixture
def run(nats_cluster, tmp_path):
    r = ClusterRun(nats_cluster, tmp_path)
    try:
        yield r
    finally:
        r.close()


def kill_leader_and_restart(run: ClusterRun, stream: str) -> None:
    cluster = run.cluster
    run.start_traffic()
    run.at(15.0)
    leader = cluster.wait_leader(stream)
    cluster.node(leader).kill()
    new = cluster.wait_leader(stream, not_on=leader)
    print(f"{stream}: leader {leader} killed, new leader {new}")
    run.at(25.0)
    cluster.node(leader).start()
    run.finish()


@pytest.mark.slow
def test_kill_9_the_aep_events_leader(run):
    kill_leader_and_restart(run, "AEP_EVENTS")


@pytest.mark.slow
def test_kill_9_the_hermes_raw_leader(run):
    kill_leader_and_restart(run, "HERMES_RAW")


@pytest.mark.slow
def test_kill_9_the_bridge_mapped_leader(run):
    kill_leader_and_restart(run, "BRIDGE_MAPPED")


@pytest.mark.slow
def test_kill_9_the_leases_bucket_leader(run):
    kill_leader_and_restart(run, "KV_aep_leases")


@pytest.mark.slow
def test_sigstop_one_node_for_20_s(run):
    cluster = run.cluster
    run.start_traffic()
    run.at(15.0)
    victim = cluster.wait_leader("AEP_EVENTS")  # the node that matters most to the pipeline
    cluster.node(victim).pause()
    new = cluster.wait_leader("AEP_EVENTS", not_on=victim)
    print(f"{victim} paused; AEP_EVENTS leader now {new}")
    run.at(35.0)
    cluster.node(victim).resume()
    run.finish()


@pytest.mark.slow
def test_rolling_restart_of_all_three_nodes_during_traffic(run):
    cluster = run.cluster
    run.start_traffic()
    run.at(10.0)
    for node in cluster.nodes:
        node.stop()  # SIGTERM: what a rolling upgrade does
        time.sleep(3.0)
        node.start()
        cluster.wait_ready(60)  # back in the meta group before the next one goes
        print(f"{node.name} restarted at {time.monotonic() - run.t0:.1f} s")
    run.finish()


@pytest.mark.slow
def test_one_node_store_wiped_catches_up(run):
    cluster = run.cluster
    run.start_traffic()
    run.at(15.0)
    victim = next(n for n in cluster.nodes if n.name != cluster.meta_leader())
    victim.wipe()
    run.at(25.0)
    victim.start()
    cluster.wait_ready(60)
    run.finish()
    # it caught up: its own copy of AEP_EVENTS holds what the leader holds
    deadline = time.monotonic() + 60
    held: dict | None = None
    want = run.pipe.counts()["AEP_EVENTS"]
    while time.monotonic() < deadline:
        held = victim.held_stream("AEP_EVENTS")
        if held and held["state"]["messages"] == want:
            break
        time.sleep(0.5)
    assert held and held["state"]["messages"] == want, (held, want)
