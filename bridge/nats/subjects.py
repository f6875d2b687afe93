"""Subject names of the pipeline (docs/ARCHITECTURE.md).

A subject token is the value with every character outside ``[A-Za-z0-9_-]``
replaced by ``_`` (an empty value is ``_``; at most 200 characters). Tokens are
for routing only: the exact values travel in the message bodies. The shim has
its own copy of this rule (it may import nothing); ``token`` here IS that copy,
so the two cannot drift.
"""

from __future__ import annotations

from bridge.shim.hook import INVALID_HOOK, RAW_SUBJECT_PREFIX, TOKEN_MAX_CHARS, UNKNOWN_HOOK, raw_subject, token

RAW_PREFIX = RAW_SUBJECT_PREFIX.rstrip(".")  # hermes.raw
MAPPED_PREFIX = "bridge.mapped"
DLQ_PREFIX = "bridge.dlq"
EVENTS_PREFIX = "aep.hermes"

__all__ = [
    "DLQ_PREFIX", "EVENTS_PREFIX", "INVALID_HOOK", "MAPPED_PREFIX", "RAW_PREFIX", "TOKEN_MAX_CHARS", "UNKNOWN_HOOK",
    "dlq_subject", "events_subject", "mapped_subject", "raw_filter", "raw_subject", "token",
]


def raw_filter(instance: str | None = None, hook: str | None = None) -> str:
    """A filter over HERMES_RAW: every raw message, one instance's, one hook's, or both."""
    return f"{RAW_PREFIX}.{token(instance) if instance is not None else '*'}.{token(hook) if hook is not None else '*'}"


def mapped_subject(partition: int, lane_token: str) -> str:
    return f"{MAPPED_PREFIX}.{partition}.{lane_token}"


def dlq_subject(reason: str) -> str:
    return f"{DLQ_PREFIX}.{token(reason)}"


def events_subject(lane_token: str, event_type: str) -> str:
    """``aep.hermes.<lane token>.<type...>``: the dotted AEP type becomes several tokens."""
    return f"{EVENTS_PREFIX}.{lane_token}.{event_type}"
