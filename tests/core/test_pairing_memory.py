"""Memory bounds of the pairing state (issue 8: the soak's "memory flat" target).

The ended sessions of a partition are remembered as 8-byte digests, FIFO, up to
``max_ended`` (100,000 per partition by default: ~5 h of session ends at the soak fleet's
rate). They are stored compactly (`_DigestRing`: ~17 bytes a digest instead of ~90 for a
set of ints plus a deque), and the bound is enforced across snapshots. No timing here:
sizes and behaviour only.
"""

from __future__ import annotations

import gc
import tracemalloc

from bridge.core.aep import Event
from bridge.core.identity import MAPPED_SLOT, SLOTS, event_id, rfc3339
from bridge.core.pairing import SECOND, PairingConfig, PairingState, _DigestRing

BASE_NS = 1_764_500_000 * SECOND


def _ended(i: int, raw_seq: int) -> tuple[Event, dict]:
    lane = f"20261130_120000_{i:06x}"
    ts = BASE_NS + raw_seq * 1_000_000
    ev = Event(
        aep="0.1",
        id=event_id(f"mem-{raw_seq}", MAPPED_SLOT, ts // 1_000_000),
        type="session.ended",
        time=rfc3339(ts),
        source=f"aep://gateway-{i % 7}.example/agent/hermes/session/{lane}",
        agent="hermes",
        session=lane,
        seq=raw_seq * SLOTS + MAPPED_SLOT,
        epoch=0,
        capture="metadata",
        data={"reason": "shutdown"},
    )
    return ev, {"ts": ts}


class _Feed:
    def __init__(self, config: PairingConfig) -> None:
        self.state = PairingState(config)
        self.position = 0
        self.raw = 0

    def end(self, i: int) -> list[str]:
        self.raw += 1
        self.position += 1
        ev, h = _ended(i, self.raw)
        return [e.type for e in self.state.process(ev, h, self.position)]

    def forget_structs(self) -> None:
        """Tick past recent_ns: ended sessions' structs go, only their digests stay."""
        self.position += 1
        self.state.tick(BASE_NS + (self.raw + 1) * 1_000_000 + self.state.config.recent_ns + SECOND, self.position)
        assert self.state.metrics()["sessions"] == 0


def test_digest_ring_is_fifo_and_bounded() -> None:
    ring = _DigestRing(100)
    for d in range(5000):
        ring.add(d * 7919)
    assert len(ring) == 100
    assert ring.tolist() == [d * 7919 for d in range(4900, 5000)]
    assert all(d * 7919 in ring for d in range(4900, 5000))
    assert not any(d * 7919 in ring for d in range(4900))
    # evicted entries are really dropped (compaction), not only skipped: no hidden growth
    assert len(ring._sorted) == 100
    assert len(ring._order) <= 2 * 100 + 1025


def test_digest_ring_restores_oldest_first_and_keeps_its_bound() -> None:
    ring = _DigestRing(3, [5, 1, 9])
    assert ring.tolist() == [5, 1, 9] and 1 in ring and 2 not in ring
    ring.add(2)
    assert ring.tolist() == [1, 9, 2] and 5 not in ring and 2 in ring


def test_ended_sessions_beyond_max_ended_are_forgotten_oldest_first() -> None:
    feed = _Feed(PairingConfig(max_ended=1000))
    for i in range(1500):
        assert feed.end(i) == ["session.ended"]
    feed.forget_structs()
    assert feed.state.metrics()["ended_remembered"] == 1000
    assert feed.end(1499) == ["x.hermes.session.finalized"]  # remembered: exclusivity holds
    assert feed.end(0) == ["session.ended"]  # forgotten: past the bound
    assert feed.state.metrics()["ended_remembered"] == 1000


def test_the_bound_holds_across_a_snapshot() -> None:
    config = PairingConfig(max_ended=1000)
    feed = _Feed(config)
    for i in range(1200):
        feed.end(i)
    feed.forget_structs()
    snap = feed.state.snapshot()
    restored = PairingState.restore(snap, config)
    assert restored.metrics()["ended_remembered"] == 1000
    assert restored.snapshot() == snap
    feed.state = restored
    assert feed.end(1199) == ["x.hermes.session.finalized"]
    assert feed.end(1) == ["session.ended"]
    assert feed.state.metrics()["ended_remembered"] == 1000
    assert feed.end(200) == ["session.ended"]  # the oldest remembered one was evicted by the add above
    assert feed.end(1199) == ["x.hermes.session.finalized"]


def _retained_after_ending(n: int, max_ended: int) -> tuple[int, PairingState]:
    events = [_ended(i, i + 1) for i in range(n)]
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        feed = _Feed(PairingConfig(max_ended=max_ended, dedupe_ids=0))
        for position, (ev, h) in enumerate(events, start=1):
            feed.state.process(ev, h, position)
        feed.raw, feed.position = n, n
        feed.forget_structs()
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before, feed.state
    finally:
        tracemalloc.stop()


def test_a_remembered_ended_session_costs_a_few_bytes() -> None:
    """What a partition keeps per ended session once its struct is gone: its digest only
    (~17 bytes; a set of ints plus a deque cost ~86). 100,000 per partition, 8 partitions:
    ~13 MiB at the bound instead of ~65. Measured as the difference between remembering
    all of them and remembering one (the rest of the state is the same in both)."""
    n = 20_000
    remembered, state = _retained_after_ending(n, max_ended=n)
    assert state.metrics()["ended_remembered"] == n
    baseline, state = _retained_after_ending(n, max_ended=1)
    assert state.metrics()["ended_remembered"] == 1
    per_digest = (remembered - baseline) / n
    assert per_digest < 24, f"{per_digest:.1f} bytes per remembered ended session"


def test_the_pairing_growth_benchmark_runs_and_reports_the_state() -> None:
    """benchmarks/pairing_growth.py (issue 8: the state over hours of stream time) on a tiny
    run: it must keep working, and its rows must describe a state that evicts."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "pairing_growth.py"
    out = subprocess.run([sys.executable, str(script), "--minutes", "4", "--rate", "40", "--every", "1",
                          "--instances", "50"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["stream_min"] for r in rows] == [1.0, 2.0, 3.0, 4.0]
    assert rows[-1]["sessions"] > 0 and rows[-1]["ended_digests"] > 0 and rows[-1]["checkpoint_kb"] > 0
    assert rows[-1]["evicted"] > 0, "ended sessions leave after recent_ns (2 min)"
    assert "simulate more than 32 min" in out.stdout
