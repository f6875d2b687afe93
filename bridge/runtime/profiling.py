"""Opt-in allocation profiling of the services, and the memory figures it records.

For memory investigations such as the soak's. With
`AEP_BRIDGE_TRACEMALLOC=<dir>` the service's start (`bridge.runtime.serve`) also starts `tracemalloc`
(`AEP_BRIDGE_TRACEMALLOC_FRAMES` frames, default 4) and a daemon thread that writes a
snapshot every `AEP_BRIDGE_TRACEMALLOC_EVERY_S` seconds (default 60) to
`<dir>/<service>-<pid>-<unix time>.snap`, plus one line per snapshot to
`<dir>/<service>-<pid>.jsonl` (traced bytes, RSS, glibc malloc figures, and a census of
the large containers held by the bridge's and nats-py's objects); a last one when the
service stops. tracemalloc makes Python 7x (1 frame) to 12x (4 frames) slower here:
`AEP_BRIDGE_TRACEMALLOC_FRAMES=0` keeps only the rows and the census (no per-allocation
cost; a pause of a fraction of a second per row), for runs at full rate. Unset (the
default), nothing of it runs.

`rss_kb` (a process's resident set) is also read by the simulation harness and benchmarks.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
import threading
import time
import tracemalloc
from collections import deque
from typing import TYPE_CHECKING, Any

import structlog

from bridge.config import load_environ, setting

if TYPE_CHECKING:  # the service's Health (bridge.runtime.health imports nothing of this module)
    from bridge.runtime.health import Health

TRACEMALLOC_ENV = "AEP_BRIDGE_TRACEMALLOC"
TRACEMALLOC_EVERY_ENV = "AEP_BRIDGE_TRACEMALLOC_EVERY_S"
TRACEMALLOC_FRAMES_ENV = "AEP_BRIDGE_TRACEMALLOC_FRAMES"


def _malloc_info() -> dict[str, int]:
    """glibc's allocator figures (mallinfo2), {} elsewhere: `in_use` is what malloc handed out
    and holds, `free` what it keeps without returning it to the system (fragmentation)."""
    try:
        import ctypes

        class MallInfo2(ctypes.Structure):
            _fields_ = [(name, ctypes.c_size_t) for name in (
                "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

        fn = ctypes.CDLL(None).mallinfo2
        fn.restype = MallInfo2
        info = fn()
        return {"heap": info.arena, "mmapped": info.hblkhd, "in_use": info.uordblks, "free": info.fordblks,
                "releasable": info.keepcost}
    except Exception:
        return {}


def _pymalloc_info() -> dict[str, int]:
    """pymalloc's arenas (Python's allocator for objects up to 512 bytes): `arenas` bytes
    held, `used` bytes in allocated blocks; the difference is free space inside arenas that
    cannot be returned while one block of the arena lives (fragmentation). From
    `sys._debugmallocstats()`, which prints to the C stderr: fd 2 is pointed at a temporary
    file for the call (a log line another thread writes meanwhile lands there too)."""
    out: dict[str, int] = {}
    with tempfile.TemporaryFile() as tmp:
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            os.dup2(tmp.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        text = tmp.read().decode("utf-8", "replace")
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if not sep:
            continue
        try:
            number = int(value.strip().replace(",", ""))
        except ValueError:
            continue
        if "arenas * " in key:
            out["arenas"] = number
        elif key.startswith("# bytes in allocated blocks"):
            out["used"] = number
    return out


def rss_kb(pid: int | str = "self") -> int:
    """Resident set size of a process in KiB (0 when it is gone or /proc is not there)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


#: owners whose attributes the census names (instances of other modules are not looked into:
#: reading `__dict__` materializes it, which would itself cost memory on many small objects)
_CENSUS_OWNERS = ("bridge.", "nats.aio.client", "nats.js.client", "nats.aio.subscription", "prometheus_client.metrics")


def container_census(min_len: int = 1000, top: int = 40) -> dict[str, Any]:
    """What the process holds in containers, without tracemalloc.

    ``named``: the containers that are attributes of an object of the bridge, nats-py or
    prometheus-client, by ``Class.attribute`` and summed over instances (the eight
    partitions' states are one line), when they hold ``min_len`` items or more in all: their
    length, shallow size and an estimate of shallow size + keys + values (sampled, shallow:
    objects shared by two containers count twice). ``anonymous``: the other containers of
    ``min_len`` items or more, by type. ``lru``: the bridge's `functools.lru_cache`s, [size,
    maxsize]. ``types``: gc-tracked objects by type (the most numerous), ``objects`` their total.
    """
    kinds = (dict, list, set, frozenset, deque, bytearray)
    containers: dict[int, Any] = {}
    owners: dict[int, str] = {}
    types: dict[str, int] = {}
    lru: dict[str, list[int]] = {}
    for obj in gc.get_objects():
        t = type(obj)
        name = t.__name__
        types[name] = types.get(name, 0) + 1
        if isinstance(obj, kinds):
            containers[id(obj)] = obj
        elif name == "_lru_cache_wrapper" and str(getattr(obj, "__module__", "")).startswith("bridge."):
            info = obj.cache_info()
            lru[f"{obj.__module__}.{obj.__qualname__}"] = [info.currsize, info.maxsize or 0]
        # `__module__` of a metaclass's instances can be a descriptor, not a str (seen in the suite).
        elif isinstance(module := getattr(t, "__module__", None), str) and module.startswith(_CENSUS_OWNERS) \
                and not isinstance(obj, type):
            d = vars(obj) if getattr(t, "__dictoffset__", 0) else None
            if isinstance(d, dict):
                for attr, value in d.items():
                    if isinstance(value, kinds):
                        owners.setdefault(id(value), f"{t.__qualname__}.{attr}")
                        containers.setdefault(id(value), value)  # bytearray and friends are not gc-tracked

    def measure(obj: Any) -> tuple[int, int, int]:
        n = len(obj)
        shallow = sys.getsizeof(obj)
        if isinstance(obj, bytearray) or not n:
            return n, shallow, shallow
        if isinstance(obj, dict):
            sample = [sys.getsizeof(k) + sys.getsizeof(v) for k, v in list(obj.items())[:200]]
        else:
            sample = [sys.getsizeof(x) for x in list(obj)[:200]]
        return n, shallow, shallow + int(sum(sample) / len(sample) * n)

    named: dict[str, dict[str, int]] = {}
    anonymous: dict[str, dict[str, int]] = {}
    for key, obj in containers.items():
        label = owners.get(key)
        try:
            if label is None and len(obj) < min_len:
                continue
            n, shallow, est = measure(obj)
        except Exception:  # changed size meanwhile (another thread): skip it
            continue
        into = named if label else anonymous
        row = into.setdefault(label or type(obj).__name__, {"n": 0, "len": 0, "shallow": 0, "est": 0})
        row["n"] += 1
        row["len"] += n
        row["shallow"] += shallow
        row["est"] += est
    del containers
    named = {k: v for k, v in named.items() if v["len"] >= min_len}
    ordered = sorted(types.items(), key=lambda kv: -kv[1])[:top]
    return {"named": dict(sorted(named.items(), key=lambda kv: -kv[1]["est"])),
            "anonymous": dict(sorted(anonymous.items(), key=lambda kv: -kv[1]["est"])[:top]),
            "lru": lru, "types": dict(ordered), "objects": sum(types.values())}


