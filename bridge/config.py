"""Settings shared by every `aep-bridge` command: one typed table of every variable.

`FIELDS` lists each setting once: its name, type, default, accepted range, the roles that
read it, whether it is a secret, and a line of help. Every command resolves its settings
from it the same way (`resolve`): command-line flag > environment > the optional
`KEY=VALUE` file named by `AEP_BRIDGE_CONFIG` (default `~/.config/aep-bridge/env`) >
built-in default. `Settings` (the NATS side and the workers), the relay's `RelayConfig`,
the gate's `GateConfig`, the exporter's sinks and the allocation profiler all read
through it, and `aep-bridge config` prints it.

The shim (`bridge/shim/hook.py`) stays one standard-library file with its own reader. The
settings it also reads are resolved here with its own functions (`settings_file`,
`int_setting`, `spool_dir_setting`, `read_env_file`), so the two can never disagree:
its numbers keep the shim's rule (a bad value is warned about and replaced by the
default; `Settings.notes` says so), everything else is checked strictly and a bad value
raises `SettingError`, naming the variable and what it accepts (`aep-bridge` prints it
and exits 2). tests/test_config.py holds the two readers equal.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from bridge.shim import hook

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
DEFAULT_DEADLINE_MS = hook.DEFAULT_DEADLINE_MS
DEFAULT_MAX_FIELD_BYTES = hook.DEFAULT_MAX_FIELD_BYTES
DEFAULT_SPOOL_MAX_BYTES = hook.DEFAULT_SPOOL_MAX_BYTES
DEFAULT_PARTITIONS = 8
MAPPER_METRICS_PORT = 9464
PAIRING_METRICS_PORT = 9465
GATE_METRICS_PORT = 9466
EXPORTER_METRICS_PORT = 9467
DEFAULT_RELAY_LISTEN = "127.0.0.1:8787"

#: who reads a setting: the hook, each service, `bootstrap`, and the short-lived commands that
#: talk to NATS or the spool (tail, control, demo, spool, hermes doctor, verify)
ROLES = ("shim", "mapper", "pairing", "gate", "relay", "exporter", "bootstrap", "client")
SERVICES = frozenset({"mapper", "pairing", "gate", "relay", "exporter"})
NATS_ROLES = SERVICES | {"bootstrap", "client"}
ROLE_METRICS_PORT = {"mapper": MAPPER_METRICS_PORT, "pairing": PAIRING_METRICS_PORT,
                     "gate": GATE_METRICS_PORT, "exporter": EXPORTER_METRICS_PORT}
_BOOL = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
#: a family member (AEP_BRIDGE_KAFKA_<PROP>) whose name says it holds a secret
_SECRET_NAME = re.compile(r"PASSWORD|SECRET|TOKEN|CREDENTIAL|SEED|PRIVATE", re.I)
_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/@,:]*:)(?P<secret>[^/@,]*)(?=@)")
_URL_TOKEN = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://)(?P<secret>[^/@,:]+)(?=@)")
MASK = "*****"


class SettingError(ValueError):
    """A setting that cannot be used: the message names the variable and what it accepts
    (never a secret's value)."""


@dataclass(frozen=True)
class Field:
    """One setting. ``default`` is a value, or a function of (the merged environment, the
    role). ``range``: inclusive bounds of a number (None: open; ``(0, None)`` on a float: above
    0). ``flag``: the command-line flag that overrides it. ``shim``: read by the hook
    too, with the hook's rule (a bad number becomes the default with a note, never an
    error). ``prefix``: a family of variables (``AEP_BRIDGE_KAFKA_`` + a property)."""

    name: str
    type: str  # str | int | float | bool | list | path | choice | listen
    default: Any
    roles: frozenset[str]
    help: str
    range: tuple[float | None, float | None] | None = None
    choices: tuple[str, ...] = ()
    secret: bool = False
    flag: str | None = None
    shim: bool = False
    prefix: bool = False

    def accepts(self) -> str:
        if self.type in ("int", "float"):
            lo, hi = self.range or (None, None)
            noun = "an integer" if self.type == "int" else "a number"
            if lo is not None and hi is not None:
                return f"{noun} in {_num(lo)}-{_num(hi)}"
            if lo is not None:
                return f"{noun} > 0" if self.type == "float" and lo == 0 else f"{noun} >= {_num(lo)}"
            return noun
        if self.type == "bool":
            return "one of 1, true, yes, on, 0, false, no, off"
        if self.type == "choice":
            return "one of " + ", ".join(self.choices)
        if self.type == "listen":
            return "HOST:PORT with a port in 0-65535"
        return "a string"

    def default_for(self, merged: Mapping[str, str], role: str | None) -> Any:
        """The default as a value of the field's type: a default written as text (HOST:PORT) is
        parsed like a set one, so a reader never gets the string where it expects the tuple."""
        value = self.default(merged, role) if callable(self.default) else self.default
        return self.parse(value) if isinstance(value, str) and self.type == "listen" else value

    def parse(self, raw: str) -> Any:
        """The typed value of a non-empty ``raw``; SettingError when it is not one."""
        try:
            if self.type == "int":
                value: Any = int(raw.strip())
            elif self.type == "float":
                value = float(raw.strip())
                if value != value or value in (float("inf"), float("-inf")):
                    raise ValueError(raw)
            elif self.type == "bool":
                value = _BOOL[raw.strip().lower()]
            elif self.type == "choice":
                value = raw.strip().lower()
                if value not in self.choices:
                    raise ValueError(raw)
            elif self.type == "list":
                value = tuple(v.strip() for v in raw.split(",") if v.strip())
            elif self.type == "listen":
                host, sep, port = raw.rpartition(":")
                if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
                    raise ValueError(raw)
                value = (host.strip("[]") or "127.0.0.1", int(port))
            else:
                value = raw
        except (ValueError, KeyError):
            raise self.error(raw) from None
        if self.range is not None:
            lo, hi = self.range
            positive = self.type == "float" and lo == 0 and hi is None  # (0, None) on a float: > 0
            if (lo is not None and (value < lo or (positive and value == 0))) or (hi is not None and value > hi):
                raise self.error(raw)
        return value

    def error(self, raw: str, label: str | None = None) -> SettingError:
        shown = MASK if self.secret else (raw if len(raw) <= 80 else raw[:80] + "...")
        return SettingError(f"{label or self.name} must be {self.accepts()}, got {shown!r}")


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else str(v)


def _f(name: str, type: str, default: Any, roles: Iterable[str], help: str, **kw: Any) -> Field:
    return Field(name, type, default, frozenset(roles), help, **kw)


def _hostname(merged: Mapping[str, str], role: str | None) -> str:
    return socket.gethostname()


def _spool_dir(merged: Mapping[str, str], role: str | None) -> str:
    return hook.spool_dir_setting(merged)


def _metrics_port(merged: Mapping[str, str], role: str | None) -> int | None:
    return ROLE_METRICS_PORT.get(role or "")


_SHIM_NATS = {"shim"} | NATS_ROLES
_LIMIT = hook.LIMITS
FIELDS: tuple[Field, ...] = (
    # ---- NATS: every role that connects
    _f("AEP_BRIDGE_NATS_URL", "str", DEFAULT_NATS_URL, _SHIM_NATS, "NATS servers, comma-separated; nats://user:pass@host:port, nats://token@host, tls://host:port", flag="--nats"),
    _f("AEP_BRIDGE_NATS_USER", "str", None, _SHIM_NATS, "NATS user (overrides the URL's)"),
    _f("AEP_BRIDGE_NATS_PASSWORD", "str", None, _SHIM_NATS, "NATS password (overrides the URL's)", secret=True),
    _f("AEP_BRIDGE_NATS_TOKEN", "str", None, _SHIM_NATS, "NATS token", secret=True),
    _f("AEP_BRIDGE_NATS_JWT", "str", None, {"shim"}, "shim: a fleet instance's bearer user JWT (`aep-bridge fleet issue`)", secret=True),
    _f("AEP_BRIDGE_NATS_CREDS", "path", None, NATS_ROLES, ".creds file (JWT + nkey seed)"),
    _f("AEP_BRIDGE_NATS_NKEY_SEED", "path", None, NATS_ROLES, "nkey seed file", secret=True),
    _f("AEP_BRIDGE_TLS_CA", "path", None, _SHIM_NATS, "TLS CA file (TLS on when set)"),
    _f("AEP_BRIDGE_TLS_CERT", "path", None, _SHIM_NATS, "TLS client certificate"),
    _f("AEP_BRIDGE_TLS_KEY", "path", None, _SHIM_NATS, "TLS client key"),
    _f("AEP_BRIDGE_INBOX_PREFIX", "str", None, NATS_ROLES, "NATS inbox prefix (default: the role's own)"),
    _f("AEP_BRIDGE_NATS_LEAVE_AFTER_S", "float", 5.0, SERVICES, "a service leaves a NATS server whose JetStream requests have failed (timed out, 503) this many seconds with no answer between, for the next server of the list (0: never)", range=(0, 3600)),
    # ---- the shim (and what inspects its spool)
    _f("AEP_BRIDGE_INSTANCE", "str", _hostname, {"shim", "client", "mapper"}, "the Hermes instance's name (default: the host name)"),
    _f("AEP_BRIDGE_SPOOL_DIR", "path", _spool_dir, {"shim", "client"}, "the shim's spool (default $XDG_STATE_HOME/aep-bridge/spool, ~ expanded)", shim=True),
    _f("XDG_STATE_HOME", "path", None, {"shim", "client"}, "base of the default spool and of `up`'s state (default ~/.local/state)"),
    _f("TMPDIR", "path", "/tmp", {"shim", "client"}, "the shim's fallback spool is $TMPDIR/aep-bridge-<uid>"),
    _f("AEP_BRIDGE_DEADLINE_MS", "int", DEFAULT_DEADLINE_MS, {"shim", "client"}, "shim: stdin read, then connect + publish + ack deadline", range=_LIMIT["DEADLINE_MS"], shim=True),
    _f("AEP_BRIDGE_MAX_FIELD_BYTES", "int", DEFAULT_MAX_FIELD_BYTES, {"shim"}, "shim: a larger value is replaced by {digest, bytes}", range=_LIMIT["MAX_FIELD_BYTES"], shim=True),
    _f("AEP_BRIDGE_SPOOL_MAX_BYTES", "int", DEFAULT_SPOOL_MAX_BYTES, {"shim", "client"}, "shim: spool cap", range=_LIMIT["SPOOL_MAX_BYTES"], shim=True),
    _f("AEP_BRIDGE_REDACT_NAMES", "list", (), {"shim", "mapper", "gate"}, "environment variables whose values are secrets (redaction rule b)"),
    # ---- the workers
    _f("AEP_BRIDGE_PARTITIONS", "int", DEFAULT_PARTITIONS, {"mapper", "pairing"}, "partitions of BRIDGE_MAPPED", range=(1, 65536), flag="--partitions"),
    _f("AEP_BRIDGE_CAPTURE", "choice", None, {"mapper", "gate"}, "capture ceiling (unset: metadata, attention.* at redacted)", choices=("none", "metadata", "redacted", "full"), flag="--capture"),
    _f("AEP_BRIDGE_CAPTURE_OVERRIDES", "str", None, {"mapper", "gate"}, "per-category levels CATEGORY=LEVEL,... (default attention=redacted)"),
    _f("AEP_BRIDGE_PRICE_TABLE", "path", None, {"mapper"}, "price table (YAML or JSON: currency, models -> price per 1,000,000 input/output/cache_read/cache_write/reasoning tokens): the cost of each model call and run; unset: no cost"),
    _f("AEP_BRIDGE_LANE_WAIT_MS", "int", 2000, {"mapper"}, "how long a session-less event waits for earlier raw messages", range=(0, 3_600_000)),
    _f("AEP_BRIDGE_TICK_S", "float", 15.0, {"pairing"}, "seconds between pairing ticks", range=(0, None), flag="--tick-s"),
    _f("AEP_BRIDGE_MAPPER_ACK_WAIT_S", "float", 30.0, {"mapper"}, "mapper: seconds before a message a replica took and did not ack is delivered again (set when the mapper creates its durable; keep it below AEP_BRIDGE_PAIRING_HOLD_S)", range=(1, 3600)),
    _f("AEP_BRIDGE_EXPORT_ACK_WAIT_S", "float", 60.0, {"exporter"}, "exporter: seconds before an event a replica took and did not confirm is delivered again (its durables' ack_wait; progress is reported every third of it while a sink holds a batch)", range=(3, 3600)),
    _f("AEP_BRIDGE_LINGER_MS", "float", 10.0, {"mapper"}, "mapper: after a batch of less than a quarter of the fetch size and of fewer than ~64 messages, how long the next one gathers at least (latency for CPU per event when the fleet is quiet; 0: no pause). Pairing does not pause: it takes each of the mapper's batches as it comes", range=(0, 1000)),
    _f("AEP_BRIDGE_LINGER_MAX_MS", "float", 300.0, {"mapper"}, "mapper: the longest a quiet stream's next batch gathers, plus up to AEP_BRIDGE_LINGER_MS to end on its clock (the pause grows toward ~64 messages a batch at the rate of the recent batches; at or below AEP_BRIDGE_LINGER_MS: always that; well below the mapper's ack wait)", range=(0, 1000)),
    _f("AEP_BRIDGE_PAIRING_CHECKPOINT_S", "float", 10.0, {"pairing"}, "pairing: seconds between a partition's timed checkpoints (one every 5,000 of its messages too): a takeover replays at most this much; each encodes and compresses the partition's whole state", range=(1, 3600)),
    _f("AEP_BRIDGE_PAIRING_HOLD_S", "float", 45.0, {"pairing"}, "pairing: seconds a terminal waits for its start and a card outlives its session's end (keep it above AEP_BRIDGE_MAPPER_ACK_WAIT_S)", range=(0, 120)),
    _f("AEP_BRIDGE_STREAM_REPLICAS", "int", None, {"bootstrap", "gate"}, "stream replicas (default 1; 3 on a cluster)", range=(1, 5)),
    _f("AEP_BRIDGE_METRICS_PORT", "int", _metrics_port, SERVICES - {"relay"}, "/metrics, /healthz, /readyz port (mapper 9464, pairing 9465, gate 9466, exporter 9467)", range=(0, 65535), flag="--metrics-port"),
    _f("AEP_BRIDGE_METRICS_HOST", "str", "0.0.0.0", SERVICES - {"relay"}, "where the metrics port listens"),
    _f("AEP_BRIDGE_LOG_FORMAT", "choice", "json", SERVICES, "log format", choices=("json", "console"), flag="--log-format"),
    _f("AEP_BRIDGE_LOG_LEVEL", "choice", "info", SERVICES, "log level", choices=("debug", "info", "warning", "warn", "error", "critical")),
    # ---- allocation profiling (opt-in, every service)
    _f("AEP_BRIDGE_TRACEMALLOC", "path", None, SERVICES, "directory for allocation snapshots (profiling on when set)"),
    _f("AEP_BRIDGE_TRACEMALLOC_EVERY_S", "float", 60.0, SERVICES, "seconds between allocation snapshots", range=(1, 86400)),
    _f("AEP_BRIDGE_TRACEMALLOC_FRAMES", "int", 4, SERVICES, "tracemalloc frames per allocation (0: census only)", range=(0, 100)),
    # ---- the opt-in control plane: shim and gate
    _f("AEP_HERMES_CONTROL", "bool", False, {"shim", "gate"}, "hold pre_tool_call for an operator's allow/deny", shim=True),
    _f("AEP_INSTRUCT", "bool", False, {"shim", "gate"}, "steer the next turn with queued instructions", shim=True),
    _f("AEP_HERMES_GATE_TOOLS", "str", None, {"shim"}, "shim: regex of the tool names to hold (default: every tool)"),
    _f("AEP_HERMES_HOLD_MS", "int", hook.DEFAULT_HOLD_MS, {"shim"}, "shim: how long a held call waits for the operator", range=(1, hook.HOLD_MS_MAX), shim=True),
    _f("AEP_CONTROL_SENDERS", "list", None, {"gate"}, "command senders (`agent`s) the gate obeys (default: any)"),
    _f("AEP_GATE_PROBE_MS", "int", 1000, {"gate"}, "how often a held hook is probed", range=(1, 3_600_000), flag="--probe-ms"),
    _f("AEP_BRIDGE_SESSION_IDLE_TTL_S", "int", 1800, {"gate", "relay"}, "a Hermes session with no raw message this long is no longer live (roster, commands)", range=(1, 7 * 86400)),
    # ---- the relay
    _f("AEP_BRIDGE_RELAY_LISTEN", "listen", DEFAULT_RELAY_LISTEN, {"relay"}, "HOST:PORT the relay listens on", flag="--listen"),
    _f("AEP_BRIDGE_RELAY_TOKEN", "str", None, {"relay"}, "a bearer token with every right", secret=True),
    _f("AEP_BRIDGE_RELAY_TOKENS_FILE", "path", None, {"relay"}, "per-client tokens (JSON or YAML)"),
    _f("AEP_BRIDGE_RELAY_TLS_CERT", "path", None, {"relay"}, "serve HTTPS/WSS: certificate"),
    _f("AEP_BRIDGE_RELAY_TLS_KEY", "path", None, {"relay"}, "serve HTTPS/WSS: key"),
    _f("AEP_BRIDGE_RELAY_INSECURE", "bool", False, {"relay"}, "off loopback without TLS (a proxy in front terminates it)"),
    _f("AEP_BRIDGE_RELAY_REPLAY_BUFFER", "int", 10000, {"relay"}, "the replay window: the last N events of AEP_EVENTS", range=(1, 10**9)),
    _f("AEP_BRIDGE_RELAY_QUEUE", "int", 10000, {"relay"}, "events queued per subscription before backpressure", range=(1, 10**7)),
    _f("AEP_BRIDGE_RELAY_HEARTBEAT_S", "int", 15, {"relay"}, "SSE ping / idle interval in seconds", range=(1, 30)),
    _f("AEP_BRIDGE_RELAY_CLAIM_TTL_S", "int", 30, {"relay"}, "a WebSocket emitter's shared claim outlives a dead replica this long", range=(3, 3600)),
    _f("AEP_BRIDGE_RELAY_REQUEST_TIMEOUT_S", "int", 10, {"relay"}, "a request's headers, a POST's body, a WebSocket's hello, an idle connection: closed past this", range=(1, 3600)),
    _f("AEP_BRIDGE_RELAY_MAX_CONNECTIONS_PER_CLIENT", "int", 256, {"relay"}, "open connections per client address (0: no cap; behind a proxy, raise it)", range=(0, 10**6)),
    # ---- the exporter
    _f("AEP_BRIDGE_EXPORT_CONFIG", "path", None, {"exporter"}, "sinks file, YAML or JSON", flag="--config"),
    _f("AEP_BRIDGE_KAFKA_SASL_PASSWORD", "str", None, {"exporter"}, "fills a Kafka sink's sasl.password", secret=True),
    _f("AEP_BRIDGE_KAFKA_", "str", None, {"exporter"}, "AEP_BRIDGE_KAFKA_<PROP>: librdkafka property prop (_ as .) for every Kafka sink", prefix=True),
)
BY_NAME = {f.name: f for f in FIELDS if not f.prefix}


def flag_fields() -> list[tuple[str, str, str]]:
    """(flag, argparse dest, variable) of every setting a command takes as a flag: the one
    flag -> variable map (FIELDS' ``flag``), which the services' commands and `config` read."""
    return [(f.flag, f.flag.lstrip("-").replace("-", "_"), f.name) for f in FIELDS if f.flag]


def fields_for(role: str | None) -> list[Field]:
    """The fields ``role`` reads (every field when None)."""
    if role is not None and role not in ROLES:
        raise SettingError(f"unknown role {role!r} (expected one of {', '.join(ROLES)})")
    return [f for f in FIELDS if role is None or role in f.roles]


def default_config_path() -> Path:
    return Path(os.path.expanduser("~/.config/aep-bridge/env"))


def default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(base) / "aep-bridge"


def read_env_file(path: Path) -> dict[str, str]:
    """Parse a `KEY=VALUE` file (comments with #, optional `export` and quotes); missing file -> {}.

    The shim's own parser (standard library only, no `os` import) is the one parser, so
    the shim and the services can never read the same file differently.
    """
    return hook.read_env_file(str(path))


@dataclass
class Layers:
    """Where settings come from: the environment, the settings file, the flags."""

    env: dict[str, str]
    path: str
    file: dict[str, str]
    flags: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, environ: Mapping[str, str] | None = None, flags: Mapping[str, Any] | None = None,
             config_path: str | None = None) -> "Layers":
        env = dict(os.environ if environ is None else environ)
        path = hook.settings_file(env, config_path)
        return cls(env, path, read_env_file(Path(path)), {k: v for k, v in (flags or {}).items() if v is not None})

    @property
    def merged(self) -> dict[str, str]:
        merged = dict(self.file)
        merged.update(self.env)
        return merged

    def raw(self, name: str) -> tuple[str | None, str]:
        """The raw value of ``name`` and its source; an empty value counts as unset (an empty
        variable in the environment also hides the file's, as in the shim)."""
        if name in self.env:
            return (self.env[name] or None), "env"
        if name in self.file:
            return (self.file[name] or None), f"file {self.path}"
        return None, "default"


