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
* A fan-out hop (the relay) delivers each subscription at its ceiling field by field
  (``downlevel_fields``): an event above it lands on ``metadata`` with its metadata-level
  fields: the levels ``bridge.core.aep`` declares for the types this bridge emits, those of
  the AEP payload schemas (vendored in ``bridge/data/aep_spec/``) for the other standard
  types; vendor and unknown types keep their envelope alone. Reading those schemas, once,
  at first use (``importlib.resources``) is the one thing here that touches a file.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Any, Callable, Iterable

import msgspec
from msgspec import UNSET

from bridge.core import aep

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
TOO_DEEP = "[REDACTED:too-deep]"
#: nesting a structure may have before what lies deeper is replaced by TOO_DEEP (the
#: walk is recursive; Python's own limit is 1000 frames)
MAX_DEPTH = 200

# Every pattern below is linear on hostile input (tests/services/test_hostile_capture.py runs 1 MB
# strings built against each): quantifiers are bounded or start where a run starts, so no
# start position rescans what an earlier one failed on.

# (a) PEM blocks, any label; a block cut before its END line is redacted to the end of the
# text, and an END line whose BEGIN was cut off takes the base64 lines before it along.
_PEM_BEGIN = re.compile(r"-----BEGIN [A-Z0-9 ]{1,64}-----")
_PEM_END = re.compile(r"-----END [A-Z0-9 ]{1,64}-----")
_B64_LINE = re.compile(r"[A-Za-z0-9+/=]+")


def _orphan_pem_ends(text: str) -> str:
    if "-----END " not in text:
        return text
    out: list[str] = []
    pos = 0
    for m in _PEM_END.finditer(text):
        lines = text[pos:m.start()].split("\n")
        k = len(lines)
        if not lines[-1].strip() or _B64_LINE.fullmatch(lines[-1].strip()):
            k -= 1  # END's own line, before it
            while k > 0 and lines[k - 1].strip() and _B64_LINE.fullmatch(lines[k - 1].strip()):
                k -= 1
        kept = "\n".join(lines[:k])
        if 0 < k < len(lines):
            kept += "\n"  # the line break before the first redacted line
        out.append(kept + SECRET)
        pos = m.end()
    out.append(text[pos:])
    return "".join(out)


def _redact_pem(text: str) -> str:
    if "-----" not in text:
        return text
    out: list[str] = []
    pos, n = 0, len(text)
    while pos < n:
        begin = _PEM_BEGIN.search(text, pos)
        if begin is None:
            out.append(_orphan_pem_ends(text[pos:]))
            break
        out.append(_orphan_pem_ends(text[pos:begin.start()]))
        out.append(SECRET)
        end = _PEM_END.search(text, begin.end())
        pos = end.end() if end is not None else n
    return "".join(out)


_KEYWORDS = (r"(?:passw(?:or)?d|passphrase|pwd|secret|api[_-]?key|apikey|access[_-]?key|private[_-]?key"
             r"|auth[_-]?token|token|credentials?)")