class AllocationProfiler(threading.Thread):
    """Periodic `tracemalloc` snapshots of this process (see the module docstring)."""

    def __init__(self, service: str, directory: str, every_s: float = 60.0, frames: int = 4,
                 health: Health | None = None) -> None:
        super().__init__(name=f"{service}-tracemalloc", daemon=True)
        self.service, self.dir, self.every_s, self.frames = service, directory, every_s, frames
        self.health = health  # its `info` (what the service reports about itself) goes with each row
        self.stopped = threading.Event()
        self.pid = os.getpid()
        self._lock = threading.Lock()

    def begin(self) -> "AllocationProfiler":
        os.makedirs(self.dir, exist_ok=True)
        if self.frames > 0 and not tracemalloc.is_tracing():
            tracemalloc.start(self.frames)
        self.start()
        return self

    def run(self) -> None:
        while not self.stopped.wait(self.every_s):
            self.dump()

    def dump(self) -> str | None:
        """Write one snapshot (atomically: an analysis never reads half a file) and its figures."""
        with self._lock:
            started = time.monotonic()
            now = time.time()
            row: dict[str, Any] = {"t": round(now, 3), "rss_kb": rss_kb(), "malloc": _malloc_info()}
            try:
                row["pymalloc"] = _pymalloc_info()
            except Exception:  # a diagnostic
                pass
            path = None
            if tracemalloc.is_tracing():
                snapshot = tracemalloc.take_snapshot()
                row["traced"], row["peak"] = tracemalloc.get_traced_memory()
                row["tracemalloc_overhead"] = tracemalloc.get_tracemalloc_memory()
                path = os.path.join(self.dir, f"{self.service}-{self.pid}-{now:.0f}.snap")
                if os.path.exists(path):  # two in one second (the last one at stop)
                    path = os.path.join(self.dir, f"{self.service}-{self.pid}-{now:.3f}.snap")
                snapshot.dump(path + ".tmp")
                os.replace(path + ".tmp", path)
                del snapshot
                row["snap"] = os.path.basename(path)
            try:
                row["census"] = container_census()
            except Exception as exc:  # a diagnostic: never let it stop the service
                row["census"] = {"error": f"{type(exc).__name__}: {exc}"}
            row["dump_s"] = round(time.monotonic() - started, 3)
            if self.health is not None:
                try:
                    row["info"] = json.loads(json.dumps(self.health.info, default=str))
                except Exception:  # changed by the loop meanwhile: skip it this time
                    pass
            with open(os.path.join(self.dir, f"{self.service}-{self.pid}.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")
            return path

    def finish(self) -> None:
        self.stopped.set()
        if self.is_alive() and self is not threading.current_thread():
            self.join(timeout=30)
        self.dump()
        if self.frames > 0:
            tracemalloc.stop()


_profiler: AllocationProfiler | None = None


def start_allocation_profiler(service: str, health: Health | None = None) -> AllocationProfiler | None:
    """Start the profiler when `AEP_BRIDGE_TRACEMALLOC` names a directory (once per process)."""
    global _profiler
    env = load_environ()  # the environment over the AEP_BRIDGE_CONFIG file, as every setting
    directory = env.get(TRACEMALLOC_ENV)
    if not directory or _profiler is not None:
        return _profiler
    try:  # the command checked them at start (bridge/config.py FIELDS); a later change: the defaults
        every_s, frames = setting(TRACEMALLOC_EVERY_ENV, env), setting(TRACEMALLOC_FRAMES_ENV, env)
    except ValueError:
        every_s, frames = 60.0, 4
    _profiler = AllocationProfiler(service, directory, max(1.0, every_s), max(0, frames), health).begin()
    structlog.get_logger("aep_bridge.runtime").info(
        "tracemalloc_started", directory=directory, every_s=_profiler.every_s, frames=_profiler.frames)
    return _profiler


def stop_allocation_profiler() -> None:
    """A last snapshot, then stop tracing (no-op when the profiler is not running)."""
    global _profiler
    if _profiler is not None:
        profiler, _profiler = _profiler, None
        profiler.finish()
