"""The lane KV (`aep_lanes`): which sessions and task aliases HERMES_RAW has shown so far.

A bounded in-process cache (`bridge.core.lanes.MemoryLanes`) in front of the bucket, with a
short negative cache, and the pipelined puts that teach it. Used by the mapper (it learns and
looks up) and the gate (it looks up); `epoch_of` is the AEP epoch rule both share.

Lane facts (bucket `aep_lane_facts`, key `r.<instance token>.<raw id token>`): the lane a raw
message whose lane came from a look-up was filed under, recorded (create: the first attempt
wins) before its first event is published, and reused by every later attempt (`PinnedLane`),
so that an alias that changed or a KV get that failed between two attempts cannot file the
same event under two lanes.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import Any

from nats.js.errors import APIError, KeyNotFoundError, KeyWrongLastSequenceError

from bridge.core.lanes import MemoryLanes, lane_candidates, lane_of, lane_token
from bridge.core.mapping import MapResult
from bridge.nats import streams as S
from bridge.nats import subjects as subj
from bridge.nats.connection import WRONG_LAST_SEQUENCE_IN_FLIGHT

NEGATIVE_TTL_S = 2.0  # how long a lanes-KV miss is believed
NEGATIVE_MAX = 4096  # misses remembered at most
# Lane cache entries (sessions, and task aliases, each). Sized to the working set, not to every
# session ever seen: a 1,000-instance fleet at 2,000 events/s starts ~64 sessions/s and has
# ~3,000-6,000 with an event in the last minute; a session that falls out costs one KV get (an
# approval) or one idempotent KV put (its next event). At 100,000 the cache grew the mapper
# by ~0.8 KiB per new session for ~26 minutes of such a fleet (tracemalloc, 2026-12-01).
LANE_CACHE_ENTRIES = 8192
FACT_PREFIX = "r."  # + <raw subject's instance token>.<lane_token(raw id)>: a raw message's lane
OWNER_PREFIX = "o."  # + <lane_token(session)>: the instance the session belongs to (its first)
FACT_UNKNOWN = b"?"  # the fact "filed under the unknown lane"; a session is b"=" + its UTF-8
WRONG_LAST_SEQUENCE = 10071  # JetStream's err_code when a create finds the key there already
#: ... and WRONG_LAST_SEQUENCE_IN_FLIGHT a clustered stream's while another create of the key is
#: still being replicated: the first is recorded or about to be (nats-py's KV create maps both
#: to KeyWrongLastSequenceError)
LOST_CREATE = frozenset({WRONG_LAST_SEQUENCE, WRONG_LAST_SEQUENCE_IN_FLIGHT})


def lost_create(exc: BaseException | None) -> bool:
    """Did a KV create (a publish with ``Nats-Expected-Last-Subject-Sequence: 0``) fail because
    another create of its key came first (stored, or in flight on a clustered stream)? Its
    winner is then read; one in flight may not be readable yet (the caller retries)."""
    return isinstance(exc, KeyWrongLastSequenceError) or getattr(exc, "err_code", None) in LOST_CREATE


FACT_TIMEOUT_S = 5.0


def epoch_of(created: Any) -> int:
    """The AEP epoch: HERMES_RAW's creation time in whole milliseconds. It changes (upward)
    only when the stream is recreated, every replica reads the same value, and milliseconds
    make a reuse after a quick delete-and-recreate practically impossible."""
    return int(created.timestamp() * 1000) if created else 0


def lane_fact_key(instance_token: str, raw_id: str) -> str:
    """The KV key of a raw message's lane fact: its instance (the raw subject's token, which the
    server authorised: one instance cannot pin another's messages) and its id."""
    return f"{FACT_PREFIX}{instance_token}.{lane_token(raw_id)}"


class PinnedLane:
    """The lane look-up of a raw message whose lane is a recorded fact: it answers exactly
    ``session`` (None: the unknown lane), whatever the lanes KV says now."""

    __slots__ = ("session",)

    def __init__(self, session: str | None) -> None:
        self.session = session

    @classmethod
    def of(cls, result: MapResult) -> "PinnedLane":
        return cls(None if result.unknown else result.lane)

    @classmethod
    def decode(cls, value: bytes) -> "PinnedLane":
        if value == FACT_UNKNOWN or not value.startswith(b"="):
            return cls(None)
        return cls(value[1:].decode("utf-8", "surrogatepass"))

    def encode(self) -> bytes:
        return FACT_UNKNOWN if self.session is None else b"=" + self.session.encode("utf-8", "surrogatepass")

    def is_known_session(self, session_id: str) -> bool:
        return self.session is not None and session_id == self.session

    def task_session(self, task_id: str) -> str | None:
        return self.session

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PinnedLane) and other.session == self.session

    def __hash__(self) -> int:
        return hash(self.session)


