"""The one way tests run the CLI and pick a port: `cli(...)` runs `python -m bridge.cli` as a
process from the repository root, `free_port()` a loopback port nothing listens on, `ROOT` the
repository. Every test uses these (issue 38: the suite had `cli()` eight times and `free_port`
six times, each a little different)."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


#: free_port's ports: from here up to the kernel's ephemeral range (`ephemeral_low()`)
LOW_PORT = 10000
_pick = random.SystemRandom()


def ephemeral_low() -> int:
    """The first port the kernel gives outgoing connections (ip_local_port_range; 32768 when
    it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that was free a moment ago, picked at random below the kernel's
    ephemeral range, where no outgoing connection is ever given a port. The OS's own pick
    (bind to 0) is in that range: with the suite's servers and clients making loopback
    connections on both xdist workers, such a port was taken by a connection before its server
    bound it (a cluster node's route port, "address already in use", 2026-12-07). The OS's pick
    when the range leaves too little room below it."""
    low = ephemeral_low()
    if low - LOW_PORT >= 1000:
        for _ in range(50):
            port = _pick.randrange(LOW_PORT, low)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:  # in use (or lingering): another one
                    continue
                return port
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
