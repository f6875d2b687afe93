"""`aep-bridge exporter` to an OTLP/HTTP logs endpoint: a receiver here decodes the protobuf
with opentelemetry-proto; a 503 with Retry-After is honoured and nothing is lost."""

from __future__ import annotations

import json

from bridge.core.bridges.otlp import to_log_record
from bridge.core.ceiling import METADATA
from tests.natsfixture import JetStreamClient
from tests.support.services import Service, publish_all, raw_records, wait_for
from tests.corpus import envelopes
from tests.support.otlp import Receiver, event_ids, to_id
from tests.support.streams import quiet


def any_value(v):
    kind = v.WhichOneof("value")
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in v.kvlist_value.values}
    if kind == "array_value":
        return [any_value(x) for x in v.array_value.values]
    if kind is None:
        return None
    return getattr(v, kind)


def as_pin(resource: dict, log) -> dict:
    """A decoded protobuf LogRecord in the projection's form (to_log_record)."""
    out = {
        "time_unix_nano": log.time_unix_nano,
        "event_name": log.event_name,
        "severity_text": log.severity_text,
        "severity_number": log.severity_number,
        "resource": {a["key"]: a["value"]["stringValue"] for a in resource.get("attributes", [])},
        "attributes": {kv.key: any_value(kv.value) for kv in log.attributes},
    }
    if log.trace_id:
        out["trace_id"], out["span_id"], out["flags"] = log.trace_id.hex(), log.span_id.hex(), log.flags
    if log.HasField("body"):
        out["body"] = any_value(log.body)
    return out


def test_every_event_arrives_as_its_log_record_and_a_503_retry_after_is_honoured(nats_server_fn, tmp_path):
    from bridge.sim.sessions import realistic_envelopes

    client = JetStreamClient(nats_server_fn.url)
    client.bootstrap()
    records = raw_records(list(envelopes()) + list(realistic_envelopes(300, seed=5)), instance="otlp")
    client.run(publish_all(client.js, records))
    mapper = Service("mapper", nats_server_fn.url, tmp_path).start()
    (tmp_path / "p").mkdir()
    pairing = Service("pairing", nats_server_fn.url, tmp_path / "p", "--replica", "solo").start()
    with Receiver(refuse=2, retry_after="2") as rx:
        (tmp_path / "e").mkdir()
        exporter = Service("exporter", nats_server_fn.url, tmp_path / "e",
                           "--sink", f"otlp+http://127.0.0.1:{rx.port}/v1/logs?name=otel&batch=200")
        try:
            quiet(client, "BRIDGE_MAPPED")
            quiet(client, "AEP_EVENTS")
            stored = [json.loads(m.data) for m in client.fetch("aep.hermes.>", stream="AEP_EVENTS")]
            exporter.start()
            wait_for(lambda: len({to_id(r) for r in rx.records()}) >= len(stored), 90,
                     what=f"{len(stored)} events at the receiver")
            got: dict[str, dict] = {}
            for resource, log in rx.records():
                pin = as_pin(resource, log)
                event_id = pin["attributes"]["aep.event_id"]
                assert got.setdefault(event_id, pin) == pin, "a duplicate is a same-id redelivery"
            # Every event, as exactly the LogRecord the projection defines at max_capture metadata.
            assert set(got) == {e["id"] for e in stored}
            by_id = {e["id"]: e for e in stored}
            for event_id, pin in got.items():
                assert pin == to_log_record(by_id[event_id], METADATA)
            # The two 503s were honoured: the next request came no sooner than Retry-After said.
            answered = rx.requests
            assert [q["status"] for q in answered[:3]] == [503, 503, 200]
            assert answered[1]["t"] - answered[0]["t"] >= 1.9 and answered[2]["t"] - answered[1]["t"] >= 1.9
            assert all(q["path"] == "/v1/logs" and q["type"] == "application/x-protobuf" and q["encoding"] == "gzip"
                       for q in answered)
            assert max(len(q.get("records", [])) for q in answered) > 1, "batched"
        finally:
            exporter.terminate()
            pairing.terminate()
            mapper.terminate()
            client.close()


