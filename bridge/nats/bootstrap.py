"""Create or update every stream, KV bucket and object store of ``bridge.nats.streams``, idempotently.

``bootstrap(js, settings)`` converges the server to the specs: a missing stream
is created, one whose managed settings differ is updated in place, an equal one
is left alone. Running it twice changes nothing the second time. Settings the
server cannot change on a live stream (storage, retention) raise
``BootstrapError`` naming the stream, instead of silently diverging.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from nats.js.errors import APIError, NotFoundError

from bridge.config import Settings, load_environ
from bridge.nats import streams as S

# The StreamConfig fields bootstrap owns; anything else on the server is left as it is.
MANAGED_FIELDS = (
    "subjects", "description", "retention", "storage", "discard", "max_age", "max_bytes", "max_msgs",
    "max_msg_size", "max_consumers", "max_msgs_per_subject", "duplicate_window", "num_replicas",
    "allow_rollup_hdrs", "deny_delete", "allow_direct",
)


class BootstrapError(RuntimeError):
    pass


def default_replicas(settings: Settings | None = None, environ: dict[str, str] | None = None) -> int:
    """``AEP_BRIDGE_STREAM_REPLICAS`` (environment or config file), else 1."""
    value = getattr(settings, "stream_replicas", None)
    if value:
        return int(value)
    raw = load_environ(environ if environ is not None else dict(os.environ)).get("AEP_BRIDGE_STREAM_REPLICAS")
    if not raw:
        return 1
    try:
        n = int(raw)
    except ValueError:
        raise BootstrapError(f"AEP_BRIDGE_STREAM_REPLICAS must be an integer, got {raw!r}") from None
    if not 1 <= n <= 5:
        raise BootstrapError(f"AEP_BRIDGE_STREAM_REPLICAS must be between 1 and 5, got {n}")
    return n


def _norm(field: str, value: Any) -> Any:
    if value is None:
        return {"subjects": (), "description": None, "max_age": 0.0, "duplicate_window": 0.0}.get(field)
    if field == "subjects":
        return tuple(sorted(value))
    if field in ("max_age", "duplicate_window"):
        return round(float(value), 3)
    if hasattr(value, "value"):  # enums
        return value.value
    return value


def differences(current: Any, wanted: Any) -> dict[str, tuple[Any, Any]]:
    """Managed fields whose value on the server differs from the spec: {field: (server, spec)}."""
    out = {}
    for f in MANAGED_FIELDS:
        want = getattr(wanted, f, None)
        if want is None:
            continue  # not managed for this stream
        have = _norm(f, getattr(current, f, None))
        want_n = _norm(f, want)
        if f == "allow_direct" and have is None and want_n is False:
            continue
        if have != want_n:
            out[f] = (have, want_n)
    return out


async def ensure_stream(js: Any, config: Any) -> tuple[str, dict[str, tuple[Any, Any]]]:
    """Create or update one stream. Returns ("created" | "updated" | "unchanged", differences)."""
    try:
        info = await js.stream_info(config.name)
    except NotFoundError:
        await js.add_stream(config)
        return "created", {}
    diff = differences(info.config, config)
    if not diff:
        return "unchanged", {}
    try:
        await js.update_stream(config)
    except APIError as exc:
        changes = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in diff.items())
        raise BootstrapError(
            f"stream {config.name} exists with different settings the server will not update in place "
            f"({changes}): {exc.description or exc}. Recreate it deliberately (this loses its messages) "
            f"or change the spec in bridge/nats/streams.py"
        ) from exc
    return "updated", diff


async def bootstrap(
    js: Any,
    settings: Settings | None = None,
    *,
    replicas: int | None = None,
    report: Callable[[str, str, dict[str, tuple[Any, Any]]], None] | None = None,
    duplicate_window_s: float | None = None,
) -> dict[str, str]:
    """Create or update HERMES_RAW, BRIDGE_MAPPED, BRIDGE_DLQ, AEP_EVENTS, the KV buckets
    (aep_lanes, aep_pairing, aep_leases) and the object store aep_checkpoints (stream
    OBJ_aep_checkpoints). Returns {stream name: outcome}.

    ``duplicate_window_s`` replaces the streams' duplicate window (default 120 s; see
    ``bridge.nats.streams.all_stream_configs``); running bootstrap again without it
    restores the default."""
    n = replicas if replicas is not None else default_replicas(settings)
    results: dict[str, str] = {}
    for config in S.all_stream_configs(n, duplicate_window_s):
        outcome, diff = await ensure_stream(js, config)
        results[config.name] = outcome
        if report is not None:
            report(config.name, outcome, diff)
    return results
