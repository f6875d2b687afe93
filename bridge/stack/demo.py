"""`aep-bridge demo`: replay real Hermes sessions through the real shim, then summarise.

The envelopes are the real ones shipped in `bridge/data/observed_sessions.jsonl`,
with a run-specific suffix on every session id so that each demo makes new
sessions. Each envelope goes through `bridge/shim/hook.py` exactly the way Hermes
spawns a hook (`<python> -I -S hook.py`, envelope on stdin, `{}` expected back),
so the whole path shim -> HERMES_RAW -> mapper -> BRIDGE_MAPPED -> pairing ->
AEP_EVENTS is exercised. The instance name is `demo-<suffix>`, which lets the
demo find exactly its own events on AEP_EVENTS (their `source` names it).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections import Counter, defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TextIO

from nats.js.api import ConsumerConfig, DeliverPolicy

from bridge.config import Settings, default_state_dir
from bridge.core.ceiling import CapturePolicy
from bridge.core.lanes import MemoryLanes
from bridge.core.pipeline import map_record, record_from_line
from bridge.hermes.install import InstallError, compile_hook
from bridge.nats.connection import connect_client, shim_env
from bridge.sim.sessions import renamed_corpus

SHIM = Path(__file__).resolve().parent.parent / "shim" / "hook.py"


def demo_envelopes(suffix: str) -> list[dict[str, Any]]:
    """The real sessions, every identity suffixed with `suffix` (a fresh run of the same corpus)."""
    return renamed_corpus(suffix)


def expected_mapped(envelopes: list[dict[str, Any]]) -> int:
    """How many events the mapping stage makes of these envelopes (pairing adds more)."""
    lanes, total = MemoryLanes(), 0
    for i, env in enumerate(envelopes, start=1):
        result = map_record(record_from_line(env, i, "demo", 0), i, 0, lanes, CapturePolicy())
        lanes.learn(result.learned)
        total += len(result.events)
    return total


def shim_script() -> Path:
    """The byte-compiled shim, as `aep-bridge hermes install` registers it (a script named on
    the command line is recompiled on every run: ~11 ms here); the source if compiling fails."""
    try:
        return compile_hook(sys.executable, target=default_state_dir() / "demo-hook.pyc")
    except (InstallError, OSError):
        return SHIM


def progress(out: TextIO, text: str, final: bool = False) -> None:
    """One updating line on a terminal; only the final line elsewhere (logs, pipes)."""
    if out.isatty():
        print("\r" + text, end="\n" if final else "", file=out, flush=True)
    elif final:
        print(text, file=out, flush=True)


def spawn_shims(envelopes: list[dict[str, Any]], env: dict[str, str], out: TextIO) -> tuple[int, list[float]]:
    """Run the shim once per envelope, as Hermes does; returns (failures, durations in ms)."""
    failures, durations = 0, []
    cmd = [sys.executable, "-I", "-S", str(shim_script())]
    for i, envelope in enumerate(envelopes, start=1):
        started = time.perf_counter()
        proc = subprocess.run(cmd, input=json.dumps(envelope).encode(), capture_output=True, env=env, timeout=10)
        durations.append(1000 * (time.perf_counter() - started))
        if proc.returncode != 0 or proc.stdout.strip() != b"{}":
            failures += 1
        if i % 20 == 0 or i == len(envelopes):
            progress(out, f"aep-bridge demo: {i}/{len(envelopes)} hook runs", final=i == len(envelopes))
    return failures, durations


async def collect(nc: Any, source_prefix: str, since: datetime, want: int, timeout: float, out: TextIO) -> list[tuple[dict[str, Any], float]]:
    """Read AEP_EVENTS from `since` until `want` events of ours arrived and the stream is quiet."""
    js = nc.jetstream()
    got: list[tuple[dict[str, Any], float]] = []
    queue: asyncio.Queue = asyncio.Queue()

    async def cb(msg: Any) -> None:
        await queue.put((msg.data, msg.metadata.timestamp))

    config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=since)
    from bridge.nats.subjects import events_filter

    sub = await js.subscribe(events_filter(), cb=cb, ordered_consumer=True, config=config)
    deadline = time.monotonic() + timeout
    last = time.monotonic()
    try:
        while time.monotonic() < deadline:
            try:
                async with asyncio.timeout(0.25):  # (not wait_for: it can swallow Ctrl-C, see tail)
                    data, stored = await queue.get()
            except TimeoutError:
                if len(got) >= want and time.monotonic() - last > 1.5:
                    break
                continue
            event = json.loads(data)
            if str(event.get("source", "")).startswith(source_prefix):
                got.append((event, stored.timestamp() if hasattr(stored, "timestamp") else 0.0))
                last = time.monotonic()
                if len(got) % 50 == 0:
                    progress(out, f"aep-bridge demo: {len(got)} events on AEP_EVENTS")
    finally:
        await sub.unsubscribe()
    progress(out, f"aep-bridge demo: {len(got)} events on AEP_EVENTS", final=True)
    return got


def summarise(events: list[tuple[dict[str, Any], float]]) -> dict[str, dict[str, Any]]:
    sessions: dict[str, dict[str, Any]] = defaultdict(lambda: {
        "events": 0, "runs": Counter(), "tools": Counter(), "approvals": Counter(), "answers": Counter(),
        "forms": Counter(), "subagents": Counter(), "latencies_ms": [],
    })
    for event, stored in events:
        lane = "unknown" if event.get("lane") == "unknown" else event.get("session", "?")
        s = sessions[lane]
        s["events"] += 1
        t = event["type"]
        data = event.get("data") or {}
        if t.startswith("run."):
            s["runs"][t.split(".", 1)[1]] += 1
        elif t in ("tool.completed", "tool.failed", "tool.denied"):
            s["tools"][t.split(".", 1)[1]] += 1
        elif t == "attention.requested":
            s["approvals" if data.get("kind") == "permission" else "forms"]["requested"] += 1
        elif t == "attention.answered":
            answer = data.get("answer") or {}
            s["answers"][answer.get("option") or "form"] += 1
        elif t in ("attention.timeout", "attention.resolved"):
            s["approvals"][data.get("resolution", "timeout")] += 1
        elif t.startswith("delegation.subagent."):
            s["subagents"][t.rsplit(".", 1)[1]] += 1
        if stored and event.get("time"):
            received = datetime.fromisoformat(event["time"].replace("Z", "+00:00")).timestamp()
            s["latencies_ms"].append(max(0.0, 1000 * (stored - received)))
    return dict(sessions)


def _fmt(counter: Counter) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(counter.items())) or "-"


def print_summary(summary: dict[str, dict[str, Any]], out: TextIO) -> None:
    print("\nper-session summary (AEP_EVENTS)", file=out)
    print(f"{'session':<34} {'events':>6}  {'runs':<22} {'tools':<28} {'approvals/cards':<34} {'answers':<18} {'subagents':<18} {'latency p50/max ms'}", file=out)
    for lane, s in sorted(summary.items(), key=lambda kv: (kv[0] == "unknown", kv[0])):
        lat = sorted(s["latencies_ms"])
        p50 = lat[len(lat) // 2] if lat else 0.0
        cards = s["approvals"] + Counter({f"form_{k}": v for k, v in s["forms"].items()})
        print(f"{lane[-34:]:<34} {s['events']:>6}  {_fmt(s['runs']):<22} {_fmt(s['tools']):<28} {_fmt(cards):<34} "
              f"{_fmt(s['answers']):<18} {_fmt(s['subagents']):<18} {p50:.0f}/{(lat[-1] if lat else 0):.0f}", file=out)


async def run_demo(settings: Settings, out: TextIO = sys.stdout, color: bool = False, timeout: float = 60.0,
                   json_summary: Path | None = None) -> dict[str, Any]:
    # Connected first: a wrong URL, a dead server or refused credentials end the demo in one line
    # within seconds, before any shim runs (and spools what it cannot deliver).
    nc = await connect_client(settings, name="aep-bridge-demo", role="consumer")
    try:
        return await _run_demo(nc, settings, out, color, timeout, json_summary)
    finally:
        await nc.close()


async def _run_demo(nc: Any, settings: Settings, out: TextIO, color: bool, timeout: float,
                    json_summary: Path | None) -> dict[str, Any]:
    suffix = f"-d{int(time.time() * 1000) % 10**9}"
    instance = f"demo{suffix}"
    envelopes = demo_envelopes(suffix)
    want = expected_mapped(envelopes)
    print(f"aep-bridge demo: replaying {len(envelopes)} real Hermes hook events ({len(set(e['session_id'] for e in envelopes if e['session_id']))} sessions) through the shim ...", file=out)
    env = dict(os.environ)
    env.update({
        "AEP_BRIDGE_INSTANCE": instance,
        "AEP_BRIDGE_SPOOL_DIR": str(default_state_dir() / "demo-spool"),
        "AEP_BRIDGE_CONFIG": os.devnull,
    })
    env.update(shim_env(settings))  # the shim connects as the demo does (e.g. `aep-bridge up`'s generated credential)
    since = datetime.now(timezone.utc)
    failures, durations = await asyncio.to_thread(spawn_shims, envelopes, env, out)
    durations.sort()
    print(f"aep-bridge demo: shim answered {{}} {len(envelopes) - failures}/{len(envelopes)} times; "
          f"hook run time median {durations[len(durations) // 2]:.1f} ms, max {durations[-1]:.1f} ms", file=out)
    events = await collect(nc, f"aep://{instance}/", since, want, timeout, out)
    summary = summarise(events)
    print_summary(summary, out)
    result = {
        "instance": instance,
        "hook_runs": len(envelopes),
        "shim_failures": failures,
        "mapped_expected": want,
        "events": len(events),
        "sessions": {k: {**v, "runs": dict(v["runs"]), "tools": dict(v["tools"]), "approvals": dict(v["approvals"]),
                         "answers": dict(v["answers"]), "forms": dict(v["forms"]), "subagents": dict(v["subagents"])}
                     for k, v in summary.items()},
    }
    if json_summary:
        json_summary.write_text(json.dumps(result, indent=2))
    return result