def test_a_stuck_sink_never_stalls_another_and_catches_up_and_a_refusal_is_dead_lettered(nats_server_fn, tmp_path):
    """Three sinks from one AEP_BRIDGE_EXPORT_CONFIG file: `stuck` answers 503 (no Retry-After) for
    a long time, `fast` (filtered to tool.*) answers at once, `strict` refuses its first request
    with 400. `fast` gets all its events while `stuck` holds; `stuck` then gets everything;
    `strict`'s refused batch is in the DLQ with the reason, and the rest reaches it."""
    client = JetStreamClient(nats_server_fn.url)
    client.bootstrap()
    client.run(publish_all(client.js, raw_records(list(envelopes()), instance="iso")))
    mapper = Service("mapper", nats_server_fn.url, tmp_path).start()
    (tmp_path / "p").mkdir()
    pairing = Service("pairing", nats_server_fn.url, tmp_path / "p", "--replica", "solo").start()
    with Receiver(refuse=10**6, retry_after=None) as stuck, Receiver() as fast, \
            Receiver(refuse=1, retry_after=None, status=400) as strict:
        config = tmp_path / "export.yaml"
        config.write_text(f"""
sinks:
  - name: stuck
    url: otlp+http://127.0.0.1:{stuck.port}/v1/logs
  - name: fast
    url: otlp+http://127.0.0.1:{fast.port}/v1/logs
    filter: {{type: ["tool.*"]}}
    batch: 20
  - name: strict
    url: otlp+http://127.0.0.1:{strict.port}/v1/logs
    batch: 10
""")
        (tmp_path / "e").mkdir()
        exporter = Service("exporter", nats_server_fn.url, tmp_path / "e", env={"AEP_BRIDGE_EXPORT_CONFIG": str(config)})
        try:
            quiet(client, "AEP_EVENTS")
            stored = [json.loads(m.data) for m in client.fetch("aep.hermes.>", stream="AEP_EVENTS")]
            tools = {e["id"] for e in stored if e["type"].startswith("tool.")}
            exporter.start()
            wait_for(lambda: event_ids(fast) >= tools, 60, what="the fast sink's events")
            assert event_ids(fast) == tools and len(stuck.requests) >= 1 and not stuck.records()
            assert exporter.alive()
            stuck.refuse = 0  # the stuck endpoint recovers: backoff retries deliver everything
            wait_for(lambda: event_ids(stuck) == {e["id"] for e in stored}, 90, what="the stuck sink to catch up")

            wait_for(lambda: len(event_ids(strict)) >= len(stored) - 10, 60, what="the strict sink")
            dlq = client.fetch("bridge.dlq.>", stream="BRIDGE_DLQ")
            assert {m.headers["Bridge-Dlq-Reason"] for m in dlq} == {"export_otlp_400"}
            refused = {m.headers["Bridge-Event-Id"] for m in dlq}  # the letter names the event (no content at the sink's metadata ceiling)
            assert all(json.loads(m.data)["original"]["id"] == m.headers["Bridge-Event-Id"] and "content" not in json.loads(m.data) for m in dlq)
            assert len(refused) == 10 and all(m.headers["Bridge-Stage"] == "exporter:strict" for m in dlq)
            assert event_ids(strict) | refused == {e["id"] for e in stored} and not event_ids(strict) & refused
        finally:
            exporter.terminate()
            pairing.terminate()
            mapper.terminate()
            client.close()


def test_events_other_emitters_post_to_the_relay_are_exported_unless_a_sinks_filter_excludes_them(nats_server_fn, tmp_path):
    """Issue 25 item 7. AEP_EVENTS holds the bridge's own events (aep.hermes.>) and those
    other AEP emitters post to the relay (aep.ingest.>): a sink gets both; a sink whose
    filter names the Hermes agent only gets the bridge's. Before the fix the exporter's
    consumers took aep.hermes.> alone."""
    import asyncio

    import aiohttp

    from tests.support.relay import EMITTER, RelayProcess, auth, encode, event, publish
    from tests.support.streams import consumer_idle

    client = JetStreamClient(nats_server_fn.url)
    client.bootstrap()
    own = [{**event("s-hermes-1", i), "agent": "hermes"} for i in range(1, 4)]
    asyncio.run(publish(nats_server_fn.url, own))
    ingested = [{**event("ci-run-7", i), "source": "urn:ci:runner-7", "agent": "ci-bot"} for i in range(1, 4)]
    relay = RelayProcess(nats_server_fn.url, tmp_path).start()

    async def post() -> int:
        async with aiohttp.ClientSession() as s:
            async with s.post(relay.url + "/events", data=b"\n".join(encode(e) for e in ingested) + b"\n",
                              headers={**auth(EMITTER), "AEP-Version": "0.1", "Content-Type": "application/x-ndjson"}) as r:
                return r.status

    with Receiver() as everything, Receiver() as hermes_only:
        config = tmp_path / "export.yaml"
        config.write_text(f"""
sinks:
  - name: all
    url: otlp+http://127.0.0.1:{everything.port}/v1/logs
  - name: hermes
    url: otlp+http://127.0.0.1:{hermes_only.port}/v1/logs
    filter: {{agent: hermes}}
""")
        # sink `all`'s durable as an earlier release made it (aep.hermes.> only): the exporter updates it
        from nats.js.api import AckPolicy, ConsumerConfig

        client.run(client.js.add_consumer("AEP_EVENTS", ConsumerConfig(
            durable_name="export-all", ack_policy=AckPolicy.EXPLICIT, max_deliver=-1, filter_subject="aep.hermes.>")))
        (tmp_path / "e").mkdir()
        exporter = Service("exporter", nats_server_fn.url, tmp_path / "e", env={"AEP_BRIDGE_EXPORT_CONFIG": str(config)})
        try:
            assert asyncio.run(post()) == 202
            assert len(client.fetch("aep.ingest.>", stream="AEP_EVENTS")) == len(ingested), "the relay stored them"
            exporter.start()
            want = {e["id"] for e in own} | {e["id"] for e in ingested}
            wait_for(lambda: event_ids(everything) >= want, 60, what="every event, ingested ones too, at the sink")
            assert event_ids(everything) == want
            # the filtered sink has taken and acked everything it was given: what it delivered is final
            wait_for(lambda: event_ids(hermes_only) >= {e["id"] for e in own}, 60, what="the Hermes events")
            wait_for(lambda: consumer_idle(client, "AEP_EVENTS", "export-hermes"), 30, what="the filtered sink's acks")
            assert event_ids(hermes_only) == {e["id"] for e in own}
            assert exporter.alive()
        finally:
            exporter.terminate()
            relay.stop()
            client.close()
