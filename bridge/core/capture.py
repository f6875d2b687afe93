"""Capture ceilings, the redaction pipeline and digests (AEP-0001 §8.2, AEP-0003 §9).

Theory of operation
-------------------
* A ceiling is one of ``none < metadata < redacted < full``. The policy gives
  each event category (`tool`, `attention`, ...) its ceiling: a default
  (``metadata``) with per-category overrides (default ``attention=redacted``).
* The mapping asks the policy for the ceiling of the event it is about to build
  and includes a field only when the ceiling admits the field's level. Free
  text admitted at ``redacted`` goes through the redaction pipeline first; at
  ``full`` it is verbatim. The event's ``capture`` is the ceiling honoured.
  Nothing here ever labels unredacted text ``redacted``.
* The redaction pipeline is a visible chain of small processors, run in the
  spec's order: secrets, operator-listed values, home prefix to ``~``, PII.
* ``digest(v)`` hashes the canonical JSON of the ORIGINAL value, before any
  redaction; a size stub made by the shim carries that digest already and is
  passed through, so digests downstream equal those of the original content.
* Exporters (the AEP-0005 bridges) apply their own ceiling, ``max_capture``, to
  finished AEP events: an event above it keeps its envelope and loses its payload
  (``exported_payload``, ``downlevel``).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

LEVELS = ("none", "metadata", "redacted", "full")
NONE, METADATA, REDACTED, FULL = range(4)
LEVEL_RANK = {name: rank for rank, name in enumerate(LEVELS)}

STUB_KEY = "$aep_stub"


def level_rank(name: str) -> int:
    try:
        return LEVEL_RANK[name]
    except KeyError:
        raise ValueError(f"unknown capture level {name!r} (expected one of {', '.join(LEVELS)})") from None


# ---------------------------------------------------------------- digests

_dumps = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode


def canonical_json(value: Any) -> bytes:
    """Sorted keys, `,`/`:` separators, no spaces, UTF-8 unescaped.

    The standard library's encoder, not msgspec's (6x faster here: 0.5 vs 3.1 us for a
    1 KB value): the shim computes the digests of size stubs with exactly this call,
    and msgspec writes some floats differently (``1e16`` vs ``1e+16``) and refuses
    lone surrogates, so only this keeps a stub's digest equal to the core's.
    """
    return _dumps(value).encode("utf-8", "surrogatepass")


def is_stub(value: Any) -> bool:
    return type(value) is dict and value.get(STUB_KEY) is True and isinstance(value.get("digest"), str)


def digest(value: Any) -> str:
    """AEP digest: the first 16 bytes of SHA-256 over the canonical JSON, as 32 hex characters."""
    if is_stub(value):
        return value["digest"]  # computed by the shim over the original content
    return hashlib.sha256(canonical_json(value)).hexdigest()[:32]


# ---------------------------------------------------------------- the redaction pipeline

SECRET = "[REDACTED:secret]"
PII = "[REDACTED:pii]"

_SECRET_PATTERNS = [
    # (a) PEM blocks, any label.
    re.compile(r"-----BEGIN [A-Z0-9 ]*?(?:PRIVATE KEY|CERTIFICATE|KEY)[A-Z0-9 ]*-----.*?-----END [A-Z0-9 ]*-----", re.S),
    # key=value / key: value / "key": "value" credentials; the value may sit on the next line.
    re.compile(
        r"""(?ix)
        (?P<key>["']?\b[\w.-]*(?:password|passwd|pwd|secret|api[_-]?key|apikey|access[_-]?key|private[_-]?key
            |auth[_-]?token|token|credentials?)["']?)
        (?P<sep>\s*[=:]\s*)
        (?P<val>"[^"\n]*"|'[^'\n]*'|[^\s,;&|'"}]+)
        """
    ),
    # Authorization schemes (RFC 6750: case-insensitive), only when followed by a token-looking value.
    re.compile(r"(?i)\b(bearer|basic|token)\s+(?=[A-Za-z0-9._~+/=-]*\d)[A-Za-z0-9._~+/=-]{8,}"),
    re.compile(r"\bAKIA[0-9A-Z]{16}\b"),
    re.compile(r"\beyJ[A-Za-z0-9_-]{2,}\.[A-Za-z0-9_-]{2,}\.[A-Za-z0-9_-]{2,}"),  # JWT shapes
    re.compile(r"\bgh[pousr]_[A-Za-z0-9]{20,}\b"),  # GitHub tokens
    re.compile(r"\bgithub_pat_[A-Za-z0-9_]{20,}\b"),
    re.compile(r"\bglpat-[A-Za-z0-9_-]{16,}\b"),  # GitLab
    re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{10,}\b"),  # Slack
    re.compile(r"\bsk-(?:proj-|live-|test-)?[A-Za-z0-9_-]{16,}\b"),  # OpenAI-style
    re.compile(r"\bsk_(?:live|test)_[A-Za-z0-9]{10,}\b"),  # Stripe-style
    re.compile(r"\bAIza[0-9A-Za-z_-]{35}\b"),  # Google API keys
]

_KV_INDEX = 1  # the key=value pattern keeps its key and separator


def _redact_secrets(text: str, _cfg: "Redactor") -> str:
    for i, pattern in enumerate(_SECRET_PATTERNS):
        if i == _KV_INDEX:
            text = pattern.sub(lambda m: m.group("key") + m.group("sep") + SECRET, text)
        else:
            text = pattern.sub(SECRET, text)
    return text


def _redact_names(text: str, cfg: "Redactor") -> str:
    for value in cfg.secret_values:
        if value and value in text:
            text = text.replace(value, SECRET)
    return text


_HOME_ANY = re.compile(r"(?:/home|/Users)/[^/\s'\"]+(?=/|\b)")


def _redact_home(text: str, cfg: "Redactor") -> str:
    if cfg.home and cfg.home not in ("/", "") and cfg.home in text:
        text = text.replace(cfg.home.rstrip("/"), "~")
    if cfg.hide_all_homes:
        text = _HOME_ANY.sub("~", text)
    return text


_EMAIL = re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}")
_PHONE = re.compile(r"(?<![\w/.-])(?:\+\d{1,3}[\s.-]?)?(?:\(\d{2,4}\)[\s.-]?|\d{2,4}[\s.-])\d{3,4}[\s.-]\d{3,4}(?![\w/-])")


def _redact_pii(text: str, cfg: "Redactor") -> str:
    if not cfg.pii:
        return text
    text = _EMAIL.sub(PII, text)
    return _PHONE.sub(PII, text)


Processor = Callable[[str, "Redactor"], str]

#: AEP-0003 §9.4 order: (a) secrets, (b) operator-listed names, (c) home prefix, (d) PII.
PIPELINE: tuple[Processor, ...] = (_redact_secrets, _redact_names, _redact_home, _redact_pii)


@dataclass(frozen=True)
class Redactor:
    """The §9.4 pipeline with its operator settings."""

    secret_values: tuple[str, ...] = ()
    home: str = ""
    pii: bool = True
    hide_all_homes: bool = True

    def text(self, text: str) -> str:
        for step in PIPELINE:
            text = step(text, self)
        return text

    def value(self, value: Any) -> Any:
        """Redact every string inside a JSON value (keys are structural and kept)."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            if is_stub(value):
                return {"digest": value["digest"], "bytes": value.get("bytes")}
            return {k: self.value(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.value(v) for v in value]
        return value


# ---------------------------------------------------------------- the policy


def parse_overrides(spec: str | Iterable[str]) -> dict[str, str]:
    """`"attention=redacted,tool=full"` (or a list of `CATEGORY=LEVEL`) -> mapping, validated."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    result: dict[str, str] = {}
    for item in items:
        item = item.strip()
        if not item:
            continue
        category, sep, level = item.partition("=")
        category = category.strip().rstrip(".*").strip()
        if not sep or not category:
            raise ValueError(f"capture override {item!r} must look like CATEGORY=LEVEL")
        level_rank(level.strip())
        result[category] = level.strip()
    return result


@dataclass(frozen=True)
class CapturePolicy:
    """Ceilings per event category. Categories are the first type segment, or for
    vendor types `x.hermes.<category>` the segment after the vendor."""

    default: str = "metadata"
    overrides: dict[str, str] = field(default_factory=lambda: {"attention": "redacted"})
    redactor: Redactor = field(default_factory=Redactor)

    def __post_init__(self) -> None:
        level_rank(self.default)
        for level in self.overrides.values():
            level_rank(level)

    def ceiling(self, event_type: str) -> int:
        parts = event_type.split(".")
        candidates = [parts[0]]
        if parts[0] == "x" and len(parts) > 2:
            candidates = [".".join(parts[:3]), parts[2]]
        for category in candidates:
            if category in self.overrides:
                return LEVEL_RANK[self.overrides[category]]
        return LEVEL_RANK[self.default]


# ---------------------------------------------------------------- an exporter's ceiling (AEP-0005 §3.3, §4.6)
#
# The bridges (bridge/core/bridges/) apply one rule before they project an AEP event: an
# event whose `capture` is above the exporter's `max_capture` keeps its envelope and loses
# its whole payload. Dropping more than the field levels require is always a legal
# down-level (AEP-0001 §8.2 b), it needs no schema of the event's type (the exporters see
# foreign and vendor types too), and it is what the AEP-0005 pins assert (§4.3: "a level
# above max_capture": the payload does not survive; §4.6: "created from the envelope alone").


def event_capture(event: dict[str, Any]) -> int:
    """The rank of an AEP event's `capture` (absent: `metadata`, AEP-0001 §5.1)."""
    return level_rank(event.get("capture", "metadata"))


def exported_payload(event: dict[str, Any], max_capture: int) -> dict[str, Any] | None:
    """The payload an exporter with ceiling ``max_capture`` may pass on, or None.

    None when the event is above the ceiling, when it is `capture: none` (envelope only,
    AEP-0005 §3.3), or when it has no object `data`.
    """
    level = event_capture(event)
    data = event.get("data")
    if level == NONE or level > max_capture or not isinstance(data, dict):
        return None
    return data


def downlevel(event: dict[str, Any], max_capture: int) -> dict[str, Any]:
    """The event as a re-emitting hop under ``max_capture`` passes it on (AEP-0001 §8.2 b).

    Within the ceiling: the event itself, unchanged (the CloudEvents bridge stays lossless).
    Above it: the envelope without `data`, its `capture` rewritten to `none`, the level of
    what it now carries (the rule of `exported_payload`; never up-levelled, never a
    `redacted` claim minted, §8.2 e).
    """
    if event_capture(event) <= max_capture:
        return event
    out = {k: v for k, v in event.items() if k != "data"}
    out["capture"] = "none"
    return out