# (substitution, pattern): the substitution keeps the named group `pre` and replaces `val`.
_KEEP_PRE = "pre"
_SECRET_PATTERNS: list[tuple[str | None, re.Pattern[str]]] = [
    # Authorization / Cookie values (also Proxy-Authorization, X-Authorization, Set-Cookie): all of it.
    (_KEEP_PRE, re.compile(
        r"""(?i)(?P<pre>(?<![A-Za-z0-9])(?:authorization|cookie)["']?[ \t]*[:=][ \t]*)"""
        r"""(?P<val>"[^"\n]*"|'[^'\n]*'|[^\n'"]+)""")),
    # key=value / key: value / "key": "value" credentials (the key may go on: AWS_SECRET_ACCESS_KEY,
    # X-Api-Key, db_password); the value may sit on the next line.
    (_KEEP_PRE, re.compile(
        rf"""(?i)(?P<pre>{_KEYWORDS}[\w.-]{{0,40}}?["']?\s*[=:]\s*)(?P<val>"[^"\n]*"|'[^'\n]*'|\S+)""")),
    # --password VALUE, --api-key VALUE (a flag and its argument).
    (_KEEP_PRE, re.compile(rf"(?i)(?P<pre>(?<![\w-])--?[\w-]{{0,30}}?{_KEYWORDS}[ \t]+)(?P<val>(?!-)\S+)")),
    # curl -u user:password, --user, --proxy-user: the password part.
    (_KEEP_PRE, re.compile(
        r"""(?P<pre>(?<![\w-])(?:-u|-U|--user|--proxy-user)(?:[ \t]+|=)?["']?[^\s:'"]{0,256}:)(?P<val>[^\s'"]+)""")),
    # mysql -pSECRET (the password glued to -p; `-p` alone prompts), sshpass -p SECRET.
    (_KEEP_PRE, re.compile(
        r"""(?P<pre>\b(?:mysql[\w-]*|mariadb[\w-]*)\b[^\n|;&]{0,200}?[ \t]-p)(?P<val>'[^'\n]*'|"[^"\n]*"|[^\s'"]+)""")),
    (_KEEP_PRE, re.compile(r"(?P<pre>\bsshpass[ \t]+-p[ \t]*)(?P<val>\S+)")),
    # URL credentials: scheme://user:password@host.
    (_KEEP_PRE, re.compile(r"(?i)(?P<pre>\b[a-z][a-z0-9+.-]{0,20}://[^\s/:@]{0,256}:)(?P<val>[^\s/@]{1,512})(?=@)")),
    # Authorization schemes (RFC 6750: case-insensitive): a token-looking value (a digit or a
    # token68 symbol, or 20+ characters), or anything after the canonical `Bearer`.
    (None, re.compile(r"(?i)\b(?:bearer|basic|token)[ \t]+(?:(?=[A-Za-z0-9._~+/=-]{0,4096}[\d._~+/=])[A-Za-z0-9._~+/=-]{8,}|[A-Za-z0-9._~+/=-]{20,})")),
    (None, re.compile(r"\bBearer[ \t]+[A-Za-z0-9._~+/=-]{8,}")),
    # AWS access key ids (also glued to `_`: AWS_KEY_AKIA...).
    (None, re.compile(r"(?<![A-Za-z0-9])(?:AKIA|ASIA|ABIA|ACCA|AGPA|AIDA|AIPA|ANPA|ANVA|AROA|APKA)[0-9A-Z]{16}(?![A-Za-z0-9])")),
    (None, re.compile(r"(?<![A-Za-z0-9_-])eyJ[A-Za-z0-9_-]{2,}\.[A-Za-z0-9_-]{2,}\.[A-Za-z0-9_-]{2,}")),  # JWT shapes
    (None, re.compile(r"(?<![A-Za-z0-9])gh[pousr]_[A-Za-z0-9]{20,}")),  # GitHub tokens
    (None, re.compile(r"(?<![A-Za-z0-9])github_pat_[A-Za-z0-9_]{20,}")),
    (None, re.compile(r"(?<![A-Za-z0-9])glpat-[A-Za-z0-9_-]{16,}")),  # GitLab
    (None, re.compile(r"(?<![A-Za-z0-9])xox[abposr]-[A-Za-z0-9-]{10,}")),  # Slack
    (None, re.compile(r"(?<![A-Za-z0-9])sk-(?:proj-|live-|test-)?[A-Za-z0-9_-]{16,}")),  # OpenAI-style
    (None, re.compile(r"(?<![A-Za-z0-9])sk_(?:live|test)_[A-Za-z0-9]{10,}")),  # Stripe-style
    (None, re.compile(r"(?<![A-Za-z0-9])AIza[0-9A-Za-z_-]{35}")),  # Google API keys
]


def _keep_pre(m: re.Match[str]) -> str:
    return m.group("pre") + SECRET


def _redact_secrets(text: str, _cfg: "Redactor") -> str:
    text = _redact_pem(text)
    for keep, pattern in _SECRET_PATTERNS:
        text = pattern.sub(_keep_pre if keep else SECRET, text)
    return text


def _redact_names(text: str, cfg: "Redactor") -> str:
    for value in cfg.secret_values:
        if value and value in text:
            text = text.replace(value, SECRET)
    return text


_HOME_ANY = re.compile(r"(?:/home|/Users)/[^/\s'\"]{1,255}(?=/|\b)")


