"""Which HTTP/WebSocket stack serves the relay: aiohttp, or starlette on uvicorn (websockets)?

The measurement the relay's choice rests on (bridge/services/relay/__init__.py quotes it):
SSE fan-out of the same pre-serialized events to N concurrent clients on loopback, each
server in its own process with the same in-process fan-out (one bounded queue per client,
one writer task per client), the clients in this process (plain asyncio streams counting
``\\n\\n`` frames, so the client costs the same against both servers). It prints the
sustained delivery rate (events delivered to every client per second of wall time).

    .venv/bin/python benchmarks/bench_relay_stack.py [--clients 100] [--events 3000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time

EVENT = b"event: tool.called\nid: s:0:%d\ndata: " + b'{"aep":"0.1","type":"tool.called","x":"' + b"a" * 500 + b'"}\n\n'

SERVER = r'''
import asyncio, sys
N_CLIENTS, N_EVENTS, PORT, STACK = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
EVENT = %r
queues = []
ready = asyncio.Event()

async def produce():
    await ready.wait()
    for i in range(N_EVENTS):
        frame = EVENT %% i
        for q in queues:
            q.put_nowait(frame)
        if i %% 64 == 0:
            await asyncio.sleep(0)
    for q in queues:
        q.put_nowait(None)

def register():
    q = asyncio.Queue()
    queues.append(q)
    if len(queues) == N_CLIENTS:
        ready.set()
        asyncio.ensure_future(produce())
    return q

if STACK == "aiohttp":
    from aiohttp import web
    async def stream(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        q = register()
        while (item := await q.get()) is not None:
            await resp.write(item)
        return resp
    async def main():
        app = web.Application()
        app.router.add_get("/stream", stream)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", PORT).start()
        await asyncio.Event().wait()
    asyncio.run(main())
else:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route
    async def gen():
        q = register()
        while (item := await q.get()) is not None:
            yield item
    async def stream(request):
        return StreamingResponse(gen(), media_type="text/event-stream")
    app = Starlette(routes=[Route("/stream", stream)])
    uvicorn.run(app, host="127.0.0.1", port=PORT, log_level="error", access_log=False, ws="auto")
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def client(port: int, n_events: int, started: asyncio.Event) -> float:
    for _ in range(200):
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            break
        except OSError:
            await asyncio.sleep(0.05)
    writer.write(b"GET /stream HTTP/1.1\r\nHost: x\r\nAccept: text/event-stream\r\n\r\n")
    await writer.drain()
    seen = 0
    tail = b""
    while seen < n_events:
        chunk = await reader.read(1 << 16)
        if not chunk:
            break
        if not started.is_set():
            started.set()
        data = tail + chunk
        seen += data.count(b"\n\n")
        tail = data[-1:]
        if tail == b"\n" and data.endswith(b"\n\n"):
            tail = b""
    writer.close()
    return time.perf_counter()


async def run(stack: str, n_clients: int, n_events: int) -> float:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVER % EVENT, str(n_clients), str(n_events), str(port), stack])
    try:
        started = asyncio.Event()
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(client(port, n_events, started)) for _ in range(n_clients)]
        await started.wait()
        t0 = time.perf_counter()
        ends = await asyncio.gather(*tasks)
        return n_events / (max(ends) - t0)
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--events", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    print(f"SSE fan-out, {a.clients} clients, {a.events} events of {len(EVENT)} bytes, loopback, cpu={os.cpu_count()}")
    for stack in ("aiohttp", "starlette"):
        rates = [asyncio.run(run(stack, a.clients, a.events)) for _ in range(a.rounds)]
        print(f"  {stack:10s} best {max(rates):8.0f} events/s to every client  (rounds: {', '.join(f'{r:.0f}' for r in rates)})")


if __name__ == "__main__":
    main()
