"""aep-bridge Hermes shell hook: one envelope in, one JetStream message out, ``{}`` back.

Hermes runs this file for every hook event, synchronously, as
``<absolute python> -I -S <absolute path>/hook.py`` and waits for it, twice per
tool call. Everything here serves one budget: answer ``{}`` and exit 0 within a
few milliseconds of a bare Python start, whatever the input, whether or not
NATS answers, without ever losing the event silently.

Theory of operation
-------------------
1. Read all of stdin (bytes) until EOF, the deadline (a pipe that never closes is cut by
   SIGALRM: ``stdin_timeout``) or 128 MiB (``truncated``). Stamp a ULID ``id`` (time
   part = receive time), ``ts`` (receive time, ns) and ``instance``; wrap the envelope
   in the raw message of docs/ARCHITECTURE.md. Input that is empty, incomplete, not
   UTF-8, not JSON or not an object is published too, as ``hook: "_invalid"`` with the
   reason and the raw text (base64 when not UTF-8). The values of the variables named by
   ``AEP_BRIDGE_REDACT_NAMES`` are replaced first (``edge.redacted``); NaN/Infinity
   become null (``edge.nonfinite``): the body is always RFC 8259 JSON.
2. Edge trimming: drop ``extra.conversation_history`` and the API bodies;
   replace the digest-bearing fields (``tool_input``, ``extra.result``, ...)
   whole, and any other single string, by ``{"$aep_stub": true, "digest",
   "bytes"}`` when its canonical JSON is over ``AEP_BRIDGE_MAX_FIELD_BYTES``.
   The digest is taken over the ORIGINAL value, so downstream digests equal
   those of the original content. If the message is still over the server's
   ``max_payload`` the limit is halved until it fits (then ``extra``, then the
   envelope, are stubbed whole): the published message never exceeds it.
3. Publish with the NATS text protocol over a raw ``_socket``: read ``INFO``,
   then send ``CONNECT`` + ``SUB <inbox>.*`` + ``HPUB`` (header
   ``Nats-Msg-Id: <id>``) in ONE write, and wait for the JetStream PubAck on
   the inbox. Servers (comma-separated ``AEP_BRIDGE_NATS_URL``) are tried from a
   place hashed from the instance name, the one that acked last first (kept in
   ``<spool dir>/<token>.server``), each but the last with a share of the time left
   to connect, send INFO and ack (``server_order``, ``connect_candidates``): a server
   that does not ack in its share is left for the next, and remembered as bad (the next
   run starts after it); all of connect + publish + ack happens within
   ``AEP_BRIDGE_DEADLINE_MS`` (default 250) of the start.
4. Spool: when no server acks in time, the stamped message is appended to
   ``<spool dir>/<instance token>.spool``, one record per line:
   ``<crc32 hex8> <id> <subject> <message JSON>\\n`` (the compact JSON never
   contains a raw newline). Appends hold ``flock(LOCK_EX)`` on the spool file
   and first terminate a torn last line, so concurrent shims never interleave
   and a crash mid-write leaves at worst one line that fails its CRC.
   Whoever holds the replay lock (``flock`` on ``<token>.pos``, never waited
   for) republishes records in order from the committed position, pipelined
   in batches, commits the position after the acks, and truncates the file
   when it is empty. A line without its newline while no writer holds the
   lock is a torn tail: it is moved to ``<token>.torn-<ns>``; a line failing
   its CRC goes to ``<token>.corrupt``; a message JetStream rejects for good
   (4xx) goes to ``<token>.rejected``. None is ever replayed as garbage.
   Every invocation first replays what it can within its deadline (a record over
   max(max_payload, 1 MiB), which only older shims wrote, is left for ``spool drain``),
   then publishes its own event, or appends it behind the remaining spool (order). A
   record is fitted to 1 MiB before it is spooled: nothing is spooled that cannot be
   published. ``Nats-Msg-Id`` makes a resend after a lost ack a no-op within the stream's
   duplicate window. Spool files are opened ``O_NOFOLLOW|O_NONBLOCK`` and used only when
   they are regular files of our uid. When the spool directory cannot be written, the
   private ``$TMPDIR/aep-bridge-<uid>`` (0700, owner-checked) takes the records, and keeps
   them while it holds any (order); replay drains the primary first. Past
   ``AEP_BRIDGE_SPOOL_MAX_BYTES`` of pending records, or with no writable spool, a record
   is dropped, counted in ``<token>.dropped`` (``aep-bridge spool status``), reported on
   stderr and, once, in the next message's ``edge.spool_dropped`` (a mapper counter).
   The hook still answers ``{}`` in time.
5. Always write ``{}`` to stdout and exit 0 (diagnostics go to stderr, which
   Hermes logs at debug level; a non-zero exit would only add warnings).

Configuration: the ``AEP_BRIDGE_*`` variables of docs/ARCHITECTURE.md, from the
environment (inherited from Hermes) over the optional ``KEY=VALUE`` file named by
``AEP_BRIDGE_CONFIG`` (default ``~/.config/aep-bridge/env``; ``aep-bridge hermes
install`` writes it). Same names and precedence as ``bridge/config.py``. With
``AEP_BRIDGE_NATS_JWT`` (a fleet instance's credential, `aep-bridge fleet issue`) CONNECT carries
that bearer JWT and no user, password or signature. Odd values
(out-of-range numbers, a settings file that is not a small regular file: ``/dev/zero``, a
FIFO) are reported on stderr and replaced by the defaults; they never crash or hang the hook.

Why it looks like this (measured on the 2-core dev box, Python 3.11, ``-X importtime``
and median wall time of 60 spawns; a bare ``python -I -S -c pass`` spawn: ~10 ms):

* no ``os``: ``-I -S`` does not load it (+1.3 ms); ``posix`` is built in.
* ``_socket`` (0.3-0.6 ms) instead of ``socket`` (+8 ms spawn to spawn, 14 ms of
  imports: enum, selectors); no asyncio, no NATS client (~100 ms).
* ``getaddrinfo`` gets the host as ASCII bytes: given a ``str`` it encodes it with the
  ``idna`` codec, whose import pulls in ``re`` (+8.4 ms, found with ``-X importtime``).
* ``_json``'s C scanner and encoder (0.3-0.6 ms) instead of ``json`` (+8 ms: it imports
  ``re`` and ``enum``). The C scanner only imports ``json.decoder`` to raise a decode
  error, i.e. on invalid input, where time does not matter.
* ``_sha256`` (1.6 ms), ``binascii``, ``fcntl`` (0.35 ms), ``zlib`` (0.5 ms) are imported
  only when a stub, a non-UTF-8 input or the spool needs them; ``ssl`` (+23 ms with
  ``socket``) only when TLS is configured (``tls://`` or ``AEP_BRIDGE_TLS_CA``): that is
  the documented price of TLS.
* A script named on the command line is compiled on every run: ~11.5 ms for this file,
  more than everything else the hook does. ``aep-bridge hermes install`` therefore
  registers the byte-compiled copy of this very file by default (bridge/hermes/install.py);
  ``--mode source`` registers this file as is.
* ``posix._exit`` after writing ``{}``: nothing is buffered (raw fd writes), and skipping
  interpreter finalisation saves ~3 ms (10.2 -> 7.2 ms for an empty program).
* One write carries CONNECT + SUB + HPUB, so a publish costs one round trip after INFO.

Result: benchmarks/bench_shim.py (the figures: README "Performance", docs/BENCHMARKS.md).

Control plane (opt-in; docs/ARCHITECTURE.md "Control plane")
--------------------------------------------------------------
Off unless ``AEP_HERMES_CONTROL`` or ``AEP_INSTRUCT`` is ``1`` (environment or config
file): then ``main`` checks two booleans and nothing else changes, not a byte of the
output nor an import. On, exactly two moments change, both after the usual publish:

* ``AEP_HERMES_CONTROL=1``, a ``pre_tool_call`` whose tool name fullmatches
  ``AEP_HERMES_GATE_TOOLS`` (default: every tool): the raw message carries two more
  headers, ``Aep-Gate-Reply: <inbox>.g`` and ``Aep-Gate-Hold-Ms: <hold>``, on the inbox
  the connection already subscribes to; the hook then waits up to ``AEP_HERMES_HOLD_MS``
  (default 55000, below the Hermes ``timeout:`` the installer writes) for the gate's
  ``release`` (confirmed to its reply subject, then printed: ``{}`` or
  ``{"action":"block","message":...}``), answering its ``ping`` probes meanwhile.
  Expiry, a broken connection or an unpublished event: ``{}`` (Hermes's own fail-open).
* ``AEP_INSTRUCT=1``, a ``pre_llm_call`` with a session id: after the ack, a request on
  ``aep.gate.instruct.<session token>`` within the same deadline; a ``{"context": ...}``
  asked back by the gate is confirmed and printed; anything else, or no gate: ``{}``.

The module is also imported by the ``aep-bridge`` CLI (``spool drain|status``,
tests); it must stay standard-library-only and import nothing at module level
beyond the built-ins above.
"""

import posix
import sys
import time

import _json
import _socket

VERSION = "0.1.0"

# ---------------------------------------------------------------- defaults (keep in step with bridge/config.py)

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
DEFAULT_DEADLINE_MS = 250
DEFAULT_MAX_FIELD_BYTES = 64 * 1024
DEFAULT_SPOOL_MAX_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_PAYLOAD = 1024 * 1024  # NATS default, assumed until a server's INFO says otherwise

RAW_SUBJECT_PREFIX = "hermes.raw."
INVALID_HOOK = "_invalid"
UNKNOWN_HOOK = "_unknown"
TOKEN_MAX_CHARS = 200  # keeps the HPUB control line far below the server's 4 KiB limit
STDIN_MAX_BYTES = 128 * 1024 * 1024  # more is not a hook envelope: the rest is not read ("truncated")
CONFIG_MAX_BYTES = 1024 * 1024  # a settings file larger than this is ignored
SECRET_MARK = "[REDACTED:secret]"  # keep in step with bridge/core/redaction.py SECRET (a test compares them)
# Accepted ranges; anything else is warned about and replaced by the default.
LIMITS = {
    "DEADLINE_MS": (1, 60_000),
    "MAX_FIELD_BYTES": (1024, 64 * 1024 * 1024),
    "SPOOL_MAX_BYTES": (0, 1 << 40),
}
HOLD_MS_MAX = 24 * 3600 * 1000

# Dropped before publishing: no mapping needs them, they are big and hold conversation content.
DROP_EXTRA = ("conversation_history", "request", "response", "request_messages", "response_messages")
# Stubbed whole (their digests are AEP fields); elsewhere single strings are stubbed.
WHOLE_FIELDS = (
    ("tool_input",),
    ("extra", "result"),
    ("extra", "user_message"),
    ("extra", "assistant_response"),
    ("extra", "final_response"),
)
STUB_KEY = "$aep_stub"
MIN_FIT_LIMIT = 1024

# Spool replay: bounded work per hook invocation so the deadline holds.
REPLAY_BATCH = 128  # records per pipelined batch
REPLAY_BATCH_BYTES = 4 * 1024 * 1024
REPLAY_SHARE = 0.6  # of the deadline that replay may use before the own event
SPOOL_LOCK_GRACE_S = 0.03  # how long past the deadline an append may wait for the spool's lock

