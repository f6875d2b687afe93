"""The redaction pipeline (AEP-0003 §9.4): what free text admitted at ``redacted`` goes through.

A visible chain of small processors, run in the spec's order: secrets, operator-listed
values, home prefix to ``~``, PII (``PIPELINE``). ``Redactor.value`` walks a JSON value:
keys are kept, a value under a secret-named key is a secret whatever it looks like.
Nothing here decides whether text is admitted at all: that is the ceiling's
(``bridge.core.ceiling``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable

from bridge.core.digest import is_stub

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