def _redact_home(text: str, cfg: "Redactor") -> str:
    if cfg.home and cfg.home not in ("/", "") and cfg.home in text:
        text = text.replace(cfg.home.rstrip("/"), "~")
    if cfg.hide_all_homes:
        text = _HOME_ANY.sub("~", text)
    return text


# An address starts where a run of address characters starts (no rescanning inside a run).
_EMAIL = re.compile(
    r"(?<![A-Za-z0-9._%+-])[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9-]{1,63}(?:\.[A-Za-z0-9-]{1,63}){0,8}\.[A-Za-z]{2,24}(?![A-Za-z])")
_PHONE = re.compile(r"(?<![\w/.-])(?:\+\d{1,3}[\s.-]?)?(?:\(\d{2,4}\)[\s.-]?|\d{2,4}[\s.-])\d{3,4}[\s.-]\d{3,4}(?![\w/-])")


def _redact_pii(text: str, cfg: "Redactor") -> str:
    if not cfg.pii:
        return text
    if "@" in text:
        text = _EMAIL.sub(PII, text)
    return _PHONE.sub(PII, text)


Processor = Callable[[str, "Redactor"], str]

#: AEP-0003 §9.4 order: (a) secrets, (b) operator-listed names, (c) home prefix, (d) PII.
PIPELINE: tuple[Processor, ...] = (_redact_secrets, _redact_names, _redact_home, _redact_pii)

# Structure keys whose values are secrets whatever they look like (the text patterns see a
# value without its key). Matched on the key lower-cased with everything but letters and
# digits removed: X-Api-Key -> xapikey, AWS_SECRET_ACCESS_KEY -> awssecretaccesskey.
_SECRET_KEY_PARTS = ("password", "passwd", "passphrase", "secret", "apikey", "accesskey", "privatekey",
                     "authorization", "credential", "cookie", "token", "signature")
_SECRET_KEY_EXACT = frozenset({"pwd", "auth", "pass"})
# Usage figures and tokenizer names, not secrets: input_tokens, max_tokens, token_count, tokenizer.
_USAGE_KEY = re.compile(
    r"(?:input|output|total|max|min|prompt|completion|cached|cache|creation|read|reasoning|num|context|estimated"
    r"|used|remaining|audio|text|image|accepted|rejected|prediction)*"
    r"tokens?(?:count|counts|usage|limit|budget|used|total|remaining|details|izer|ization|ized)?")
_NON_ALNUM = re.compile(r"[^a-z0-9]")


@lru_cache(maxsize=4096)
def is_secret_key(key: str) -> bool:
    """Does a structure key (a JSON object key, a header name) name a secret?"""
    k = _NON_ALNUM.sub("", key.lower()[:128])
    if k in _SECRET_KEY_EXACT or k.endswith("pwd"):
        return True
    parts = [part for part in _SECRET_KEY_PARTS if part in k]
    if not parts:
        return False
    return not (parts == ["token"] and k not in ("token", "tokens") and _USAGE_KEY.fullmatch(k))


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
        """Redact every string inside a JSON value. Keys are structural and kept, but a value
        under a secret-named key (`password`, `api_key`, `X-Api-Key`, `authorization`, ...,
        or `{"name": "<secret name>", "value": ...}`) is a secret whatever it looks like;
        nesting deeper than MAX_DEPTH is replaced by TOO_DEEP."""
        return self._walk(value, False, 0)

    def _walk(self, value: Any, secret: bool, depth: int) -> Any:
        if isinstance(value, str):
            return (SECRET if value else value) if secret else self.text(value)
        if isinstance(value, (bool, type(None))):
            return value
        if isinstance(value, (int, float)):
            return SECRET if secret else value
        if depth >= MAX_DEPTH:
            return TOO_DEEP
        if isinstance(value, dict):
            if is_stub(value):
                return {"digest": value["digest"], "bytes": value.get("bytes")}
            named = value.get("name", value.get("key"))
            pair_secret = isinstance(named, str) and "value" in value and is_secret_key(named)
            return {k: self._walk(v, secret or (isinstance(k, str) and is_secret_key(k))
                                  or (pair_secret and k == "value"), depth + 1)
                    for k, v in value.items()}
        if isinstance(value, list):
            return [self._walk(v, secret, depth + 1) for v in value]
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
    vendor types `x.hermes.<category>` the segment after the vendor.

    ``default`` is the level of a category without an override; ``limit`` (when set) is
    the global ceiling: no category gets more, whatever its override says. `configure`
    builds the policy the operator's settings ask for."""

    default: str = "metadata"
    overrides: dict[str, str] = field(default_factory=lambda: {"attention": "redacted"})
    redactor: Redactor = field(default_factory=Redactor)
    limit: str | None = None

    def __post_init__(self) -> None:
        level_rank(self.default)
        for level in self.overrides.values():
            level_rank(level)
        if self.limit is not None:
            level_rank(self.limit)

    def ceiling(self, event_type: str) -> int:
        parts = event_type.split(".")
        candidates = [parts[0]]
        if parts[0] == "x" and len(parts) > 2:
            candidates = [".".join(parts[:3]), parts[2]]
        rank = LEVEL_RANK[self.default]
        for category in candidates:
            if category in self.overrides:
                rank = LEVEL_RANK[self.overrides[category]]
                break
        return rank if self.limit is None else min(rank, LEVEL_RANK[self.limit])

    def lowest(self) -> int:
        """The lowest ceiling of any category: what content of unknown category (a dead
        letter) may carry."""
        rank = min(LEVEL_RANK[level] for level in (self.default, *self.overrides.values()))
        return rank if self.limit is None else min(rank, LEVEL_RANK[self.limit])