TOKEN_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")  # what `token` keeps
_B32 = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"  # Crockford base32 (ULID)

_O_CLOEXEC = getattr(posix, "O_CLOEXEC", 0)

# The opt-in control plane (keep in step with bridge/core/control.py; a test compares them;
# the pull's subject prefix is the one bridge/nats/subjects.py imports).
_ON = ("1", "true", "yes", "on")
DEFAULT_HOLD_MS = 55000
DEFAULT_DENY_MESSAGE = "Blocked by an operator through the aep-bridge control gate."
GATE_REPLY_HEADER = "Aep-Gate-Reply"
GATE_HOLD_HEADER = "Aep-Gate-Hold-Ms"
INSTRUCT_PULL_PREFIX = "aep.gate.instruct"


# ---------------------------------------------------------------- JSON through the C accelerator


class _ScanContext:
    """What ``_json.make_scanner`` reads from ``json.JSONDecoder``: the stdlib defaults."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}.__getitem__
    memo = None


def _no_default(o):
    raise TypeError("not JSON serialisable: " + type(o).__name__)


_scan = _json.make_scanner(_ScanContext())
# make_encoder(markers, default, encoder, indent, key_sep, item_sep, sort_keys, skipkeys, allow_nan)
_enc = _json.make_encoder(None, _no_default, _json.encode_basestring, None, ":", ",", False, False, True)
_enc_ascii = _json.make_encoder(None, _no_default, _json.encode_basestring_ascii, None, ":", ",", False, False, True)
_enc_canon = _json.make_encoder(None, _no_default, _json.encode_basestring, None, ":", ",", True, False, True)
# What goes on the wire is RFC 8259 JSON: NaN/Infinity raise ValueError (build_record normalises them).
_enc_strict = _json.make_encoder(None, _no_default, _json.encode_basestring, None, ":", ",", False, False, False)
_enc_ascii_strict = _json.make_encoder(
    None, _no_default, _json.encode_basestring_ascii, None, ":", ",", False, False, False
)
_WS = " \t\n\r"


def loads(text):
    """``json.loads`` for a str, without importing ``json`` (ValueError/StopIteration/RecursionError on bad input)."""
    start = len(text) - len(text.lstrip(_WS))
    obj, end = _scan(text, start)
    if end != len(text) and text[end:].strip(_WS):
        raise ValueError("extra data after the JSON value at offset %d" % end)
    return obj


def dumps(obj):
    """Compact JSON, UTF-8 unescaped (``json.dumps(o, separators=(",", ":"), ensure_ascii=False)``)."""
    return "".join(_enc(obj, 0))


def encode(obj):
    """Compact RFC 8259 JSON bytes (ValueError on NaN/Infinity); falls back to ASCII escapes
    when a string holds a lone surrogate."""
    try:
        return "".join(_enc_strict(obj, 0)).encode("utf-8")
    except UnicodeEncodeError:
        return "".join(_enc_ascii_strict(obj, 0)).encode("ascii")


def canonical(obj):
    """Canonical JSON bytes for digests: sorted keys, no spaces, UTF-8 unescaped (lone surrogates passed)."""
    return "".join(_enc_canon(obj, 0)).encode("utf-8", "surrogatepass")


_sha256 = None


def digest(value):
    """AEP digest: first 16 bytes of SHA-256 over the canonical JSON, 32 lowercase hex characters."""
    return digest_bytes(canonical(value))


def digest_bytes(data):
    global _sha256
    if _sha256 is None:
        try:  # the C module alone: hashlib costs 4 ms, _sha256 1.6 ms
            from _sha256 import sha256 as _sha256
        except ImportError:  # pragma: no cover - other builds (3.12+: _sha2)
            from hashlib import sha256 as _sha256
    return _sha256(data).hexdigest()[:32]


def stub(value, data=None):
    """The size stub of ``value`` (``data`` = its canonical JSON when already computed)."""
    if data is None:
        data = canonical(value)
    return {STUB_KEY: True, "digest": digest_bytes(data), "bytes": len(data)}


# ---------------------------------------------------------------- identity, subjects (bridge/nats/subjects.py imports these)


def ulid(ms=None, rand=None):
    """A ULID: 48-bit millisecond time + 80 random bits, Crockford base32, 26 characters."""
    if ms is None:
        ms = time.time_ns() // 1_000_000
    if rand is None:
        rand = posix.urandom(10)
    n = ((ms & 0xFFFFFFFFFFFF) << 80) | int.from_bytes(rand, "big")
    return "".join([_B32[(n >> s) & 31] for s in range(125, -1, -5)])


def token(value):
    """Subject token: every character outside ``[A-Za-z0-9_-]`` becomes ``_`` (empty -> ``_``,
    at most TOKEN_MAX_CHARS characters). Routing only: exact values travel in the body."""
    if not value:
        return "_"
    value = value[:TOKEN_MAX_CHARS]
    ok = TOKEN_CHARS
    return "".join([c if c in ok else "_" for c in value])


SHIM_INBOX_PREFIX = "_INBOX.hermes."


def shim_inbox_prefix(instance):
    """The shim's inbox space: ``_INBOX.hermes.<instance token>`` (the token of its raw
    subject). A shim user may subscribe to its own instance's space only
    (deploy/nats/nats.conf), and the gate sends a held call's decision only inside the space
    of the instance whose subject carried it."""
    return SHIM_INBOX_PREFIX + token(instance)


def raw_subject(instance, hook):
    return RAW_SUBJECT_PREFIX + token(instance) + "." + token(hook)


def instruct_subject(session):
    """Where a ``pre_llm_call`` pulls its session's queued instructions from the gate."""
    return INSTRUCT_PULL_PREFIX + "." + token(session)


# ---------------------------------------------------------------- configuration


def _expand_user(path, env):
    if not path.startswith("~"):
        return path
    home = env.get("HOME")
    if not home:
        try:
            import pwd

            home = pwd.getpwuid(posix.getuid()).pw_dir
        except (ImportError, KeyError):
            return path
    return home + path[1:]


def read_env_file(path):
    """``KEY=VALUE`` lines (``#`` comments, optional ``export``, optional quotes), as bridge/config.py."""
    values = {}
    try:  # O_NONBLOCK: opening a FIFO must not wait for a writer
        fd = posix.open(path, posix.O_RDONLY | posix.O_NONBLOCK | _O_CLOEXEC)
    except OSError:
        return values
    try:
        st = posix.fstat(fd)
        if st.st_mode & 0o170000 != 0o100000:
            if path == "/dev/null":  # the documented way to say "no settings file"
                return values
            _warn("settings file %s is not a regular file; ignored, using the defaults" % path)
            return values
        if st.st_size > CONFIG_MAX_BYTES:
            _warn("settings file %s is over %d bytes; ignored, using the defaults" % (path, CONFIG_MAX_BYTES))
            return values
        chunks = []
        left = CONFIG_MAX_BYTES + 1
        while left > 0:
            b = posix.read(fd, min(65536, left))
            if not b:
                break
            chunks.append(b)
            left -= len(b)
    except OSError as exc:
        _warn("settings file %s cannot be read (%s); ignored, using the defaults" % (path, exc))
        return values
    finally:
        posix.close(fd)
    for line in b"".join(chunks).decode("utf-8", "replace").splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.partition("=")
        key = key.strip()
        if key.startswith("export "):
            key = key[7:].strip()
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[key] = value
    return values


def settings_file(env, config_path=None):
    """The settings file: ``--config``, else ``AEP_BRIDGE_CONFIG``, else ``~/.config/aep-bridge/env``
    (``~`` is the environment's HOME). bridge/config.py resolves it with this function."""
    return _expand_user(config_path or env.get("AEP_BRIDGE_CONFIG") or "~/.config/aep-bridge/env", env)


def int_setting(name, raw, default, lo, hi):
    """``(value, warning)``: ``raw`` as an integer in [lo, hi]; unset or empty: the default; anything
    else: the default and why (the shim's rule; bridge/config.py resolves the shim's numbers with it)."""
    if not raw:
        return default, None
    try:
        value = int(raw.strip()) if len(raw) < 40 else None
    except ValueError:
        value = None
    if value is None or not lo <= value <= hi:
        return default, "%s=%.40r is not an integer in [%d, %d]; using the default %d" % (name, raw, lo, hi, default)
    return value, None


def spool_dir_setting(merged):
    """``AEP_BRIDGE_SPOOL_DIR``, else ``$XDG_STATE_HOME/aep-bridge/spool`` (default
    ``~/.local/state``), ``~`` expanded (bridge/config.py resolves the spool with this function)."""
    spool = merged.get("AEP_BRIDGE_SPOOL_DIR")
    if not spool:
        state = merged.get("XDG_STATE_HOME") or _expand_user("~/.local/state", merged)
        spool = state + "/aep-bridge/spool"
    return _expand_user(spool, merged)


def os_environ():
    """The process environment as str -> str (``os.environ`` without importing ``os``)."""
    return {
        k.decode("utf-8", "surrogateescape"): v.decode("utf-8", "surrogateescape") for k, v in posix.environ.items()
    }


class Config:
    """The shim's view of the ``AEP_BRIDGE_*`` settings."""

    __slots__ = (
        "servers", "user", "password", "token", "jwt", "tls_ca", "tls_cert", "tls_key", "instance",
        "spool_dir", "deadline_ms", "max_field_bytes", "spool_max_bytes",
        "control", "instruct", "gate_tools", "hold_ms", "redact_values", "fallback_dir",
    )

    def __init__(self, environ=None, config_path=None):
        env = os_environ() if environ is None else dict(environ)
        merged = read_env_file(settings_file(env, config_path))
        merged.update(env)

        def get(name):
            v = merged.get("AEP_BRIDGE_" + name)
            return v if v else None

        def get_int(name, default):
            value, warning = int_setting("AEP_BRIDGE_" + name, get(name), default, *LIMITS[name])
            if warning:
                _warn(warning)
            return value

        url = get("NATS_URL") or DEFAULT_NATS_URL
        self.servers = [s.strip() for s in url.split(",") if s.strip()]
        self.user = get("NATS_USER")
        self.password = get("NATS_PASSWORD")
        self.token = get("NATS_TOKEN")
        # A fleet's instance credential (`aep-bridge fleet issue`): a bearer user JWT, sent in
        # CONNECT with no nonce signature (docs/THREAT_MODEL.md "A fleet's own identities").
        self.jwt = get("NATS_JWT")
        self.tls_ca = get("TLS_CA")
        self.tls_cert = get("TLS_CERT")
        self.tls_key = get("TLS_KEY")
        self.instance = get("INSTANCE") or posix.uname().nodename
        self.spool_dir = spool_dir_setting(merged)
        self.fallback_dir = fallback_spool_dir(merged)
        self.deadline_ms = get_int("DEADLINE_MS", DEFAULT_DEADLINE_MS)
        self.max_field_bytes = get_int("MAX_FIELD_BYTES", DEFAULT_MAX_FIELD_BYTES)
        self.spool_max_bytes = get_int("SPOOL_MAX_BYTES", DEFAULT_SPOOL_MAX_BYTES)
        # AEP_BRIDGE_REDACT_NAMES: the values of these variables (Hermes's environment, which the
        # hook inherits, over the settings file) are replaced here, before anything leaves the host.
        names = get("REDACT_NAMES")
        self.redact_values = ()
        if names:
            values = [merged.get(n.strip()) for n in names.split(",") if n.strip()]
            self.redact_values = tuple(sorted({v for v in values if v}, key=len, reverse=True))
        # The opt-in control plane (off unless set): see "Control plane" below.
        self.control = merged.get("AEP_HERMES_CONTROL", "").strip().lower() in _ON
        self.instruct = merged.get("AEP_INSTRUCT", "").strip().lower() in _ON
        self.gate_tools = merged.get("AEP_HERMES_GATE_TOOLS") or None
        self.hold_ms = DEFAULT_HOLD_MS
        if self.control:
            self.hold_ms, warning = int_setting("AEP_HERMES_HOLD_MS", merged.get("AEP_HERMES_HOLD_MS"),
                                                DEFAULT_HOLD_MS, 1, HOLD_MS_MAX)
            if warning:
                _warn(warning)


