"""What the relay's two bindings (HTTP/SSE in ``endpoints``, WebSocket in ``websocket``) share:
the AEP versions served, the resume limit, the metrics, and the bearer token of a request."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from typing import Any, Awaitable, Callable

import msgspec
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge

VERSIONS = ["0.1"]
MAX_FROM_POSITIONS = 256
# an HTTP request line's limit: a `from` of 256 positions of sessions up to 1,024 characters,
# URL-encoded (~300 KB), with room to spare; past it aiohttp answers a plain-text 400
MAX_REQUEST_LINE = 1 << 19
encode = msgspec.json.Encoder().encode
decode = msgspec.json.Decoder().decode


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.connections = Gauge("aep_bridge_relay_connections", "open SSE and WebSocket connections", ["binding"], registry=r)
        self.subscriptions = Gauge("aep_bridge_relay_subscriptions", "live subscriptions (an SSE stream is one)", registry=r)
        self.delivered = Counter("aep_bridge_relay_delivered_events_total", "events delivered", ["binding"], registry=r)
        self.bytes = Counter("aep_bridge_relay_delivered_bytes_total", "bytes of events delivered", ["binding"], registry=r)
        self.drops = Counter("aep_bridge_relay_dropped_events_total", "debug/info events dropped toward slow consumers", registry=r)
        self.disconnects = Counter("aep_bridge_relay_backpressure_disconnects_total",
                                   "subscriptions ended because a notice-or-above event found the queue full", registry=r)
        self.refusals = Counter("aep_bridge_relay_refusals_total", "requests and frames refused", ["code"], registry=r)
        self.exhausted = Counter("aep_bridge_relay_replay_exhausted_total", "resume positions older than the replay buffer", registry=r)
        self.ingested = Counter("aep_bridge_relay_ingested_events_total", "events from emitters (POST, WebSocket) stored (new)", registry=r)
        self.commands = Counter("aep_bridge_relay_commands_total", "control commands routed (to the gate or a WebSocket emitter)", registry=r)
        self.claims = Gauge("aep_bridge_relay_claims", "live claims of this replica's WebSocket emitters (sessions x connections)",
                            registry=r)
        self.resumes = Counter("aep_bridge_relay_resumes_total", "subscriptions that resumed (from, Last-Event-ID)", ["kind"], registry=r)
        self.replay_failures = Counter("aep_bridge_relay_replay_failures_total",
                                       "replays that could not complete: the subscription ended, resumable", registry=r)
        self.read_gaps = Counter("aep_bridge_relay_history_read_gaps_total",
                                 "history reads (replay, recorded acks) that lost a delivery and read again", registry=r)


async def kv_scan(kv: Any, keys: str) -> list[tuple[str, bytes]]:
    """(key, value) of ``kv``'s live keys matching ``keys``, read through a watch (the bucket
    read the relay's NATS role has). A failure raises (unknown is not empty)."""
    out = []
    watcher = None
    try:
        watcher = await kv.watch(keys, ignore_deletes=True)
        async for entry in watcher:
            if entry is None:
                break
            if entry.value:
                out.append((entry.key, entry.value))
    finally:
        if watcher is not None:
            with contextlib.suppress(Exception):
                await watcher.stop()
    return out


def to_the_end(handler: Callable[[web.Request], Awaitable[Any]]) -> Callable[[web.Request], Awaitable[Any]]:
    """``handler``, run to its end when its client leaves: what the client sent before it
    went (a POST's batch, a WebSocket's last frames) is still stored. The server cancels a
    handler whose client left (``Relay.start``), for SSE's sake; this one's work goes on in
    its own task, and the cancellation is raised once it is done."""

    @functools.wraps(handler)
    async def run(request: web.Request) -> Any:
        task = asyncio.ensure_future(handler(request))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            await asyncio.wait([task])
            raise

    return run


def bearer(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return request.query.get("access_token")
