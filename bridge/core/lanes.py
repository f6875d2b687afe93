"""Lanes: which AEP session an event is filed under, and how a lane names a subject.

Resolution rules (AEP.md "Lanes", HERMES.md):
1. An envelope with a non-empty ``session_id`` is its own lane.
2. An envelope without one but with a ``turn_id`` (approval hooks always carry
   ``session_id: ""`` and a ``turn_id``) is filed under the turn id's session prefix:
   Hermes builds ``turn_id`` as ``{session}:{task}:{hex8}`` (CLI) or
   ``{session}:{session}:{hex8}`` (gateway), so the prefix IS a session id. A pure
   function of the envelope: no look-up, the same answer on every replica at any time.
   (``subagent_*`` hooks carry their parent's ``session_id``; their ``parent_turn_id``
   counts as a turn id for this rule.)
3. Without a usable turn id: an approval's ``extra.session_key`` when it names a KNOWN
   session (``hermes chat`` interactive: the session id); other events (tools called
   inside ``execute_code`` carry only ``task_id``) through a known task alias.
4. Otherwise the ``unknown`` lane. A gateway key (``ns:platform:chat_type:chat_id``, or
   a run id) never mints a lane: a ``session_key`` must name a session seen earlier.

The lookup is an interface (`LaneLookup`) and is only asked in rule 3: the `map`
command backs it with a dict, the mapper service with a JetStream KV bucket plus a
bounded cache.
"""

from __future__ import annotations

import base64
import hashlib
import re
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from bridge.core.envelope import HermesEnvelope

UNKNOWN = "unknown"  # the unknown lane's `session` on the wire (with the attribute `lane: "unknown"`)
UNKNOWN_TOKEN = "_unknown"
APPROVAL_HOOKS = frozenset({"pre_approval_request", "post_approval_response"})

# A lane token is at most this many characters (subjects and KV keys stay far below the
# server's 4 KiB control line; see `lane_token`).
LANE_TOKEN_MAX = 128
HASHED_PREFIX = "_h"  # + 32 hex digits: the token of an id too long for the other forms
_PLAIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")  # used with fullmatch: "id\n" is not plain


class LaneLookup(Protocol):
    def is_known_session(self, session_id: str) -> bool: ...

    def task_session(self, task_id: str) -> str | None: ...


class Learned(msgspec.Struct, frozen=True):
    """What mapping one envelope teaches the lane table (applied by the caller)."""

    session: str | None = None
    task_id: str | None = None


@dataclass
class MemoryLanes:
    """A bounded in-memory lane table (LRU); the `map` command's lookup and the services' cache."""

    max_entries: int = 100_000
    sessions: OrderedDict[str, None] = field(default_factory=OrderedDict)
    tasks: OrderedDict[str, str] = field(default_factory=OrderedDict)

    def is_known_session(self, session_id: str) -> bool:
        if session_id in self.sessions:
            self.sessions.move_to_end(session_id)
            return True
        return False

    def task_session(self, task_id: str) -> str | None:
        session = self.tasks.get(task_id)
        if session is not None:
            self.tasks.move_to_end(task_id)
        return session

    def add_session(self, session_id: str) -> None:
        self.sessions[session_id] = None
        self.sessions.move_to_end(session_id)
        while len(self.sessions) > self.max_entries:
            self.sessions.popitem(last=False)

    def add_task(self, task_id: str, session_id: str) -> None:
        self.tasks[task_id] = session_id
        self.tasks.move_to_end(task_id)
        while len(self.tasks) > self.max_entries:
            self.tasks.popitem(last=False)

    def learn(self, learned: Learned) -> None:
        if learned.session:
            self.add_session(learned.session)
            if learned.task_id:
                self.add_task(learned.task_id, learned.session)


def turn_session_prefix(turn_id: str) -> str | None:
    """``{session}:{task}:{hex8}`` -> ``session`` (a session id may itself contain ':')."""
    parts = turn_id.rsplit(":", 2)
    if len(parts) == 3 and parts[0]:
        return parts[0]
    return None


@dataclass(frozen=True)
class Candidates:
    """What resolving a session-less envelope may ask the lane table: session ids to test
    (``session_key`` for approvals, then the turn-id prefix) and a task alias."""

    sessions: tuple[str, ...] = ()
    task_id: str | None = None

    def __bool__(self) -> bool:
        return bool(self.sessions or self.task_id)


