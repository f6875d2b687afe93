"""benchmarks/bench_relay.py (the README's relay row) on a tiny run: it must keep working as
the relay moves, and account for every delivery on both paths (no figure is checked)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_relay.py"


def test_the_relay_benchmark_runs_both_paths_and_counts_every_delivery() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--subscribers", "3", "--procs", "1", "--n", "50",
                          "--rate", "50", "--seconds", "1"], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert re.search(r"^  sustained, nats : +[\d,]+ events/s to every subscriber \(50 events\)", out.stdout, re.M), out.stdout
    assert re.search(r"^  sustained, relay: +[\d,]+ events/s to every subscriber \(50 events\)", out.stdout, re.M), out.stdout
    assert re.search(r"^  ratio relay/bare nats-py: [\d.]+", out.stdout, re.M), out.stdout
    # 50 events x 3 subscribers, every one of them received, on both paths
    assert len(re.findall(r"^  at 50 events/s for 1 s, (nats |relay): .*\(150 deliveries\)", out.stdout, re.M)) == 2, out.stdout
    assert len(re.findall(r"reference \(1 more ordered consumer, own process\): p50 +[\d.]+ ms", out.stdout)) == 2
    assert re.search(r"^  p99 the relay adds at 50 events/s: -?[\d.]+ ms = relay end-to-end p99 [\d.]+ ms - [\d.]+ ms, "
                     r"the (bare path's|reference consumer's)", out.stdout, re.M), out.stdout