#: The built-in per-category override (AEP-0003 §9.1's recommendation: prompts stay readable).
DEFAULT_OVERRIDES = "attention=redacted"


def configure(capture: str | None = None, overrides: str | None = None, extra: Iterable[str] = (),
              redactor: Redactor | None = None) -> tuple[CapturePolicy, list[str]]:
    """The policy of the operator's settings, and the warnings to show at start.

    * ``capture`` (`AEP_BRIDGE_CAPTURE`, `--capture`) is the ceiling: no event carries more,
      and it is the level of every category without an override. Unset (None), the bridge
      runs the default posture: `metadata`, with `attention` at `redacted` (its ceiling).
    * ``overrides`` (`AEP_BRIDGE_CAPTURE_OVERRIDES`; None: the built-in `attention=redacted`)
      and ``extra`` (`--capture-override`, applied over them) may only lower a category's
      level: one above the ceiling is clamped to it, with a warning. The built-in override
      is clamped silently (`--capture none` means none: the operator did not ask for it).
    """
    if capture is None:
        default, limit = "metadata", "redacted"
    else:
        level_rank(capture)
        default = limit = capture
    top = LEVEL_RANK[limit]
    levels: dict[str, str] = {}
    if overrides is None:
        for category, level in parse_overrides(DEFAULT_OVERRIDES).items():
            levels[category] = LEVELS[min(LEVEL_RANK[level], top)]
    asked = parse_overrides(overrides) if overrides is not None else {}
    asked.update(parse_overrides(list(extra)))
    warnings: list[str] = []
    for category, level in asked.items():
        if LEVEL_RANK[level] > top:
            why = "the default posture's ceiling (AEP_BRIDGE_CAPTURE is unset)" if capture is None else "the capture ceiling"
            warnings.append(f"capture override {category}={level} is above {why} {limit}: clamped to {limit}"
                            + (f" (set AEP_BRIDGE_CAPTURE={level} to allow it)" if capture is None else ""))
            level = limit
        levels[category] = level
    return CapturePolicy(default=default, overrides=levels, redactor=redactor or Redactor(), limit=limit), warnings


# ---------------------------------------------------------------- one event's ceiling


@dataclass(frozen=True)
class Ceiling:
    """The ceiling of one event and the redaction that goes with it."""

    level: int
    policy: CapturePolicy

    def admits(self, level: int) -> bool:
        return self.level >= level

    def text(self, value: Any, level: int = REDACTED) -> Any:
        """Free text (or a JSON value) admitted at ``level``: UNSET, redacted, or verbatim."""
        if value is None or not self.admits(level):
            return UNSET
        if self.level >= FULL:
            return value
        return self.policy.redactor.value(value)


