"""A NATS server that answers but never acks (issue 39): what a node cut off from a stream's
leader looks like to a client. It accepts, sends a valid INFO, answers PING with PONG and
reads every publish, but no JetStream PubAck (nor anything else) ever comes back.

``MuteServer(store_to=url)`` also passes what the client sends on to a real server and drops
that server's answers: the publish is stored, only its ack is lost (a node that forwarded the
write before it was cut off). ``url``, ``connections``, ``publishes``, ``close()``.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from urllib.parse import urlparse

INFO = {
    "server_id": "NMUTE", "server_name": "mute", "version": "2.10.0", "proto": 1, "go": "go1.22",
    "host": "127.0.0.1", "port": 0, "headers": True, "max_payload": 1048576, "jetstream": True,
}


class MuteServer:
    def __init__(self, store_to: str | None = None) -> None:
        self.store_to = store_to
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        self.url = f"nats://127.0.0.1:{self.port}"
        self.connections = 0
        self.publishes = 0  # HPUB/PUB lines read, over all connections
        self.pings = 0
        self._held: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            with self._lock:
                self.connections += 1
                self._held.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _upstream(self) -> socket.socket | None:
        if not self.store_to:
            return None
        u = urlparse(self.store_to)
        up = socket.create_connection((u.hostname or "127.0.0.1", u.port or 4222), timeout=5)
        with self._lock:
            self._held.append(up)
        threading.Thread(target=self._discard, args=(up,), daemon=True).start()
        return up

    @staticmethod
    def _discard(up: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while up.recv(65536):
                pass

    def _serve(self, conn: socket.socket) -> None:
        info = dict(INFO, port=self.port)
        buf = b""
        try:
            up = self._upstream()
            conn.sendall(b"INFO " + json.dumps(info).encode() + b"\r\n")
            while True:
                data = conn.recv(65536)
                if not data:
                    return
                if up is not None:
                    up.sendall(data)
                buf += data
                buf = self._parse(conn, buf)
        except OSError:
            return

    def _parse(self, conn: socket.socket, buf: bytes) -> bytes:
        """Consume whole protocol lines (and the payloads of PUB/HPUB); return the rest."""
        while True:
            i = buf.find(b"\r\n")
            if i < 0:
                return buf
            line = buf[:i]
            op = line.split(b" ", 1)[0].upper()
            if op in (b"PUB", b"HPUB"):
                size = int(line.split()[-1])
                if len(buf) < i + 2 + size + 2:
                    return buf
                buf = buf[i + 2 + size + 2 :]
                self.publishes += 1
                continue
            buf = buf[i + 2 :]
            if op == b"PING":
                self.pings += 1
                conn.sendall(b"PONG\r\n")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        with self._lock:
            held, self._held = self._held, []
        for c in held:
            with contextlib.suppress(OSError):
                c.close()
