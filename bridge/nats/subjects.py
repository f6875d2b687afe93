"""The bridge's NATS subjects (docs/ARCHITECTURE.md): every subject it publishes to,
subscribes to, filters on or checks a reply against is built or checked here (the streams'
subject lists in ``bridge.nats.streams`` are made of these prefixes and builders), and no
subject built here is longer than MAX_SUBJECT_CHARS. The one exception is inboxes:
nats-py mints them under the roles' prefixes (``bridge.nats.connection.ROLE_INBOX``).

The shim (``bridge/shim/hook.py``) may import nothing of the bridge, so the subjects it
uses itself are defined there and imported here, never copied: the raw subject and its
token rule (``token``: every character outside ``[A-Za-z0-9_-]`` becomes ``_``, an empty
value is ``_``, at most 200 characters; routing only, the exact values travel in the
bodies), the shim's inbox space and the instruction pull. What cannot be shared by import
(the NATS permissions in ``deploy/``, constants the pure core keeps) is compared by
tests/nats/test_subjects.py.

Lane subjects use the lane token (`bridge.core.lanes.lane_token`: at most 128 characters),
event subjects the AEP type (`bridge.core.mapping.valid_type`: the AEP grammar, at most 128
characters). A builder refuses (``SubjectError``, with the reason the caller dead-letters
under) anything else: nats-server closes a connection whose control line exceeds its
``max_control_line`` (4 KiB by default) and nats-py never reconnects a closed connection,
so such a subject must never reach the wire.
"""

from __future__ import annotations

from bridge.core.envelope import EnvelopeError
from bridge.core.lanes import LANE_TOKEN_MAX, UNKNOWN_TOKEN, event_lane_token, lane_token
from bridge.core.mapping import valid_type
from bridge.shim.hook import (INSTRUCT_PULL_PREFIX, INVALID_HOOK, RAW_SUBJECT_PREFIX, SHIM_INBOX_PREFIX, TOKEN_CHARS,
                              TOKEN_MAX_CHARS, UNKNOWN_HOOK, instruct_subject, raw_subject, shim_inbox_prefix, token)

RAW_PREFIX = RAW_SUBJECT_PREFIX.rstrip(".")  # hermes.raw
MAPPED_PREFIX = "bridge.mapped"
DLQ_PREFIX = "bridge.dlq"
EVENTS_PREFIX = "aep.hermes"
INGEST_PREFIX = "aep.ingest"  # events other AEP emitters POST to the relay (never aep.hermes.>)
TICK_TOKEN = "__tick__"
INBOX_PREFIX = "_INBOX."  # every inbox: the roles' (bridge.nats.connection.ROLE_INBOX), the shim's (SHIM_INBOX_PREFIX)
# The opt-in control plane (docs/ARCHITECTURE.md "Control plane"): the gate's hello service, and
# its consumer's filters over the command subjects (acks match the first one too and are skipped).
HELLO_SUBJECT = "aep.gate.hello"
COMMAND_FILTERS = (f"{EVENTS_PREFIX}.*.control.>", f"{EVENTS_PREFIX}.*.x.*.control.>")
# Far below nats-server's max_control_line (4096 by default, which also holds the verb, the
# reply subject and the sizes): the longest subject built here is ~300 characters.
MAX_SUBJECT_CHARS = 1024

