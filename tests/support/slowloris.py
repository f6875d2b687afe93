"""A slowloris client for the relay's tests (standard library only, run as a script): N
connections from one address to HOST:PORT (5,000 a second), each sending the start of a request and never its
end. Bounded: it opens at most N, waits at most RAMP_S for them to connect, prints how many
did, then holds them until its stdin closes or HOLD_S pass, and exits (closing them all).

    python slowloris.py HOST PORT N RAMP_S HOLD_S
"""

from __future__ import annotations

import selectors
import socket
import sys
import time

BATCH, PAUSE_S = 250, 0.05  # 5,000 connections a second per process
HALF = b"GET /stream HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "  # never the blank line that ends the headers


def main() -> int:
    host, port, n, ramp_s, hold_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
    sel = selectors.DefaultSelector()
    socks = []
    for i in range(n):
        if i and i % BATCH == 0:  # paced: past the server's accept queue, a handshake waits for retransmits
            time.sleep(PAUSE_S)
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        s.connect_ex((host, port))
        socks.append(s)
        sel.register(s, selectors.EVENT_WRITE)
    connected = failed = 0
    deadline = time.monotonic() + ramp_s
    pending = len(socks)
    while pending and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=0.2):
            s = key.fileobj
            sel.unregister(s)
            pending -= 1
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                try:
                    s.send(HALF)
                    connected += 1
                except OSError:
                    failed += 1
            else:
                failed += 1
    print(f"connected {connected} failed {failed} pending {pending}", flush=True)
    end = time.monotonic() + hold_s
    sel2 = selectors.DefaultSelector()
    sel2.register(sys.stdin, selectors.EVENT_READ)
    while time.monotonic() < end:
        if sel2.select(timeout=min(0.5, max(0.0, end - time.monotonic()))):
            if not sys.stdin.buffer.read1(1):
                break
    for s in socks:
        s.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
