"""Shared fixtures: a real JetStream server (see tests/natsfixture.py for the backends).

* ``nats_server``: one server for the whole session (tests isolate themselves by
  subject, e.g. a unique instance name). Do not stop it; use ``nats_server_fn``.
* ``nats_server_fn``: a fresh server per test, for fault tests that stop, kill and
  restart it (same port, same store).
* ``nats_factory``: ``nats_factory(extra_config="authorization {...}")`` starts a
  server with extra configuration; closed at the end of the test.
* ``jetstream``: a ``JetStreamClient`` on ``nats_server`` with every stream and
  bucket bootstrapped by the bridge's own ``bootstrap``.
* ``nats_cluster``: a fresh three-node JetStream cluster per test (tests/clusterfixture.py:
  nats-server processes on loopback; kill, restart, wipe, pause nodes; name leaders).

The slow part of `make test` runs on two xdist workers with ``--dist loadgroup`` (Makefile):
`pytest_collection_modifyitems` below puts every slow test of tests/cluster/ and of any module
that uses tests/support/partition.py into one group, ``cluster``, run by one worker one test at a
time (the timing-sensitive cluster and partition runs never overlap each other), and every other
slow test into a group of its module (a module's tests stay on one worker, as with loadfile).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.clusterfixture import Cluster, make_cluster
from tests.support import partition
from tests.natsfixture import JetStreamClient, NatsServer, chosen_backend, make_server


@pytest.fixture(scope="session")
def nats_backend() -> str:
    return chosen_backend()


@pytest.fixture(scope="session")
def nats_server(nats_backend: str) -> Iterator[NatsServer]:
    server = make_server(backend=nats_backend)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def nats_server_fn(nats_backend: str) -> Iterator[NatsServer]:
    if nats_backend == "external":
        pytest.skip("fault tests need a server they own; NATS_TEST_BACKEND=external cannot provide one")
    server = make_server(backend=nats_backend)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def nats_factory(nats_backend: str) -> Iterator[Callable[..., NatsServer]]:
    started: list[NatsServer] = []

    def factory(extra_config: str = "") -> NatsServer:
        if nats_backend == "external":
            pytest.skip("NATS_TEST_BACKEND=external cannot start servers with extra configuration")
        server = make_server(extra_config, backend=nats_backend)
        started.append(server)
        return server

    try:
        yield factory
    finally:
        for server in started:
            server.close()


@pytest.fixture
def jetstream(nats_server: NatsServer) -> Iterator[JetStreamClient]:
    client = JetStreamClient(nats_server.url)
    try:
        client.bootstrap()
        yield client
    finally:
        client.close()


@pytest.fixture
def nats_cluster() -> Iterator[Cluster]:
    cluster = make_cluster()
    try:
        yield cluster
    finally:
        cluster.close()


#: the xdist group of the slow cluster and partition tests (one worker, one at a time)
CLUSTER_GROUP = "cluster"


def uses_partitions(module: object) -> bool:
    """The module imported tests/support/partition.py or something from it."""
    return any(v is partition or getattr(v, "__module__", None) == partition.__name__
               for v in vars(module).values())


def slow_group(item: pytest.Item) -> str:
    """The xdist group of a slow test: ``cluster`` for tests/cluster/ and the partition users,
    else its module's path."""
    module = getattr(item, "module", None)
    in_cluster_dir = item.path.parent.name == "cluster" and item.path.parent.parent.name == "tests"
    if in_cluster_dir or (module is not None and uses_partitions(module)):
        return CLUSTER_GROUP
    return item.path.relative_to(item.config.rootpath).as_posix()


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups into the node ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.pluginmanager.hasplugin("xdist"):  # -p no:xdist: no such marker (--strict-markers)
        return
    for item in items:
        if item.get_closest_marker("slow") is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(slow_group(item)))
