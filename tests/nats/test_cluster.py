"""The three-node cluster fixture itself (tests/clusterfixture.py): R3 streams keep their
messages and elect a new leader when theirs is killed; a wiped node catches up."""

from __future__ import annotations

import time

import pytest
from nats.js.api import StreamConfig

from tests.clusterfixture import Cluster


def test_cluster_has_three_peers_and_a_meta_leader(nats_cluster: Cluster) -> None:
    leader = nats_cluster.meta_leader()
    assert leader in {"n1", "n2", "n3"}
    meta = nats_cluster.node(leader).jsz()["meta_cluster"]
    assert meta["cluster_size"] == 3
    assert sorted([leader] + [r["name"] for r in meta["replicas"]]) == ["n1", "n2", "n3"]
    assert len({n.port for n in nats_cluster.nodes}) == 3
    assert nats_cluster.url.count(",") == 2


def _r3_stream(cluster: Cluster, name: str) -> None:
    """An R3 stream, returned once it has a leader (until then a publish finds no responders)."""
    cluster.admin(lambda js: js.add_stream(StreamConfig(name=name, subjects=[f"{name.lower()}.>"], num_replicas=3)))
    cluster.wait_leader(name)


@pytest.mark.slow
def test_r3_stream_survives_killing_its_leader(nats_cluster: Cluster) -> None:
    c = nats_cluster.client()
    try:
        _r3_stream(nats_cluster, "SURVIVE")
        for i in range(10):
            c.run(c.js.publish("survive.x", b"%d" % i))
        info = c.stream_info("SURVIVE")
        assert info.config.num_replicas == 3 and len(info.cluster.replicas) == 2
    finally:
        c.close()
    old = nats_cluster.wait_leader("SURVIVE")
    nats_cluster.node(old).kill()
    new = nats_cluster.wait_leader("SURVIVE", not_on=old)
    assert new != old
    c = nats_cluster.client()
    try:
        assert c.stream_info("SURVIVE").state.messages == 10
        c.run(c.js.publish("survive.x", b"after"))  # two of three: still a quorum
        assert c.stream_info("SURVIVE").state.messages == 11
    finally:
        c.close()
    nats_cluster.node(old).start()  # same ports, same store
    nats_cluster.wait_ready()
    assert nats_cluster.node(old).running


@pytest.mark.slow
def test_wiped_node_catches_up(nats_cluster: Cluster) -> None:
    c = nats_cluster.client()
    try:
        _r3_stream(nats_cluster, "CATCHUP")
        for i in range(20):
            c.run(c.js.publish("catchup.x", b"%d" % i))
    finally:
        c.close()
    leader = nats_cluster.wait_leader("CATCHUP")
    follower = next(n for n in nats_cluster.nodes if n.name != leader)
    follower.wipe()
    assert not follower.store_dir.exists()
    follower.start()
    nats_cluster.wait_ready()
    deadline = time.monotonic() + 30
    held = None
    while time.monotonic() < deadline:
        held = follower.held_stream("CATCHUP")
        if held and held["state"]["messages"] == 20:
            break
        time.sleep(0.1)
    assert held is not None and held["state"]["messages"] == 20, held


def test_paused_node_accepts_but_never_answers(nats_cluster: Cluster) -> None:
    import socket

    node = nats_cluster.nodes[0]
    node.pause()
    try:
        with socket.create_connection((node.host, node.port), timeout=1) as s:
            s.settimeout(0.3)
            with pytest.raises(TimeoutError):
                s.recv(100)  # no INFO
    finally:
        node.resume()
    with socket.create_connection((node.host, node.port), timeout=1) as s:
        s.settimeout(5)
        assert s.recv(5) == b"INFO "


def test_leaders_of_a_stream_a_consumer_and_a_kv_bucket(nats_cluster: Cluster) -> None:
    from nats.js.api import ConsumerConfig, KeyValueConfig

    _r3_stream(nats_cluster, "LEADS")
    nats_cluster.admin(lambda js: js.add_consumer("LEADS", ConsumerConfig(durable_name="d1")))
    nats_cluster.admin(lambda js: js.create_key_value(KeyValueConfig(bucket="leads_kv", replicas=3)))
    names = {"n1", "n2", "n3"}
    assert nats_cluster.wait_leader("LEADS") in names
    assert nats_cluster.wait_leader("LEADS", "d1") in names
    kv = nats_cluster.wait_leader("KV_leads_kv")  # the bucket's stream
    assert kv in names and nats_cluster.kv_leader("leads_kv") == kv


def test_admin_asks_again_while_the_cluster_does_not_answer_and_not_otherwise(nats_cluster: Cluster) -> None:
    import nats.errors
    from nats.js.errors import BadRequestError

    calls: list[int] = []

    async def flaky(js):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) < 3:
            raise nats.errors.TimeoutError
        return await js.account_info()

    assert nats_cluster.admin(flaky).streams == 0
    assert len(calls) == 3

    async def refused(js):  # type: ignore[no-untyped-def]
        calls.append(1)
        raise BadRequestError(code=400, err_code=10058, description="stream name already in use")

    calls.clear()
    with pytest.raises(BadRequestError):
        nats_cluster.admin(refused)
    assert len(calls) == 1
