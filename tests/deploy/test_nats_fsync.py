"""JetStream fsyncs every write (`sync_interval: always`) in both server configurations we ship:
deploy/nats/nats.conf and the chart's bundled server (values.yaml's `nats.config.jetstream.merge`
in the jetstream block, as :func:`values_nats_conf` writes it). Chosen by measurement
(benchmarks/bench_cluster.py): an event acked to a shim is on the disks of a majority, so a
power loss of all three machines at once loses none of it; nats-server's default (2m) could lose
up to two minutes of acked writes there (Jepsen, NATS 2.12.1, 2025-12-08). Checked on a real
nats-server: what its /varz reports, not the text of the file."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from tests.support.cli import free_port
from tests.support.nats_roles import configured_server, sample_nats_conf, values_nats_conf


@pytest.mark.parametrize("kind", ["sample", "values"])
def test_jetstream_fsyncs_every_write(kind: str, tmp_path: Path) -> None:
    text = sample_nats_conf(tmp_path / "js") if kind == "sample" else values_nats_conf(tmp_path / "js")
    monitor = free_port()
    with configured_server(tmp_path, text, monitor_port=monitor):
        with urllib.request.urlopen(f"http://127.0.0.1:{monitor}/varz", timeout=5) as r:
            config = json.loads(r.read())["jetstream"]["config"]
    assert config.get("sync_always") is True, config