def _warn(message):
    """One line to stderr (Hermes logs a hook's stderr at debug level). Never raises."""
    try:
        posix.write(2, ("aep-bridge hook: " + message + "\n").encode("utf-8", "replace"))
    except OSError:
        pass


# ---------------------------------------------------------------- the raw message


class Record:
    """One stamped raw message: ``id`` (also Nats-Msg-Id), ``subject``, ``body`` (bytes)."""

    __slots__ = ("id", "subject", "body", "message", "original", "extra")

    def __init__(self, id, subject, body, message=None, original=None):
        self.id = id
        self.subject = subject
        self.body = body
        self.message = message  # the dict behind body (None for records read back from the spool)
        self.original = original  # the untrimmed envelope, kept to re-fit under a smaller max_payload
        self.extra = b""  # more header lines (the control plane's, only when it is switched on)


def _canon_size_over(s, limit):
    """Canonical JSON bytes of string ``s`` when over ``limit``, else None (cheap for short strings)."""
    if 6 * len(s) + 2 <= limit:  # a character is at most 6 bytes of canonical JSON
        return None
    data = canonical(s)
    return data if len(data) > limit else None


def _shrink(value, limit, path, stubbed):
    """``value`` with every string over ``limit`` replaced by its stub (new containers only if changed)."""
    def fn(s):
        data = _canon_size_over(s, limit)
        return s if data is None else stub(s, data)

    return _walk_strings(value, fn, path, stubbed)


WHOLE_EXTRA = frozenset(f[1] for f in WHOLE_FIELDS if f[0] == "extra")


def _whole(value, limit, path, stubbed):
    """A digest-bearing field: stubbed whole when its canonical JSON is over ``limit``."""
    if value is None or value is True or value is False or type(value) in (int, float):
        return value
    data = canonical(value)
    if len(data) <= limit:
        return value
    stubbed.append(path)
    return stub(value, data)


def trim_envelope(env, limit, input_bytes=None):
    """Edge-trim a Hermes envelope (a dict): drop the DROP_EXTRA keys, stub the WHOLE_FIELDS
    and any other string over ``limit``. Returns (envelope, dropped paths, stubbed paths);
    ``env`` itself is never modified (only copied containers are)."""
    dropped = []
    stubbed = []
    out = dict(env)
    extra = out.get("extra")
    if isinstance(extra, dict):
        extra = out["extra"] = dict(extra)
        for k in DROP_EXTRA:
            if k in extra:
                del extra[k]
                dropped.append("extra." + k)
    else:
        extra = None
    # Fast path: the canonical JSON of any part is at most ~6x its input bytes (escapes,
    # float spelling), so a small input has nothing to stub.
    if input_bytes is not None and 6 * input_bytes + 2 <= limit:
        return out, dropped, stubbed
    for key, value in out.items():  # assigning existing keys while iterating is allowed
        if key == "tool_input":
            out[key] = _whole(value, limit, key, stubbed)
        elif key == "extra" and extra is not None:
            for k, v in extra.items():
                path = "extra." + k
                extra[k] = _whole(v, limit, path, stubbed) if k in WHOLE_EXTRA else _shrink(v, limit, path, stubbed)
        else:
            out[key] = _shrink(value, limit, key, stubbed)
    return out, dropped, stubbed


def _invalid_message(rid, instance, ts, code, detail, data, limit):
    try:
        text = data.decode("utf-8")
        encoding = "utf-8"
    except UnicodeDecodeError:
        import binascii

        text = binascii.b2a_base64(data, newline=False).decode("ascii")
        encoding = "base64"
    msg = {
        "v": 1, "id": rid, "instance": instance, "ts": ts, "hook": INVALID_HOOK,
        "error": code + ": " + detail, "raw": text, "raw_encoding": encoding, "raw_bytes": len(data),
    }
    big = _canon_size_over(text, limit)
    if big is not None:
        msg["raw"] = stub(text, big)
        msg["edge"] = {"stubbed": ["raw"]}
    return msg


