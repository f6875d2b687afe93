#!/usr/bin/env python3
"""The pure mapping stage per raw message, in-process: no NATS, no asyncio.

    .venv/bin/python benchmarks/bench_mapping.py [--n 20000] [--repeat 5]

N realistic raw messages (copies of the real Hermes sessions shipped in bridge/data,
wrapped as the shim wraps them, the input of benchmarks/bench_mapper.py) go through what
the mapper does to each one outside NATS: decode the raw message, `record_from_raw`,
`map_record` with an in-memory lane table, encode every event. Prints the best of
`--repeat` passes in microseconds per raw message, for `map_record` alone and for the
whole step. Absolute figures: they move with the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bridge.core.aep import encode_event  # noqa: E402
from bridge.core.ceiling import CapturePolicy  # noqa: E402
from bridge.core.envelope import decode_raw  # noqa: E402
from bridge.core.identity import event_id  # noqa: E402
from bridge.core.lanes import MemoryLanes  # noqa: E402
from bridge.core.pipeline import map_record, record_from_raw  # noqa: E402
from bridge.sim.sessions import realistic_envelopes  # noqa: E402


def raw_messages(n: int) -> list[bytes]:
    base = time.time_ns()
    out = []
    for i, env in enumerate(realistic_envelopes(n, seed=1)):
        ts = base + i * 1000
        rid = event_id("bench", i, ts // 1_000_000)
        hook = env.get("hook_event_name", "x")
        out.append(json.dumps({"v": 1, "id": rid, "instance": "bench", "ts": ts, "hook": hook, "envelope": env},
                              separators=(",", ":")).encode())
    return out


def one_pass(bodies: list[bytes], policy: CapturePolicy) -> tuple[float, float, int]:
    """Seconds for the whole step, seconds inside map_record, events emitted."""
    lanes = MemoryLanes()
    inside = 0.0
    events = 0
    clock = time.perf_counter
    started = clock()
    for seq, body in enumerate(bodies, start=1):
        record = record_from_raw(decode_raw(body))
        t0 = clock()
        result = map_record(record, seq, 0, lanes, policy)
        inside += clock() - t0
        lanes.learn(result.learned)
        for event in result.events:
            encode_event(event)
        events += len(result.events)
    return clock() - started, inside, events


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=20_000)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    bodies = raw_messages(args.n)
    policy = CapturePolicy()
    runs = [one_pass(bodies, policy) for _ in range(args.repeat)]
    whole, inside, events = min(runs)
    print(f"{args.n:,} raw messages (mean {sum(map(len, bodies)) / len(bodies):.0f} B), {events:,} events, "
          f"best of {args.repeat} passes")
    print(f"map_record alone:                      {inside / args.n * 1e6:.1f} µs per raw message")
    print(f"decode + record + map_record + encode: {whole / args.n * 1e6:.1f} µs per raw message")


if __name__ == "__main__":
    main()
