"""The opt-in allocation profiler of the services (bridge/runtime/profiling.py, issue 8)."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest

from bridge.runtime import profiling
from bridge.runtime.profiling import container_census, start_allocation_profiler, stop_allocation_profiler
from bridge.runtime import Health


@pytest.fixture(autouse=True)
def _no_profiler_left(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    for name in (profiling.TRACEMALLOC_ENV, profiling.TRACEMALLOC_EVERY_ENV, profiling.TRACEMALLOC_FRAMES_ENV):
        monkeypatch.delenv(name, raising=False)
    yield
    stop_allocation_profiler()
    if tracemalloc.is_tracing():
        tracemalloc.stop()


def test_off_by_default() -> None:
    assert start_allocation_profiler("mapper") is None
    assert not tracemalloc.is_tracing()
    stop_allocation_profiler()  # a no-op


def test_snapshots_and_rows_when_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(profiling.TRACEMALLOC_ENV, str(tmp_path))
    monkeypatch.setenv(profiling.TRACEMALLOC_EVERY_ENV, "3600")
    monkeypatch.setenv(profiling.TRACEMALLOC_FRAMES_ENV, "2")
    health = Health("pairing")
    health.info["state"] = {"sessions": 3}
    profiler = start_allocation_profiler("pairing", health)
    assert profiler is not None and tracemalloc.is_tracing() and tracemalloc.get_traceback_limit() == 2
    assert start_allocation_profiler("pairing") is profiler  # once per process
    path = profiler.dump()
    assert path is not None and Path(path).name.startswith(f"pairing-{profiler.pid}-") and path.endswith(".snap")
    assert tracemalloc.Snapshot.load(path).traces
    stop_allocation_profiler()  # writes the last one and stops tracing
    assert not tracemalloc.is_tracing()
    rows = [json.loads(line) for line in (tmp_path / f"pairing-{profiler.pid}.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and len(list(tmp_path.glob("*.snap"))) == 2
    assert rows[0]["traced"] > 0 and rows[0]["rss_kb"] > 0 and rows[0]["info"] == {"state": {"sessions": 3}}
    assert "named" in rows[0]["census"]


def test_census_only_without_tracemalloc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(profiling.TRACEMALLOC_ENV, str(tmp_path))
    monkeypatch.setenv(profiling.TRACEMALLOC_FRAMES_ENV, "0")
    profiler = start_allocation_profiler("mapper")
    assert profiler is not None and not tracemalloc.is_tracing()
    assert profiler.dump() is None  # no snapshot, a row
    row = json.loads((tmp_path / f"mapper-{profiler.pid}.jsonl").read_text())
    assert "traced" not in row and row["census"]["objects"] > 0


def test_census_names_the_containers_of_bridge_objects() -> None:
    from bridge.core.lanes import MemoryLanes

    lanes = MemoryLanes(max_entries=5000)
    for i in range(1500):
        lanes.add_session(f"s{i}")
    got = container_census(min_len=1000)["named"]
    assert got["MemoryLanes.sessions"]["len"] >= 1500
    assert got["MemoryLanes.sessions"]["est"] > got["MemoryLanes.sessions"]["shallow"] > 0
