"""`aep-bridge bootstrap --replicas N` on a real three-node cluster (issue 23): R3 everywhere,
R1 streams scaled in place (and said so), more replicas than servers a clear, fast error."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import nats.errors
import nats.js.errors

from bridge.nats import streams as S
from tests.clusterfixture import Cluster
from tests.support.cli import cli

ROOT = Path(__file__).resolve().parents[2]
ALL = [c.name for c in S.all_stream_configs()]


def bridge_cli(*args: str, url: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "AEP_BRIDGE_CONFIG": os.devnull, "AEP_BRIDGE_NATS_URL": url}
    full.pop("AEP_BRIDGE_STREAM_REPLICAS", None)
    return cli(*args, env={**full, **env}, inherit=False, timeout=60)


def replicas_of(cluster: Cluster) -> dict[str, tuple[int, int]]:
    """{stream: (config.num_replicas, peers besides the leader)} for every bridge stream."""
    c = cluster.client()
    try:
        out = {}
        for name in ALL:
            for attempt in range(3):  # an R1 stream's host may be slow to answer right after a start (CI, 2026-12-05)
                try:
                    info = c.stream_info(name)
                    break
                except nats.errors.TimeoutError:
                    if attempt == 2:
                        raise
            out[name] = (info.config.num_replicas, len(info.cluster.replicas or []) if info.cluster else 0)
        return out
    finally:
        c.close()


def wait_replicas(cluster: Cluster, want: tuple[int, int], timeout: float = 30.0) -> dict[str, tuple[int, int]]:
    deadline = time.monotonic() + timeout
    got = replicas_of(cluster)
    while time.monotonic() < deadline and set(got.values()) != {want}:
        time.sleep(0.1)
        got = replicas_of(cluster)
    return got


def test_bootstrap_replicas_3_gives_r3_everywhere(nats_cluster: Cluster) -> None:
    out = bridge_cli("bootstrap", "--replicas", "3", url=nats_cluster.url)
    assert out.returncode == 0, out.stderr
    assert [line.split()[:2] for line in out.stdout.splitlines()] == [[name, "created"] for name in ALL]
    assert wait_replicas(nats_cluster, (3, 2)) == {name: (3, 2) for name in ALL}
    again = bridge_cli("bootstrap", url=nats_cluster.url, AEP_BRIDGE_STREAM_REPLICAS="3")
    assert again.returncode == 0, again.stderr
    assert [line.split()[:2] for line in again.stdout.splitlines()] == [[name, "unchanged"] for name in ALL]


def test_bootstrap_scales_r1_streams_to_r3_in_place(nats_cluster: Cluster) -> None:
    first = bridge_cli("bootstrap", url=nats_cluster.url)
    assert first.returncode == 0, first.stderr
    assert set(replicas_of(nats_cluster).values()) == {(1, 0)}
    c = nats_cluster.client()
    try:
        # The R1 stream lives on one node; this client may sit on another, where the stream's
        # interest arrives over the routes a moment after the create (CI: "no response from
        # stream" at once): asked again until it answers.
        deadline = time.monotonic() + 15
        while True:
            try:
                c.run(c.js.publish("hermes.raw.scale.pre_tool_call", b"{}", headers={"Nats-Msg-Id": "scale-1"}))
                break
            except nats.js.errors.NoStreamResponseError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        lanes = c.run(c.js.key_value(S.LANES_BUCKET))
        c.run(lanes.put("s.kept", b"1"))
        c.run(c.js.add_consumer(S.HERMES_RAW, S.mapper_consumer_config()))  # the mapper's, made at R1
    finally:
        c.close()
    scaled = bridge_cli("bootstrap", "--replicas", "3", url=nats_cluster.url)
    assert scaled.returncode == 0, scaled.stderr
    lines = scaled.stdout.splitlines()
    assert [line.split()[:2] for line in lines] == [[name, "updated"] for name in ALL]
    assert all("scaled from 1 to 3 replicas" in line for line in lines), lines
    assert wait_replicas(nats_cluster, (3, 2)) == {name: (3, 2) for name in ALL}
    c = nats_cluster.client()
    try:  # in place: the messages and keys are still there
        assert c.stream_info("HERMES_RAW").state.messages == 1
        assert c.run(c.run(c.js.key_value(S.LANES_BUCKET)).get("s.kept")).value == b"1"
    finally:
        c.close()
    deadline = time.monotonic() + 30  # a durable consumer follows its stream to R3
    while time.monotonic() < deadline:
        c = nats_cluster.client()
        try:
            consumer = c.run(c.js.consumer_info(S.HERMES_RAW, S.MAPPER_DURABLE))
        finally:
            c.close()
        if consumer.cluster and len(consumer.cluster.replicas or []) == 2:
            break
        time.sleep(0.1)
    assert consumer.cluster is not None and len(consumer.cluster.replicas or []) == 2, consumer.cluster


def test_more_replicas_than_servers_fails_fast_and_clearly(nats_cluster: Cluster) -> None:
    # the count comes from the connected server's INFO (connect_urls): wait until every node advertises
    # all three (a route made after the meta group formed is gossiped a moment later; CI of c26f3f8 saw 2)
    deadline = time.monotonic() + 15
    while not all(len(n.connect_urls()) == len(nats_cluster.nodes) for n in nats_cluster.nodes):
        assert time.monotonic() < deadline, {n.name: n.connect_urls() for n in nats_cluster.nodes}
        time.sleep(0.1)
    out = bridge_cli("bootstrap", "--replicas", "5", url=nats_cluster.url)  # a hang would end in cli()'s timeout
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "5 replicas" in out.stderr and "3 servers" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    c = nats_cluster.client()
    try:  # nothing half-created
        assert c.run(c.js.account_info()).streams == 0
    finally:
        c.close()


def test_replicas_3_on_a_single_server_fails_clearly(nats_factory) -> None:  # type: ignore[no-untyped-def]
    server = nats_factory()
    out = bridge_cli("bootstrap", "--replicas", "3", url=server.url)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "3 replicas" in out.stderr and "1 server" in out.stderr and "not a cluster" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    env = bridge_cli("bootstrap", url=server.url, AEP_BRIDGE_STREAM_REPLICAS="3")
    assert env.returncode == 2 and "3 replicas" in env.stderr, env.stderr


def test_replicas_out_of_range_is_a_usage_error(nats_factory) -> None:  # type: ignore[no-untyped-def]
    out = bridge_cli("bootstrap", "--replicas", "0", url="nats://127.0.0.1:1")
    assert out.returncode == 2 and "--replicas" in out.stderr, out.stderr


def test_bootstrap_without_a_replicas_setting_never_scales_down(nats_cluster: Cluster) -> None:
    assert bridge_cli("bootstrap", "--replicas", "3", url=nats_cluster.url).returncode == 0
    wait_replicas(nats_cluster, (3, 2))
    plain = bridge_cli("bootstrap", url=nats_cluster.url)  # a deploy that forgot AEP_BRIDGE_STREAM_REPLICAS
    assert plain.returncode == 0, plain.stderr
    assert [line.split()[:2] for line in plain.stdout.splitlines()] == [[name, "unchanged"] for name in ALL]
    assert {r for r, _ in replicas_of(nats_cluster).values()} == {3}
    down = bridge_cli("bootstrap", "--replicas", "1", url=nats_cluster.url)  # asked for: done, and said
    assert down.returncode == 0, down.stderr
    assert all("scaled from 3 to 1 replicas" in line for line in down.stdout.splitlines()), down.stdout
    assert wait_replicas(nats_cluster, (1, 0)) == {name: (1, 0) for name in ALL}