def build_record(data, cfg, now_ns=None, rand=None, stdin_error=None):
    """Stamp and trim one stdin payload (bytes) into a Record. Never raises on any input.
    ``stdin_error`` ("<code>: <detail>"): the input is incomplete; published as ``_invalid``."""
    if now_ns is None:
        now_ns = time.time_ns()
    rid = ulid(now_ns // 1_000_000, rand)
    instance = cfg.instance
    limit = cfg.max_field_bytes
    secrets = cfg.redact_values
    env = None
    code = detail = None
    if stdin_error is not None:
        code, _, detail = stdin_error.partition(": ")
    elif not data.strip(b" \t\n\r"):
        code, detail = "empty", "no input on stdin" if not data else "only whitespace on stdin"
    else:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            code, detail = "not_utf8", "invalid UTF-8 at byte %d" % exc.start
        else:
            if text[:1] == "\ufeff":
                text = text[1:]
            try:
                env = loads(text)
            except RecursionError:
                code, detail = "not_json", "nested too deeply"
            except StopIteration as exc:
                code, detail = "not_json", "expecting a value at offset %s" % (exc.value,)
            except Exception as exc:  # JSONDecodeError, ValueError (e.g. int digit limit)
                code, detail = "not_json", str(exc)[:200]
            else:
                if not isinstance(env, dict):
                    code, detail = "not_object", "the input is a JSON %s" % _json_type(env)
                    env = None
    if env is None:
        return _invalid_record(rid, instance, now_ns, code, detail, data, limit, secrets)
    hook = env.get("hook_event_name")
    if not isinstance(hook, str) or not hook:
        hook = UNKNOWN_HOOK
    try:
        note = None
        if secrets:
            env, paths = _redacted(env, secrets)
            if paths:
                note = {"redacted": paths}
                if isinstance(env.get("hook_event_name"), str):
                    hook = env["hook_event_name"] or UNKNOWN_HOOK
        msg = _envelope_message(rid, instance, now_ns, hook, env, limit, len(data), note)
        try:
            body = encode(msg)
        except ValueError:  # NaN/Infinity (Python's json.dumps writes them): null, and say where
            env, paths = _finite(env)
            note = dict(note or {})
            note["nonfinite"] = paths
            msg = _envelope_message(rid, instance, now_ns, hook, env, limit, len(data), note)
            body = encode(msg)
    except RecursionError:  # deeper than our walk can go: publish it as text, nothing lost
        return _invalid_record(rid, instance, now_ns, "not_json", "nested too deeply", data, limit, secrets)
    return Record(rid, raw_subject(instance, hook), body, msg, env)


def _invalid_record(rid, instance, now_ns, code, detail, data, limit, secrets):
    redacted = False
    for value in secrets:
        b = value.encode("utf-8", "surrogateescape")
        if b in data:
            data = data.replace(b, SECRET_MARK.encode("ascii"))
            redacted = True
    msg = _invalid_message(rid, instance, now_ns, code, detail, data, limit)
    if redacted:
        msg.setdefault("edge", {})["redacted"] = ["raw"]
    return Record(rid, raw_subject(instance, INVALID_HOOK), encode(msg), msg)


def _walk_strings(value, fn, path, paths):
    """``value`` with ``fn`` applied to every string value (new containers only where changed);
    the paths of changed strings are appended to ``paths``."""
    if isinstance(value, str):
        new = fn(value)
        if new is not value:
            paths.append(path)
        return new
    if isinstance(value, dict):
        out = None
        for k, v in value.items():
            nv = _walk_strings(v, fn, path + "." + k if path else k, paths)
            if nv is not v:
                if out is None:
                    out = dict(value)
                out[k] = nv
        return value if out is None else out
    if isinstance(value, list):
        out = None
        for i, v in enumerate(value):
            nv = _walk_strings(v, fn, path + "." + str(i) if path else str(i), paths)
            if nv is not v:
                if out is None:
                    out = list(value)
                out[i] = nv
        return value if out is None else out
    return value


def _redacted(env, secrets):
    """The envelope with every operator-listed secret value replaced by SECRET_MARK in its strings."""
    def fn(s):
        out = s
        for value in secrets:
            if value in out:
                out = out.replace(value, SECRET_MARK)
        return out

    paths = []
    return _walk_strings(env, fn, "", paths), paths


def _finite(value, path="", paths=None):
    """``value`` with NaN/Infinity floats replaced by None; returns (value, their paths)."""
    top = paths is None
    if top:
        paths = []
    if type(value) is float:
        if value != value or value in (_INF, -_INF):
            paths.append(path)
            value = None
    elif isinstance(value, dict):
        value = {k: _finite(v, path + "." + k if path else k, paths)[0] for k, v in value.items()}
    elif isinstance(value, list):
        value = [_finite(v, path + "." + str(i) if path else str(i), paths)[0] for i, v in enumerate(value)]
    return value, paths


_INF = float("inf")


def _json_type(v):
    if isinstance(v, list):
        return "array"
    if isinstance(v, str):
        return "string"
    if isinstance(v, bool) or v is None:
        return "literal"
    return "number"


def _envelope_message(rid, instance, ts, hook, env, limit, input_bytes=None, note=None):
    """The raw message; ``note``: more ``edge`` entries (redacted, nonfinite, spool_dropped)."""
    trimmed, dropped, stubbed = trim_envelope(env, limit, input_bytes)
    msg = {"v": 1, "id": rid, "instance": instance, "ts": ts, "hook": hook, "envelope": trimmed}
    if dropped or stubbed or note:
        edge = {}
        if dropped:
            edge["dropped"] = dropped
        if stubbed:
            edge["stubbed"] = stubbed
        if note:
            edge.update(note)
        msg["edge"] = edge
    return msg


def _edge_note(msg):
    """The ``edge`` entries of ``msg`` that trimming does not recompute."""
    edge = msg.get("edge")
    if not isinstance(edge, dict):
        return None
    return {k: v for k, v in edge.items() if k not in ("dropped", "stubbed")} or None


def _headers(rid, extra=b""):
    return b"NATS/1.0\r\nNats-Msg-Id: " + rid.encode("ascii", "replace") + b"\r\n" + extra + b"\r\n"


def fit(record, max_payload, limit):
    """Make ``record`` (headers + body) fit in ``max_payload``: re-trim the original envelope
    with a halving field limit, then stub ``extra``, then the whole envelope. Returns the record."""
    room = max_payload - len(_headers(record.id, record.extra))
    if len(record.body) <= room:
        return record
    msg = record.message
    if msg is None:  # read back from the spool
        try:
            msg = _finite(loads(record.body.decode("utf-8")))[0]  # an older shim may have spooled NaN
        except Exception:
            msg = None
        if not isinstance(msg, dict):
            return record  # cannot shrink what we cannot read; the server will reject it
    original = record.original if record.original is not None else msg.get("envelope")
    if msg.get("hook") == INVALID_HOOK or not isinstance(original, dict):
        raw = msg.get("raw")
        if isinstance(raw, str):
            msg = dict(msg)
            msg["raw"] = stub(raw)
            msg["edge"] = {**(_edge_note(msg) or {}), "stubbed": ["raw"]}
        record.body, record.message = encode(msg), msg
        return record
    head = (msg["id"], msg["instance"], msg["ts"], msg["hook"])
    note = _edge_note(msg)
    lim = min(limit, room) // 2
    if len(record.body) > max(8 * room, 4 * DEFAULT_MAX_PAYLOAD):
        lim = 0  # megabytes of small fields: each halving pass costs a walk of it all, in vain
    while lim >= MIN_FIT_LIMIT:
        new = _envelope_message(*head, original, lim, None, note)
        body = encode(new)
        if len(body) <= room:
            record.body, record.message = body, new
            return record
        lim //= 2
    # Too many small fields: keep the routing keys, stub the rest.
    new = _envelope_message(*head, original, MIN_FIT_LIMIT, None, note)
    env = new["envelope"]
    small = {k: env[k] for k in ("hook_event_name", "tool_name", "session_id", "cwd") if k in env}
    stubbed = new.setdefault("edge", {}).setdefault("stubbed", [])
    for key in ("tool_input", "extra"):
        if key in env:
            small[key] = stub(original.get(key))
            stubbed.append(key)
    new["envelope"] = small
    body = encode(new)
    if len(body) > room:
        new["envelope"] = stub(original)
        new["edge"]["stubbed"] = ["envelope"]
        body = encode(new)
    record.body, record.message = body, new
    return record


# ---------------------------------------------------------------- NATS text protocol


class NatsError(Exception):
    """A server could not be used (connect, TLS, auth, protocol); the message says why."""


def _unquote(s):
    """Percent-decoding of URL user info (urllib.parse costs 5 ms to import)."""
    if "%" not in s:
        return s
    b = s.encode("utf-8")
    out = bytearray()
    i = 0
    while i < len(b):
        if b[i] == 37 and i + 2 < len(b):  # "%XX"
            try:
                out.append(int(b[i + 1 : i + 3], 16))
                i += 3
                continue
            except ValueError:
                pass
        out.append(b[i])
        i += 1
    return out.decode("utf-8", "replace")


URL_MASK = "*****"  # what `aep-bridge config` shows for a secret (bridge.config.MASK)


def masked_url(server):
    """A server URL as printed in an error: a password (``user:*****@``) or a token
    (``*****@``) masked, as `aep-bridge config` shows it. Hermes logs a hook's stderr, so no
    message may carry the credential. Only on error paths: the hot path never calls it."""
    scheme, sep, rest = server.partition("://")
    if not sep:
        scheme, rest = "", server
    slash = rest.find("/")
    at = (rest if slash < 0 else rest[:slash]).rfind("@")
    if at < 0:
        return server
    info = rest[:at]
    shown = info.split(":", 1)[0] + ":" + URL_MASK if ":" in info else URL_MASK
    return scheme + sep + shown + rest[at:]


def parse_server_url(url):
    """``[scheme://][user[:pass]@]host[:port]`` -> (scheme, host, port, user, password, token).
    A user without a password is a token (``nats://token@host``)."""
    scheme = "nats"
    rest = url.strip()
    if "://" in rest:
        scheme, rest = rest.split("://", 1)
        scheme = scheme.lower()
    rest = rest.split("/", 1)[0]
    user = password = tok = None
    if "@" in rest:
        info, rest = rest.rsplit("@", 1)
        if ":" in info:
            user, password = info.split(":", 1)
            user, password = _unquote(user), _unquote(password)
        else:
            tok = _unquote(info)
    port = 4222
    if rest.startswith("["):  # [ipv6]:port
        host, _, tail = rest[1:].partition("]")
        if tail.startswith(":") and tail[1:]:
            port = int(tail[1:])
    elif rest.count(":") == 1:
        host, p = rest.split(":")
        if p:
            port = int(p)
    else:
        host = rest
    if not 0 < port < 65536:
        raise ValueError("%s: port %d out of range" % (url.strip()[:100], port))
    return scheme, host or "127.0.0.1", port, user, password, tok


class NatsConnection:
    """A minimal NATS client: one connection, JetStream publishes with acks, nothing else."""

    def __init__(self, sock, info, server, instance=""):
        self.sock = sock
        self.info = info
        self.server = server
        self.max_payload = int(info.get("max_payload") or DEFAULT_MAX_PAYLOAD)
        self.buf = b""
        self.inbox = shim_inbox_prefix(instance) + "." + posix.urandom(11).hex()
        self.error = None  # why the last publish() came back short
        self.pending = b""  # CONNECT + SUB, sent with the first publish (one write, one round trip)
        self.next = 0
        # Messages on our inbox that are not PubAcks (the gate's ping or release on <inbox>.g can
        # overtake the PubAck of the held call itself), kept for `next_msg` instead of dropped.
        self.early = []
        self.place = 0  # where its server was in this run's server_order (0: the first tried)
        # Until the server has answered a publish once (``answered``), no wait for an ack goes
        # past ``ack_by`` (monotonic; None: the caller's deadline): a server that sends INFO but
        # never acks (cut off from the stream's leader) costs its share, not the whole deadline.
        self.ack_by = None
        self.answered = False
        self.refused = None  # what the last publish's first transient answer said (503 no responders, ...)

    @classmethod
    def connect(cls, server, cfg, deadline, answer_by=None):
        """Connect and read INFO. ``answer_by`` (monotonic, before ``deadline``): the TCP
        connect and the INFO line must come by then (a server that is not the last to try
        gets a share of the deadline: see ``connect_candidates``)."""
        scheme, host, port, user, password, tok = parse_server_url(server)
        if cfg.user or cfg.password:
            user, password, tok = cfg.user, cfg.password, None
        if cfg.token:
            tok, user, password = cfg.token, None, None
        tls = scheme == "tls" or bool(cfg.tls_ca)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise NatsError("deadline passed before connecting to %s" % masked_url(server))
        answer = deadline if answer_by is None or answer_by > deadline else answer_by
        started = time.monotonic()
        sock = None
        err = None
        # A str host makes getaddrinfo encode it with the "idna" codec, whose import pulls in
        # re (+8.4 ms measured); ASCII bytes skip the codec.
        try:
            hostb = host.encode("ascii")
        except UnicodeEncodeError:
            hostb = host.encode("idna")
        for af, st, proto, _, sa in _socket.getaddrinfo(hostb, port, 0, _socket.SOCK_STREAM):
            sock = _socket.socket(af, st, proto)
            try:
                sock.settimeout(max(answer - time.monotonic(), 0.001))
                sock.connect(sa)
                break
            except OSError as exc:
                err = exc
                sock.close()
                sock = None
        if sock is None:
            raise NatsError("cannot connect to %s: %s" % (masked_url(server), err))
        try:
            try:
                sock.setsockopt(_socket.IPPROTO_TCP, _socket.TCP_NODELAY, 1)
            except OSError:
                pass
            conn = cls(sock, {}, server, cfg.instance)
            try:
                line = conn._read_line(answer)
            except TimeoutError:
                raise NatsError("%s sent no INFO within %d ms" % (masked_url(server), (answer - started) * 1000)) from None
            if not line.startswith(b"INFO "):
                raise NatsError("%s: expected INFO, got %r" % (masked_url(server), line[:80]))
            info = loads(line[5:].decode("utf-8"))
            conn.info = info
            conn.max_payload = int(info.get("max_payload") or DEFAULT_MAX_PAYLOAD)
            if info.get("tls_required") and not tls:
                tls = True
            if tls:
                conn.sock = _wrap_tls(sock, host, cfg, answer)
            if info.get("headers") is False:
                raise NatsError("%s does not support headers (needs nats-server >= 2.2)" % masked_url(server))
            opts = {
                "verbose": False, "pedantic": False, "tls_required": tls, "name": "aep-bridge-hook",
                "lang": "python-stdlib", "version": VERSION, "protocol": 1, "headers": True,
                "no_responders": True,
            }
            if cfg.jwt:
                opts["jwt"] = cfg.jwt
            elif user is not None:
                opts["user"] = user
                opts["pass"] = password or ""
            elif tok is not None:
                opts["auth_token"] = tok
            conn.pending = (
                b"CONNECT " + encode(opts) + b"\r\nSUB " + conn.inbox.encode() + b".* 1\r\n"
            )
            return conn
        except BaseException:
            sock.close()
            raise

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass

    def _recv(self, deadline):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("deadline")
        self.sock.settimeout(remaining)
        data = self.sock.recv(65536)
        if not data:
            raise NatsError("%s closed the connection" % masked_url(self.server))
        self.buf += data

    def _read_line(self, deadline):
        while True:
            i = self.buf.find(b"\r\n")
            if i >= 0:
                line, self.buf = self.buf[:i], self.buf[i + 2 :]
                return line
            if len(self.buf) > 1 << 20:
                raise NatsError("protocol line too long")
            self._recv(deadline)

    def _read_exact(self, n, deadline):
        while len(self.buf) < n:
            self._recv(deadline)
        data, self.buf = self.buf[:n], self.buf[n:]
        return data

    def _read_msg(self, deadline):
        """The next message from the server as (subject, reply or None, header bytes, payload),
        or None for a PONG; answers PINGs, skips +OK and INFO, raises NatsError on -ERR. The one
        parser of MSG and HMSG (publish, next_msg, read_pong)."""
        while True:
            line = self._read_line(deadline)
            if line.startswith(b"MSG ") or line.startswith(b"HMSG "):
                parts = line.split()  # [H]MSG <subject> <sid> [reply] [<header bytes>] <total bytes>
                n = int(parts[-1])
                if line[0:1] == b"H":
                    hlen, reply = int(parts[-2]), (parts[3] if len(parts) == 6 else None)
                else:
                    hlen, reply = 0, (parts[3] if len(parts) == 5 else None)
                data = self._read_exact(n + 2, deadline)[:n]
                return parts[1], reply, data[:hlen], data[hlen:]
            if line == b"PING":
                self.sock.sendall(b"PONG\r\n")
            elif line == b"PONG":
                return None
            elif line.startswith(b"-ERR"):
                raise NatsError("%s: %s" % (masked_url(self.server), line[5:].decode("utf-8", "replace").strip(" '")))

    def send(self, data, deadline, least=0.001):
        """Write ``data``, allowing until ``deadline`` (at least ``least`` seconds). OSError when it cannot."""
        self.sock.settimeout(max(deadline - time.monotonic(), least))
        self.sock.sendall(data)

    def next_msg(self, deadline):
        """The next message on our inbox (first those a publish read before its acks) as (subject,
        reply, header bytes, payload); None at the deadline or when the connection fails."""
        if self.early:
            return self.early.pop(0)
        try:
            while True:
                m = self._read_msg(deadline)
                if m is not None:
                    return m
        except (OSError, NatsError, ValueError):  # TimeoutError is an OSError
            return None

    def read_pong(self, deadline):
        """Wait until ``deadline`` for the PONG that answers a PING we sent: the server then has
        everything written before it. Messages read meanwhile are dropped. False when the
        connection failed or the deadline passed first."""
        try:
            while self._read_msg(deadline) is not None:
                pass
            return True
        except (OSError, NatsError, ValueError):
            return False

    def publish(self, records, deadline):
        """Publish ``records`` pipelined, each with its own reply subject, and collect the acks.

        Returns one outcome per record, in order, up to the first one without a definite
        answer: ``True`` (stored or duplicate) or a string (a permanent JetStream rejection,
        e.g. ``"400 10054 message size exceeds maximum allowed"``). A shorter list means
        the rest got no answer before the deadline or a transient error (503, -ERR, closed).
        """
        out = bytearray(self.pending)
        self.pending = b""
        base = self.next
        for i, r in enumerate(records):
            hdr = _headers(r.id, r.extra)
            out += b"HPUB %s %s.%d %d %d\r\n" % (
                r.subject.encode("utf-8"), self.inbox.encode(), base + i, len(hdr), len(hdr) + len(r.body)
            )
            out += hdr
            out += r.body
            out += b"\r\n"
        self.next += len(records)
        self.error = None
        self.refused = None
        results = {}
        share = self.ack_by if self.ack_by is not None and self.ack_by < deadline else None
        try:
            self.send(out, deadline if share is None or self.answered else share)
            want = len(records)
            while len(results) < want:
                m = self._read_msg(deadline if share is None or self.answered else share)
                if m is None:  # a PONG
                    continue
                try:
                    idx = int(m[0].rsplit(b".", 1)[1]) - base
                except (IndexError, ValueError):  # not a PubAck: the gate's ping or release, for next_msg
                    if len(self.early) < 16:
                        self.early.append(m)
                    continue
                if 0 <= idx < want:  # a late answer to an earlier call is not ours
                    o = results[idx] = _ack_outcome(m[2], m[3])
                    if o is not False:
                        self.answered = True
                    elif self.refused is None:
                        self.refused = _refusal(m[2], m[3])
        except TimeoutError as exc:
            if share is not None and not self.answered:
                exc = NatsError("%s: no ack within its share of the deadline" % self.server)
            self.error = exc
        except (OSError, NatsError, ValueError) as exc:
            self.error = exc
        ordered = []
        for i in range(len(records)):
            o = results.get(i)
            if o is None or o is False:
                if o is False and self.error is None:
                    # Answered, but not stored (503 no responders, JetStream unavailable): this
                    # server cannot take it now. An error, so that every caller goes on to the
                    # next server: a spool replay read a short answer without one as "its share
                    # spent" and spooled behind a node cut off from its peers (issue 42).
                    self.error = NatsError("%s: publish not stored (%s)" % (masked_url(self.server), self.refused or "no ack"))
                break
            ordered.append(o)
        return ordered


def _refusal(headers, payload):
    """What a transient answer said, short (for the error that sends a caller to the next server)."""
    if headers:
        line = headers.split(b"\r\n", 1)[0].split(None, 1)
        if len(line) == 2:
            return line[1].decode("utf-8", "replace")[:60]
    return payload[:120].decode("utf-8", "replace")


def _ack_outcome(headers, payload):
    """True = stored (or a duplicate); str = permanent rejection; False = transient/no answer."""
    if headers:
        status = headers.split(b"\r\n", 1)[0].split()
        if len(status) >= 2 and status[1] != b"200":
            return False  # 503 no responders: no stream yet (bootstrap not run) or it is down
    if b'"error"' not in payload:
        return b'"seq"' in payload
    try:
        err = loads(payload.decode("utf-8")).get("error") or {}
        code = int(err.get("code") or 500)
        text = "%s %s %s" % (code, err.get("err_code", ""), err.get("description", ""))
    except Exception:
        return False
    if err.get("err_code") == MSG_ID_IN_PROCESS:  # its first publish's fate is open: ask again later
        return False
    return text if 400 <= code < 500 else False


#: JetStream's 409 "duplicate message id is in process": a publish with this Nats-Msg-Id is
#: being proposed and not yet stored. Not a rejection: that proposal can be lost with its
#: leader (a partition healing), and a record set aside for it was lost (tests/cluster/
#: test_partitions.py, 19 events of one instance, 2026-12-07). Transient: spooled, replayed.
MSG_ID_IN_PROCESS = 10158


def _wrap_tls(sock, host, cfg, deadline):
    """Upgrade to TLS after INFO (NATS protocol). Imports ssl: ~23 ms, the price of TLS."""
    import socket
    import ssl

    ctx = ssl.create_default_context(cafile=cfg.tls_ca) if cfg.tls_ca else ssl.create_default_context()
    if cfg.tls_cert:
        ctx.load_cert_chain(cfg.tls_cert, cfg.tls_key)
    pysock = socket.socket(sock.family, sock.type, sock.proto, fileno=sock.detach())
    pysock.settimeout(max(deadline - time.monotonic(), 0.001))
    try:
        return ctx.wrap_socket(pysock, server_hostname=host)
    except (ssl.SSLError, OSError) as exc:
        pysock.close()
        raise NatsError("TLS handshake with %s failed: %s" % (host, exc)) from None


def _bare_server(server):
    """A server URL without its user info (what ``<token>.server`` keeps: no credentials)."""
    s = server.strip()
    head, sep, rest = s.partition("://")
    if not sep:
        head, rest = "", s
    rest = rest.rsplit("@", 1)[-1]
    return head + sep + rest


def _server_memo_path(cfg):
    return cfg.spool_dir.rstrip("/") + "/" + token(cfg.instance) + ".server"


def server_order(cfg):
    """The servers in the order this run tries them. One server: the list as is (no file
    read). Several: the list rotated to start at a place given by a hash of the instance
    name (instances spread over the servers; stable across processes, unlike ``hash``),
    rotated again to start at the server that acked last (``<spool dir>/<instance
    token>.server``) when it is in the list."""
    servers = cfg.servers
    n = len(servers)
    if n < 2:
        return servers
    h = 0
    for b in cfg.instance.encode("utf-8", "replace"):
        h = (h * 31 + b) & 0xFFFFFFFF
    start = h % n
    order = servers[start:] + servers[:start]
    try:
        fd = _open_own(_server_memo_path(cfg), posix.O_RDONLY)
    except OSError:
        return order
    try:
        last = posix.pread(fd, 1024, 0).decode("utf-8", "replace").strip()
    except OSError:
        last = ""
    finally:
        posix.close(fd)
    if last and _bare_server(order[0]) != last:
        for i in range(1, n):
            if _bare_server(order[i]) == last:  # go on round the list from there
                return order[i:] + order[:i]
    return order


def remember_server(cfg, server):
    """Keep ``server`` (without credentials) as the one to try first next time. Best effort:
    a spool directory that cannot be written just means no memory."""
    data = (_bare_server(server) + "\n").encode("utf-8", "replace")
    try:
        _makedirs(cfg.spool_dir)
        fd = _open_own(_server_memo_path(cfg), posix.O_WRONLY | posix.O_CREAT)
        try:
            posix.pwrite(fd, data, 0)
            posix.ftruncate(fd, len(data))
        finally:
            posix.close(fd)
    except OSError:
        pass


def left_unacked(cfg, order):
    """Every server tried in this run failed (none acked in its share): the first one is
    remembered as bad (the next run starts at the server after it, not at it again)."""
    if len(order) > 1:
        remember_server(cfg, order[1])


def connect_candidates(cfg, deadline, errors, order=None):
    """Yield a connection to each server of ``order`` (default ``server_order``) that answers,
    in order, until the caller stops (``conn.place``: where its server was in that order).
    Every server but the last to try has an equal share of the time left to ack: TCP connect,
    INFO and the first publish ack must all come within it (``conn.ack_by``). A black-holed
    server (it accepts, never answers), one whose packets are dropped, or one that sends INFO
    but never acks (cut off from the stream's leader) costs that share, not the whole
    deadline; the caller then goes on to the next."""
    if order is None:
        order = server_order(cfg)
    n = len(order)
    for i, server in enumerate(order):
        now = time.monotonic()
        if now >= deadline:
            errors.append("deadline passed")
            return
        answer_by = None if i == n - 1 else now + (deadline - now) / (n - i)
        try:
            conn = NatsConnection.connect(server, cfg, deadline, answer_by)
        except (OSError, NatsError, ValueError) as exc:
            errors.append(str(exc) or exc.__class__.__name__)
            continue
        conn.place = i
        conn.ack_by = answer_by
        yield conn


def connect_any(cfg, deadline, errors):
    """The first server (in ``server_order``) that answers before ``deadline``, or None. Its
    acks may take until the caller's deadline (no next server to go to: ``ack_by`` unset)."""
    for conn in connect_candidates(cfg, deadline, errors):
        conn.ack_by = None
        return conn
    return None


def acked(cfg, conn):
    """``conn``'s server acked: when it was not the first tried, remember it for next time."""
    if conn.place:
        remember_server(cfg, conn.server)


def publish_one(cfg, record, deadline, errors):
    """Connect (servers in ``server_order``) and publish one record, going on to the next
    server when one does not ack in its share. True when acked; a str when rejected for good;
    False otherwise (then ``errors`` says why)."""
    order = server_order(cfg)
    for conn in connect_candidates(cfg, deadline, errors, order):
        try:
            fit(record, conn.max_payload, cfg.max_field_bytes)
            got = conn.publish([record], deadline)
            if got:
                acked(cfg, conn)
                return got[0]
            errors.append(str(conn.error or "no ack from %s before the deadline" % masked_url(conn.server)))
        finally:
            conn.close()
    left_unacked(cfg, order)
    return False


# ---------------------------------------------------------------- the spool

_fcntl = None
# nats-server's words for a refused credential or subject ("Authorization Violation": revoked,
# expired at connect, unknown; "Permissions Violation for Publish to ...": another instance's
# subject; "User Authentication Expired/Revoked": a live connection dropped).
_REFUSALS = ("Authorization Violation", "Permissions Violation", "User Authentication")
REFUSED_MAX_BYTES = 65536


def _flock(fd, deadline=None, blocking=True):
    """flock(LOCK_EX) on fd. Non-blocking attempt when ``blocking`` is False; polled until
    ``deadline`` (monotonic) when given. True when held."""
    global _fcntl
    if _fcntl is None:
        import fcntl as _fcntl  # 0.35 ms, only when the spool is touched
    if not blocking or deadline is not None:
        while True:
            try:
                _fcntl.flock(fd, _fcntl.LOCK_EX | _fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if not blocking or time.monotonic() >= deadline:
                    return False
                time.sleep(0.0005)
    _fcntl.flock(fd, _fcntl.LOCK_EX)
    return True


def _crc32(data):
    from zlib import crc32  # 0.5 ms, only when the spool is touched

    return crc32(data)


def frame(record):
    """One spool line: ``<crc32 hex8> <id> <subject> <body>\\n`` (crc over what follows it)."""
    rest = record.id.encode("ascii", "replace") + b" " + record.subject.encode("utf-8") + b" " + record.body
    return b"%08x %s\n" % (_crc32(rest), rest)


def unframe(line):
    """A Record from a spool line (without its newline), or None when it fails its checks."""
    if len(line) < 10 or line[8:9] != b" ":
        return None
    rest = line[9:]
    try:
        if int(line[:8], 16) != _crc32(rest):
            return None
        rid, subject, body = rest.split(b" ", 2)
        return Record(rid.decode("ascii"), subject.decode("utf-8"), body)
    except (ValueError, UnicodeDecodeError):
        return None


def _makedirs(path):
    parts = path.rstrip("/").split("/")
    for i in range(2, len(parts) + 1):
        p = "/".join(parts[:i])
        if not p:
            continue
        try:
            posix.mkdir(p, 0o700)
        except FileExistsError:
            pass


_O_NOFOLLOW = getattr(posix, "O_NOFOLLOW", 0)
_S_IFMT, _S_IFREG, _S_IFDIR, _S_IFLNK = 0o170000, 0o100000, 0o040000, 0o120000


def _why_not_ours(st, path):
    """None when ``st`` (an lstat/fstat) is a regular file of ours, else why it is not."""
    kind = st.st_mode & _S_IFMT
    if kind == _S_IFLNK:
        return "spool file %s is a symlink" % path
    if kind != _S_IFREG:
        return "spool file %s is not a regular file" % path
    if st.st_uid != posix.geteuid():
        return "spool file %s is not owned by uid %d" % (path, posix.geteuid())
    return None


def _open_own(path, flags):
    """Open a spool file: never through a symlink (O_NOFOLLOW), never a FIFO or device
    (O_NONBLOCK, then fstat), only a file this uid owns. OSError otherwise."""
    try:
        fd = posix.open(path, flags | _O_NOFOLLOW | posix.O_NONBLOCK | _O_CLOEXEC, 0o600)
    except OSError:
        try:
            st = posix.lstat(path)
        except OSError:
            raise
        why = _why_not_ours(st, path)
        if why is not None:
            raise OSError(why + "; not used") from None
        raise
    try:
        why = _why_not_ours(posix.fstat(fd), path)
    except OSError:
        posix.close(fd)
        raise
    if why is not None:
        posix.close(fd)
        raise OSError(why + "; not used")
    return fd


def _private_dir(path):
    """Create ``path`` (0700) when missing and make sure it is a real directory of this uid that
    nobody else may write: the fallback spool lives under the shared temporary directory."""
    _makedirs(path)
    st = posix.lstat(path)
    if st.st_mode & _S_IFMT != _S_IFDIR or st.st_uid != posix.geteuid() or st.st_mode & 0o077:
        raise OSError("fallback spool dir %s is not a private directory of uid %d" % (path, posix.geteuid()))


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        n = posix.write(fd, view)
        view = view[n:]


def _pread_all(fd, n, offset):
    chunks = []
    while n > 0:
        b = posix.pread(fd, min(n, 1 << 22), offset)
        if not b:
            break
        chunks.append(b)
        n -= len(b)
        offset += len(b)
    return b"".join(chunks)


def fallback_spool_dir(environ):
    """Where the spool goes when spool_dir cannot be written: a private per-uid directory
    under ``$TMPDIR`` (default /tmp)."""
    tmp = (environ.get("TMPDIR") or "/tmp").rstrip("/") or "/tmp"
    return tmp + "/aep-bridge-%d" % posix.geteuid()


def spool_for(cfg, instance=None):
    """The spool of ``instance`` (default: the configured one) with its fallback
    (AEP_BRIDGE_SPOOL_DIR, then the private temp dir)."""
    return Spool(cfg.spool_dir, cfg.instance if instance is None else instance, cfg.spool_max_bytes, cfg.fallback_dir)


class Spool:
    """The per-instance spool: ``<dir>/<instance token>.spool`` and its side files; with
    ``fallback`` (a directory), a second spool used when this one cannot be written. Records
    go to the fallback while it holds any (order), and replay drains this one first."""

    def __init__(self, directory, instance, max_bytes=DEFAULT_SPOOL_MAX_BYTES, fallback=None, private=False):
        self.dir = directory.rstrip("/") or "/"
        self.name = token(instance)
        self.max_bytes = max_bytes
        self.path = self.dir + "/" + self.name + ".spool"
        self.pos_path = self.dir + "/" + self.name + ".pos"
        self.dropped_path = self.dir + "/" + self.name + ".dropped"
        self.reported_path = self.dir + "/" + self.name + ".reported"
        self.private = private
        fb = fallback.rstrip("/") if fallback else None
        self.fallback = Spool(fb, instance, max_bytes, private=True) if fb and fb != self.dir else None
        self._warned = False

    # -- cheap probes

    def size(self):
        """Bytes in the spool file (0 when missing, or a symlink or anything else not our own file)."""
        try:
            st = posix.lstat(self.path)
        except OSError:
            return 0
        if st.st_mode & _S_IFMT == _S_IFREG and st.st_uid == posix.geteuid():
            return st.st_size
        if not self._warned:
            self._warned = True
            _warn(_why_not_ours(st, self.path) + "; not used")
        return 0

    def pending(self):
        """Bytes in this spool and its fallback (two lstat calls)."""
        return self.size() + (self.fallback.size() if self.fallback is not None else 0)

    def _read_pos(self, fd=None):
        try:
            if fd is None:
                fd2 = _open_own(self.pos_path, posix.O_RDONLY)
                try:
                    data = posix.pread(fd2, 64, 0)
                finally:
                    posix.close(fd2)
            else:
                data = posix.pread(fd, 64, 0)
            return int(data.split(b"\n", 1)[0] or b"0")
        except (OSError, ValueError):
            return 0

    def _write_pos(self, fd, pos):
        posix.pwrite(fd, b"%020d\n" % pos, 0)

    # -- append

    def append(self, records, deadline=None):
        """Append records (one locked write): to the fallback while it holds records (order),
        else here, else to the fallback. Returns the number dropped over the cap.
        Raises OSError when no spool can be written."""
        fb = self.fallback
        if fb is not None and fb.size():
            try:
                return fb._append(records, deadline)
            except OSError as exc:
                _warn("fallback spool %s: %s" % (fb.path, exc))
        try:
            return self._append(records, deadline)
        except OSError as exc:
            if fb is None:
                raise
            _warn("spool %s unusable (%s); using the fallback spool %s" % (self.path, exc, fb.path))
            return fb._append(records, deadline)

    def keep(self, records, deadline, max_field_bytes=DEFAULT_MAX_FIELD_BYTES):
        """What the hook does with records no server acked: each is fitted to the default
        max_payload first (nothing is spooled that cannot be published), then they are appended
        behind what is pending, waiting for the lock until SPOOL_LOCK_GRACE_S past ``deadline``.
        Returns how many were dropped over the cap (the last ones). When no spool can be
        written they are counted as dropped and the OSError is raised: they are lost."""
        for r in records:
            try:
                fit(r, DEFAULT_MAX_PAYLOAD, max_field_bytes)
            except (ValueError, RecursionError):
                pass
        try:
            return self.append(records, max(deadline, time.monotonic()) + SPOOL_LOCK_GRACE_S)
        except OSError:
            try:
                self._count_dropped(len(records), sum(len(r.body) for r in records))
            except OSError:
                pass
            raise

    def reject(self, record, why):
        """Set aside a record JetStream rejected for good (``why``: its 4xx answer) in
        ``<token>.rejected``: never replayed. OSError when it cannot be written."""
        self._set_aside(".rejected", b"%s %s\n" % (why.encode("utf-8", "replace"), frame(record)[:-1]))

    def _append(self, records, deadline=None):
        data = b"".join([frame(r) for r in records])
        if self.private:
            _private_dir(self.dir)
        else:
            _makedirs(self.dir)
        fd = _open_own(self.path, posix.O_RDWR | posix.O_APPEND | posix.O_CREAT)
        try:
            if not _flock(fd, deadline):
                raise OSError("spool %s stayed locked past the deadline" % self.path)
            size = posix.fstat(fd).st_size
            if size and posix.pread(fd, 1, size - 1) != b"\n":
                _write_all(fd, b"\n")  # terminate a torn last line: it will fail its CRC, not glue to ours
                size += 1
            live = size - min(self._read_pos(), size)
            keep = []
            dropped = []
            for r, line in zip(records, _split_frames(data, len(records))):
                if live + len(line) > self.max_bytes:
                    dropped.append(r)
                else:
                    keep.append(line)
                    live += len(line)
            if keep:
                _write_all(fd, b"".join(keep))
            if dropped:
                self._count_dropped(len(dropped), sum(len(r.body) for r in dropped))
                _warn(
                    "spool %s is full (AEP_BRIDGE_SPOOL_MAX_BYTES=%d): dropped %d event(s), first id %s"
                    % (self.path, self.max_bytes, len(dropped), dropped[0].id)
                )
            return len(dropped)
        finally:
            posix.close(fd)  # closing releases the lock

    def _count_dropped(self, n, nbytes):
        """Add to the drop counter (``<records> <bytes>``); the caller holds the spool lock.
        Counted in the fallback directory when this one cannot be written."""
        try:
            if self.private:
                _private_dir(self.dir)
            fd = _open_own(self.dropped_path, posix.O_RDWR | posix.O_CREAT)
        except OSError as exc:
            if self.fallback is not None:
                return self.fallback._count_dropped(n, nbytes)
            _warn("cannot count dropped events in %s: %s" % (self.dropped_path, exc))
            return
        try:
            old = posix.pread(fd, 64, 0).split()
            count = int(old[0]) if old else 0
            total = int(old[1]) if len(old) > 1 else 0
            new = b"%d %d\n" % (count + n, total + nbytes)
            posix.pwrite(fd, new, 0)
            posix.ftruncate(fd, len(new))
        except (OSError, ValueError) as exc:
            _warn("cannot count dropped events in %s: %s" % (self.dropped_path, exc))
        finally:
            posix.close(fd)

    def dropped(self):
        """(records, bytes) dropped over the cap since the counter was created."""
        try:
            fd = _open_own(self.dropped_path, posix.O_RDONLY)
        except OSError:
            return 0, 0
        try:
            parts = posix.pread(fd, 64, 0).split()
            return (int(parts[0]) if parts else 0), (int(parts[1]) if len(parts) > 1 else 0)
        except (OSError, ValueError):
            return 0, 0
        finally:
            posix.close(fd)

    # -- drops not yet reported downstream

    def claim_drops(self):
        """Drops (here and in the fallback) not yet reported in a raw message's ``edge``:
        (claims, records, bytes). Each claim holds the ``.reported`` file's lock (never waited
        for: a concurrent hook reports them instead) until ``settle_drops``. Hot path: two lstat."""
        claims = []
        records = nbytes = 0
        for sp in (self, self.fallback):
            if sp is None:
                continue
            try:
                posix.lstat(sp.dropped_path)
            except OSError:
                continue
            dropped, dropped_bytes = sp.dropped()
            try:
                fd = _open_own(sp.reported_path, posix.O_RDWR | posix.O_CREAT)
            except OSError:
                continue
            try:
                if _flock(fd, blocking=False):
                    old = posix.pread(fd, 64, 0).split()
                    seen = int(old[0]) if old else 0
                    seen_bytes = int(old[1]) if len(old) > 1 else 0
                    if dropped > seen:
                        claims.append((fd, dropped, dropped_bytes))
                        records += dropped - seen
                        nbytes += max(dropped_bytes - seen_bytes, 0)
                        fd = None
            except (OSError, ValueError):
                pass
            finally:
                if fd is not None:
                    posix.close(fd)
        return claims, records, nbytes

    @staticmethod
    def settle_drops(claims, reported):
        """Record the claimed drops as reported (when the message carrying them is published or
        spooled), then release the claims."""
        for fd, dropped, dropped_bytes in claims:
            try:
                if reported:
                    new = b"%d %d\n" % (dropped, dropped_bytes)
                    posix.pwrite(fd, new, 0)
                    posix.ftruncate(fd, len(new))
            except OSError:
                pass
            finally:
                posix.close(fd)

    # -- replay

    def replay(self, conn, deadline, max_records=None, progress=None, wait_lock=False, max_line_bytes=None):
        """Republish pending records in order through ``conn`` (this spool, then the fallback)
        until both are empty, the deadline passes or ``max_records`` were sent. A record over
        ``max_line_bytes`` (the hook's bound) stops the replay: `spool drain` takes it.
        Returns (sent, empty, busy): ``busy`` means another process holds the replay lock."""
        sent = 0
        if self.size():
            sent, empty, busy = self._replay(conn, deadline, max_records, progress, wait_lock, max_line_bytes)
            if not empty:
                return sent, empty, busy
        fb = self.fallback
        if fb is None or not fb.size():
            return sent, True, False
        more = None if max_records is None else max_records - sent
        if more is not None and more <= 0:
            return sent, False, False
        s2, empty, busy = fb._replay(conn, deadline, more, progress, wait_lock, max_line_bytes)
        return sent + s2, empty, busy

    def _replay(self, conn, deadline, max_records, progress, wait_lock, max_line_bytes):
        try:
            pfd = _open_own(self.pos_path, posix.O_RDWR | posix.O_CREAT)
        except FileNotFoundError:
            return 0, True, False
        try:
            if not _flock(pfd, blocking=wait_lock):
                return 0, False, True
            try:
                fd = _open_own(self.path, posix.O_RDWR)
            except FileNotFoundError:
                return 0, True, False
            try:
                return self._replay_locked(conn, fd, pfd, deadline, max_records, progress, max_line_bytes)
            finally:
                posix.close(fd)
        finally:
            posix.close(pfd)

    def _too_big(self, pos, n, limit):
        _warn("spool record at %s:%d is over %d bytes (%d): too big to replay within a hook's deadline; "
              "left for `aep-bridge spool drain`" % (self.path, pos, limit, n))

    def _replay_locked(self, conn, fd, pfd, deadline, max_records, progress, max_line_bytes=None):
        pos = self._read_pos(pfd)
        sent = 0
        while True:
            size = posix.fstat(fd).st_size
            if pos > size:  # the file was truncated behind a stale position
                pos = 0
            if pos == size:
                if self._truncate_if_drained(fd, pfd, pos):
                    return sent, True, False
                continue
            if time.monotonic() >= deadline or (max_records is not None and sent >= max_records):
                return sent, False, False
            chunk = _pread_all(fd, min(size - pos, REPLAY_BATCH_BYTES), pos)
            end = chunk.rfind(b"\n")
            if end < 0 and len(chunk) < size - pos:  # one line longer than the window
                if max_line_bytes is not None and len(chunk) >= max_line_bytes:
                    self._too_big(pos, size - pos, max_line_bytes)
                    return sent, False, False
                chunk = _pread_all(fd, size - pos, pos)
                end = chunk.rfind(b"\n")
            if end < 0:
                # No complete line. Either a writer is mid-append or the tail is torn: decide
                # while holding the append lock (no writer can be active then).
                pos = self._set_aside_torn_tail(fd, pfd, pos)
                continue
            lines = chunk[: end + 1].split(b"\n")[:-1]
            budget = REPLAY_BATCH if max_records is None else min(REPLAY_BATCH, max_records - sent)
            batch = []
            spans = []
            for line in lines[: max(budget, 1)]:
                if batch and time.monotonic() >= deadline:
                    break  # fitting and sending takes time too: stay inside the budget
                if max_line_bytes is not None and len(line) >= max_line_bytes:
                    if batch:
                        break
                    self._too_big(pos, len(line), max_line_bytes)
                    return sent, False, False
                r = unframe(line)
                if r is None:
                    if batch:
                        break  # publish and commit what precedes the bad line first
                    self._set_aside(".corrupt", line + b"\n")
                    pos += len(line) + 1
                    self._write_pos(pfd, pos)
                    continue
                fit(r, conn.max_payload, DEFAULT_MAX_FIELD_BYTES)
                batch.append(r)
                spans.append(len(line) + 1)
            if not batch:
                continue
            outcomes = conn.publish(batch, deadline)
            for r, outcome, span in zip(batch, outcomes, spans):
                if outcome is not True:
                    self.reject(r, outcome)
                pos += span
                sent += 1
            self._write_pos(pfd, pos)
            if progress is not None:
                progress(sent, self._pending_bytes(fd, pos))
            if len(outcomes) < len(batch):
                return sent, False, False

    def _pending_bytes(self, fd, pos):
        return max(posix.fstat(fd).st_size - pos, 0)

    def _truncate_if_drained(self, fd, pfd, pos):
        """Truncate the spool to 0 when nothing was appended behind ``pos``. True when done."""
        _flock(fd)
        try:
            if posix.fstat(fd).st_size != pos:
                return False
            posix.ftruncate(fd, 0)
            self._write_pos(pfd, 0)
            return True
        finally:
            _unlock(fd)

    def _set_aside_torn_tail(self, fd, pfd, pos):
        _flock(fd)
        try:
            size = posix.fstat(fd).st_size
            tail = _pread_all(fd, size - pos, pos)
            if b"\n" in tail:  # a writer finished meanwhile
                return pos
            path = self.dir + "/" + self.name + ".torn-%d" % time.time_ns()
            out = _open_own(path, posix.O_WRONLY | posix.O_CREAT | posix.O_EXCL)
            try:
                _write_all(out, tail)
            finally:
                posix.close(out)
            posix.ftruncate(fd, pos)
            _warn("torn spool tail (%d bytes) moved to %s" % (len(tail), path))
            return pos
        finally:
            _unlock(fd)

    def _set_aside(self, suffix, data):
        path = self.dir + "/" + self.name + suffix
        _makedirs(self.dir)
        out = _open_own(path, posix.O_WRONLY | posix.O_APPEND | posix.O_CREAT)
        try:
            _write_all(out, data)
        finally:
            posix.close(out)
        _warn("spool line set aside in %s" % path)

    def note_refused(self, reason):
        """The server refused this instance's credential (revoked, expired, another instance's
        subject): one line ``<unix s> <reason>`` appended to ``<token>.refused`` (kept under
        64 KiB), which `spool status` counts and `hermes doctor` names. The failure path only."""
        path = self.dir + "/" + self.name + ".refused"
        try:
            _makedirs(self.dir)
            fd = _open_own(path, posix.O_WRONLY | posix.O_APPEND | posix.O_CREAT)
            try:
                if posix.fstat(fd).st_size < REFUSED_MAX_BYTES:
                    _write_all(fd, ("%d %s\n" % (time.time(), reason.replace("\n", " ")[:300])).encode("utf-8", "replace"))
            finally:
                posix.close(fd)
        except OSError:
            pass

    def refused(self):
        """(count, last line) of ``<token>.refused``: (0, None) when none."""
        try:
            fd = _open_own(self.dir + "/" + self.name + ".refused", posix.O_RDONLY)
        except OSError:
            return 0, None
        try:
            lines = _pread_all(fd, REFUSED_MAX_BYTES + 512, 0).decode("utf-8", "replace").splitlines()
        finally:
            posix.close(fd)
        return len(lines), (lines[-1] if lines else None)

    # -- inspection

    def status(self):
        """Counts for ``aep-bridge spool status``."""
        size = self.size()
        pos = min(self._read_pos(), size)
        pending = 0
        pending_bytes = size - pos
        torn_tail = 0
        if pending_bytes:
            try:
                fd = _open_own(self.path, posix.O_RDONLY)
                try:
                    off = pos
                    rest = b""
                    while off < size:
                        b = posix.pread(fd, min(1 << 22, size - off), off)
                        if not b:
                            break
                        pending += b.count(b"\n")
                        rest = b
                        off += len(b)
                    if rest and not rest.endswith(b"\n"):
                        torn_tail = len(rest) - (rest.rfind(b"\n") + 1)
                finally:
                    posix.close(fd)
            except OSError:
                pass
        dropped, dropped_bytes = self.dropped()
        aside = {}
        try:
            for name in posix.listdir(self.dir):
                for kind in ("torn", "corrupt", "rejected"):
                    if name.startswith(self.name + "." + kind):
                        aside[kind] = aside.get(kind, 0) + 1
        except OSError:
            pass
        out = {
            "instance_token": self.name, "path": self.path, "pending_records": pending,
            "pending_bytes": pending_bytes, "file_bytes": size, "max_bytes": self.max_bytes,
            "dropped_records": dropped, "dropped_bytes": dropped_bytes, "torn_tail_bytes": torn_tail,
            "set_aside_files": aside, "refused_runs": self.refused()[0],
        }
        if self.fallback is not None:  # drops are totals over both; pending records per spool
            fb = out["fallback"] = self.fallback.status()
            out["dropped_records"] += fb["dropped_records"]
            out["dropped_bytes"] += fb["dropped_bytes"]
        return out


def _unlock(fd):
    _fcntl.flock(fd, _fcntl.LOCK_UN)


def _split_frames(data, n):
    """The ``n`` newline-terminated frames of ``data`` (a frame holds exactly one newline)."""
    out = []
    start = 0
    for _ in range(n):
        end = data.index(b"\n", start) + 1
        out.append(data[start:end])
        start = end
    return out


# ---------------------------------------------------------------- one hook invocation


def run(data, cfg, started=None):
    """Handle one stdin payload: replay the spool, publish, spool on failure.
    Returns a short outcome for tests: "published", "spooled", "dropped", "lost" or "rejected"."""
    if started is None:
        started = time.monotonic()
    return deliver(build_record(data, cfg), cfg, started)


def deliver(record, cfg, started, ctl=None):
    """Publish one stamped record (spool replay first, the spool on failure); with ``ctl``
    (the control plane, switched on) run its moment on the live connection once acked."""
    deadline = started + cfg.deadline_ms / 1000.0
    spool = spool_for(cfg)
    claims, dropped, dropped_bytes = spool.claim_drops()
    if claims:  # events lost at this edge earlier: say so downstream (the mapper counts them)
        _add_note(record, "spool_dropped", {"records": dropped, "bytes": dropped_bytes})
    result = "lost"
    try:
        result = _deliver(record, cfg, started, deadline, spool, ctl)
    finally:
        if claims:
            spool.settle_drops(claims, result in ("published", "spooled"))
    return result


def _add_note(record, key, value):
    msg = record.message
    if not isinstance(msg, dict):
        return
    msg = dict(msg)
    edge = msg["edge"] = dict(msg.get("edge") or {})
    edge[key] = value
    record.message, record.body = msg, encode(msg)


def _deliver(record, cfg, started, deadline, spool, ctl):
    errors = []
    outcome = False
    if ctl is None and spool.pending() == 0:
        outcome = publish_one(cfg, record, deadline, errors)
    else:
        # The spool first, then the own event, on the first server that acks in its share; a
        # server that fails (no ack in its share, a closed connection) is left for the next,
        # which replays from the committed position (Nats-Msg-Id drops what was stored twice).
        order = server_order(cfg)
        for conn in connect_candidates(cfg, deadline, errors, order):
            try:
                if ctl is not None:
                    ctl.prepare(record, conn)
                fit(record, conn.max_payload, cfg.max_field_bytes)
                empty = True
                if ctl is None or spool.pending():
                    replay_deadline = started + cfg.deadline_ms * REPLAY_SHARE / 1000.0
                    # A record this size is fitted and sent in a few ms; a bigger one (an older
                    # shim spooled records whole) is left for `spool drain`.
                    max_line = max(conn.max_payload, DEFAULT_MAX_PAYLOAD) + 4096
                    try:
                        _, empty, _ = spool.replay(conn, replay_deadline, max_line_bytes=max_line)
                    except OSError as exc:
                        errors.append("spool replay: %s" % exc)
                        empty = False
                if conn.error is not None:
                    errors.append(str(conn.error))
                    continue  # the next server
                if not empty:
                    break  # the replay's share is spent (or another run holds it): spool behind it
                got = conn.publish([record], deadline)
                if not got:
                    errors.append(str(conn.error or "no ack from %s before the deadline" % conn.server))
                    continue
                outcome = got[0]
                acked(cfg, conn)
                if outcome is True and ctl is not None:
                    ctl.run(conn, cfg, started)
                break
            finally:
                conn.close()
        else:  # every server failed (or the time ran out): none acked
            left_unacked(cfg, order)
    if outcome is True:
        return "published"
    if outcome:  # a permanent rejection: spooling would only get it rejected again
        _warn("event %s rejected by JetStream: %s" % (record.id, outcome))
        try:
            spool.reject(record, outcome)
        except OSError:
            pass
        return "rejected"
    try:
        dropped = spool.keep([record], deadline, cfg.max_field_bytes)
    except OSError as exc:
        _warn(
            "event %s LOST: NATS unavailable (%s) and spool unwritable (%s)"
            % (record.id, "; ".join(errors) or "not tried", exc)
        )
        return "lost"
    if errors:
        _warn("event %s spooled: %s" % (record.id, "; ".join(errors)[:500]))
        for e in errors:
            if any(r in e for r in _REFUSALS):  # the credential, not the network
                spool.note_refused(e)
                break
    return "dropped" if dropped else "spooled"


# ---------------------------------------------------------------- the control plane (opt-in)
# Nothing below runs unless AEP_HERMES_CONTROL or AEP_INSTRUCT is set (main() checks two
# booleans). See "Control plane" in the module docstring and docs/ARCHITECTURE.md.


def run_control(data, cfg, started):
    """One invocation with the control plane on. Returns the answer for Hermes (a dict),
    or None for ``{}``. Only a held ``pre_tool_call`` or a ``pre_llm_call`` can get one."""
    record = build_record(data, cfg)
    msg = record.message or {}
    env = msg.get("envelope")
    ctl = None
    if isinstance(env, dict):
        hook = msg.get("hook")
        if cfg.control and hook == "pre_tool_call" and _gated(env.get("tool_name"), cfg.gate_tools):
            ctl = _Control("gate", cfg.hold_ms)
        elif cfg.instruct and hook == "pre_llm_call":
            session = env.get("session_id")
            if isinstance(session, str) and session:
                ctl = _Control("instruct", 0, session)
    outcome = deliver(record, cfg, started, ctl)
    if ctl is not None and outcome != "published" and ctl.mode == "gate":
        _warn("call %s not held: the event was not published (%s); released with {}" % (record.id, outcome))
    return ctl.answer if ctl is not None else None


def _gated(tool, pattern):
    """AEP_HERMES_GATE_TOOLS: a regex the tool name must fullmatch (default: every tool). An
    invalid regex gates every tool: an operator-deny gate errs toward holding."""
    if not pattern:
        return True
    import re  # ~8 ms, only for a pre_tool_call with the gate on and a pattern set

    try:
        return re.fullmatch(pattern, tool if isinstance(tool, str) else "") is not None
    except re.error as exc:
        _warn("AEP_HERMES_GATE_TOOLS is not a valid regex (%s); gating every tool" % exc)
        return True


class _Control:
    """The one moment the control plane changes: a held pre_tool_call (``gate``) or the
    pre_llm_call instruction pull (``instruct``), run on the live connection."""

    __slots__ = ("mode", "hold_ms", "session", "answer", "raw_id")

    def __init__(self, mode, hold_ms, session=None):
        self.mode = mode
        self.hold_ms = hold_ms
        self.session = session
        self.answer = None
        self.raw_id = None

    def prepare(self, record, conn):
        self.raw_id = record.id
        if self.mode == "gate":  # where the decision goes, and how long we wait for it
            record.extra = (
                "%s: %s.g\r\n%s: %d\r\n" % (GATE_REPLY_HEADER, conn.inbox, GATE_HOLD_HEADER, self.hold_ms)
            ).encode("ascii")

    def run(self, conn, cfg, started):
        try:
            if self.mode == "gate":
                self.answer = _hold(conn, started + self.hold_ms / 1000.0, self.raw_id)
            else:
                self.answer = _pull(conn, self.session, started + cfg.deadline_ms / 1000.0)
        except (OSError, NatsError, ValueError) as exc:  # a broken connection releases with {}
            _warn("control: %s" % exc)


def _reply(conn, reply, data, deadline):
    """Publish ``data`` to ``reply`` and make sure the server has it (PING/PONG) before we
    exit. False when it could not be sent; then nothing may be applied."""
    try:
        conn.send(b"PUB %s %d\r\n%s\r\nPING\r\n" % (reply, len(data), data), deadline, 0.05)
    except OSError:
        return False
    conn.read_pong(max(deadline, time.monotonic() + 0.5))  # sent: the decision applies whatever happens to the PONG
    return True


def _hold(conn, until, raw_id=None):
    """Wait for the gate's decision on ``<inbox>.g`` until ``until`` (the hold window).
    ``{"op": "ping"}`` is answered (the gate's is-the-hook-still-there probe);
    ``{"op": "release", "decision": "allow"|"deny", "id": <raw id>, "message": ...}`` is
    confirmed to its reply subject, then applied, only when ``id`` is this call's raw message
    id: a card opened by anything else (a raw message that copied this inbox) can never
    release this call. Expiry or a broken connection: None (Hermes proceeds)."""
    gate = (conn.inbox + ".g").encode("ascii")
    while True:
        m = conn.next_msg(until)
        if m is None:
            return None
        subject, reply, _, body = m
        if subject != gate:
            continue
        try:
            msg = loads(body.decode("utf-8"))
        except Exception:
            continue
        op = msg.get("op") if isinstance(msg, dict) else None
        if op == "ping":
            if reply:
                try:
                    conn.send(b"PUB %s 4\r\npong\r\n" % reply, until)
                except OSError:
                    return None
        elif op == "release" and msg.get("decision") in ("allow", "deny") and reply and msg.get("id") == raw_id:
            if not _reply(conn, reply, b"ok", until):
                return None
            if msg["decision"] == "allow":
                return None
            text = msg.get("message")
            return {"action": "block", "message": text if isinstance(text, str) and text else DEFAULT_DENY_MESSAGE}


def _pull(conn, session, deadline):
    """Ask the gate for the session's queued instructions (a request on
    ``aep.gate.instruct.<token>``) within the hook's deadline. The gate answers ``{}`` or
    asks back with ``{"context": ...}``; we confirm, then answer Hermes with the context.
    No gate (503), no answer in time, anything odd: None."""
    inbox = (conn.inbox + ".i").encode("ascii")
    body = encode({"session": session})
    subject = instruct_subject(session).encode("utf-8")
    conn.send(b"PUB %s %s %d\r\n%s\r\n" % (subject, inbox, len(body), body), deadline)
    while True:
        m = conn.next_msg(deadline)
        if m is None:
            return None
        subj, reply, hdrs, data = m
        if subj != inbox:
            continue
        status = hdrs.split(b"\r\n", 1)[0].split()[1:2] if hdrs else None
        if status and status != [b"200"]:
            return None  # 503: no gate listens
        try:
            msg = loads(data.decode("utf-8"))
        except Exception:
            return None
        text = msg.get("context") if isinstance(msg, dict) else None
        if not isinstance(text, str) or not text.strip() or not reply:
            return None
        if not _reply(conn, reply, b"ok", deadline):
            return None
        return {"context": text}


class _StdinTimeout(Exception):
    pass


_reading = [False]


def _on_alarm(signum, frame):
    if _reading[0]:  # a late alarm after the read loop must not break what follows
        raise _StdinTimeout()


def read_stdin(deadline=None):
    """All of stdin, read until EOF, ``deadline`` (monotonic) or STDIN_MAX_BYTES. Returns
    (data, None) or (what was read, "stdin_timeout: ..." | "truncated: ..."). A pipe that never
    closes is cut by SIGALRM (``_signal`` is built in: no import, no select)."""
    chunks = []
    total = 0
    why = None
    timer = False
    t0 = time.monotonic()
    try:
        if deadline is not None and posix.fstat(0).st_mode & 0o170000 != 0o100000:  # not a regular file
            import _signal

            _signal.signal(_signal.SIGALRM, _on_alarm)
            _reading[0] = timer = True
            _signal.setitimer(_signal.ITIMER_REAL, max(deadline - t0, 0.001))
        while total <= STDIN_MAX_BYTES:
            b = posix.read(0, 1 << 20)
            if not b:
                break
            chunks.append(b)
            total += len(b)
        else:
            why = "truncated: input over %d bytes; the rest was not read" % STDIN_MAX_BYTES
        _reading[0] = False
    except _StdinTimeout:
        why = "stdin_timeout: no end of input after %d ms (%d bytes read)" % ((time.monotonic() - t0) * 1000, total)
    except OSError:
        pass
    finally:
        _reading[0] = False
        if timer:
            _signal.setitimer(_signal.ITIMER_REAL, 0)
    return b"".join(chunks), why


def main(argv=None):
    """``hook.py [--config FILE]``: FILE replaces AEP_BRIDGE_CONFIG (the installer passes it)."""
    started = time.monotonic()
    answer = None
    try:
        argv = sys.argv[1:] if argv is None else argv
        config_path = argv[1] if len(argv) >= 2 and argv[0] == "--config" else None
        cfg = Config(config_path=config_path)
        data, why = read_stdin(started + cfg.deadline_ms / 1000.0)
        if why is not None:  # its deadline is spent: kept in the spool, published by the next hook
            record = build_record(data, cfg, stdin_error=why)
            # Its id: the `_invalid` message (a shim_invalid dead letter) that holds what was read.
            _warn("event %s: %s" % (record.id, why))
            deliver(record, cfg, started)
        elif cfg.control or cfg.instruct:
            answer = run_control(data, cfg, started)
        else:
            run(data, cfg, started)
    except BaseException as exc:  # never fail Hermes; say why on stderr
        try:
            _warn("internal error: %s: %s" % (exc.__class__.__name__, exc))
        except BaseException:
            pass
    out = b"{}\n"
    if answer:
        try:
            out = encode(answer) + b"\n"
        except Exception:
            pass
    try:
        posix.write(1, out)
    except OSError:
        pass


if __name__ == "__main__":
    main()
    posix._exit(0)  # nothing is buffered (raw fd writes); skip interpreter finalisation
