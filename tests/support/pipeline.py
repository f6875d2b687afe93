"""Run the bridge's services as real processes around a NATS server, for fault tests, the soak and
the cost benchmark (test machinery: it lived in bridge/sim/harness.py, inside the shipped package).

``Pipeline(url, workdir)`` bootstraps the streams (optionally with a shorter duplicate
window) and starts ``aep-bridge mapper`` / ``aep-bridge pairing`` workers as child
processes with their own metrics ports. A ``Worker`` can be killed (SIGKILL), paused
(SIGSTOP) and resumed, restarted, scraped (``/metrics``) and measured (RSS from
``/proc``). ``Pipeline.lag()`` reads the consumers' backlog from the server, and
``Pipeline.settle()`` waits until the mapper and pairing consumers have nothing pending.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import nats
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from bridge.nats import streams as S
from bridge.nats.bootstrap import bootstrap
from bridge.runtime.profiling import rss_kb
from tests.support.cli import ROOT, free_port



_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eE]+|NaN|[+-]Inf)\s*$')


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value}."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


class Worker:
    """``aep-bridge <kind> --nats URL`` as a child process with a known metrics port."""

    def __init__(self, kind: str, url: str, log_dir: Path, name: str, args: list[str] | None = None,
                 env: dict[str, str] | None = None, python_args: list[str] | None = None,
                 module: str = "bridge.cli") -> None:
        self.kind = kind
        self.module = module  # the entry point run with -m (tests run a mapper with an injected hook)
        self.python_args = list(python_args or [])  # e.g. ["-m", "cProfile", "-o", FILE]
        self.url = url
        self.name = name
        self.args = list(args or [])
        self.log_path = Path(log_dir) / f"{name}.log"
        self.env = {**os.environ, "AEP_BRIDGE_CONFIG": os.devnull, "AEP_BRIDGE_LOG_FORMAT": "json", **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.starts = 0
        self.kills = 0

    def start(self) -> "Worker":
        self.port = free_port()
        self.starts += 1
        extra = ["--replica", self.name] if self.kind == "pairing" else []
        cmd = [sys.executable, *self.python_args, "-m", self.module, self.kind, "--nats", self.url, "--metrics-port", str(self.port),
               *extra, *self.args]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT)
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else 0

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
            self.kills += 1

    def restart(self) -> "Worker":
        self.kill()
        return self.start()

    def pause(self) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGCONT)

    def terminate(self, timeout: float = 30.0) -> int | None:
        self.ask_to_stop()
        return self.wait_stopped(timeout)

    def ask_to_stop(self) -> None:
        """SIGCONT (a paused worker stops too), then SIGTERM; `wait_stopped` waits for the exit."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)

    def wait_stopped(self, timeout: float = 30.0) -> int | None:
        """The exit code once the worker has exited; SIGKILL after ``timeout``."""
        if self.proc is None:
            return None
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return self.proc.returncode

    def rss_kb(self) -> int:
        return rss_kb(self.pid) if self.alive() else 0

    def metrics(self, timeout: float = 2.0) -> dict[str, float]:
        """The worker's /metrics, parsed ({} when it does not answer)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=timeout) as r:
                return parse_metrics(r.read().decode())
        except OSError:
            return {}

    def ready(self, timeout: float = 2.0) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/readyz", timeout=timeout) as r:
                return r.status == 200
        except OSError:
            return False

    def log(self, tail: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-tail:]
        except OSError:
            return ""


class Pipeline:
    """Workers around one NATS server, plus the server-side views tests and the soak need."""

    def __init__(self, url: str, workdir: str | Path, env: dict[str, str] | None = None) -> None:
        self.url = url
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.env = env or {}
        self.workers: list[Worker] = []

    # ------------------------------------------------------------ server side

    def run(self, coro_fn: Any, timeout: float = 30.0) -> Any:
        """Run ``coro_fn(js)`` on a fresh connection (synchronous helper)."""
        async def main() -> Any:
            servers = [u.strip() for u in self.url.split(",") if u.strip()]  # one server or a cluster's list
            nc = await nats.connect(servers, connect_timeout=3, max_reconnect_attempts=2, reconnect_time_wait=0.2)
            try:
                return await asyncio.wait_for(coro_fn(nc.jetstream(timeout=min(20.0, timeout))), timeout)
            finally:
                await nc.close()

        return asyncio.run(main())

    def bootstrap(self, duplicate_window_s: float | None = None, replicas: int = 1) -> dict[str, str]:
        return self.run(lambda js: bootstrap(js, None, replicas=replicas, duplicate_window_s=duplicate_window_s))

    def counts(self) -> dict[str, int]:
        async def f(js: Any) -> dict[str, int]:
            out = {}
            for name in ("HERMES_RAW", "BRIDGE_MAPPED", "BRIDGE_DLQ", "AEP_EVENTS"):
                out[name] = (await js.stream_info(name)).state.messages
            return out

        return self.run(f)

    def lag(self, partitions: int = 8) -> dict[str, int]:
        """Backlog as the server sees it: the mapper durable's pending + unacked; the sum of
        num_pending over pairing's consumers on BRIDGE_MAPPED (per partition the one that got
        furthest), and how many partitions those cover (``pairing_consumers``; a consumer of
        ``bridge.mapped.>``, a replica that owns them all, covers ``partitions``)."""
        async def f(js: Any) -> dict[str, int]:
            out = {"mapper_pending": 0, "mapper_ack_pending": 0, "pairing_pending": 0, "pairing_consumers": 0}
            try:
                info = await js.consumer_info(S.HERMES_RAW, S.MAPPER_DURABLE)
                out["mapper_pending"] = info.num_pending or 0
                out["mapper_ack_pending"] = info.num_ack_pending or 0
            except Exception:
                out["mapper_pending"] = -1
            # Per partition the consumer that got furthest: a killed owner's consumer lingers
            # (inactive_threshold) with a growing backlog nobody reads.
            # A pairing replica reads the partitions it owns through one consumer (filter_subjects):
            # per partition the consumer that got furthest; its pending counted once.
            best: dict[str, tuple[int, str]] = {}
            pending: dict[str, int] = {}
            for c in await js.consumers_info(S.BRIDGE_MAPPED):
                delivered = (c.delivered.stream_seq or 0) if c.delivered else 0
                subjects = c.config.filter_subjects or [c.config.filter_subject or ""]
                if subjects == [f"{S.MAPPED_PREFIX}.>"]:
                    subjects = [f"{S.MAPPED_PREFIX}.{n}.>" for n in range(partitions)]
                for subject in subjects:
                    if subject.startswith(f"{S.MAPPED_PREFIX}."):
                        pending[c.name] = c.num_pending or 0
                        if subject not in best or delivered > best[subject][0]:
                            best[subject] = (delivered, c.name)
            out["pairing_pending"] = sum(pending[name] for name in {name for _, name in best.values()})
            out["pairing_consumers"] = len(best)
            return out

        return self.run(f)

    def dump(self, out_dir: str | Path, streams: tuple[str, ...] = ("HERMES_RAW", "BRIDGE_MAPPED", "BRIDGE_DLQ", "AEP_EVENTS"),
             timeout: float = 120.0) -> Path:
        """Write every stored message of ``streams`` to ``<out_dir>/<STREAM>.jsonl`` (one JSON
        object per message: seq, subject, headers, data as text): the evidence to replay a failed
        run offline (e.g. a pairing partition through `PairingState`)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)

        async def f(js: Any) -> None:
            for name in streams:
                total = (await js.stream_info(name)).state.messages
                sub = await js.pull_subscribe("", stream=name, config=ConsumerConfig(
                    ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL, inactive_threshold=30.0))
                got = 0
                with open(out / f"{name}.jsonl", "w", encoding="utf-8") as fh:
                    while got < total:
                        msgs = await sub.fetch(min(total - got, 512), timeout=5)
                        for m in msgs:
                            fh.write(json.dumps({"seq": m.metadata.sequence.stream, "subject": m.subject,
                                                 "headers": dict(m.headers or {}),
                                                 "data": m.data.decode("utf-8", "replace")}) + "\n")
                        got += len(msgs)
                await sub.unsubscribe()

        self.run(f, timeout=timeout)
        return out

    def settle(self, timeout: float = 90.0, quiet_s: float = 2.0, partitions: int = 8) -> dict[str, int]:
        """Wait until nothing is pending for the mapper or the pairing partitions and AEP_EVENTS
        stopped growing for ``quiet_s``. Raises TimeoutError with the last view."""
        deadline = time.monotonic() + timeout
        last_count, since = -1, time.monotonic()
        view: dict[str, int] = {}
        while time.monotonic() < deadline:
            try:
                view = {**self.lag(partitions), **self.counts()}
            except Exception as exc:  # the server may be coming back
                view = {"error": str(exc)}  # type: ignore[dict-item]
                time.sleep(0.5)
                continue
            idle = (view["mapper_pending"] == 0 and view["mapper_ack_pending"] == 0
                    and view["pairing_pending"] == 0 and view["pairing_consumers"] >= partitions)
            if view["AEP_EVENTS"] != last_count:
                last_count, since = view["AEP_EVENTS"], time.monotonic()
            if idle and time.monotonic() - since >= quiet_s:
                return view
            time.sleep(0.25)
        raise TimeoutError(f"the pipeline did not settle within {timeout}s: {view}\n{self.evidence()}")

    def evidence(self) -> str:
        """What a settle that timed out needs to be explained offline (CI keeps no tmp_path): the
        mapper durable's state as its leader sees it, and the mappers' warnings."""
        async def f(js: Any) -> str:
            info = await js.consumer_info(S.HERMES_RAW, S.MAPPER_DURABLE)
            return (f"mapper durable: delivered {info.delivered}, ack_floor {info.ack_floor}, "
                    f"redelivered {info.num_redelivered}, waiting {info.num_waiting}, cluster {info.cluster}")
        try:
            text = self.run(f, timeout=10)
        except Exception as exc:
            text = f"mapper durable: {exc!r}"
        for w in self.of("mapper"):
            lines = [line for line in w.log(10_000_000).splitlines() if '"level": "info"' not in line]
            text += f"\n--- {w.name} (starts {w.starts}): last {min(40, len(lines))} of {len(lines)} non-info lines ---\n"
            text += "\n".join(lines[-40:])
        return text

    # ------------------------------------------------------------ workers

    def add(self, kind: str, name: str | None = None, args: list[str] | None = None,
            env: dict[str, str] | None = None, python_args: list[str] | None = None,
            module: str = "bridge.cli") -> Worker:
        name = name or f"{kind}-{sum(1 for w in self.workers if w.kind == kind)}"
        w = Worker(kind, self.url, self.dir, name, args, {**self.env, **(env or {})}, python_args, module)
        self.workers.append(w)
        return w.start()

    def of(self, kind: str) -> list[Worker]:
        return [w for w in self.workers if w.kind == kind]

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(w.ready() for w in self.workers if w.alive()):
                return
            time.sleep(0.1)
        raise TimeoutError("workers not ready: " + "; ".join(f"{w.name}: {w.log(600)}" for w in self.workers))

    def stop(self, timeout: float = 30.0) -> dict[str, int | None]:
        """Every worker asked to stop at once, then each waited for (each its own ``timeout``):
        one after the other, the seven services of a cluster run took ~11 s on the loaded
        2-core machine (1-2.6 s each), at once about the slowest one's time."""
        for w in self.workers:
            w.ask_to_stop()
        return {w.name: w.wait_stopped(timeout) for w in self.workers}

    def logs(self) -> str:
        return "\n".join(f"--- {w.name} (starts {w.starts}, kills {w.kills}) ---\n{w.log(3000)}" for w in self.workers)
