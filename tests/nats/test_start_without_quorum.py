"""A service started while its cluster has no JetStream quorum waits for one instead of exiting
on nats-py's 5 s API timeout (`bridge.nats.connection.until_answered`): the cluster fault
suite's services start while a freshly (re)started cluster still elects. Real processes: a
three-node cluster with two nodes paused, the mapper and pairing as `aep-bridge` processes."""

from __future__ import annotations

import time

import pytest

from tests.clusterfixture import Cluster
from tests.support.services import Service, wait_for


@pytest.mark.slow
@pytest.mark.parametrize("role, ready", [("mapper", "mapper_ready"), ("pairing", "partition_started")])
def test_a_service_started_without_a_quorum_waits_for_one(nats_cluster: Cluster, tmp_path, role: str, ready: str) -> None:
    nats_cluster.bootstrap(replicas=3)
    first, *others = nats_cluster.nodes
    for node in others:
        node.pause()
    service = Service(role, first.url, tmp_path).start()
    try:
        wait_for(lambda: "jetstream_unanswered" in service.log(), 40, what=f"{role} waiting for JetStream")
        time.sleep(6.0)  # past nats-py's 5 s API timeout: before the fix the process had exited
        assert service.alive(), service.log()
        assert ready not in service.log()
        for node in others:
            node.resume()
        wait_for(lambda: ready in service.log(), 60, what=f"{role} bound once the quorum is back")
        assert service.alive(), service.log()
    finally:
        for node in others:
            node.resume()
        service.terminate()
