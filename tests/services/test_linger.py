"""AEP_BRIDGE_LINGER_MS and AEP_BRIDGE_LINGER_MAX_MS reach the mapper: a slow trickle of raw
messages is gathered into a few batches when they linger (a fixed pause, or a short one that
grows on a quiet stream), and taken one by one when they do not. Pairing does not pause: it
takes each of the mapper's batches as one burst, so it follows the mapper's batching."""

from __future__ import annotations

import re
import time

import pytest

from bridge.config import Settings
from bridge.sim.sessions import renamed_corpus
from tests.natsfixture import JetStreamClient
from tests.support.services import Service, publish_all, raw_records, wait_for
from tests.support.streams import count

TRICKLE = 30  # raw messages, one every GAP_S
GAP_S = 0.04


def batches(service: Service, role: str) -> int:
    """How many batches the service fetched (its ``aep_bridge_<role>_batch_size`` histogram)."""
    m = re.search(rf"^aep_bridge_{role}_batch_size_count (\S+)$", service.metrics_text(), re.M)
    assert m, f"no batch histogram on {role}'s /metrics"
    return int(float(m.group(1)))


def trickle(client: JetStreamClient, url: str, tmp_path, linger_ms: str, instance: str,
            max_ms: str | None = None) -> tuple[int, int]:
    """Batches (mapper, pairing) for TRICKLE raw messages sent GAP_S apart."""
    env = {"AEP_BRIDGE_LINGER_MS": linger_ms, "AEP_BRIDGE_LINGER_MAX_MS": max_ms or linger_ms}  # the mapper's
    log_dir = tmp_path / f"linger-{linger_ms}-{max_ms}"
    log_dir.mkdir()
    mapper = Service("mapper", url, log_dir, env=env).start()
    pairing = Service("pairing", url, log_dir, "--replica", f"l{instance}").start()  # no linger of its own
    try:
        wait_for(lambda: "mapper_ready" in mapper.log() and "reader_started" in pairing.log(), 30, what="services up")
        before = count(client, "AEP_EVENTS")
        mapped_before = count(client, "BRIDGE_MAPPED")
        # each trickle its own sessions: a session belongs to the first instance that names it (issue 44),
        # so the corpus's ids under a second instance would be dead-lettered, not mapped
        records = raw_records(renamed_corpus(f"-{instance}")[:TRICKLE], instance=instance)
        for record in records:
            client.run(publish_all(client.js, [record]))
            time.sleep(GAP_S)
        wait_for(lambda: count(client, "BRIDGE_MAPPED") - mapped_before >= TRICKLE, 30, what="the trickle mapped")
        wait_for(lambda: count(client, "AEP_EVENTS") > before, 30, what="the trickle paired")
        time.sleep(1.5)  # pairing's last batches
        return batches(mapper, "mapper"), batches(pairing, "pairing")
    finally:
        pairing.terminate()
        mapper.terminate()


@pytest.mark.slow
def test_the_linger_is_a_setting_of_the_mapper_and_pairing_follows_its_batches(nats_server_fn, tmp_path):
    client = JetStreamClient(nats_server_fn.url)
    client.bootstrap()
    try:
        long_m, long_p = trickle(client, nats_server_fn.url, tmp_path, "500", "slow")
        none_m, none_p = trickle(client, nats_server_fn.url, tmp_path, "0", "fast")
        # a 1 ms floor that grows, when the stream is as quiet as this one, up to 500 ms
        grow_m, grow_p = trickle(client, nats_server_fn.url, tmp_path, "1", "grow", max_ms="500")
    finally:
        client.close()
    # 30 messages over ~1.2 s: at 500 ms the mapper takes them in a handful of gatherings, at 0
    # one by one (the machine may be slow: the bounds leave a wide margin either way).
    assert long_m <= 12, f"mapper at 500 ms took {long_m} batches for {TRICKLE} messages"
    assert none_m >= 20, f"mapper at 0 ms took only {none_m} batches for {TRICKLE} messages"
    assert long_p < none_p, f"pairing: {long_p} batches at 500 ms, {none_p} at 0 ms"
    assert grow_m <= 15 and grow_p < none_p, f"1 ms growing to 500 ms: mapper {grow_m}, pairing {grow_p} batches"
    assert Settings.from_env({"AEP_BRIDGE_CONFIG": "/dev/null"}).linger_ms == 10.0
    assert Settings.from_env({"AEP_BRIDGE_CONFIG": "/dev/null"}).linger_max_ms == 300.0
    for name, bad in (("AEP_BRIDGE_LINGER_MS", "-1"), ("AEP_BRIDGE_LINGER_MS", "1001"), ("AEP_BRIDGE_LINGER_MS", "soon"),
                      ("AEP_BRIDGE_LINGER_MAX_MS", "-1"), ("AEP_BRIDGE_LINGER_MAX_MS", "1001")):
        with pytest.raises(ValueError, match=name):
            Settings.from_env({"AEP_BRIDGE_CONFIG": "/dev/null", name: bad})
