#!/usr/bin/env python3
"""Pairing state over hours of stream time, in minutes of CPU: does it stop growing?

    .venv/bin/python benchmarks/pairing_growth.py --minutes 60 --rate 1000

The soak (benchmarks/soak.py) runs in wall time, so a 10-minute run cannot show where
bounds measured in tens of minutes (idle sessions: ``idle_ttl_ns``, 30 min) stop the
pairing state. This runs the same simulated fleet (`bridge.sim.instances`, 1,000 instances)
through the pure pipeline only: shim record (stamped with a simulated receive time
``rate`` events per second apart), the mapping, the lane table, and ONE `PairingState`
(all lanes in one partition), with a tick every 15 s of stream time as the service
publishes them. No NATS, no wall clock: the output is deterministic for a seed.

Every ``--every`` minutes of stream time it prints the state's sessions (open, ended
but remembered, idle), ended-session digests, held follow-ups, open pairs, the size of
its compressed checkpoint (what the service writes every 10 s) and the process RSS.
A state whose bounds hold levels off once the longest bound (``idle_ttl_ns``) has
passed; the last line compares the final figures with those at that point.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import zlib

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bridge.core.ceiling import CapturePolicy  # noqa: E402
from bridge.core.envelope import decode_raw  # noqa: E402
from bridge.core.lanes import MemoryLanes  # noqa: E402
from bridge.core.pairing import MINUTE, SECOND, PairingState  # noqa: E402
from bridge.core.pipeline import map_record, record_from_raw  # noqa: E402
from bridge.runtime.profiling import rss_kb  # noqa: E402
from bridge.shim import hook  # noqa: E402
from bridge.sim.instances import stream_envelopes  # noqa: E402

TICK_NS = 15 * SECOND  # the pairing service's default tick interval (AEP_BRIDGE_TICK_S)


def _old_open(state: PairingState, age_ns: int) -> dict[str, int]:
    """Open starts older than ``age_ns`` by kind: what keeps a quiet session past idle_ttl_ns."""
    from bridge.core.pairing import KINDS, OPEN

    out: dict[str, int] = {}
    for s in state._sessions.values():
        for p in s.pairs or ():
            if p.state == OPEN and state.clock - p.ts > age_ns:
                out[KINDS[p.kind]] = out.get(KINDS[p.kind], 0) + 1
    return out


def row(minute: float, state: PairingState, started: float) -> dict[str, float]:
    m = state.metrics()
    ended_live = sum(1 for s in state._sessions.values() if s.ended)
    return {
        "stream_min": round(minute, 1),
        "sessions": m["sessions"],
        "ended_kept": ended_live,
        "idle_or_open": m["sessions"] - ended_live,
        "ended_digests": m["ended_remembered"],
        "held": m["held_now"],
        "open": {k[5:]: v for k, v in m.items() if k.startswith("open.")},
        "open_30min": _old_open(state, 30 * MINUTE),
        "evicted": m.get("evicted", 0),
        "checkpoint_kb": round(len(zlib.compress(state.snapshot(), 1)) / 1024, 1),
        "rss_mib": round(rss_kb(os.getpid()) / 1024, 1),
        "cpu_s": round(time.process_time() - started, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=60.0, help="stream time to simulate (default 60)")
    ap.add_argument("--rate", type=float, default=1000.0, help="combined events per second (default 1000)")
    ap.add_argument("--instances", type=int, default=1000)
    ap.add_argument("--every", type=float, default=5.0, help="minutes of stream time between rows")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    cfg = hook.Config({"AEP_BRIDGE_CONFIG": os.devnull, "AEP_BRIDGE_INSTANCE": "gen"})
    lanes, policy, state = MemoryLanes(max_entries=8192), CapturePolicy(), PairingState(partition=0)
    base = 1_764_500_000 * SECOND
    step = int(SECOND / args.rate)
    total = int(args.minutes * 60 * args.rate)
    next_tick, next_row, position = base + TICK_NS, base + int(args.every * MINUTE), 0
    rows = []
    started = time.process_time()
    rand = random.Random(args.seed + 2)
    print(f"pairing_growth: {args.instances} instances, {args.rate:.0f} events/s, {args.minutes:.0f} min of stream time; "
          f"idle_ttl {state.config.idle_ttl_ns // MINUTE} min, recent {state.config.recent_ns // SECOND} s, "
          f"max_ended {state.config.max_ended}")
    for i, (name, data) in enumerate(stream_envelopes(args.instances, args.seed)):
        if i >= total:
            break
        now = base + i * step
        while next_tick <= now:
            position += 1
            state.tick(next_tick, position)
            next_tick += TICK_NS
        if now >= next_row:
            rows.append(row((now - base) / MINUTE, state, started))
            print(json.dumps(rows[-1]), flush=True)
            next_row += int(args.every * MINUTE)
        cfg.instance = name
        record = hook.build_record(data, cfg, now_ns=now, rand=rand.getrandbits(80).to_bytes(10, "big"))
        try:
            result = map_record(record_from_raw(decode_raw(record.body)), i + 1, 0, lanes, policy)
        except Exception:  # hostile input: the mapper dead-letters it
            continue
        lanes.learn(result.learned)
        for event in result.events:
            position += 1
            state.process(event, result.hints, position)
    rows.append(row(args.minutes, state, started))
    print(json.dumps(rows[-1]))
    settle = state.config.idle_ttl_ns / MINUTE + state.config.recent_ns / MINUTE
    after = [r for r in rows if r["stream_min"] >= settle]
    if len(after) >= 2:
        a, b = after[0], after[-1]
        print(f"after {a['stream_min']:.0f} min (idle_ttl + recent): sessions {a['sessions']} -> {b['sessions']}, "
              f"checkpoint {a['checkpoint_kb']} -> {b['checkpoint_kb']} KB, RSS {a['rss_mib']} -> {b['rss_mib']} MiB "
              f"({100 * (b['rss_mib'] - a['rss_mib']) / a['rss_mib']:+.1f} %); ended digests keep growing to max_ended "
              f"(16 B each)")
    else:
        print(f"(simulate more than {settle:.0f} min to see the state level off)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
