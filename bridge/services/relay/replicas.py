"""What relay replicas share through NATS (issue 25 items 3 and 4): the live claims of their
WebSocket emitters, so that a command reaching any replica finds its claimant, and the
operator token each command ``source`` belongs to.

* **Shared claims** (``SharedClaims``): each claim of a local emitter connection is a key
  ``claim.<lane token>.<replica>.<connection>`` in the KV bucket ``aep_relay`` holding its
  roster entry, written with a per-message TTL (``Nats-TTL``, AEP_BRIDGE_RELAY_CLAIM_TTL_S)
  and renewed every third of it while the socket lives; deleted when the connection ends. A
  replica that dies stops renewing: its claims are gone within the TTL. Another replica reads
  the keys of a session when a command comes (and every key for a roster, at most once a
  second) and routes to a remote claim over core NATS.
* **Forwarding** (``forward_subject`` / ``reply_subject``): the replica with the command
  publishes it, byte-identical, to ``aep.relay.<holder>.command`` as a request (headers: the
  connection, where to answer); the holder answers at once (taken, or a refusal) and later
  publishes what its emitter answers (the ack, or a refusal such as the emitter not taking
  it) to ``aep.relay.<sender>.reply``. The sender's replica settles its own pending command
  from that: the emitter's ack reaches the operator once, as with a local claim.
* **Source bindings** (``SourceBindings``): ``src.<sha256 of source>`` = the name of the
  operator token that first sent a command under that source (created, never overwritten).
  Another token's command under it is refused ``unauthorized``: one operator cannot reuse
  another's (source, id) and read its decision.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import secrets
from dataclasses import dataclass, field
from typing import Any

import msgspec
import structlog
from nats.js.errors import BucketNotFoundError, KeyWrongLastSequenceError

from bridge.core.lanes import lane_token
from bridge.runtime import follow
from bridge.runtime import streams as S
from bridge.services.relay.shared import kv_scan

log = structlog.get_logger("aep_bridge.relay")

SUBJECT_PREFIX = "aep.relay"
CONN_HEADER = "Aep-Relay-Conn"
REPLICA_HEADER = "Aep-Relay-Replica"
REPLY_HEADER = "Aep-Relay-Reply"
SCAN_CACHE_S = 1.0  # every replica's claims are read at most this often for rosters
BINDINGS_CACHED = 10_000  # sources whose token this replica remembers
FORWARD_REQUEST_TIMEOUT_S = 2.0
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


def new_id() -> str:
    """A replica's or a connection's id: a subject and KV key token."""
    return secrets.token_hex(8)


def forward_subject(replica: str) -> str:
    return f"{SUBJECT_PREFIX}.{replica}.command"


def reply_subject(replica: str) -> str:
    return f"{SUBJECT_PREFIX}.{replica}.reply"


def claim_key(session: str, replica: str, conn: str) -> str:
    return f"claim.{lane_token(session)}.{replica}.{conn}"


@dataclass(frozen=True)
class Remote:
    """A claim held by another replica's emitter connection: a command target. Two are the
    same target when they name the same connection."""

    replica: str
    conn: str
    entry: dict[str, Any] = field(compare=False, hash=False)

    @property
    def control(self) -> dict[str, Any] | None:
        control = self.entry.get("control")
        return control if isinstance(control, dict) else None

    def accepts(self, command_type: str) -> bool:
        accepts = (self.control or {}).get("accepts")
        return isinstance(accepts, list) and command_type in accepts


class StoreUnavailable(Exception):
    """The relay bucket could not be used (NATS trouble, or no bucket: bootstrap not run)."""


async def _bucket(js: Any) -> Any:
    try:
        return await follow.kv(js, S.RELAY_BUCKET)
    except BucketNotFoundError as exc:
        raise StoreUnavailable("no bucket aep_relay (run aep-bridge bootstrap)") from exc
    except Exception as exc:  # noqa: BLE001
        raise StoreUnavailable(type(exc).__name__) from exc


class SharedClaims:
    """This replica's claims, published for the others, and the others' claims, read."""

    def __init__(self, js: Any, nc: Any, replica: str, ttl_s: float) -> None:
        self.js = js
        self.nc = nc
        self.replica = replica
        self.ttl_s = ttl_s
        self.mine: dict[str, bytes] = {}  # key -> value: what the renewal re-publishes
        self._renewer: asyncio.Task | None = None
        self._scan: tuple[float, asyncio.Future] | None = None
        self._writes: asyncio.Queue = asyncio.Queue()
        self._writer: asyncio.Task | None = None

    @property
    def _headers(self) -> dict[str, str]:
        return {"Nats-TTL": f"{int(self.ttl_s)}s"}

    def start(self) -> None:
        self._renewer = asyncio.ensure_future(self._renew())
        self._writer = asyncio.ensure_future(self._write())

    async def stop(self) -> None:
        """Release every claim still held (the relay is stopping), then stop."""
        for key in list(self.mine):
            self.mine.pop(key)
            self._writes.put_nowait((key, None))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2.0):
                await self._writes.join()
        for task in (self._renewer, self._writer):
            if task is not None:
                task.cancel()

    def put(self, session: str, conn: str, entry: dict[str, Any]) -> None:
        key = claim_key(session, self.replica, conn)
        value = _encode({"replica": self.replica, "conn": conn, "entry": entry})
        self.mine[key] = value
        self._writes.put_nowait((key, value))

    def drop(self, sessions: Any, conn: str) -> None:
        for session in sessions:
            key = claim_key(session, self.replica, conn)
            if self.mine.pop(key, None) is not None:
                self._writes.put_nowait((key, None))

    async def _write(self) -> None:
        """Claims and releases in the order they happened, off the connections' read loops.
        A release is a delete marker with the claims' TTL (it keeps nothing past it)."""
        while True:
            key, value = await self._writes.get()
            try:
                subject = f"$KV.{S.RELAY_BUCKET}.{key}"
                if value is None:
                    await self.js.publish(subject, b"", headers={**self._headers, "KV-Operation": "DEL"})
                elif key in self.mine:  # not released meanwhile
                    await self.js.publish(subject, value, headers=self._headers)
            except Exception as exc:  # noqa: BLE001 - NATS away: the renewal writes it again
                log.warning("shared_claim_not_written", error=type(exc).__name__)
            finally:
                self._writes.task_done()

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            for key, value in list(self.mine.items()):
                try:  # core publish: no round trip per claim; a lost one is renewed next time
                    await self.nc.publish(f"$KV.{S.RELAY_BUCKET}.{key}", value, headers=self._headers)
                except Exception as exc:  # noqa: BLE001
                    log.warning("shared_claims_not_renewed", error=type(exc).__name__)
                    break

    async def _read(self, keys: str) -> list[Remote]:
        """The other replicas' live claims under ``keys``, read through a watch."""
        kv = await _bucket(self.js)
        try:
            found = await kv_scan(kv, keys)
        except Exception as exc:  # noqa: BLE001 - NATS trouble mid-read: unknown, not empty
            raise StoreUnavailable(type(exc).__name__) from exc
        out: list[Remote] = []
        for _, value in found:
            try:
                doc = _decode(value)
                remote = Remote(str(doc["replica"]), str(doc["conn"]), dict(doc["entry"]))
            except (msgspec.DecodeError, KeyError, TypeError, ValueError):
                continue
            if remote.replica != self.replica:
                out.append(remote)
        return out

    async def of(self, session: str) -> list[Remote]:
        """The other replicas' claims of ``session``."""
        return [r for r in await self._read(f"claim.{lane_token(session)}.>") if r.entry.get("session") == session]

    async def entries(self) -> list[dict[str, Any]]:
        """The other replicas' roster entries (a failure: none, this replica's still listed)."""
        now = asyncio.get_running_loop().time()
        if self._scan is None or now - self._scan[0] > SCAN_CACHE_S:
            self._scan = (now, asyncio.ensure_future(self._read("claim.>")))
        try:
            return [r.entry for r in await asyncio.shield(self._scan[1])]
        except StoreUnavailable:
            self._scan = None
            return []


class SourceBindings:
    """Which operator token (by name) a command source belongs to: the first to use it."""

    def __init__(self, js: Any) -> None:
        self.js = js
        self.known: collections.OrderedDict[str, str] = collections.OrderedDict()

    async def owner(self, source: str, name: str) -> str:
        """The token name ``source`` belongs to, binding it to ``name`` on first use."""
        owner = self.known.get(source)
        if owner is None:
            kv = await _bucket(self.js)
            key = "src." + hashlib.sha256(source.encode("utf-8", "surrogateescape")).hexdigest()[:40]
            try:
                try:
                    await kv.create(key, name.encode())
                    owner = name
                except KeyWrongLastSequenceError:
                    owner = (await kv.get(key)).value.decode()
            except Exception as exc:  # noqa: BLE001
                raise StoreUnavailable(type(exc).__name__) from exc
            self.known[source] = owner
            while len(self.known) > BINDINGS_CACHED:
                self.known.popitem(last=False)
        self.known.move_to_end(source)
        return owner
