"""The one way tests run the CLI and pick a port: `cli(...)` runs `python -m bridge.cli` as a
process from the repository root, `free_port()` a loopback port nothing listens on, `ROOT` the
repository. Every test uses these (issue 38: the suite had `cli()` eight times and `free_port`
six times, each a little different)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def cli(*args: str, env: Mapping[str, str] | None = None, inherit: bool = True, timeout: float = 120,
        **run: Any) -> subprocess.CompletedProcess[str]:
    """`python -m bridge.cli *args` from the repository root, its output captured as text.

    `env` goes on top of this process's environment; with `inherit=False` it is the whole
    environment (a test that removed a variable from its copy keeps it removed)."""
    full = {**os.environ, **(env or {})} if inherit else dict(env or {})
    return subprocess.run([sys.executable, "-m", "bridge.cli", *args], env=full, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, **run)