class KvLanes:
    """Lane lookups: a bounded cache in front of the `aep_lanes` KV bucket."""

    def __init__(self, kv: Any, cache_size: int = LANE_CACHE_ENTRIES, facts: Any = None) -> None:
        self.kv = kv
        self.facts = facts  # the aep_lane_facts bucket (None: lanes are not recorded)
        self.cache = MemoryLanes(max_entries=cache_size)
        # Negative cache: key -> monotonic time the look-up that found nothing was SENT, oldest
        # first (one TTL for all: insertion order is expiry order).
        self._missing: OrderedDict[str, float] = OrderedDict()
        self._owners: OrderedDict[str, str] = OrderedDict()  # session -> its instance (`session_owner`)

    async def _get(self, key: str, since: float | None = None) -> bytes | None:
        """The KV value of ``key``; a miss is remembered for NEGATIVE_TTL_S, and trusted only
        if that look-up was sent at or after ``since`` (monotonic) when given."""
        asked = self._missing.get(key)
        sent = time.monotonic()
        if asked is not None and sent - asked < NEGATIVE_TTL_S and (since is None or asked >= since):
            return None
        try:
            entry = await self.kv.get(key)
        except KeyNotFoundError:  # (a deleted key too) a miss, remembered for a moment
            missing = self._missing
            missing.pop(key, None)
            missing[key] = sent
            while missing and (len(missing) > NEGATIVE_MAX or sent - next(iter(missing.values())) >= NEGATIVE_TTL_S):
                missing.popitem(last=False)
            return None
        except Exception:  # a timeout, no leader: unknown for now, not a miss to remember
            return None
        return entry.value if entry is not None else None

    async def recorded_lane(self, key: str) -> PinnedLane | None:
        """The lane fact under ``key`` (`lane_fact_key`), or None when none is recorded. Any
        other failure raises: the caller cannot tell which lane an earlier attempt chose."""
        if self.facts is None:
            return None
        try:
            entry = await self.facts.get(key)
        except KeyNotFoundError:
            return None
        return PinnedLane.decode(entry.value or b"")

    async def send_lane(self, key: str, lane: PinnedLane, publish: Any) -> asyncio.Future:
        """The create of the fact under ``key``, sent with ``publish`` (`AckPublisher.publish`)
        and not waited for (`record_lane` without the wait; many are in flight at once): its
        publish future. It fails with an ``APIError`` whose ``err_code`` is WRONG_LAST_SEQUENCE
        when a fact is recorded already (AckPublisher settles an error reply; nats-py's
        ``publish_async`` never did, hence a request and a task each before issue 43)."""
        return await publish(subj.kv_subject(S.LANE_FACTS_BUCKET, key), lane.encode(),
                             headers={"Nats-Expected-Last-Subject-Sequence": "0"})

    async def record_lane(self, key: str, lane: PinnedLane) -> PinnedLane:
        """Record ``lane`` as the fact under ``key`` unless one is recorded already (KV create,
        acked before the caller publishes); returns the fact in force. Raises on failure."""
        try:
            await self.facts.create(key, lane.encode())
            return lane
        except KeyWrongLastSequenceError:  # an earlier attempt recorded one first
            recorded = await self.recorded_lane(key)
            if recorded is None:
                raise
            return recorded

    def cached_owner(self, session: str) -> str | None:
        """`session_owner` when this process knows it already (no await: the hot path)."""
        owner = self._owners.get(session)
        if owner is not None:
            self._owners.move_to_end(session)
        return owner

    async def session_owner(self, session: str, instance: str, publish: Any = None) -> str | None:
        """The instance ``session`` belongs to: the first one seen for it, recorded as
        ``o.<lane token>`` in aep_lane_facts by a KV create (the first wins; every replica,
        and every later attempt, reads the same), ``instance`` when this is the first.
        Cached (bounded). None when lane facts are not there (a release before them).
        ``publish``: an `AckPublisher.publish` to send the create with (cheaper than nats-py's
        KV create: the mapper's hot path); else the bucket's own create."""
        owner = self.cached_owner(session)
        if owner is not None:
            return owner
        if self.facts is None:
            return None
        key = OWNER_PREFIX + lane_token(session)
        value = instance.encode("utf-8", "surrogatepass")
        try:
            if publish is None:
                await self.facts.create(key, value)
            else:
                sent = await publish(subj.kv_subject(S.LANE_FACTS_BUCKET, key), value,
                                     headers={"Nats-Expected-Last-Subject-Sequence": "0"})
                await asyncio.wait_for(sent, FACT_TIMEOUT_S)
            owner = instance
        except (KeyWrongLastSequenceError, APIError) as exc:  # recorded first by another message (or replica)
            if not lost_create(exc):
                raise
            try:
                entry = await self._read_recorded(key)
            except KeyNotFoundError:  # the first create is still being replicated (10164): asked again
                raise exc from None
            owner = (entry.value or b"").decode("utf-8", "surrogatepass")
        self._remember_owner(session, owner)
        return owner

    async def _read_recorded(self, key: str) -> Any:
        """A fact a create was refused for (recorded already): a replica's copy can lag behind
        the leader that refused it, so a miss there asks the leader where the bucket can
        (`bridge.nats.follow.kv` with ``leader``: the mapper). Seen in a partition run
        (2026-12-07 18:33): "wrong last sequence" and then "key not found", and the raw message
        was retried as its own fault."""
        get_recorded = getattr(self.facts, "get_recorded", None)
        return await (get_recorded(key) if get_recorded is not None else self.facts.get(key))

    def _remember_owner(self, session: str, owner: str) -> None:
        self._owners[session] = owner
        while len(self._owners) > self.cache.max_entries:
            self._owners.popitem(last=False)

    async def send_owner(self, session: str, instance: str, publish: Any) -> asyncio.Future:
        """`session_owner`'s create, sent with ``publish`` (`AckPublisher.publish`) and not
        waited for: its publish future (the mapper's hot path: no task and no ``wait_for`` per
        new session, issue 43). `owner_answered` reads the answer."""
        return await publish(subj.kv_subject(S.LANE_FACTS_BUCKET, OWNER_PREFIX + lane_token(session)),
                             instance.encode("utf-8", "surrogatepass"),
                             headers={"Nats-Expected-Last-Subject-Sequence": "0"})

    async def owner_answered(self, session: str, instance: str, sent: asyncio.Future) -> str:
        """The instance ``session`` belongs to, once ``sent`` (`send_owner`'s future, done) is
        answered: ``instance`` when its create was the first, else the recorded one (read);
        cached like `session_owner`'s. Raises what failed (the caller retries the message)."""
        owner = self.cached_owner(session)
        if owner is not None:
            return owner
        error = sent.exception()
        if error is None:
            owner = instance
        elif lost_create(error) and self.facts is not None:
            try:  # recorded first by another
                entry = await self._read_recorded(OWNER_PREFIX + lane_token(session))
            except KeyNotFoundError:  # still being replicated (10164): retried, its fate is open
                raise error from None
            owner = (entry.value or b"").decode("utf-8", "surrogatepass")
        else:
            raise error
        self._remember_owner(session, owner)
        return owner

    async def prefetch(self, env: Any, since: float | None = None) -> bool:
        """Load what `resolve_lane` may ask about this envelope into the cache. Returns
        True when the envelope has look-ups to make and none of them found anything yet
        (it would land in the unknown lane). ``since``: see `_get`."""
        candidates = lane_candidates(env)
        if not candidates:
            return False
        for session in candidates.sessions:
            if not self.cache.is_known_session(session):
                if await self._get("s." + lane_token(session), since) is not None:
                    self.cache.add_session(session)
        task = candidates.task_id
        if task and self.cache.task_session(task) is None:
            value = await self._get("t." + lane_token(task), since)
            if value:
                self.cache.add_task(task, value.decode())
        return lane_of(env, self.cache) is None

    def needs_learning(self, result: MapResult) -> bool:
        """Cheap check on the hot path: does this envelope teach the lane table anything new?"""
        learned = result.learned
        if not learned.session:
            return False
        if learned.session not in self.cache.sessions:
            return True
        return bool(learned.task_id) and self.cache.tasks.get(learned.task_id) != learned.session

    async def learn(self, result: MapResult, publish: Any) -> list[asyncio.Future]:
        """Record what this envelope taught us, pipelined: a KV put is a JetStream publish to
        `$KV.<bucket>.<key>`, so it is sent with ``publish`` (`bridge.nats.publish.AckPublisher.
        publish`: a future per put, failed at once on an error reply) and its ack awaited with
        the batch."""
        learned = result.learned
        futures: list[asyncio.Future] = []
        if learned.session and not self.cache.is_known_session(learned.session):
            key = "s." + lane_token(learned.session)
            futures.append(await publish(subj.kv_subject(S.LANES_BUCKET, key), b"1"))
            self.cache.add_session(learned.session)
            self._missing.pop(key, None)
        if learned.session and learned.task_id and self.cache.task_session(learned.task_id) != learned.session:
            key = "t." + lane_token(learned.task_id)
            futures.append(await publish(subj.kv_subject(S.LANES_BUCKET, key), learned.session.encode()))
            self.cache.add_task(learned.task_id, learned.session)
            self._missing.pop(key, None)
        return futures