def strip_to_required(payload: aep._Payload) -> aep._Payload:
    """Capture ``none``: keep only the fields a payload schema requires (envelope-level structure)."""
    kept = {}
    for f in msgspec.structs.fields(payload):
        value = getattr(payload, f.name)
        if f.required:
            kept[f.name] = strip_to_required(value) if isinstance(value, aep._Payload) else value
    return type(payload)(**kept)


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


# ---------------------------------------------------------------- a fan-out hop's ceiling (AEP-0001 §8.2, AEP-0003 §6.4)
#
# The relay delivers each subscription at its ceiling. Down-levelling there is field by field
# for the types whose payload fields carry their capture levels: the event keeps what its new
# level admits. The levels of a type come from `bridge.core.aep` when this bridge emits it (our
# types are our schemas, at least as strict as the spec's: tests/core/test_spec_levels.py),
# else from the AEP payload schema of the standard type (`bridge/data/aep_spec/types/`, what
# other emitters POST to the relay). Where it lands: an event above the ceiling goes to
# `metadata` (or to `none` under a `none` ceiling), never to `redacted`: that level claims the
# text passed the §9.4 pipeline, which a mechanical hop cannot mint (§8.2 e), and a `redacted`
# source event is within a `redacted` ceiling anyway. A type without known levels (vendor
# types we do not emit, unregistered ones, registered ones without a schema) keeps its
# envelope and loses its payload: dropping more than the levels require is always legal (§8.2 b).


def _shape(tp: Any) -> tuple[int, Any]:
    """(capture level, shape) of one field's msgspec type info. A shape is a dict of the
    fields of a nested payload, ``[shape]`` for a list of payloads, or None (a leaf)."""
    level = FULL  # a field without an annotation is content, to be safe
    while True:
        if isinstance(tp, msgspec.inspect.Metadata):
            schema = tp.extra_json_schema or {}
            if "x-aep-capture" in schema:
                level = LEVEL_RANK[schema["x-aep-capture"]]
            tp = tp.type
        elif isinstance(tp, msgspec.inspect.UnionType):
            kinds = [t for t in tp.types if not isinstance(t, msgspec.inspect.UnsetType)]
            if len(kinds) != 1:
                return level, None
            tp = kinds[0]
        else:
            break
    if isinstance(tp, msgspec.inspect.StructType):
        return level, _fields(tp)
    if isinstance(tp, msgspec.inspect.ListType):
        _, inner = _shape(tp.item_type)
        return level, [inner] if isinstance(inner, dict) else None
    return level, None


def _fields(info: msgspec.inspect.StructType) -> dict[str, tuple[int, Any]]:
    return {f.encode_name: _shape(f.type) for f in info.fields}


# ---- the levels of the AEP payload schemas

SPEC_DATA = "bridge.data"  # the package holding aep_spec/ (a name, not an import: the core imports no other floor)


def _level_of(value: Any) -> int:
    """An `x-aep-capture` value's rank; an unknown one is `full` (to be safe)."""
    return LEVEL_RANK.get(value, FULL) if isinstance(value, str) else FULL


def _pointer(ref: str, root: dict[str, Any]) -> Any:
    """The node a local reference (`#`, `#/$defs/x`, `#/definitions/x`) names in ``root``, or None."""
    if not ref.startswith("#"):
        return None  # another document: not followed
    node: Any = root
    for part in ref[2:].split("/") if len(ref) > 1 else ():
        node = node.get(part.replace("~1", "/").replace("~0", "~")) if isinstance(node, dict) else None
    return node


def _resolve(node: Any, root: dict[str, Any]) -> tuple[dict[str, Any] | None, list[int]]:
    """A schema node with its `$ref` chain followed, and the capture levels annotated along the
    chain; ``{}`` for no schema object, None for a reference that leaves the document, does not
    resolve to a schema object or loops (what it stands for is unknown: content)."""
    levels: list[int] = []
    seen: set[str] = set()
    while isinstance(node, dict):
        if "x-aep-capture" in node:
            levels.append(_level_of(node["x-aep-capture"]))
        ref = node.get("$ref")
        if not isinstance(ref, str):
            return node, levels
        if ref in seen:
            return None, levels
        seen.add(ref)
        node = _pointer(ref, root)
        if not isinstance(node, dict):
            return None, levels
    return {}, levels


