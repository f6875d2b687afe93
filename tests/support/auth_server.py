"""A nats-server whose one user's password a test changes: reloaded (SIGHUP: the server closes
the connections of the old credential) or restarted (every reconnect is refused)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
from pathlib import Path

from bridge.stack.server import MAX_FILE_STORE, find_nats_server, terminate
from tests.support.cli import free_port
from tests.support.services import wait_for

USER = "svc"


class AuthServer:
    """nats-server with one user whose password the test can rotate (config reload, SIGHUP)."""

    def __init__(self, tmp: Path, password: str) -> None:
        self.tmp, self.port = tmp, free_port()
        self.conf = tmp / "nats.conf"
        self.url = f"nats://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.write(password)

    def write(self, password: str) -> None:
        self.conf.write_text(json.dumps({
            # max_file_store as every local server declares it (bridge.stack.server): left out,
            # nats-server takes 75 % of the free disk, and with less than ~66 GB free the
            # streams' reservations did not fit ("insufficient storage resources available",
            # test_hostile_health in a clean-clone CI, 2026-12-07: Max Storage 47.24 GB)
            "jetstream": {"store_dir": str(self.tmp / "js"), "max_file_store": MAX_FILE_STORE},
            "authorization": {"users": [{"user": USER, "password": password}]},
        }))

    def start(self) -> "AuthServer":
        log = open(self.tmp / "server.log", "ab")
        self.proc = subprocess.Popen([find_nats_server(), "-c", str(self.conf), "-a", "127.0.0.1", "-p", str(self.port)],
                                     stdout=log, stderr=subprocess.STDOUT)
        log.close()
        wait_for(lambda: accepts_connections(self.port), 15, what="nats-server")
        return self

    def rotate(self, password: str) -> None:
        """The new password, in force when this returns: the reload is asynchronous, and a hook
        sent right after a rotation back met the old credential at load 5 (spooled on
        `Authorization Violation`, 2026-12-07)."""
        self.write(password)
        assert self.proc is not None
        self.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: self.accepts(password), 15, what="the reloaded credential")

    def accepts(self, password: str) -> bool:
        import asyncio

        import nats

        async def connect() -> bool:
            try:
                nc = await nats.connect(self.url, user=USER, password=password, connect_timeout=1,
                                        allow_reconnect=False, max_reconnect_attempts=0)
            except Exception:
                return False
            await nc.close()
            return True

        return asyncio.run(connect())

    def stop(self) -> None:
        terminate(self.proc, 10)


def accepts_connections(port: int) -> bool:
    """Something listens on 127.0.0.1:``port``."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False
