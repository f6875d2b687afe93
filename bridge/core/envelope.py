"""The Hermes stdin envelope and the shim's raw message around it, decoded tolerantly.

Hermes sends ``{"hook_event_name", "tool_name", "tool_input", "session_id",
"cwd", "extra"}`` (HERMES.md). Decoding never raises on a JSON object: unknown
keys are kept in ``unknown``, wrong types are replaced by the neutral value and
reported in ``problems``. Only a missing or non-string ``hook_event_name`` makes
an envelope unmappable (``EnvelopeError``), because nothing says what happened.

The raw message is the shim's wrapper (docs/ARCHITECTURE.md): ``{"v", "id",
"instance", "ts", "hook", "envelope" | "error"+"raw", "edge"?}``.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec
from msgspec import UNSET, Struct, UnsetType

PINNED_SCHEMA_VERSION = "hermes.observer.v1"


class EnvelopeError(ValueError):
    """An input that cannot be mapped; ``reason`` is a short token for the DLQ subject."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class HermesEnvelope(Struct, omit_defaults=True, kw_only=True):
    """One Hermes hook envelope. ``unknown`` and ``problems`` are ours, not Hermes's."""

    hook_event_name: str
    tool_name: str | None = None
    tool_input: dict[str, Any] | None = None
    session_id: str = ""
    cwd: str = ""
    extra: dict[str, Any] = msgspec.field(default_factory=dict)
    unknown: dict[str, Any] = msgspec.field(default_factory=dict)
    problems: list[str] = msgspec.field(default_factory=list)

    @property
    def schema_version(self) -> str | None:
        value = self.extra.get("telemetry_schema_version")
        return value if isinstance(value, str) else None

    @property
    def drift(self) -> str | None:
        """None when the drift sentinel is the pinned value, else what was seen."""
        seen = self.extra.get("telemetry_schema_version")
        if seen == PINNED_SCHEMA_VERSION:
            return None
        if seen is None:
            return "missing"
        return seen if isinstance(seen, str) else repr(seen)

    def x(self, key: str, default: Any = None) -> Any:
        return self.extra.get(key, default)

    def xstr(self, key: str) -> str:
        """A string from ``extra``, or "" when absent or not a string."""
        value = self.extra.get(key)
        return value if isinstance(value, str) else ""


_KNOWN = ("hook_event_name", "tool_name", "tool_input", "session_id", "cwd", "extra")
_KNOWN_SET = frozenset(_KNOWN)
_generic = msgspec.json.Decoder()


def envelope_from_obj(obj: Any) -> HermesEnvelope:
    """Build an envelope from a decoded JSON value; never raises except ``EnvelopeError``."""
    if not isinstance(obj, dict):
        raise EnvelopeError("not_object", f"envelope is a JSON {type(obj).__name__}, not an object")
    hook = obj.get("hook_event_name")
    if not isinstance(hook, str) or not hook.strip():
        raise EnvelopeError("no_hook", f"hook_event_name is {_describe(hook)}")
    problems: list[str] = []

    tool_name = obj.get("tool_name")
    if tool_name is not None and not isinstance(tool_name, str):
        problems.append(f"tool_name: expected string or null, got {_describe(tool_name)}")
        tool_name = str(tool_name)
    tool_input = obj.get("tool_input")
    if tool_input is not None and not isinstance(tool_input, dict):
        problems.append(f"tool_input: expected object or null, got {_describe(tool_input)}")
        tool_input = None
    session_id = obj.get("session_id", "")
    if session_id is None:
        session_id = ""
    elif not isinstance(session_id, str):
        problems.append(f"session_id: expected string, got {_describe(session_id)}")
        session_id = ""
    cwd = obj.get("cwd", "")
    if not isinstance(cwd, str):
        if cwd is not None:
            problems.append(f"cwd: expected string, got {_describe(cwd)}")
        cwd = ""
    extra = obj.get("extra", {})
    if extra is None:
        extra = {}
    elif not isinstance(extra, dict):
        problems.append(f"extra: expected object, got {_describe(extra)}")
        extra = {}
    # (most envelopes have no other key: a set comparison in C, not a loop over the keys)
    unknown = {} if obj.keys() <= _KNOWN_SET else {k: v for k, v in obj.items() if k not in _KNOWN}
    return HermesEnvelope(
        hook_event_name=hook.strip(),
        tool_name=tool_name,
        tool_input=tool_input,
        session_id=session_id,
        cwd=cwd,
        extra=extra,
        unknown=unknown,
        problems=problems,
    )