def _deepest_level(node: Any, root: dict[str, Any]) -> int:
    """The highest `x-aep-capture` anywhere within a schema node, references followed (one that
    does not resolve: `full`); NONE if none."""
    top, stack, seen = NONE, [node], set()
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if "x-aep-capture" in item:
                top = max(top, _level_of(item["x-aep-capture"]))
            ref = item.get("$ref")
            if isinstance(ref, str) and ref not in seen:
                seen.add(ref)
                target = _pointer(ref, root)
                if target is None:
                    top = FULL
                stack.append(target)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return top


def _schema_field(node: Any, root: dict[str, Any], depth: int = 0) -> tuple[int, Any]:
    """(capture level, shape) of one property of a payload schema, the way `_shape` reads a
    struct field: an object with `properties` is a nested shape, an array whose `items` has
    `properties` is ``[shape]``, anything else a leaf. A field without `x-aep-capture` is
    `full` (content, to be safe); a leaf (or an array's items) holding annotations the shape
    does not model (combinators, `additionalProperties`...) is raised to the highest of them."""
    node, levels = _resolve(node, root)
    if node is None or depth > 32:
        return FULL, None
    level = max(levels) if levels else FULL
    if isinstance(node.get("properties"), dict):
        return level, _schema_fields(node, root, depth + 1)
    items, item_levels = _resolve(node.get("items"), root)
    if items is not None and isinstance(items.get("properties"), dict):
        return max([level, *item_levels]), [_schema_fields(items, root, depth + 1)]
    return max(level, _deepest_level(node, root)), None


def _schema_fields(node: dict[str, Any], root: dict[str, Any], depth: int = 0) -> dict[str, tuple[int, Any]]:
    return {name: _schema_field(sub, root, depth) for name, sub in node["properties"].items()}


def schema_payload_fields(schema: dict[str, Any]) -> dict[str, tuple[int, Any]]:
    """The payload fields of a payload JSON Schema, name -> (capture level, shape), as `payload_fields`."""
    node, _ = _resolve(schema, schema)
    return _schema_fields(node, schema) if node is not None and isinstance(node.get("properties"), dict) else {}


@lru_cache(maxsize=1)
def spec_payload_fields() -> dict[str, dict[str, tuple[int, Any]]]:
    """The payload fields of every registered AEP type with a payload schema, read once from
    the vendored registry (`bridge/data/aep_spec/`)."""
    spec = resources.files(SPEC_DATA).joinpath("aep_spec")
    registry = json.loads(spec.joinpath("registry", "types.json").read_text(encoding="utf-8"))
    table = {}
    for entry in registry["types"]:
        if entry.get("schema"):
            schema = json.loads(spec.joinpath("types", entry["schema"]).read_text(encoding="utf-8"))
            table[entry["type"]] = schema_payload_fields(schema)
    return table


def _merged(ours: dict[str, tuple[int, Any]], spec: dict[str, tuple[int, Any]]) -> dict[str, tuple[int, Any]]:
    """Our fields over the spec's: ours decide every field both define (level and shape, merged
    one level down into nested objects and lists of objects); a field only the spec defines
    keeps the spec's level (a posted ``tool.completed`` keeps its ``status`` at metadata)."""
    out = dict(spec)
    for name, (level, shape) in ours.items():
        other = spec.get(name)
        if other is not None and isinstance(shape, dict) and isinstance(other[1], dict):
            shape = _merged(shape, other[1])
        elif (other is not None and isinstance(shape, list) and isinstance(other[1], list)
              and isinstance(shape[0], dict) and isinstance(other[1][0], dict)):
            shape = [_merged(shape[0], other[1][0])]
        out[name] = (level, shape)
    return out


@lru_cache(maxsize=1)
def _field_table() -> dict[str, dict[str, tuple[int, Any]]]:
    spec = spec_payload_fields()
    table = dict(spec)
    for t, cls in aep.PAYLOAD_TYPES.items():
        table[t] = _merged(_fields(msgspec.inspect.type_info(cls)), spec.get(t, {}))
    return table


