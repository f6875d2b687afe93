"""Settings shared by every `aep-bridge` command, from `AEP_BRIDGE_*` variables.

Precedence: command-line flag > environment > the optional `KEY=VALUE` file named
by `AEP_BRIDGE_CONFIG` (default `~/.config/aep-bridge/env`) > built-in default.
The shim (`bridge/shim/hook.py`) reads the same names with its own stdlib-only
parser; keep the two in step (tests/shim/test_hook.py::test_defaults_agree_with_bridge_config checks).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from bridge.shim.hook import read_env_file as shim_read_env_file

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
DEFAULT_DEADLINE_MS = 250
DEFAULT_MAX_FIELD_BYTES = 64 * 1024
DEFAULT_SPOOL_MAX_BYTES = 64 * 1024 * 1024
DEFAULT_PARTITIONS = 8
MAPPER_METRICS_PORT = 9464
PAIRING_METRICS_PORT = 9465
GATE_METRICS_PORT = 9466
EXPORTER_METRICS_PORT = 9467


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
    return shim_read_env_file(str(path))


def load_environ(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The effective `AEP_BRIDGE_*` view: the config file overlaid by the environment."""
    env = dict(os.environ if environ is None else environ)
    path = Path(env.get("AEP_BRIDGE_CONFIG") or default_config_path())
    merged = read_env_file(path)
    merged.update({k: v for k, v in env.items()})
    return merged


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
    spool_dir: Path = field(default_factory=lambda: default_state_dir() / "spool")
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
    log_format: str = "json"
    log_level: str = "info"
    #: nats-py inbox prefix; None: the role's own (bridge.nats.connection.ROLE_INBOX)
    inbox_prefix: str | None = None

    @property
    def servers(self) -> list[str]:
        return [s.strip() for s in self.nats_url.split(",") if s.strip()]

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> "Settings":
        env = load_environ(environ)

        def get(name: str) -> str | None:
            value = env.get("AEP_BRIDGE_" + name)
            return value if value not in (None, "") else None

        def get_int(name: str, default: int) -> int:
            raw = get(name)
            if raw is None:
                return default
            try:
                return int(raw)
            except ValueError as exc:
                raise ValueError(f"AEP_BRIDGE_{name} must be an integer, got {raw!r}") from exc

        s = cls()
        s.nats_url = get("NATS_URL") or DEFAULT_NATS_URL
        s.nats_user = get("NATS_USER")
        s.nats_password = get("NATS_PASSWORD")
        s.nats_token = get("NATS_TOKEN")
        s.nats_creds = get("NATS_CREDS")
        s.nats_nkey_seed = get("NATS_NKEY_SEED")
        s.tls_ca = get("TLS_CA")
        s.tls_cert = get("TLS_CERT")
        s.tls_key = get("TLS_KEY")
        s.instance = get("INSTANCE") or socket.gethostname()
        if get("SPOOL_DIR"):
            s.spool_dir = Path(get("SPOOL_DIR"))  # type: ignore[arg-type]
        s.deadline_ms = get_int("DEADLINE_MS", DEFAULT_DEADLINE_MS)
        s.max_field_bytes = get_int("MAX_FIELD_BYTES", DEFAULT_MAX_FIELD_BYTES)
        s.spool_max_bytes = get_int("SPOOL_MAX_BYTES", DEFAULT_SPOOL_MAX_BYTES)
        s.partitions = get_int("PARTITIONS", DEFAULT_PARTITIONS)
        s.capture = get("CAPTURE")
        s.capture_overrides = get("CAPTURE_OVERRIDES")
        names = get("REDACT_NAMES")
        s.redact_names = tuple(n.strip() for n in names.split(",") if n.strip()) if names else ()
        s.lane_wait_ms = get_int("LANE_WAIT_MS", 2000)
        tick = get("TICK_S")
        try:
            s.tick_s = float(tick) if tick else 15.0
        except ValueError as exc:
            raise ValueError(f"AEP_BRIDGE_TICK_S must be a number of seconds, got {tick!r}") from exc
        if not s.tick_s > 0:
            raise ValueError(f"AEP_BRIDGE_TICK_S must be positive, got {tick!r}")
        port = get("METRICS_PORT")
        s.metrics_port = int(port) if port else None
        s.metrics_host = get("METRICS_HOST") or "0.0.0.0"
        s.log_format = get("LOG_FORMAT") or "json"
        s.log_level = get("LOG_LEVEL") or "info"
        s.inbox_prefix = get("INBOX_PREFIX")
        return s

    def secret_values(self, environ: dict[str, str] | None = None) -> tuple[str, ...]:
        """Values of the operator-listed names (redaction rule b), read from the environment."""
        env = os.environ if environ is None else environ
        return tuple(env[n] for n in self.redact_names if env.get(n))
