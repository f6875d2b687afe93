"""Dead letters: what BRIDGE_DLQ keeps of a message a stage could not handle.

BRIDGE_DLQ is kept 30 days and browsed by operators, so a dead letter carries no more
than the capture policy lets through; the exact original stays where it was read
(HERMES_RAW, 7 days; BRIDGE_MAPPED for pairing), at the position the letter names.

The body is one JSON object (docs/ARCHITECTURE.md, "Dead letters"):

* always: ``dlq`` (format 1), ``stage``, ``reason``, ``capture`` (the level applied),
  ``error``, and ``original``: ``stream``, ``seq``, ``subject``, ``bytes``, ``sha256``
  (first 16 bytes of SHA-256 over the exact bytes, hex) and what identifies it: the raw
  message's ``id`` (mapper), the event's ``id``/``type`` and the ``raw_seq`` it was made
  from (pairing); an id that is not a short plain token is replaced by its digest
  (``id_digest``).
* the level is the LOWEST ceiling of any category (``CapturePolicy.lowest``: a dead
  letter may hold any category's content): at ``none`` and ``metadata`` (the default
  posture) nothing more, ``error`` being only the exception's type or the reason's code;
  at ``redacted`` also ``content``, the message passed through the redaction pipeline
  (a JSON body as a value, other bytes as text), and the error text redacted; at
  ``full`` the content verbatim (bytes that are not UTF-8 as ``content_base64``).
* headers copied from the original as ``Bridge-Orig-<name>`` never include a reply
  subject (``Aep-Gate-Reply``, any name with ``reply`` or ``inbox``, any value naming an
  inbox): whoever reads the DLQ must not be able to answer a held call. Below
  ``redacted`` only ``Aep-Gate-Hold-Ms`` is copied; at ``redacted`` values are redacted.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from dataclasses import dataclass
from typing import Any, Mapping

import msgspec

from bridge.core.ceiling import FULL, LEVELS, REDACTED, CapturePolicy
from bridge.core.digest import digest

FORMAT = 1
#: the reasons the stages use (the envelope's, the shim's `shim_<code>`, the services'); a
#: metric labels these by name and folds others (bounded)
KNOWN_REASONS = ("not_json", "not_object", "no_hook", "bad_raw", "shim_empty", "shim_not_json", "shim_not_object",
                 "shim_not_utf8", "shim_invalid", "max_deliver", "bad_mapped", "pairing_error", "bad_hook",
                 "instance_mismatch", "too_large", "instance_conflict")
_PLAIN_ID = re.compile(r"[0-9A-Za-z_-]{1,64}")
_REPLY_NAME = re.compile(r"reply|inbox", re.I)
_METADATA_HEADERS = frozenset({"Aep-Gate-Hold-Ms"})
_MAX_HEADER = 1000


@dataclass(frozen=True)
class Original:
    """Where the message is (its stream position) and what it is."""

    stream: str
    seq: int
    subject: str
    data: bytes
    headers: Mapping[str, str] | None = None


@dataclass(frozen=True)
class DeadLetter:
    subject_reason: str
    body: bytes
    headers: dict[str, str]


def _id_fields(value: Any, key: str = "id") -> dict[str, str]:
    if not isinstance(value, str) or not value:
        return {}
    if _PLAIN_ID.fullmatch(value):
        return {key: value}
    return {f"{key}_digest": digest(value)}


def _decode(data: bytes) -> Any:
    try:
        return msgspec.json.decode(data)
    except Exception:  # not JSON, not UTF-8, nested past the decoder's limit
        return msgspec.UNSET


def _content(obj: Any, data: bytes, level: int, policy: CapturePolicy) -> dict[str, Any]:
    if level >= FULL:
        if obj is not msgspec.UNSET:
            return {"content": obj}
        try:
            return {"content_text": data.decode("utf-8")}
        except UnicodeDecodeError:
            return {"content_base64": base64.b64encode(data).decode()}
    redactor = policy.redactor
    if obj is msgspec.UNSET:
        return {"content_text": redactor.text(data.decode("utf-8", "replace"))}
    red = redactor.value(obj)
    if isinstance(obj, dict) and obj.get("raw_encoding") == "base64" and isinstance(obj.get("raw"), str):
        # Input that was not UTF-8 travels as base64: look inside it too.
        try:
            text = binascii.a2b_base64(obj["raw"]).decode("utf-8", "replace")
        except (binascii.Error, ValueError):
            text = ""
        red["raw"], red["raw_encoding"] = redactor.text(text), "utf-8-replaced"
    return {"content": red}


def _error(error_type: str, detail: str, level: int, policy: CapturePolicy) -> str:
    if level < REDACTED or not detail:
        return error_type
    text = detail if level >= FULL else policy.redactor.text(detail)
    return f"{error_type}: {text}"


def _copied_headers(headers: Mapping[str, str] | None, level: int, policy: CapturePolicy) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, value in (headers or {}).items():
        if name == "Nats-Msg-Id" or _REPLY_NAME.search(name) or not isinstance(value, str) or _REPLY_NAME.search(value):
            continue
        if level < REDACTED:
            if name not in _METADATA_HEADERS or not value.isdigit():
                continue
        elif level < FULL:
            value = policy.redactor.text(value)
        out[f"Bridge-Orig-{name}"] = _header_value(value)
    return out


def _header_value(value: str) -> str:
    return value.replace("\r", " ").replace("\n", " ")[:_MAX_HEADER]


def build(stage: str, reason: str, error_type: str, detail: str, original: Original, policy: CapturePolicy) -> DeadLetter:
    """The dead letter of ``original`` for ``reason`` (the subject token), pure and
    deterministic: the same input gives the same bytes (a redelivered failure is absorbed by
    the DLQ's duplicate window through ``Nats-Msg-Id``)."""
    level = policy.lowest()
    data = original.data
    obj = _decode(data)
    where: dict[str, Any] = {"stream": original.stream, "seq": original.seq, "subject": original.subject,
                             "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()[:32]}
    headers = {
        "Nats-Msg-Id": f"dlq:{original.stream}:{original.seq}",
        "Bridge-Dlq-Reason": reason,
        "Bridge-Dlq-Capture": LEVELS[level],
        "Bridge-Stage": stage,
    }
    if stage != "mapper":  # an AEP event: pairing's mapped input, or an exporter's AEP_EVENTS message
        kind = "Mapped" if stage == "pairing" else "Events"
        headers[f"Bridge-{kind}-Subject"] = original.subject
        headers[f"Bridge-{kind}-Seq"] = str(original.seq)
        if isinstance(obj, dict):
            where.update(_id_fields(obj.get("id")))
            etype = obj.get("type")
            if isinstance(etype, str) and len(etype) <= 128:
                where["type"] = etype
            seq = obj.get("seq")
            if type(seq) is int and seq >= 0:
                where["raw_seq"] = seq // 1024
                headers["Bridge-Raw-Seq"] = str(seq // 1024)
            if "id" in where:
                headers["Bridge-Event-Id"] = where["id"]
    else:
        headers["Bridge-Raw-Seq"] = str(original.seq)
        headers["Bridge-Raw-Subject"] = original.subject
        if isinstance(obj, dict):
            where.update(_id_fields(obj.get("id")))
            if "id" in where:
                headers["Bridge-Raw-Id"] = where["id"]
    error = _error(error_type, detail, level, policy)
    headers["Bridge-Dlq-Error"] = _header_value(error)
    body: dict[str, Any] = {"dlq": FORMAT, "stage": stage, "reason": reason, "capture": LEVELS[level],
                            "error": error, "original": where}
    if level >= REDACTED:
        body.update(_content(obj, data, level, policy))
    if stage == "mapper":
        headers.update(_copied_headers(original.headers, level, policy))
    try:
        encoded = msgspec.json.encode(body)
    except Exception:  # content the encoder refuses (a lone surrogate): the letter without it
        body.pop("content", None)
        encoded = msgspec.json.encode(body)
    return DeadLetter(reason, encoded, headers)


def error_parts(exc: BaseException | str, reason: str) -> tuple[str, str]:
    """(type, detail) for `build`: an exception's type name (an EnvelopeError's reason) and
    its text; a bare string is the detail of ``reason``."""
    if isinstance(exc, str):
        return reason, exc
    reason = getattr(exc, "reason", None)
    if isinstance(reason, str):
        return reason, str(getattr(exc, "detail", "")) or str(exc)
    return type(exc).__name__, str(exc)
