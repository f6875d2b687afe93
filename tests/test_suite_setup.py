"""The suite's own plumbing for running on two xdist workers: `free_port()` (tests/support/cli.py)
gives a loopback port outside the kernel's ephemeral range, which an outgoing connection can
take between the pick and the server's bind; the slow tests' xdist groups (tests/conftest.py)
put every cluster and partition run on one worker."""

from __future__ import annotations

import importlib
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import CLUSTER_GROUP, slow_group, uses_partitions
from tests.support.cli import LOW_PORT, ROOT, ephemeral_low, free_port


def test_free_port_is_below_the_ephemeral_range_and_can_be_bound() -> None:
    low = ephemeral_low()
    assert low - LOW_PORT >= 1000, f"this machine's ephemeral range starts at {low}"
    ports = [free_port() for _ in range(20)]
    assert all(LOW_PORT <= p < low for p in ports), ports
    assert len(set(ports)) > 1, ports  # a random pick, not one fixed port
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))


def test_a_port_in_use_is_not_given() -> None:
    held = []
    try:
        for _ in range(200):
            s = socket.socket()
            port = free_port()
            s.bind(("127.0.0.1", port))
            s.listen(1)
            held.append(s)
        assert len({s.getsockname()[1] for s in held}) == len(held)
    finally:
        for s in held:
            s.close()


@pytest.mark.parametrize("module,cluster", [
    ("tests.cluster.test_partitions", True),
    ("tests.shim.test_servers", True),  # a partition user outside tests/cluster/
    ("tests.sim.test_faults", False),
    ("tests.stack.test_up_cluster", False),
])
def test_the_partition_users_are_found_by_what_they_import(module: str, cluster: bool) -> None:
    assert uses_partitions(importlib.import_module(module)) is cluster


@pytest.mark.parametrize("module,group", [
    ("tests.cluster.test_faults", CLUSTER_GROUP),
    ("tests.cluster.test_partitions", CLUSTER_GROUP),
    ("tests.shim.test_servers", CLUSTER_GROUP),
    ("tests.sim.test_faults", "tests/sim/test_faults.py"),  # the others: a group per module
    ("tests.nats.test_cluster", "tests/nats/test_cluster.py"),
])
def test_the_slow_cluster_and_partition_tests_share_one_xdist_group(module: str, group: str) -> None:
    """What `pytest -m slow -n 2 --dist loadgroup` (the Makefile) schedules by."""
    mod = importlib.import_module(module)
    item = SimpleNamespace(path=Path(mod.__file__), module=mod, config=SimpleNamespace(rootpath=ROOT))
    assert slow_group(item) == group  # type: ignore[arg-type]
