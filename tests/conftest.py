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
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.clusterfixture import Cluster, make_cluster
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