NO_CANDIDATES = Candidates()  # (frozen: one for every envelope that names its lane)


def envelope_lane(env: HermesEnvelope) -> str | None:
    """The lane the envelope names itself (rules 1 and 2), or None when only a look-up can tell."""
    if env.session_id:
        return env.session_id
    turn = env.xstr("turn_id") or env.xstr("parent_turn_id")
    return turn_session_prefix(turn) if turn else None


def lane_candidates(env: HermesEnvelope) -> Candidates:
    """The look-ups `resolve_lane` may make for ``env`` (none when the envelope names its lane)."""
    if envelope_lane(env) is not None:
        return NO_CANDIDATES
    if env.hook_event_name in APPROVAL_HOOKS:
        key = env.xstr("session_key")
        return Candidates((key,) if key else ())
    return Candidates((), env.xstr("task_id") or None)


def resolve_lane(env: HermesEnvelope, lanes: LaneLookup) -> str:
    """The lane's session id, or ``UNKNOWN`` (which a real session named "unknown" also
    returns: `lane_of` tells them apart)."""
    lane = lane_of(env, lanes)
    return UNKNOWN if lane is None else lane


def lane_of(env: HermesEnvelope, lanes: LaneLookup) -> str | None:
    """The session id ``env`` is filed under, or None for the unknown lane."""
    lane = envelope_lane(env)
    if lane is not None:
        return lane
    if env.hook_event_name in APPROVAL_HOOKS:
        key = env.xstr("session_key")
        if key and lanes.is_known_session(key):
            return key
    else:
        task = env.xstr("task_id")
        if task:
            session = lanes.task_session(task)
            if session:
                return session
    return None


def learned_from(env: HermesEnvelope) -> Learned:
    if not env.session_id:
        return Learned()
    task = env.xstr("task_id")
    return Learned(session=env.session_id, task_id=task or None)


# ---------------------------------------------------------------- subject-safe tokens


def lane_token(lane: str) -> str:
    """A subject- and KV-key-safe token for a session id, at most LANE_TOKEN_MAX characters.

    * a plain id (fullmatches ``[A-Za-z0-9][A-Za-z0-9_-]*``) of at most LANE_TOKEN_MAX
      characters is its own token;
    * any other id whose ``=`` + unpadded base64url of its UTF-8 fits in LANE_TOKEN_MAX
      characters is that (reversible: `lane_from_token`);
    * anything longer is ``_h`` + the first 32 hex digits of SHA-256 of its UTF-8
      (deterministic, not reversible: the exact id travels in the events).

    The unknown lane is ``UNKNOWN_TOKEN`` (``_unknown``), which no session id can have: the
    caller that knows an event is in the unknown lane uses it (`event_lane_token`); a real
    session named "unknown" is the plain token ``unknown``.
    """
    if len(lane) <= LANE_TOKEN_MAX and _PLAIN.fullmatch(lane):
        return lane
    data = lane.encode("utf-8", "surrogatepass")  # JSON may carry lone surrogates
    if 4 * len(data) <= 3 * (LANE_TOKEN_MAX - 1):  # the base64 form fits
        return "=" + base64.urlsafe_b64encode(data).decode("ascii").rstrip("=")
    return HASHED_PREFIX + hashlib.sha256(data).hexdigest()[:32]


def event_lane_token(session: str, unknown: bool) -> str:
    """The token of an event's lane: ``_unknown`` for the unknown lane, else `lane_token`."""
    return UNKNOWN_TOKEN if unknown else lane_token(session)


def lane_from_token(token: str) -> str:
    """The session id of a reversible token (``ValueError`` for a hashed one)."""
    if token == UNKNOWN_TOKEN:
        return UNKNOWN
    if token.startswith(HASHED_PREFIX):
        raise ValueError("a hashed lane token cannot be reversed")
    if token.startswith("="):
        body = token[1:]
        return base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)).decode("utf-8")
    return token


def partition_of(token: str, partitions: int) -> int:
    """Stable partition of a lane token (crc32, identical on every replica and release)."""
    return zlib.crc32(token.encode("utf-8")) % partitions
