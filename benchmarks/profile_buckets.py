#!/usr/bin/env python3
"""Split a service's profile into the buckets of issue 43 and turn each into µs per event.

    .venv/bin/python benchmarks/profile_buckets.py PROFILE [PROFILE ...] --ms-per-event 0.112
    .venv/bin/python benchmarks/profile_buckets.py /tmp/prof/mapper-2000.txt --top 5

PROFILE: collapsed stacks, one ``frame;frame;... count`` a line, root first: py-spy's
``record --format raw`` (`cost.py --profile`; frames ``func (path:line)``) or
`benchmarks/cpu_sampler` (frames ``func (path)``, a count per ~4 ms of CPU). Several files
(the rounds of one process) are added up. ``--ms-per-event``: the process's CPU per raw event
over the profiled window (`cost.py` prints it); each bucket's µs per event is its share of
the samples times that. Without it, shares only. `cost.py --profile` prints this table itself.

The buckets (`bucket`: the first rule that matches a sample's stack):

1. ``timed`` — checkpoints, leases, ticks, consumer watches: any frame of a service's timed
   work (`TIMED`), pairing's checkpoint compression thread, `bridge.nats.follow`'s watch.
2. ``metrics`` — metrics, health and logs: any frame of prometheus_client, structlog, logging,
   bridge/runtime's health, activity and label code, a ``*Metrics`` method, the HTTP thread.
3. ``lanes`` — the mapper's lanes: any frame of bridge/nats/lanes.py, bridge/core/lanes.py,
   bridge/nats/lookup.py or the mapper's held-message code (`LANE_FUNCS`).
   (Not the events' publishes of a held message: `Mapper.publish_events` under the held code.)
4. Otherwise the leaf decides (frames of helpers such as a dataclass ``__init__`` or
   ``functools`` are skipped to their caller):
   - ``client`` — the client's publish/ack/fetch path: nats-py (``nats/``), `bridge.nats.publish`,
     `bridge.nats.pull`, asyncio's streams (nats-py's socket writes); asyncio called from them;
   - ``core`` — pure core work: bridge/core (mapping, the pairing state machine, decode,
     encode, ids), the shim's ``token``, msgspec, json, random;
   - ``loop`` — the event loop: asyncio's own code called from the services' code or the loop
     itself (futures, tasks, ``wait``, timeouts, queues), uvloop, the selector, ``Runner.run``'s
     own samples (uvloop's C loop);
   - ``service`` — the rest: the services' own code between those (`bridge/services`,
     `bridge/nats/subjects.py`, ...).
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

#: Left out: a non-main thread waiting in ``select``, the CPU sampler's own frames (`idle`).
BUCKETS = ("core", "lanes", "timed", "metrics", "client", "loop", "service")
TITLES = {
    "core": "pure core work (mapping, pairing's state machine, decode/encode, ids)",
    "lanes": "lanes (KvLanes, lane facts, held messages, look-ups)",
    "timed": "timed work (checkpoints, leases, ticks, consumer watch)",
    "metrics": "metrics, health and logs",
    "client": "the client's publish/ack/fetch path (nats-py, AckPublisher, Puller, socket writes)",
    "loop": "the event loop (asyncio machinery, uvloop, selector)",
    "service": "the services' own code between those",
}

_FRAME = re.compile(r"^(?P<func>.*) \((?P<path>[^()]*?)(?::\d+)?\)$")
TIMED = re.compile(r"^(PairingService\.)?(try_acquire|lease_deadline|fenced|renew|release|release_now|owned_now|read_checkpoint|"
                   r"restore|checkpoint_due|checkpoint|maintain|maintain_loop|tick_loop|export_state|restart_reader)$"
                   r"|^Mapper\.(watch_consumer|durable_gone|_keep_consumer)$")
LANE_FUNCS = re.compile(r"^Mapper\.(release_held|owner_allows|foreign|lane_fact_failed|settle_earlier|stored_before|"
                        r"already_mapped|mapped_ids|is_late)$")
SERVICE_FILES = ("bridge/services/", "services/mapper.py", "services/pairing.py")
METRIC_PATHS = ("prometheus_client/", "structlog/", "logging/", "bridge/runtime/health.py", "bridge/runtime/activity.py",
                "bridge/runtime/labels.py", "bridge/runtime/logs.py", "http/server.py", "socketserver.py")
LANE_PATHS = ("bridge/nats/lanes.py", "bridge/core/lanes.py", "bridge/nats/lookup.py")
CLIENT_PATHS = ("nats/aio/", "nats/js/", "nats/protocol/", "nats/nuid", "bridge/nats/publish.py", "bridge/nats/pull.py",
                "asyncio/streams.py", "asyncio/selector_events.py")
CORE_PATHS = ("bridge/core/", "bridge/shim/hook.py", "msgspec/", "json/", "random.py", "zlib", "uuid.py", "secrets.py")
LOOP_PATHS = ("asyncio/", "uvloop/", "selectors.py", "contextvars", "_weakrefset.py")  # (asyncio's WeakSet of tasks)
SKIP_PATHS = ("<string>", "functools.py", "enum.py", "re/", "typing.py", "contextlib.py", "copy.py", "abc.py",
              "dataclasses.py", "datetime.py", "_collections_abc.py")


def frames_of(stack: str) -> list[tuple[str, str]]:
    """(function, path) per frame, root first."""
    out = []
    for f in stack.split(";"):
        m = _FRAME.match(f)
        out.append((m.group("func"), m.group("path")) if m else (f, ""))
    return out


def _has(path: str, parts: tuple[str, ...]) -> bool:
    p = "/" + path
    return any(("/" + x) in p if not x.startswith("<") else x in p for x in parts)


def _service(path: str) -> bool:
    return _has(path, SERVICE_FILES)


def idle(frames: list[tuple[str, str]]) -> bool:
    """A thread other than the main one waiting in ``select`` (the HTTP server's): py-spy may
    count it as active; no CPU is spent there. Or `cpu_sampler`'s own handler."""
    return bool(frames) and ((frames[0][0] == "Thread._bootstrap" and frames[-1][1].endswith("selectors.py"))
                             or frames[-1][1].endswith("cpu_sampler/sitecustomize.py"))  # the sampler's own


def bucket(frames: list[tuple[str, str]]) -> str:
    """The bucket of one sample's stack (root first)."""
    for func, path in frames:
        if (_service(path) and TIMED.match(func)) or "concurrent/futures/thread.py" in path or path.endswith("bridge/nats/follow.py"):
            return "timed"
    for func, path in frames:
        if _has(path, METRIC_PATHS) or (_service(path) and re.match(r"^\w*Metrics\.", func)):
            return "metrics"
    lane = None  # the leaf-most frame that is lane work, or the events' own publish under it
    for func, path in frames:
        if _has(path, LANE_PATHS) or (_service(path) and LANE_FUNCS.match(func)):
            lane = "lanes"
        elif _service(path) and func == "Mapper.publish_events":  # a held message's events: not lane work
            lane = None
    if lane:
        return lane
    leaf = [(f, p) for f, p in frames if not _has(p, SKIP_PATHS)] or frames
    func, path = leaf[-1]
    if _has(path, CLIENT_PATHS):
        return "client"
    if _has(path, CORE_PATHS):
        return "core"
    if _has(path, LOOP_PATHS) or func in ("Runner.run", "run_until_complete"):
        if func == "Runner.run" or path.endswith("runners.py"):
            return "loop"
        for f2, p2 in reversed(leaf[:-1]):  # asyncio called from nats-py is the client's; from the rest, the loop's
            if _has(p2, LOOP_PATHS):
                continue
            return "client" if _has(p2, CLIENT_PATHS) else "loop"
        return "loop"
    return "service"


def read(paths: list[Path]) -> dict[str, collections.Counter]:
    """Samples per bucket, and per leaf function within each bucket."""
    per: dict[str, collections.Counter] = {b: collections.Counter() for b in BUCKETS}
    for path in paths:
        for line in path.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if not stack or not count.isdigit():
                continue
            frames = frames_of(stack)
            if idle(frames):
                continue
            leaf = next((f"{f} ({p})" for f, p in reversed(frames) if not _has(p, SKIP_PATHS)), stack.split(";")[-1])
            per[bucket(frames)][leaf] += int(count)
    return per


def table(per: dict[str, collections.Counter], ms_per_event: float | None = None, top: int = 0, title: str = "") -> str:
    total = sum(sum(c.values()) for c in per.values())
    if not total:
        return f"  {title}: no samples"
    rows = [f"  {title}{' ' if title else ''}{total} samples" + (f"; {1000 * ms_per_event:.0f} µs of CPU per raw event" if ms_per_event else "")]
    for b in BUCKETS:
        n = sum(per[b].values())
        us = f"{1000 * ms_per_event * n / total:7.1f} µs" if ms_per_event else ""
        rows.append(f"    {b:<8} {100 * n / total:5.1f} % {us}  {TITLES[b]}")
        for leaf, k in per[b].most_common(top):
            rows.append(f"               {100 * k / total:5.1f} %  {leaf}")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profiles", nargs="+", type=Path)
    ap.add_argument("--ms-per-event", type=float, default=None, help="the process's CPU per raw event (ms) over the window")
    ap.add_argument("--top", type=int, default=0, help="leaf functions shown per bucket")
    a = ap.parse_args()
    print(table(read(a.profiles), a.ms_per_event, a.top, ", ".join(str(p) for p in a.profiles) + ":"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
