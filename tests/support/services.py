"""Run the bridge's services as real processes, and load HERMES_RAW quickly, for tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable

from bridge.core.ceiling import CapturePolicy
from bridge.stack.server import terminate
from bridge.core.identity import event_id
from bridge.core.lanes import MemoryLanes
from bridge.core.pipeline import map_record, record_from_line

ROOT = Path(__file__).resolve().parents[2]


class Service:
    """`aep-bridge <name> --nats URL` as a child process, logs to a file."""

    def __init__(self, name: str, url: str, log_dir: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.url = url
        self.args = list(args)
        self.log_dir = log_dir
        self.env = {**os.environ, "AEP_BRIDGE_CONFIG": os.devnull, "AEP_BRIDGE_LOG_FORMAT": "json", **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    def start(self) -> "Service":
        self.starts += 1
        log = open(self.log_path, "ab")
        cmd = [sys.executable, "-m", "bridge.cli", self.name.split("-")[0], "--nats", self.url, "--metrics-port", "0", *self.args]
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT)
        log.close()
        return self

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def terminate(self, timeout: float = 30.0) -> int | None:
        return terminate(self.proc, timeout)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def metrics_port(self) -> int:
        """The port of its /metrics, from its ``<role>_starting`` log line (it was started with port 0)."""
        starting = f"{self.name.split('-')[0]}_starting"
        for line in self.log_path.read_text(errors="replace").splitlines():
            if starting in line and "{" in line:
                return int(json.loads(line[line.index("{"):])["metrics_port"])
        raise AssertionError(f"no {starting} line: {self.log()}")

    def metrics_text(self) -> str:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port()}/metrics", timeout=5) as r:
            return r.read().decode()


def raw_records(envelopes: Iterable[dict[str, Any]], instance: str = "test", base_ts: int | None = None) -> list[tuple[str, bytes, str]]:
    """Raw messages exactly as the shim wraps them: (subject, body, Nats-Msg-Id)."""
    out = []
    base = base_ts or time.time_ns()
    for i, env in enumerate(envelopes):
        ts = base + i * 1000
        rid = event_id(f"test-{instance}", i, ts // 1_000_000)
        hook = env.get("hook_event_name", "x")
        body = json.dumps({"v": 1, "id": rid, "instance": instance, "ts": ts, "hook": hook, "envelope": env}, separators=(",", ":")).encode()
        out.append((f"hermes.raw.{instance}.{hook}", body, rid))
    return out


async def publish_all(js: Any, records: list[tuple[str, bytes, str]]) -> None:
    import asyncio

    futures = []
    for subject, body, rid in records:
        futures.append(await js.publish_async(subject, body, headers={"Nats-Msg-Id": rid}))
        if len(futures) >= 2048:
            await asyncio.gather(*futures)
            futures = []
    await asyncio.gather(*futures)


def expected_events(raw_bodies: list[tuple[int, bytes]], epoch: int) -> list[Any]:
    """What the mapping stage makes of raw messages (raw seq, body), with a fresh lane table."""
    lanes, events = MemoryLanes(), []
    policy = CapturePolicy()
    for seq, body in raw_bodies:
        try:
            record = record_from_line(json.loads(body), seq, "", 0)
        except Exception:
            continue
        result = map_record(record, seq, epoch, lanes, policy)
        lanes.learn(result.learned)
        events.extend(result.events)
    return events


def wait_for(predicate, timeout: float, interval: float = 0.1, what: str = "condition") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def http_json(url: str) -> tuple[int, dict]:
    """(status, JSON body) of a GET; (0, {}) when nothing answers."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {}
    except OSError:
        return 0, {}

