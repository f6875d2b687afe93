"""The real `PairingService` in a test's own event loop, and session.started inputs for it,
published straight onto BRIDGE_MAPPED (the pairing checkpoint and reader tests)."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from typing import Any

import msgspec

from bridge.config import Settings
from bridge.core.aep import Event, encode_event
from bridge.core.identity import MAPPED_SLOT, SLOTS, event_id, rfc3339, source_uri
from bridge.core.lanes import lane_token
import nats
from bridge.nats import streams as S
from bridge.nats.bootstrap import bootstrap
from bridge.services import pairing as P

BOUND_S = 120  # an outer bound on each scenario: a hang fails the test instead of blocking the run


def session(i: int) -> str:
    return hashlib.sha256(f"ckpt-{i}".encode()).hexdigest()[:32]


def started(i: int, base_ns: int) -> tuple[Event, dict[str, Any]]:
    """session.started of session i, as the mapper makes it (raw message i)."""
    ts = base_ns + i * 1_000_000
    s = session(i)
    event = Event(
        aep="0.1", id=event_id(f"raw-ckpt-{i}", MAPPED_SLOT, ts // 1_000_000), type="session.started",
        time=rfc3339(ts), source=source_uri("ckpt", s), agent="hermes", session=s,
        seq=i * SLOTS + MAPPED_SLOT, epoch=0, capture="metadata", data={"client": {"name": "hermes"}},
    )
    return event, {"ts": ts, "hook": "on_session_start"}


async def publish_sessions(js: Any, numbers: range, base_ns: int, partition: int = 0) -> None:
    futures = []
    for i in numbers:
        event, hints = started(i, base_ns)
        subject = f"{S.MAPPED_PREFIX}.{partition}.{lane_token(event.session)}"
        headers = {"Nats-Msg-Id": event.id, "Bridge-Hints": msgspec.json.encode(hints).decode()}
        futures.append(await js.publish_async(subject, encode_event(event), headers=headers))
    await asyncio.gather(*futures)


async def service(url: str, replica: str, partitions: int = 1, lease_ttl_s: float | None = None) -> P.PairingService:
    """``lease_ttl_s``: for a scenario that calls ``maintain`` once and must outlive the
    default lease on a loaded machine (its reader stops reading a partition it may have lost)."""
    settings = Settings()
    settings.nats_url = url
    settings.partitions = partitions
    svc = P.PairingService(settings, replica=replica, tick_s=3600, lease_ttl_s=lease_ttl_s)  # no ticks: the input is all there is
    await svc.connect()
    return svc


async def until(predicate: Callable[[], bool]) -> None:
    while not predicate():  # bounded by the scenario's BOUND_S
        await asyncio.sleep(0.02)


def sample(svc: P.PairingService, name: str, **labels: str) -> float:
    return svc.registry.get_sample_value(name, labels) or 0.0


def bootstrapped(server_url: str) -> str:
    """``server_url``, once the bridge's streams and buckets are made on it (R1)."""
    async def setup() -> None:
        nc = await nats.connect(server_url)
        try:
            await bootstrap(nc.jetstream(), None, replicas=1)
        finally:
            await nc.close()

    asyncio.run(setup())
    return server_url
