"""The local nats-server (`bridge.stack.server`): room for what the bridge reserves, whatever the
machine's free disk."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from bridge.nats.streams import reserved_bytes
from bridge.stack.server import MAX_FILE_STORE, EmbeddedNats
from tests.support.cli import free_port
from tests.natsfixture import JetStreamClient


def test_the_local_file_store_holds_what_the_bridge_reserves() -> None:
    """JetStream reserves each stream's max_bytes up front (~49 GiB); left to nats-server, the
    limit is 75 % of the free disk, and on a machine with less than ~66 GB free bootstrap failed."""
    assert MAX_FILE_STORE >= reserved_bytes()


def test_an_embedded_server_declares_its_file_store_and_bootstraps(tmp_path: Path) -> None:
    monitor = free_port()
    with EmbeddedNats(tmp_path / "store", extra_args=["-m", str(monitor)]) as server:
        with urllib.request.urlopen(f"http://127.0.0.1:{monitor}/varz", timeout=10) as resp:
            varz = json.loads(resp.read())
        assert varz["jetstream"]["config"]["max_storage"] == MAX_FILE_STORE
        client = JetStreamClient(server.url)
        try:
            client.bootstrap()
            assert client.stream_info("AEP_EVENTS").config.max_bytes > 0
        finally:
            client.close()