def payload_fields(event_type: str) -> dict[str, tuple[int, Any]] | None:
    """The payload fields of a type whose field levels are known, name -> (capture level, shape):
    ours for the types this bridge emits (with the fields only the AEP payload schema defines
    added at the schema's levels), the schema's for the other standard types; None for others.
    One table, built once: no cache keyed by the type strings events carry."""
    return _field_table().get(event_type)


def _project(value: Any, shape: dict[str, tuple[int, Any]], level: int) -> dict[str, Any]:
    """The fields of an object ``value`` that ``level`` admits, recursively; fields the shape
    does not declare, and values that do not have the declared shape, are dropped."""
    out: dict[str, Any] = {}
    for key, item in value.items():
        declared = shape.get(key)
        if declared is None or declared[0] > level:
            continue
        inner = declared[1]
        if isinstance(inner, dict):
            if not isinstance(item, dict):
                continue
            item = _project(item, inner, level)
        elif isinstance(inner, list):
            if not isinstance(item, list):
                continue
            item = [_project(x, inner[0], level) for x in item if isinstance(x, dict)]
        out[key] = item
    return out


# The `[metadata*]` fields (AEP-0002 §5.1): at `metadata` they hold structural text only, at
# `redacted`+ authored text. A hop cannot tell which an event above metadata carries, so it
# rebuilds them from structure (AEP-0003 §9.2): the prompt from agent, kind and subject, a
# label from its id; a form answer keeps its booleans and numbers, never a string (a select
# id and typed free text look alike).


def _label_ids(items: Any) -> None:
    if isinstance(items, list):
        for item in items:
            if "id" in item:
                item["label"] = item["id"]
            else:
                item.pop("label", None)


def _structural_request(event: dict[str, Any], data: dict[str, Any]) -> None:
    if "prompt" in data:
        agent, kind, subject = event.get("agent"), data.get("kind"), event.get("subject")
        prompt = f"{agent if isinstance(agent, str) else 'agent'} requests {kind if isinstance(kind, str) else 'attention'}"
        data["prompt"] = f"{prompt}: {subject}" if isinstance(subject, str) else prompt
    _label_ids(data.get("options"))
    for spec in data.get("fields") or ():
        if "label" in spec:
            spec["label"] = spec.get("id", "")
        _label_ids(spec.get("choices"))


def _structural_answer(event: dict[str, Any], data: dict[str, Any]) -> None:
    answer = data.get("answer")
    if isinstance(answer, dict) and "values" in answer:
        values = answer["values"]
        kept = {k: v for k, v in values.items() if isinstance(v, (bool, int, float))} if isinstance(values, dict) else {}
        if kept:
            answer["values"] = kept
        else:
            del answer["values"]


_STRUCTURAL: dict[str, Callable[[dict[str, Any], dict[str, Any]], None]] = {
    "attention.requested": _structural_request,
    "attention.answered": _structural_answer,
    "control.attention.respond": _structural_answer,
}


def downlevel_fields(event: dict[str, Any], max_capture: int) -> dict[str, Any]:
    """The event as a fan-out hop with ceiling ``max_capture`` delivers it (AEP-0001 §8.2).

    Within the ceiling: the event itself, unchanged. Above it: `capture` becomes `metadata`
    (`none` under a `none` ceiling); at `metadata` the payload keeps its metadata-level fields
    (`[metadata*]` fields rebuilt from structure) when the type is known, else the event loses
    its payload. An unknown `capture` value counts as above every ceiling. Pure: ``event`` is
    not modified.
    """
    try:
        level = event_capture(event)
    except ValueError:
        level = FULL + 1
    if level <= max_capture:
        return event
    new = min(max_capture, METADATA)
    out = {k: v for k, v in event.items() if k != "data"}
    out["capture"] = LEVELS[new]
    shape = payload_fields(event.get("type")) if isinstance(event.get("type"), str) else None
    data = event.get("data")
    if new == METADATA and shape is not None and isinstance(data, dict):
        kept = _project(data, shape, METADATA)
        fix = _STRUCTURAL.get(event["type"])
        if fix is not None:
            fix(event, kept)
        out["data"] = kept
    return out
