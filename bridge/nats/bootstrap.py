"""Create or update every stream, KV bucket and object store of ``bridge.nats.streams``, idempotently.

``bootstrap(js, settings)`` converges the server to the specs: a missing stream
is created, one whose managed settings differ is updated in place, an equal one
is left alone. Running it twice changes nothing the second time. Settings the
server cannot change on a live stream (storage, retention) raise
``BootstrapError`` naming the stream, instead of silently diverging.

Replicas (``--replicas`` / ``AEP_BRIDGE_STREAM_REPLICAS``): an existing stream, KV bucket
(stream ``KV_<bucket>``) or object store (``OBJ_<bucket>``) with another replica count is
scaled in place by a stream update (its messages stay; the report says "scaled from 1 to 3
replicas"). With neither set (1 for new streams), an existing stream with more replicas keeps
them: a deploy that forgot the setting never scales a cluster's R3 down. More replicas than the servers can place (a single server, or a cluster with
fewer servers) is a ``ReplicasError`` naming the servers count, raised on the server's
first refusal (it answers at once: "no suitable peers for placement", "replicas > 1 not
supported in non-clustered mode"), before any other stream is touched.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, Callable

from nats.js.errors import APIError, NotFoundError, ServiceUnavailableError

from bridge.config import BY_NAME, Layers, SettingError, Settings, resolve_field
from bridge.nats import streams as S
from bridge.nats.connection import UNANSWERED, transient

# The StreamConfig fields bootstrap owns; anything else on the server is left as it is.
MANAGED_FIELDS = (
    "subjects", "description", "retention", "storage", "discard", "max_age", "max_bytes", "max_msgs",
    "max_msg_size", "max_consumers", "max_msgs_per_subject", "duplicate_window", "num_replicas",
    "allow_rollup_hdrs", "deny_delete", "allow_direct",
)


class BootstrapError(RuntimeError):
    pass


class ReplicasError(BootstrapError):
    """More replicas asked for than the servers can place (``aep-bridge bootstrap`` exits 2).
    ``offline``: the cluster called a server offline (one down, or one it has not heard from
    yet right after a start): worth waiting for, unlike a cluster too small."""

    def __init__(self, message: str, offline: bool = False) -> None:
        super().__init__(message)
        self.offline = offline


#: How often bootstrap asks again while the cluster calls a server offline (``offline_wait_s``).
OFFLINE_RETRY_S = 0.5

# JetStream API error codes that mean "these replicas cannot be placed".
PLACEMENT_ERRORS = {
    10005,  # no suitable peers for placement (cluster smaller than the replicas, or servers down)
    10023,  # insufficient resources
    10074,  # replicas > 1 not supported in non-clustered mode
}


def servers_seen(nc: Any) -> tuple[int | None, str]:
    """How many servers the connected server reports, from its INFO: (count, description).
    A server without a ``cluster`` is a single server; a cluster's ``connect_urls`` lists the
    client URLs of the servers currently routed to it, itself included (None: not advertised)."""
    info = getattr(nc, "_server_info", None) or {}
    name = info.get("server_name") or "the server"
    if not info.get("cluster"):
        return 1, f"{name} is 1 server, not a cluster"
    urls = info.get("connect_urls") or []
    if not urls:
        return None, f"cluster {info['cluster']} (its size is not advertised)"
    n = len(set(urls))
    return n, f"cluster {info['cluster']} has {n} server{'s' if n != 1 else ''} up"


def replicas_error(js: Any, config: Any, exc: Exception) -> ReplicasError:
    count, what = servers_seen(getattr(js, "_nc", None))
    desc = getattr(exc, "description", None) or str(exc)
    n = config.num_replicas
    offline = "offline" in desc
    if offline or (count is not None and count >= n):
        hint = ("a server of the cluster is offline or unreachable: run bootstrap again once every server is up "
                "(or ask for fewer replicas)")
    else:
        hint = ("use --replicas (or AEP_BRIDGE_STREAM_REPLICAS) at most the number of servers: 1 for a single "
                "server, 3 on a three-node cluster")
    return ReplicasError(f"{n} replicas asked for, but {what}: the server refused stream {config.name} ({desc}); {hint}",
                         offline=offline)


def configured_replicas(settings: Settings | None = None, environ: dict[str, str] | None = None) -> int | None:
    """``AEP_BRIDGE_STREAM_REPLICAS`` (settings, environment or config file), None when unset."""
    value = getattr(settings, "stream_replicas", None)
    if value:
        return int(value)
    try:  # the one resolver (bridge/config.py FIELDS): environment > settings file, range 1-5
        return resolve_field(BY_NAME["AEP_BRIDGE_STREAM_REPLICAS"], Layers.load(environ)).value  # type: ignore[no-any-return]
    except SettingError as exc:
        raise BootstrapError(str(exc)) from None


def default_replicas(settings: Settings | None = None, environ: dict[str, str] | None = None) -> int:
    """``AEP_BRIDGE_STREAM_REPLICAS`` (environment or config file), else 1."""
    return configured_replicas(settings, environ) or 1


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


async def ensure_stream(js: Any, config: Any, keep_more_replicas: bool = False) -> tuple[str, dict[str, tuple[Any, Any]]]:
    """Create or update one stream. Returns ("created" | "updated" | "unchanged", differences).

    ``keep_more_replicas``: an existing stream with more replicas than ``config`` keeps them
    (the replica count was not asked for: a deploy without the setting never scales down)."""
    try:
        info = await js.stream_info(config.name)
    except NotFoundError:
        try:
            await js.add_stream(config)
        except ServiceUnavailableError:
            raise  # no meta leader yet, or JetStream off: `bootstrap` tells them apart (`transient`)
        except APIError as exc:
            if exc.err_code in PLACEMENT_ERRORS:
                raise replicas_error(js, config, exc) from None
            raise BootstrapError(f"stream {config.name} cannot be created: {exc.description or exc}") from None
        return "created", {}
    have = info.config.num_replicas or 1
    if keep_more_replicas and have > (config.num_replicas or 1):
        config = dataclasses.replace(config, num_replicas=have)
    diff = differences(info.config, config)
    if not diff:
        return "unchanged", {}
    try:
        await js.update_stream(config)
    except ServiceUnavailableError:
        raise
    except APIError as exc:
        if "num_replicas" in diff and exc.err_code in PLACEMENT_ERRORS:
            raise replicas_error(js, config, exc) from None
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
    offline_wait_s: float = 0.0,
    waiting: Callable[[Exception], None] | None = None,
    nc: Any = None,
) -> dict[str, str]:
    """Create or update HERMES_RAW, BRIDGE_MAPPED, BRIDGE_DLQ, AEP_EVENTS, the KV buckets
    (aep_lanes, aep_pairing, aep_leases) and the object store aep_checkpoints (stream
    OBJ_aep_checkpoints). Returns {stream name: outcome}.

    ``duplicate_window_s`` replaces the streams' duplicate window (default 120 s; see
    ``bridge.nats.streams.all_stream_configs``); running bootstrap again without it
    restores the default.

    ``offline_wait_s``: while the cluster refuses a placement because it calls a server offline
    (a server down, or a cluster that just started and has not heard from every peer yet), try
    again every ``OFFLINE_RETRY_S`` for up to this long in all (``waiting`` is told once), then raise
    the ``ReplicasError``; likewise while JetStream does not answer at all (`UNANSWERED`: a
    cluster with no meta leader yet), then its error; not when ``nc`` (the connection) saw a
    permissions violation, nor for JetStream not enabled (`transient`). A cluster too small for
    the replicas fails at once."""
    if replicas is None:
        replicas = configured_replicas(settings)
    keep = replicas is None  # neither --replicas nor AEP_BRIDGE_STREAM_REPLICAS: never scale down
    results: dict[str, str] = {}
    deadline = time.monotonic() + offline_wait_s  # the whole run's, not each stream's
    told = False
    for config in S.all_stream_configs(replicas or 1, duplicate_window_s):
        while True:
            try:
                outcome, diff = await ensure_stream(js, config, keep_more_replicas=keep)
                break
            except (ReplicasError, *UNANSWERED) as exc:
                # a cluster just started answers 503 or nothing until it has a meta leader
                retry = exc.offline if isinstance(exc, ReplicasError) else transient(exc, nc)
                if not retry or time.monotonic() + OFFLINE_RETRY_S > deadline:
                    raise
                if waiting is not None and not told:
                    waiting(exc)
                    told = True
                await asyncio.sleep(OFFLINE_RETRY_S)
        results[config.name] = outcome
        if report is not None:
            report(config.name, outcome, diff)
    return results
