"""Fixtures of the service tests: a relay process on the session's server, one in front of a
whole control plane (mapper, pairing, gate) with its own server, and a Tansu broker."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.plane import Plane, start_plane, stop_plane
from tests.support.relay import RelayProcess
from tests.support.tansu import Tansu


@pytest.fixture
def relay(nats_server, jetstream, tmp_path) -> Iterator[RelayProcess]:  # type: ignore[no-untyped-def]
    r = RelayProcess(nats_server.url, tmp_path).start()
    try:
        yield r
    finally:
        r.stop()


@pytest.fixture(scope="module")
def relay_plane(nats_backend: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Plane, RelayProcess]]:
    """Mapper, pairing and gate (control and steering on) with a relay in front, per module."""
    if nats_backend == "external":
        pytest.skip("the control-plane tests start servers of their own")
    tmp = tmp_path_factory.mktemp("relay-plane")
    plane, services = start_plane(nats_backend, tmp, {"AEP_HERMES_CONTROL": "1", "AEP_INSTRUCT": "1"})
    relay = RelayProcess(plane.url, tmp).start()
    try:
        yield plane, relay
    finally:
        relay.stop()
        stop_plane(plane, services)


@pytest.fixture
def tansu(tmp_path):  # type: ignore[no-untyped-def]
    """A Tansu broker (Kafka wire, in-memory storage) for one test."""
    broker = Tansu(tmp_path / "tansu.log").start()
    try:
        yield broker
    finally:
        broker.stop()
