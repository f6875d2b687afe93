"""A fleet (bridge/nats/fleet.py) and nats-servers that trust it, for tests."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import nats

from bridge.nats.fleet import BRIDGE_ACCOUNT, FLEET_ACCOUNT, Fleet, push
from bridge.stack.server import EmbeddedNats, jetstream_block
from tests.support.shim import shim_env


def server_conf(fleet: Fleet, resolver_dir: Path) -> str:
    return fleet.resolver_conf(str(resolver_dir)) + jetstream_block()


@contextmanager
def fleet_server(tmp: Path) -> Iterator[tuple[Fleet, EmbeddedNats]]:
    """A new fleet and one embedded nats-server in its operator mode, streams bootstrapped."""
    fleet = Fleet.init(tmp / "keys")
    conf = tmp / "nats.conf"
    conf.write_text(server_conf(fleet, tmp / "jwt"))
    server = EmbeddedNats(tmp / "store", config_file=conf, log_file=tmp / "nats.log").start()
    try:
        asyncio.run(push(fleet, server.url, (BRIDGE_ACCOUNT, FLEET_ACCOUNT)))
        asyncio.run(bootstrap(fleet, server.url))
        yield fleet, server
    finally:
        server.stop()


async def role_client(fleet: Fleet, url: str, role: str, **kw: Any) -> nats.NATS:
    async def quiet(exc: Exception) -> None:
        pass

    kw.setdefault("error_cb", quiet)
    return await nats.connect(url.split(","), user_credentials=str(fleet.creds_path(f"aep-{role}")),
                              inbox_prefix=f"_INBOX.aep-{role}", connect_timeout=5, **kw)


async def bootstrap(fleet: Fleet, url: str, replicas: int = 1, within_s: float = 60.0) -> None:
    """`bridge.nats.bootstrap.bootstrap` as the bootstrap role, run again while a replica count
    cannot be placed (what its error says to do: a node of a loaded machine's cluster was briefly
    seen offline; the fleet cluster's setup failed so once in a clean-clone CI, 2026-12-07, "3
    replicas asked for, but cluster aep_test_cluster has 2 servers up", its 10th stream)."""
    import time

    from bridge.nats.bootstrap import ReplicasError
    from bridge.nats.bootstrap import bootstrap as bridge_bootstrap

    deadline = time.monotonic() + within_s
    while True:
        nc = await role_client(fleet, url, "bootstrap")
        try:
            await bridge_bootstrap(nc.jetstream(timeout=20), None, replicas=replicas)
            return
        except ReplicasError:
            if time.monotonic() >= deadline:
                raise
        finally:
            await nc.close()
        await asyncio.sleep(1.0)


def issue_env(fleet: Fleet, instance: str, url: str, spool: Path, **settings: Any) -> dict[str, str]:
    """``fleet issue`` for ``instance`` into ``<spool>/<instance>.env`` and the shim's environment
    reading it with AEP_BRIDGE_CONFIG (the URL and instance also in the environment)."""
    text, _ = fleet.issue(instance, urls=url, **settings)
    spool.mkdir(parents=True, exist_ok=True)
    path = spool / f"{instance}.env"
    path.write_text(text)
    env = shim_env(url, spool, instance)
    env["AEP_BRIDGE_CONFIG"] = str(path)
    return env


def jwt_of(env: dict[str, str]) -> str:
    for line in Path(env["AEP_BRIDGE_CONFIG"]).read_text().splitlines():
        if line.startswith("AEP_BRIDGE_NATS_JWT="):
            return line.split("=", 1)[1]
    raise AssertionError("no AEP_BRIDGE_NATS_JWT in the issued settings")


async def instance_client(url: str | list[str], jwt: str, instance: str, **kw: Any) -> nats.NATS:
    """nats-py as an instance's bearer JWT (no nonce signature)."""
    async def quiet(exc: Exception) -> None:
        pass

    kw.setdefault("error_cb", quiet)
    return await nats.connect(url, user_jwt_cb=lambda: jwt.encode(), signature_cb=lambda nonce: b"",
                              inbox_prefix=f"_INBOX.hermes.{instance}", connect_timeout=5, **kw)


def checksums(paths: list[Path]) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}