__all__ = [
    "COMMAND_FILTERS", "DLQ_PREFIX", "EVENTS_PREFIX", "HELLO_SUBJECT", "INBOX_PREFIX", "INGEST_PREFIX", "INSTRUCT_PULL_PREFIX",
    "INVALID_HOOK", "MAPPED_PREFIX", "MAX_SUBJECT_CHARS", "RAW_PREFIX", "SHIM_INBOX_PREFIX", "TICK_TOKEN",
    "TOKEN_CHARS", "TOKEN_MAX_CHARS", "UNKNOWN_HOOK", "UNKNOWN_TOKEN", "SubjectError",
    "ack_subjects", "check_raw_instance", "command_subject", "control_filter", "control_where", "dlq_subject", "event_subject",
    "events_filter", "events_subject", "ingest_subject", "instruct_filter", "instruct_subject", "kv_subject", "lane_token",
    "mapped_filter", "mapped_subject", "object_store_subjects", "raw_filter", "raw_subject", "raw_tokens", "requester_reply_ok", "session_filter",
    "shim_inbox_prefix", "shim_pull_reply_ok", "shim_reply_ok", "tick_subject", "token",
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


_LANE_CHARS = TOKEN_CHARS | {"="}


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


def check_raw_instance(subject: str, instance: str) -> str:
    """The body's instance is the one the server authorised: the subject's instance token (a
    per-instance NATS user may publish only on ``hermes.raw.<its instance>.>``). A body
    naming another instance is a forgery (or a misconfigured shim):
    ``EnvelopeError('instance_mismatch')``; a subject that is no raw subject ``bad_raw``.
    Compared as the shim's token of the body's instance, so names that are not plain still
    match their own subject.

    Returns the instance the message speaks for: the subject's token. Several names share a
    token (``gw.1``, ``gw 1``, ``gw/1`` and ``gw_1`` are all ``gw_1``), so the name in the
    body is not used as the identity: one subject, one instance (issue 44 item 6c). A name
    that is already subject-safe (``[A-Za-z0-9_-]``, as pod names are) is its own token."""
    tokens = raw_tokens(subject)
    if tokens is None:
        raise EnvelopeError("bad_raw", "not published on hermes.raw.<instance>.<hook>")
    if token(instance) != tokens[0]:
        raise EnvelopeError("instance_mismatch", f"the body names instance token {token(instance)!r}, "
                                                 f"the subject {tokens[0]!r}")
    return tokens[0]


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
    """The subject a KV put publishes to (``$KV.<bucket>.<key>``; key ``>``: the bucket's stream)."""
    return _bounded(f"$KV.{bucket}.{key}")


def object_store_subjects(bucket: str) -> tuple[str, str]:
    """An object store's stream subjects (ADR-20): chunks ``$O.<bucket>.C.>``, metadata ``$O.<bucket>.M.>``."""
    return _bounded(f"$O.{bucket}.C.>"), _bounded(f"$O.{bucket}.M.>")


# ---------------------------------------------------------------- the control plane's inboxes and services


def instruct_filter() -> str:
    """What the gate's instruction-pull service subscribes to (every session's ``instruct_subject``)."""
    return f"{INSTRUCT_PULL_PREFIX}.*"


def control_where() -> dict[str, str]:
    """The control plane's subjects as the hello document tells them (its ``x-aep-bridge``)."""
    return {
        "commands": f"{EVENTS_PREFIX}.<lane token>.<command type> (stored in AEP_EVENTS)",
        "acks": f"{EVENTS_PREFIX}.<lane token>.control.accepted | control.rejected (cause = command id)",
        "hello": HELLO_SUBJECT,
    }


def _plain_tokens(rest: str) -> bool:
    return all(t and set(t) <= TOKEN_CHARS for t in rest.split("."))


def shim_reply_ok(reply: str, instance_token: str, suffix: str) -> bool:
    """Is ``reply`` a subject inside the inbox space of the instance ``instance_token`` (the
    token of the subject the server let its publisher use), ending in ``.<suffix>`` (``g``: a
    held call's decision)? The shim's own is ``_INBOX.hermes.<token>.<22 hex>.g``. The gate
    sends nothing anywhere else on a shim's word: not into a stream, a KV bucket, another
    instance's inbox or another role's."""
    if len(reply) > 512 or not instance_token or not set(instance_token) <= TOKEN_CHARS:
        return False
    head = SHIM_INBOX_PREFIX + instance_token + "."
    if not reply.startswith(head) or not reply.endswith("." + suffix) or len(reply) < len(head) + len(suffix) + 2:
        return False
    return _plain_tokens(reply[len(head):-len(suffix) - 1])  # the inbox's own tokens, at least one


def shim_pull_reply_ok(reply: str) -> bool:
    """An instruction pull's reply subject: inside some shim's inbox space (the pull names a
    session, not an instance)."""
    if len(reply) > 512 or not reply.startswith(SHIM_INBOX_PREFIX):
        return False
    rest = reply[len(SHIM_INBOX_PREFIX):]
    return rest.count(".") >= 1 and _plain_tokens(rest)


def requester_reply_ok(reply: str) -> bool:
    """A hello request's reply subject: an inbox (``_INBOX.`` + plain tokens), never a stream
    or bucket subject, never a wildcard."""
    if not reply.startswith(INBOX_PREFIX) or len(reply) > 512:
        return False
    return _plain_tokens(reply[len(INBOX_PREFIX):])
