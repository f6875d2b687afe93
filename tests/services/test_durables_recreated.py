"""Issue 44 item 1: a service whose durable disappears recreates it, and is not healthy
meanwhile; nothing is lost and nothing is done twice.

The gate's is tests/deploy/test_nats_permissions_matrix.py. Here the mapper's shared durable
``mapper`` on HERMES_RAW and an exporter sink's ``export-<sink>`` on AEP_EVENTS are deleted
(by a test-only admin user: no role but the owner may) under the running service. Before the
fix both came back from the stream's start: the mapper mapped every earlier raw message again
(its events past BRIDGE_MAPPED's 2-minute duplicate window would be stored twice), the
exporter sent every earlier event to its sink again; neither counted or said so.

Process level: a real nats-server with the sample deploy/nats/nats.conf and again with the
chart's values rendered (the services as their own users: the recreate must be within their
permissions), the raw messages published as the shim user."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

from tests.corpus import envelopes
from tests.support.nats_probe import ADMIN, with_admin
from tests.support.nats_roles import USERS, configured_server, ensure_streams, sample_nats_conf, values_nats_conf
from tests.support.otlp import Receiver, to_id
from tests.support.services import Service, http_json, raw_records, wait_for

def as_user(role: str) -> dict[str, str]:
    user, password = USERS[role]
    return {"AEP_BRIDGE_NATS_USER": user, "AEP_BRIDGE_NATS_PASSWORD": password}


@pytest.fixture(scope="module", params=["sample", "values"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp(f"nats-durables-{request.param}")
    text = sample_nats_conf(tmp / "js") if request.param == "sample" else values_nats_conf(tmp / "js")
    with configured_server(tmp, with_admin(text, request.param)) as url:
        asyncio.run(ensure_streams(url))
        yield {"url": url, "kind": request.param}


def publish_raw(url: str, records: list[tuple[str, bytes, str]]) -> None:
    async def run() -> None:
        user, password = USERS["shim"]
        nc = await nats.connect(url, user=user, password=password, inbox_prefix="_INBOX.hermes.test")
        try:
            js = nc.jetstream(timeout=5)
            for subject, body, rid in records:
                await js.publish(subject, body, headers={"Nats-Msg-Id": rid})
        finally:
            await nc.close()
    asyncio.run(run())


def admin(url: str, action: str, stream: str, durable: str) -> bool:
    async def run() -> bool:
        nc = await nats.connect(url, user=ADMIN[0], password=ADMIN[1])
        try:
            js = nc.jetstream(timeout=3)
            if action == "delete":
                return await js.delete_consumer(stream, durable)
            try:
                await js.consumer_info(stream, durable)
                return True
            except nats.js.errors.NotFoundError:
                return False
        finally:
            await nc.close()
    return asyncio.run(run())


def stream_ids(url: str, stream: str, subjects: str) -> list[str]:
    """The Nats-Msg-Id of every message of ``stream`` (as the admin: an ordered read)."""
    async def run() -> list[str]:
        nc = await nats.connect(url, user=ADMIN[0], password=ADMIN[1])
        got: list[str] = []
        try:
            sub = await nc.jetstream().subscribe(subjects, stream=stream, ordered_consumer=True,
                                                 deliver_policy=nats.js.api.DeliverPolicy.ALL)
            while True:
                try:
                    m = await sub.next_msg(timeout=0.5)
                except Exception:
                    return got
                got.append(json.loads(m.data).get("id") if stream == "AEP_EVENTS" else (m.headers or {}).get("Nats-Msg-Id"))
        finally:
            await nc.close()
    return asyncio.run(run())


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name) and not line.startswith("#"))


def batches(tag: str) -> tuple[list, list]:
    """40 raw messages of the corpus, as instance ``gw-<tag>`` with session ids of its own (a
    session belongs to the first instance seen for it: the module's tests share a server)."""
    corpus = [json.loads(json.dumps(e).replace("20261130_", f"{tag}_")) for e in envelopes() if e.get("session_id")][:40]
    records = raw_records(corpus, instance=f"gw-{tag}")
    return records[:20], records[20:]


def test_the_mapper_recreates_its_durable_after_what_it_mapped(server: dict, tmp_path: Path) -> None:
    url = server["url"]
    first, second = batches(f"m{time.time_ns() % 10**8}")
    mapper = Service("mapper", url, tmp_path, env=as_user("mapper")).start()
    try:
        wait_for(lambda: "mapper_ready" in mapper.log(), 20, what=f"the mapper ready:\n{mapper.log()}")
        publish_raw(url, first)
        wait_for(lambda: metric(mapper.metrics_text(), "aep_bridge_mapper_raw_messages_total") >= len(first), 20,
                 what="the first raw messages mapped")
        mapped_before = len(stream_ids(url, "BRIDGE_MAPPED", "bridge.mapped.>"))
        assert admin(url, "delete", "HERMES_RAW", "mapper")
        publish_raw(url, second)
        wait_for(lambda: admin(url, "exists", "HERMES_RAW", "mapper"), 20, what=f"the durable back:\n{mapper.log()}")
        wait_for(lambda: metric(mapper.metrics_text(), "aep_bridge_mapper_raw_messages_total") >= len(first) + len(second),
                 20, what=f"the second raw messages mapped:\n{mapper.log()}")
        time.sleep(2)  # anything it would map again, from the stream's start
        text = mapper.metrics_text()
        # each raw message mapped once: the first ones not again
        assert metric(text, "aep_bridge_mapper_raw_messages_total") == len(first) + len(second), text
        assert "aep_bridge_mapper_consumers_recreated_total 1.0" in text and "consumer_gone" in mapper.log()
        ids = stream_ids(url, "BRIDGE_MAPPED", "bridge.mapped.>")
        assert len(ids) == len(set(ids)) and len(ids) > mapped_before, (len(ids), mapped_before)
        port = mapper.metrics_port()
        assert http_json(f"http://127.0.0.1:{port}/healthz")[0] == 200
        assert http_json(f"http://127.0.0.1:{port}/readyz")[0] == 200
    finally:
        mapper.terminate()
    assert "Traceback" not in mapper.log(), mapper.log()


def test_the_exporter_recreates_a_sinks_durable_after_what_the_sink_has(server: dict, tmp_path: Path) -> None:
    url = server["url"]
    first, second = batches(f"x{time.time_ns() % 10**8}")
    for d in ("m", "p", "e"):
        (tmp_path / d).mkdir()
    mapper = Service("mapper", url, tmp_path / "m", env=as_user("mapper")).start()
    pairing = Service("pairing", url, tmp_path / "p", "--replica", "solo", env=as_user("pairing")).start()
    with Receiver() as rx:
        exporter = Service("exporter", url, tmp_path / "e", "--sink",
                           f"otlp+http://127.0.0.1:{rx.port}/v1/logs?name=siem&batch=50", env=as_user("exporter")).start()
        try:
            publish_raw(url, first)

            def arrived() -> bool:
                want = set(stream_ids(url, "AEP_EVENTS", "aep.hermes.>"))
                return bool(want) and want <= {to_id(r) for r in rx.records()}

            wait_for(arrived, 60, what=f"the first events at the sink:\n{exporter.log()}")
            time.sleep(6)  # its ack floor read (every 5 s), as a running exporter has
            n_first = len(set(stream_ids(url, "AEP_EVENTS", "aep.hermes.>")))
            assert admin(url, "delete", "AEP_EVENTS", "export-siem")
            publish_raw(url, second)
            wait_for(lambda: admin(url, "exists", "AEP_EVENTS", "export-siem"), 20, what=f"the durable back:\n{exporter.log()}")

            def second_arrived() -> bool:
                stored = set(stream_ids(url, "AEP_EVENTS", "aep.hermes.>"))
                return len(stored) > n_first and stored <= {to_id(r) for r in rx.records()}

            wait_for(second_arrived, 60, what=f"the second events at the sink ({n_first} before, "
                     f"{len(set(stream_ids(url, 'AEP_EVENTS', 'aep.hermes.>')))} stored, "
                     f"{len({to_id(r) for r in rx.records()})} there):\n{exporter.log()}")
            time.sleep(2)  # anything it would send again
            got = [to_id(r) for r in rx.records()]
            stored = stream_ids(url, "AEP_EVENTS", "aep.hermes.>")
            assert set(got) == set(stored), "every event at the sink"
            assert len(got) == len(set(got)), f"{len(got) - len(set(got))} events sent twice"
            text = exporter.metrics_text()
            assert 'aep_bridge_export_consumers_recreated_total{sink="siem"} 1.0' in text and "consumer_gone" in exporter.log()
            port = exporter.metrics_port()
            assert http_json(f"http://127.0.0.1:{port}/readyz")[0] == 200
        finally:
            exporter.terminate()
            mapper.terminate()
            pairing.terminate()
    assert "Traceback" not in exporter.log(), exporter.log()
