"""Memory per idle open session of the pairing state: a footprint probe (tracemalloc).

    from pairing_footprint import idle_session_footprint   # benchmarks/ on sys.path

Used by benchmarks/bench_pairing.py and a smoke test; it lives here, not in
``bridge.core.pairing``, because the core imports neither ``gc`` nor ``tracemalloc``.
"""

from __future__ import annotations

import gc
import os
import sys
import tracemalloc
from typing import Any, Iterator

import msgspec
from msgspec import UNSET

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bridge.core.aep import Event  # noqa: E402
from bridge.core.identity import MAPPED_SLOT, SLOTS, event_id, rfc3339  # noqa: E402
from bridge.core.pairing import SECOND, PairingConfig, PairingState  # noqa: E402



def idle_session_inputs(n: int, base_ns: int = 1_764_500_000 * SECOND) -> Iterator[tuple[Event, dict[str, Any]]]:
    """n sessions that each ran one turn with one tool call and then went quiet (realistic id sizes)."""
    for i in range(n):
        lane = f"20261130_{i // 1_000_000:06d}_{i % 1_000_000:06x}"
        run = f"{lane}:1d62455f-df2f-4c95-934a-{i:012x}:9f0ce0fb"
        source = f"aep://gateway-{i % 7}.example/agent/hermes/session/{lane}"
        steps = (
            ("session.started", None, {"client": {"name": "hermes"}}, {}),
            ("run.started", run, {"trigger": "user"}, {}),
            ("tool.requested", run, {"tool": {"name": "terminal", "call_id": "call_0001"}}, {"tool_call_id": "call_0001"}),
            ("tool.completed", run, {"tool": {"name": "terminal", "call_id": "call_0001"}}, {"tool_call_id": "call_0001"}),
            ("run.finished", run, {}, {}),
        )
        for j, (etype, r, data, extra) in enumerate(steps):
            raw_seq = i * 8 + j + 1
            ts = base_ns + raw_seq * 1_000_000
            ev = Event(
                aep="0.1",
                id=event_id(f"probe-{raw_seq}", MAPPED_SLOT, ts // 1_000_000),
                type=etype,
                time=rfc3339(ts),
                source=source,
                agent="hermes",
                session=lane,
                run=r or UNSET,
                seq=raw_seq * SLOTS + MAPPED_SLOT,
                epoch=0,
                capture="metadata",
                data=data,
            )
            yield ev, {"ts": ts, **extra}


def idle_session_footprint(n: int = 10_000, config: PairingConfig | None = None) -> dict[str, float]:
    """Resident bytes per idle open session (tracemalloc) and snapshot bytes per session.

    Builds ``n`` sessions that each ran a turn with a tool call and are still open
    (no session.ended), ticks past ``recent_ns`` so that only what an idle session
    keeps remains, and measures what the state retains. Partition-wide overhead
    (the id ring of ``dedupe_ids``) is included and amortised over ``n``.
    """
    cfg = config or PairingConfig()
    # Encode the input first (outside the traced region), decode it inside, as the service would.
    encoder = msgspec.msgpack.Encoder()
    messages = [(encoder.encode(ev), h) for ev, h in idle_session_inputs(n)]
    decoder = msgspec.msgpack.Decoder(Event)
    last_ts = messages[-1][1]["ts"] if messages else 0
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        state = PairingState(cfg)
        position = 0
        for body, h in messages:
            position += 1
            state.process(decoder.decode(body), dict(h), position)
        state.tick(last_ts + cfg.recent_ns + 1, position + 1)
        gc.collect()
        retained = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    open_sessions = state.metrics()["sessions"]
    return {
        "sessions": float(open_sessions),
        "bytes_per_session": retained / max(open_sessions, 1),
        "snapshot_bytes_per_session": len(state.snapshot()) / max(open_sessions, 1),
    }
