"""Subject names of the pipeline (docs/ARCHITECTURE.md): every subject a service publishes
to, or filters on, is built here, and none is longer than MAX_SUBJECT_CHARS.

Raw subjects: a subject token is the value with every character outside ``[A-Za-z0-9_-]``
replaced by ``_`` (an empty value is ``_``; at most 200 characters). Tokens are for
routing only: the exact values travel in the message bodies. The shim has its own copy of
this rule (it may import nothing); ``token`` here IS that copy, so the two cannot drift.

Lane subjects use the lane token (`bridge.core.lanes.lane_token`: at most 128 characters),
event subjects the AEP type (`bridge.core.mapping.valid_type`: the AEP grammar, at most 128
characters). A builder refuses (``SubjectError``, with the reason the caller dead-letters
under) anything else: nats-server closes a connection whose control line exceeds its
``max_control_line`` (4 KiB by default) and nats-py never reconnects a closed connection,
so such a subject must never reach the wire.
"""

from __future__ import annotations

from bridge.core.lanes import LANE_TOKEN_MAX, UNKNOWN_TOKEN, event_lane_token, lane_token
from bridge.core.mapping import valid_type
from bridge.shim.hook import INVALID_HOOK, RAW_SUBJECT_PREFIX, TOKEN_MAX_CHARS, UNKNOWN_HOOK, raw_subject, token

RAW_PREFIX = RAW_SUBJECT_PREFIX.rstrip(".")  # hermes.raw
MAPPED_PREFIX = "bridge.mapped"
DLQ_PREFIX = "bridge.dlq"
EVENTS_PREFIX = "aep.hermes"
INGEST_PREFIX = "aep.ingest"  # events other AEP emitters POST to the relay (never aep.hermes.>)
TICK_TOKEN = "__tick__"
# Far below nats-server's max_control_line (4096 by default, which also holds the verb, the
# reply subject and the sizes): the longest subject built here is ~300 characters.
MAX_SUBJECT_CHARS = 1024

__all__ = [
    "DLQ_PREFIX", "EVENTS_PREFIX", "INGEST_PREFIX", "INVALID_HOOK", "MAPPED_PREFIX", "MAX_SUBJECT_CHARS", "RAW_PREFIX", "TICK_TOKEN",
    "TOKEN_MAX_CHARS", "UNKNOWN_HOOK", "UNKNOWN_TOKEN", "SubjectError",
    "ack_subjects", "command_subject", "dlq_subject", "event_subject", "events_filter", "events_subject", "ingest_subject", "session_filter", "kv_subject", "lane_token", "mapped_filter",
    "mapped_subject", "raw_filter", "raw_subject", "raw_tokens", "tick_subject", "token",
]


class SubjectError(ValueError):
    """A subject that must not be published; ``reason`` is the dead letter's reason."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def _bounded(subject: str) -> str:
    if len(subject) > MAX_SUBJECT_CHARS:
        raise SubjectError("subject_too_long", f"a subject of {len(subject)} characters (at most {MAX_SUBJECT_CHARS})")
    return subject


_LANE_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-=")


def _lane(lane_tok: str) -> str:
    if not lane_tok or len(lane_tok) > LANE_TOKEN_MAX or not _LANE_CHARS.issuperset(lane_tok):
        raise SubjectError("bad_lane", f"not a lane token ({len(lane_tok)} characters)")
    return lane_tok


def raw_filter(instance: str | None = None, hook: str | None = None) -> str:
    """A filter over HERMES_RAW: every raw message, one instance's, one hook's, or both."""
    return f"{RAW_PREFIX}.{token(instance) if instance is not None else '*'}.{token(hook) if hook is not None else '*'}"


def raw_tokens(subject: str) -> tuple[str, str] | None:
    """(instance token, hook token) of a raw subject ``hermes.raw.<instance>.<hook>``; None
    for anything else. The instance token is what the server authorised the publisher for."""
    parts = subject.split(".")
    if len(parts) != 4 or f"{parts[0]}.{parts[1]}" != RAW_PREFIX:
        return None
    return parts[2], parts[3]


def mapped_subject(partition: int, lane_tok: str) -> str:
    return _bounded(f"{MAPPED_PREFIX}.{int(partition)}.{_lane(lane_tok)}")


def mapped_filter(partition: int) -> str:
    return f"{MAPPED_PREFIX}.{int(partition)}.>"


def tick_subject(partition: int) -> str:
    return f"{MAPPED_PREFIX}.{int(partition)}.{TICK_TOKEN}"


def dlq_subject(reason: str) -> str:
    return _bounded(f"{DLQ_PREFIX}.{token(reason)}")


def events_subject(lane_tok: str, event_type: str) -> str:
    """``aep.hermes.<lane token>.<type...>``: the dotted AEP type becomes several tokens."""
    if not valid_type(event_type):
        raise SubjectError("bad_type", f"an event type of {len(event_type)} characters outside the AEP type grammar")
    return _bounded(f"{EVENTS_PREFIX}.{_lane(lane_tok)}.{event_type}")


def event_subject(event: object) -> str:
    """The AEP_EVENTS subject of an event: its lane's token (``_unknown`` for the unknown lane) and type."""
    session = getattr(event, "session")
    unknown = getattr(event, "lane", None) == "unknown"
    return events_subject(event_lane_token(session if isinstance(session, str) else "", unknown), getattr(event, "type"))


def command_subject(lane_tok: str, command_type: str) -> str:
    """Where a sender publishes a command: ``aep.hermes.<lane token>.<command type>`` (in AEP_EVENTS)."""
    return events_subject(lane_tok, command_type)


def ack_subjects(lane_tok: str) -> tuple[str, str]:
    """Where the gate acks a command of that lane: ``control.accepted`` / ``control.rejected``."""
    return events_subject(lane_tok, "control.accepted"), events_subject(lane_tok, "control.rejected")


def ingest_subject(lane_tok: str, event_type: str) -> str:
    """Where the relay stores an event another AEP emitter posted: its own subject space."""
    if not valid_type(event_type):
        raise SubjectError("bad_type", f"not an AEP type ({len(event_type)} characters)")
    return _bounded(f"{INGEST_PREFIX}.{_lane(lane_tok)}.{event_type}")


def session_filter(lane_tok: str) -> str:
    """A session's events on AEP_EVENTS, the bridge's and posted ones alike."""
    return f"aep.*.{_lane(lane_tok)}.>"


def control_filter(lane_tok: str) -> str:
    """A session's commands and acks on AEP_EVENTS under the bridge's prefix."""
    return f"{EVENTS_PREFIX}.{_lane(lane_tok)}.control.>"


def events_filter(lane_tok: str | None = None) -> str:
    return f"{EVENTS_PREFIX}.{_lane(lane_tok)}.>" if lane_tok is not None else f"{EVENTS_PREFIX}.>"


def kv_subject(bucket: str, key: str) -> str:
    """The subject a KV put publishes to (``$KV.<bucket>.<key>``)."""
    return _bounded(f"$KV.{bucket}.{key}")
