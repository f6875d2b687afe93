#!/usr/bin/env python3
"""Exporter memory over a long run with a Kafka outage in the middle (issue 14).

    .venv/bin/python benchmarks/exporter_soak.py --duration 600 --rate 200 --outage-at 240 --outage 120

An embedded nats-server and a Tansu broker; `aep-bridge exporter` as its own process with one
Kafka sink (CloudEvents); a publisher puts `--rate` AEP events/s (the realistic sessions
mapped by the pure core) into AEP_EVENTS for `--duration` seconds. At `--outage-at` the
broker is killed; `--outage` seconds later a fresh one (in-memory storage: empty) starts on
the same address. Every `--sample` seconds: the exporter's RSS, its delivered count and lag.
Prints the samples, RSS after warm-up -> end (target: +<= 10 %), and whether the sink caught
up (lag 0) after the outage. Figures only, no assertion.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.exporter import sim_messages as aep_messages  # noqa: E402
from bridge.config import Settings  # noqa: E402
from bridge.stack.server import EmbeddedNats, free_port  # noqa: E402
from bridge.runtime.profiling import rss_kb  # noqa: E402
from tests.support.tansu import Tansu  # noqa: E402


def metrics(port: int) -> dict[str, float]:
    out: dict[str, float] = {}
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=3) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("aep_bridge_export_"):
                    name, _, value = line.rpartition(" ")
                    out[name] = float(value)
    except OSError:
        pass
    return out


async def main(args: argparse.Namespace) -> None:
    import nats

    from bridge.nats.bootstrap import bootstrap

    n_total = int(args.rate * args.duration)
    msgs = aep_messages(n_total)
    with tempfile.TemporaryDirectory() as tmp, EmbeddedNats(tmp) as server:
        broker = Tansu(Path(tmp) / "tansu.log").start()
        broker.create_topics("soak", partitions=3)
        settings = Settings.from_env({"AEP_BRIDGE_NATS_URL": server.url, "AEP_BRIDGE_CONFIG": os.devnull})
        nc = await nats.connect(server.url)
        js = nc.jetstream(publish_async_max_pending=4096)
        await bootstrap(js, settings)
        port = free_port()
        log = open(Path(tmp) / "exporter.log", "wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "bridge.cli", "exporter", "--nats", server.url, "--metrics-port", str(port),
             "--sink", f"kafka://{broker.bootstrap}/soak?name=soak&message.timeout.ms=10000"],
            env={**os.environ, "AEP_BRIDGE_CONFIG": os.devnull, "AEP_BRIDGE_LOG_LEVEL": "warning"},
            stdout=log, stderr=subprocess.STDOUT)
        samples: list[tuple[float, int, float, float]] = []
        t0 = time.monotonic()
        sent = 0
        next_sample = 0.0
        outage = "before"
        try:
            while True:
                now = time.monotonic() - t0
                if now >= args.duration and outage == "after":
                    break
                due = min(n_total, int(now * args.rate))
                futures = []
                while sent < due:
                    subject, body, eid = msgs[sent]
                    futures.append(await js.publish_async(subject, body, headers={"Nats-Msg-Id": eid}))
                    sent += 1
                if futures:
                    await asyncio.gather(*futures)
                if outage == "before" and now >= args.outage_at:
                    broker.kill()
                    outage = "during"
                    print(f"{now:6.0f}s  Kafka killed", flush=True)
                elif outage == "during" and now >= args.outage_at + args.outage:
                    broker = Tansu(Path(tmp) / "tansu2.log", port=broker.port).start()
                    broker.create_topics("soak", partitions=3)
                    outage = "after"
                    print(f"{now:6.0f}s  a fresh Kafka started", flush=True)
                if now >= next_sample:
                    m = metrics(port)
                    row = (now, rss_kb(proc.pid), m.get('aep_bridge_export_delivered_total{sink="soak"}', 0.0),
                           m.get('aep_bridge_export_lag{sink="soak"}', -1.0))
                    samples.append(row)
                    print(f"{row[0]:6.0f}s  rss {row[1] / 1024:6.1f} MiB  sent {sent:7d}  delivered {row[2]:8.0f}"
                          f"  lag {row[3]:6.0f}", flush=True)
                    next_sample += args.sample
                await asyncio.sleep(0.05)
            # let it catch up
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                m = metrics(port)
                if m.get('aep_bridge_export_delivered_total{sink="soak"}', 0) >= sent:
                    break
                await asyncio.sleep(1)
            m = metrics(port)
            end = (time.monotonic() - t0, rss_kb(proc.pid), m.get('aep_bridge_export_delivered_total{sink="soak"}', 0.0),
                   m.get('aep_bridge_export_lag{sink="soak"}', -1.0))
            samples.append(end)
        finally:
            proc.terminate()
            proc.wait(30)
            log.close()
            broker.stop()
            await nc.close()
    warm = next((s for s in samples if s[0] >= args.warmup), samples[0])
    print(f"events sent {sent}, delivered (incl. same-id redeliveries) {end[2]:.0f}, final lag {end[3]:.0f}")
    print(f"exporter RSS after warm-up ({warm[0]:.0f}s) {warm[1] / 1024:.1f} MiB -> end {end[1] / 1024:.1f} MiB:"
          f" {100 * (end[1] - warm[1]) / warm[1]:+.1f} % (target +<= 10 %);"
          f" max {max(s[1] for s in samples if s[0] >= warm[0]) / 1024:.1f} MiB")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=600)
    p.add_argument("--rate", type=float, default=200)
    p.add_argument("--outage-at", type=float, default=240)
    p.add_argument("--outage", type=float, default=120)
    p.add_argument("--warmup", type=float, default=60)
    p.add_argument("--sample", type=float, default=30)
    asyncio.run(main(p.parse_args()))
