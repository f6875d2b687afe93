"""benchmarks/bench_mapping.py (the README's "pure mapping stage" row) on a tiny run: it must
keep working as the code moves, and report both figures for every message it was given."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_mapping.py"


def test_the_mapping_benchmark_runs_and_reports_microseconds_per_raw_message() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--n", "300", "--repeat", "1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert re.search(r"^300 raw messages \(mean \d+ B\), [\d,]+ events, best of 1 passes$", out.stdout, re.M), out.stdout
    figures = re.findall(r"([\d.]+) µs per raw message", out.stdout)
    assert len(figures) == 2 and all(float(f) > 0 for f in figures), out.stdout
    assert float(figures[0]) <= float(figures[1]), "map_record alone is part of the whole step"