def load_environ(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The effective variables: the config file overlaid by the environment."""
    return Layers.load(environ).merged


@dataclass(frozen=True)
class Value:
    field: Field
    name: str
    value: Any
    source: str  # flag --x | env | file PATH | default
    note: str | None = None

    def shown(self) -> str:
        """The value as printed by `aep-bridge config`: secrets masked (also a password or token
        inside a URL)."""
        return show(self.field, self.name, self.value)


def show(f: Field, name: str, value: Any) -> str:
    if value is None:
        return ""
    if f.secret or (f.prefix and _SECRET_NAME.search(name)):
        return MASK
    if f.type == "listen":
        host, port = value
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if isinstance(value, tuple):
        return ",".join(value)
    if isinstance(value, bool):
        return "1" if value else "0"
    text = str(value)
    if "://" in text:
        text = _URL_PASSWORD.sub(lambda m: m["head"] + MASK, text)
        text = _URL_TOKEN.sub(lambda m: m["head"] + MASK, text)
    return text


def resolve_field(f: Field, layers: Layers, role: str | None = None) -> Value:
    """One field's value and where it came from; SettingError for a bad flag or variable (the
    shim's numbers: the default, with a note)."""
    if f.name in layers.flags:
        raw = layers.flags[f.name]
        raw = raw if isinstance(raw, str) else "1" if raw is True else "0" if raw is False else str(raw)
        try:
            return Value(f, f.name, f.parse(raw), f"flag {f.flag}" if f.flag else "flag")
        except SettingError:
            raise f.error(raw, f"{f.flag} ({f.name})" if f.flag else None) from None
    raw, source = layers.raw(f.name)
    merged = layers.merged
    if f.name == "AEP_BRIDGE_SPOOL_DIR":  # the hook's rule: ~ and XDG_STATE_HOME expanded
        return Value(f, f.name, hook.spool_dir_setting(merged), source if raw else "default")
    if raw is None:
        return Value(f, f.name, f.default_for(merged, role), "default")
    if f.shim and f.type == "int" and f.range:
        value, note = hook.int_setting(f.name, raw, f.default, int(f.range[0] or 0), int(f.range[1] or 0))
        return Value(f, f.name, value, "default" if note else source, note)
    if f.shim and f.type == "bool":
        return Value(f, f.name, raw.strip().lower() in hook._ON, source)
    return Value(f, f.name, f.parse(raw), source)


def resolve(role: str | None, environ: Mapping[str, str] | None = None, flags: Mapping[str, Any] | None = None,
            config_path: str | None = None, layers: Layers | None = None) -> dict[str, Value]:
    """Every setting ``role`` reads, by name (a prefix family: each variable of it that is set).
    Raises SettingError for the first bad one."""
    layers = layers or Layers.load(environ, flags, config_path)
    out: dict[str, Value] = {}
    for f in fields_for(role):
        if f.prefix:
            out.update((v.name, v) for v in family(f, layers))
        else:
            out[f.name] = resolve_field(f, layers, role)
    return out


def role_values(role: str, environ: Mapping[str, str] | None = None, flags: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Every setting ``role`` reads, by variable name, as its value (`resolve`: flag >
    environment > settings file > default, each checked); what a service's own config is built
    from (the gate's, the relay's)."""
    return {name: v.value for name, v in resolve(role, environ, flags).items()}


def family(f: Field, layers: Layers) -> list[Value]:
    """The variables of a prefix field that are set (and not a field of their own)."""
    out = []
    for name in sorted({*layers.file, *layers.env}):
        if name.startswith(f.name) and name not in BY_NAME:
            raw, source = layers.raw(name)
            if raw is not None:
                out.append(Value(f, name, raw, source))
    return out


def setting(name: str, environ: Mapping[str, str] | None = None, role: str | None = None) -> Any:
    """The value of one setting (environment over the settings file over its default)."""
    return resolve_field(BY_NAME[name], Layers.load(environ), role).value


# Settings attribute -> variable (the attributes every service already uses).
_SETTINGS_ATTRS = {
    "nats_url": "AEP_BRIDGE_NATS_URL", "nats_user": "AEP_BRIDGE_NATS_USER",
    "nats_password": "AEP_BRIDGE_NATS_PASSWORD", "nats_token": "AEP_BRIDGE_NATS_TOKEN",
    "nats_creds": "AEP_BRIDGE_NATS_CREDS", "nats_nkey_seed": "AEP_BRIDGE_NATS_NKEY_SEED",
    "tls_ca": "AEP_BRIDGE_TLS_CA", "tls_cert": "AEP_BRIDGE_TLS_CERT", "tls_key": "AEP_BRIDGE_TLS_KEY",
    "instance": "AEP_BRIDGE_INSTANCE", "spool_dir": "AEP_BRIDGE_SPOOL_DIR",
    "deadline_ms": "AEP_BRIDGE_DEADLINE_MS", "max_field_bytes": "AEP_BRIDGE_MAX_FIELD_BYTES",
    "spool_max_bytes": "AEP_BRIDGE_SPOOL_MAX_BYTES", "partitions": "AEP_BRIDGE_PARTITIONS",
    "capture": "AEP_BRIDGE_CAPTURE", "capture_overrides": "AEP_BRIDGE_CAPTURE_OVERRIDES",
    "redact_names": "AEP_BRIDGE_REDACT_NAMES", "metrics_port": "AEP_BRIDGE_METRICS_PORT",
    "metrics_host": "AEP_BRIDGE_METRICS_HOST", "lane_wait_ms": "AEP_BRIDGE_LANE_WAIT_MS",
    "tick_s": "AEP_BRIDGE_TICK_S", "mapper_ack_wait_s": "AEP_BRIDGE_MAPPER_ACK_WAIT_S",
    "pairing_hold_s": "AEP_BRIDGE_PAIRING_HOLD_S", "pairing_checkpoint_s": "AEP_BRIDGE_PAIRING_CHECKPOINT_S", "linger_ms": "AEP_BRIDGE_LINGER_MS", "linger_max_ms": "AEP_BRIDGE_LINGER_MAX_MS", "export_ack_wait_s": "AEP_BRIDGE_EXPORT_ACK_WAIT_S",
    "log_format": "AEP_BRIDGE_LOG_FORMAT", "log_level": "AEP_BRIDGE_LOG_LEVEL",
    "inbox_prefix": "AEP_BRIDGE_INBOX_PREFIX", "stream_replicas": "AEP_BRIDGE_STREAM_REPLICAS",
    "nats_leave_after_s": "AEP_BRIDGE_NATS_LEAVE_AFTER_S",
    "fallback_dir": "TMPDIR", "price_table": "AEP_BRIDGE_PRICE_TABLE",
}


@dataclass
class Settings:
    nats_url: str = DEFAULT_NATS_URL
    nats_user: str | None = None
    nats_password: str | None = None
    nats_token: str | None = None
    nats_creds: str | None = None
    nats_nkey_seed: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    instance: str = field(default_factory=socket.gethostname)
    spool_dir: Path = field(default_factory=lambda: Path(hook.spool_dir_setting(os.environ)))
    deadline_ms: int = DEFAULT_DEADLINE_MS
    max_field_bytes: int = DEFAULT_MAX_FIELD_BYTES
    spool_max_bytes: int = DEFAULT_SPOOL_MAX_BYTES
    partitions: int = DEFAULT_PARTITIONS
    #: the capture ceiling; None: the default posture (metadata, attention at redacted)
    capture: str | None = None
    #: per-category levels, at most the ceiling; None: the built-in bridge.core.ceiling.DEFAULT_OVERRIDES
    capture_overrides: str | None = None
    redact_names: tuple[str, ...] = ()
    metrics_port: int | None = None
    #: where /metrics, /healthz, /readyz listen: every interface by default (Kubernetes probes
    #: and Prometheus reach the pod's IP; the chart's NetworkPolicy limits who may); `aep-bridge
    #: up` sets 127.0.0.1 for its workers
    metrics_host: str = "0.0.0.0"
    #: mapper: how long a session-less event whose session is not known yet waits for every
    #: earlier raw message to be mapped (their lanes learned) before it falls back to `unknown`
    lane_wait_ms: int = 2000  # see docs/ARCHITECTURE.md "Lanes"
    #: pairing: seconds between the ticks an owner publishes into each partition it owns (the
    #: clock of TTL closure and of held follow-ups: one is released at most this long after its
    #: hold expired)
    tick_s: float = 15.0
    #: mapper: the ack_wait its durable is created with: how long a message a replica took (and
    #: died holding) waits before it is delivered again; pairing's hold must outlast it
    mapper_ack_wait_s: float = 30.0
    #: pairing: how long a terminal waits for a start that has not arrived (replicas reorder, a
    #: start redelivered after a mapper crash comes one mapper ack_wait late) and how long a
    #: card stays open after its session ended (bridge.core.pairing.PairingConfig.hold_ns)
    pairing_hold_s: float = 45.0
    #: pairing: seconds between a partition's timed checkpoints (also every CHECKPOINT_EVERY
    #: messages): what a takeover replays at most; each encodes the partition's whole state
    pairing_checkpoint_s: float = 10.0
    #: exporter: its durables' ack_wait: how long an event a replica took (and died holding)
    #: waits before it is delivered again; +WPI every third of it while a sink holds a batch
    export_ack_wait_s: float = 60.0
    #: mapper: after a small batch (under a quarter of the fetch size and ~64 messages) the next
    #: fetch waits this long: what arrives meanwhile waits at most this, a catch-up never (issue 24)
    linger_ms: float = 10.0
    #: ... up to this when the stream is quiet (`bridge.runtime.lifecycle.Linger`)
    linger_max_ms: float = 300.0
    log_format: str = "json"
    log_level: str = "info"
    #: nats-py inbox prefix; None: the role's own (bridge.nats.connection.ROLE_INBOX)
    inbox_prefix: str | None = None
    #: bootstrap and the gate: stream replicas; None: 1 (bridge.nats.bootstrap.default_replicas)
    stream_replicas: int | None = None
    #: services: leave a server whose JetStream fails this long (bridge.nats.follow; 0: never)
    nats_leave_after_s: float = 5.0
    #: the shim's fallback spool directory ($TMPDIR/aep-bridge-<uid>)
    fallback_dir: str = field(default_factory=lambda: hook.fallback_spool_dir(os.environ))
    #: a shim setting whose bad value was replaced by its default, as the shim does (one line each)
    notes: tuple[str, ...] = ()
    #: mapper: the price table's file (AEP_BRIDGE_PRICE_TABLE); None: no cost
    price_table: str | None = None
    #: ... parsed (`role_settings("mapper")` reads it, so a bad table stops the mapper at start)
    prices: Any = None

    @property
    def servers(self) -> list[str]:
        return [s.strip() for s in self.nats_url.split(",") if s.strip()]

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, flags: Mapping[str, Any] | None = None,
                 config_path: str | None = None) -> "Settings":
        """From flags (variable name -> value), the environment, the settings file and the
        defaults; SettingError names a bad value."""
        return cls.from_layers(Layers.load(environ, flags, config_path))

    @classmethod
    def from_layers(cls, layers: Layers) -> "Settings":
        s = cls()
        notes = []
        for attr, name in _SETTINGS_ATTRS.items():
            v = resolve_field(BY_NAME[name], layers)
            value = v.value
            if attr == "spool_dir":
                value = Path(value)
            elif attr == "fallback_dir":
                value = hook.fallback_spool_dir(layers.merged)
            elif attr == "redact_names":
                value = value or ()
            elif attr == "capture_overrides" and value is not None:
                value = value.strip() or None
            setattr(s, attr, value)
            if v.note:
                notes.append(v.note)
        s.notes = tuple(notes)
        return s

    def secret_values(self, environ: dict[str, str] | None = None) -> tuple[str, ...]:
        """Values of the operator-listed names (redaction rule b), read from the environment."""
        env = os.environ if environ is None else environ
        return tuple(env[n] for n in self.redact_names if env.get(n))


def role_settings(role: str, environ: Mapping[str, str] | None = None, flags: Mapping[str, Any] | None = None,
                  config_path: str | None = None) -> Settings:
    """`Settings` for a service, after checking every setting ``role`` reads (the relay's, the
    gate's, the profiler's too), so a bad one stops the command at start, named."""
    layers = Layers.load(environ, flags, config_path)
    resolve(role, layers=layers)
    settings = Settings.from_layers(layers)
    if role == "mapper" and settings.price_table:
        settings.prices = load_price_table(settings.price_table)
    return settings


def load_price_table(path: str) -> Any:
    """The parsed `bridge.core.pricing.PriceTable` of the file ``path`` (YAML or JSON);
    SettingError naming AEP_BRIDGE_PRICE_TABLE and the bad value (the command exits 2)."""
    from bridge.core.pricing import PriceTableError, parse_price_table

    name = "AEP_BRIDGE_PRICE_TABLE"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SettingError(f"{name}: cannot read {path}: {type(exc).__name__}: {exc}") from None
    try:
        import json

        doc = json.loads(text)
    except ValueError:
        try:
            from ruamel.yaml import YAML

            doc = YAML(typ="safe").load(text)
        except Exception as exc:  # ruamel's parse errors have no common base worth naming
            raise SettingError(f"{name}: {path} is neither JSON nor YAML: {str(exc).splitlines()[0]}") from None
    try:
        return parse_price_table(doc, f"{name} ({path})")
    except PriceTableError as exc:
        raise SettingError(str(exc)) from None