def decode_envelope(data: bytes | str) -> HermesEnvelope:
    try:
        obj = _generic.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise EnvelopeError("not_json", str(exc)) from None
    return envelope_from_obj(obj)


def _describe(value: Any) -> str:
    if value is None:
        return "missing or null"
    return f"a {type(value).__name__}"


# ---------------------------------------------------------------- the raw message


class RawMessage(Struct, omit_defaults=True, kw_only=True):
    """The shim's record on HERMES_RAW. ``envelope`` is decoded separately (tolerantly)."""

    v: int = 1
    id: str
    instance: str = ""
    ts: int = 0
    hook: str = ""
    envelope: Any = UNSET
    error: str | UnsetType = UNSET
    raw: Any = UNSET
    raw_encoding: str | UnsetType = UNSET
    raw_bytes: int | UnsetType = UNSET
    edge: dict[str, Any] | UnsetType = UNSET


_raw_decoder = msgspec.json.Decoder(RawMessage)
#: the shim's error codes for input that is not a JSON object (docs/ARCHITECTURE.md)
SHIM_ERROR_CODES = frozenset({"empty", "not_json", "not_object", "not_utf8"})


def decode_raw(data: bytes | str) -> RawMessage:
    """Decode a raw message; ``EnvelopeError('bad_raw', ...)`` when it is not one."""
    try:
        return _raw_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
        raise EnvelopeError("bad_raw", str(exc)) from None
    except RecursionError:  # nested deeper than msgspec goes (100k-deep JSON): not a retry's business
        raise EnvelopeError("bad_raw", "nested too deeply") from None


RAW_VERSION = 1
TS_MAX_NS = 2**63 - 1  # int64 nanoseconds: what every later stage (ids, times, checkpoints) can hold
INSTANCE_MAX_CHARS = 256
_ULID = re.compile(r"[0-7][0-9A-HJKMNP-TV-Z]{25}")  # Crockford base32, 128 bits: what the shim mints


def check_raw(raw: RawMessage) -> None:
    """``EnvelopeError('bad_raw', why)`` unless the raw message is one the shim could have
    written: ``v`` 1, ``id`` a ULID, ``ts`` integer nanoseconds in 0..2**63-1, ``instance``
    a non-empty string of at most INSTANCE_MAX_CHARS without control characters, ``hook``
    non-empty (a hook name nobody knows is judged by its type: ``bad_hook``). The mapper
    dead-letters what fails, so no later stage meets a value it cannot hold (a ``ts`` of -1
    once made a pairing checkpoint unserialisable; 2**80 made every time conversion fail)."""
    if raw.v != RAW_VERSION:
        raise EnvelopeError("bad_raw", f"v is {raw.v!r}, not {RAW_VERSION}")
    if not isinstance(raw.id, str) or not _ULID.fullmatch(raw.id):
        raise EnvelopeError("bad_raw", f"id is not a ULID ({len(raw.id)} characters)")
    if not 0 <= raw.ts <= TS_MAX_NS:
        raise EnvelopeError("bad_raw", f"ts {raw.ts} is outside 0..2**63-1 nanoseconds")
    if not raw.hook:
        raise EnvelopeError("bad_raw", "hook is empty")
    if not raw.instance:
        raise EnvelopeError("bad_raw", "instance is empty")
    if len(raw.instance) > INSTANCE_MAX_CHARS:
        raise EnvelopeError("bad_raw", f"instance of {len(raw.instance)} characters (at most {INSTANCE_MAX_CHARS})")
    if not raw.instance.isprintable():
        raise EnvelopeError("bad_raw", "instance has control characters")


def raw_envelope(raw: RawMessage) -> HermesEnvelope:
    """The envelope inside a raw message, or the shim's own reason it could not be read."""
    if raw.error is not UNSET:
        # The code names the DLQ subject, metric label and dead letter: only the shim's own
        # codes, never text a publisher put there.
        code = str(raw.error).split(":", 1)[0].strip()
        raise EnvelopeError(f"shim_{code if code in SHIM_ERROR_CODES else 'invalid'}", str(raw.error))
    if raw.envelope is UNSET:
        raise EnvelopeError("bad_raw", "raw message has neither envelope nor error")
    return envelope_from_obj(raw.envelope)
