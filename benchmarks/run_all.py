#!/usr/bin/env python3
"""Run every benchmark in turn and print its figures (`make bench`).

Each script prints ratios against a baseline measured in the same run, so the
figures mean something on a shared, noisy machine. None of them asserts.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHES = [
    ("shim start-up vs a bare Python hook", ["bench_shim.py", "-n", "300"]),
    ("mapper vs the nats-py relay ceiling", ["bench_mapper.py", "--n", "50000"]),
    ("a publish on the services' wire path vs nats-py's public publish", ["wire_publish.py"]),
    ("the pure mapping stage, per raw message", ["bench_mapping.py"]),
    ("pairing vs the relay ceiling, memory per idle session", ["bench_pairing.py", "--n", "50000"]),
    ("relay SSE fan-out to 100 subscribers vs a bare nats-py consumer each", ["bench_relay.py"]),
    ("pairing state over an hour of stream time (pure core)", ["pairing_growth.py", "--minutes", "60", "--rate", "250"]),
    ("the pipeline at R1, R3 and R3 with sync_interval always", ["bench_cluster.py", "--n", "20000", "--seconds", "40"]),
]


def main() -> int:
    worst = 0
    for title, argv in BENCHES:
        print(f"\n=== {title}: {' '.join(argv)}", flush=True)
        worst = max(worst, subprocess.call([sys.executable, str(HERE / argv[0]), *argv[1:]]))
    return worst


if __name__ == "__main__":
    sys.exit(main())
