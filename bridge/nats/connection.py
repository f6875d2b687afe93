"""nats-py connection options from ``Settings``, and a ``connect`` that says what went wrong.

Credentials, in order of precedence: ``AEP_BRIDGE_NATS_CREDS`` (a ``.creds``
file: JWT + nkey), ``AEP_BRIDGE_NATS_NKEY_SEED`` (a seed file),
``AEP_BRIDGE_NATS_USER``/``PASSWORD``, ``AEP_BRIDGE_NATS_TOKEN``, and last the
user info of the URLs (``nats://user:pass@host``, ``nats://token@host``,
percent-encoded as in any URL). Credentials are taken out of the URLs and passed
as options, so they never show up in logs that print the server list. TLS is on
when ``AEP_BRIDGE_TLS_CA`` is set or a URL is ``tls://``; ``AEP_BRIDGE_TLS_CERT``
and ``AEP_BRIDGE_TLS_KEY`` add a client certificate.
"""

from __future__ import annotations

import asyncio
import contextvars
import ssl
import time
from dataclasses import dataclass
from typing import Any, Callable

import nats
import nats.errors
import nats.js.errors

from bridge.config import Settings
from bridge.nats import follow
from bridge.shim.hook import parse_server_url, shim_inbox_prefix

#: The inbox prefix of each role (nats-py ``inbox_prefix``): publish acks, JetStream API
#: answers and pulled messages arrive under it, so each role's NATS user may subscribe to
#: its own prefix only and no role hears what another pulls (deploy/nats/nats.conf).
ROLE_INBOX = {
    "bootstrap": "_INBOX.aep-bootstrap",
    "mapper": "_INBOX.aep-mapper",
    "pairing": "_INBOX.aep-pairing",
    "consumer": "_INBOX.aep-consumer",  # tail, demo, verify: readers of AEP_EVENTS
    "gate": "_INBOX.aep-gate",
    "operator": "_INBOX.aep-operator",  # aep-bridge control
    "exporter": "_INBOX.aep-exporter",
    "relay": "_INBOX.aep-relay",  # aep-bridge relay: the AEP-0003 door (reads AEP_EVENTS)
}


def inbox_prefix(settings: Settings, role: str | None) -> str | None:
    """``AEP_BRIDGE_INBOX_PREFIX`` when set, else the role's own prefix (``shim``: the
    shim's, which names its instance), else None (nats-py's ``_INBOX``)."""
    if settings.inbox_prefix:
        return settings.inbox_prefix
    if role == "shim":
        return shim_inbox_prefix(settings.instance)
    return ROLE_INBOX.get(role or "")


class NatsConnectError(RuntimeError):
    """No server accepted the connection; the message lists why, with a hint."""


@dataclass
class ServerList:
    urls: list[str]  # without credentials
    user: str | None = None
    password: str | None = None
    token: str | None = None
    tls: bool = False


def server_list(settings: Settings) -> ServerList:
    """The servers of ``AEP_BRIDGE_NATS_URL`` without user info, plus the credentials to use."""
    out = ServerList(urls=[])
    for raw in settings.servers:
        scheme, host, port, user, password, token = parse_server_url(raw)
        shown = f"[{host}]" if ":" in host else host
        out.urls.append(f"{scheme}://{shown}:{port}")
        out.tls = out.tls or scheme == "tls"
        if out.user is None and out.token is None:
            if user is not None:
                out.user, out.password = user, password
            elif token is not None:
                out.token = token
    if settings.nats_user or settings.nats_password:
        out.user, out.password, out.token = settings.nats_user, settings.nats_password, None
    if settings.nats_token:
        out.user, out.password, out.token = None, None, settings.nats_token
    return out


def tls_context(settings: Settings, force: bool = False) -> Any:
    """An SSLContext when TLS is configured (or ``force``), else None."""
    if not (force or settings.tls_ca or settings.tls_cert):
        return None

    ctx = ssl.create_default_context(cafile=settings.tls_ca) if settings.tls_ca else ssl.create_default_context()
    if settings.tls_cert:
        ctx.load_cert_chain(settings.tls_cert, settings.tls_key)
    return ctx


def connect_options(settings: Settings, *, name: str | None = None, role: str | None = None,
                    **overrides: Any) -> dict[str, Any]:
    """Keyword arguments for ``nats.connect`` (``overrides`` win). ``role``: see ROLE_INBOX."""
    servers = server_list(settings)
    name = name or f"aep-bridge-{settings.instance}"
    # Servers are tried in the list's order from the one a stable hash of the instance picks
    # (bridge.nats.follow.first_server_order: a fleet spreads over the servers), not shuffled.
    opts: dict[str, Any] = {"servers": follow.first_server_order(servers.urls, follow.identity(name)),
                            "name": name, "dont_randomize": True}
    prefix = inbox_prefix(settings, role)
    if prefix:
        opts["inbox_prefix"] = prefix
    ctx = tls_context(settings, force=servers.tls)
    if ctx is not None:
        opts["tls"] = ctx
    if settings.nats_creds:
        opts["user_credentials"] = settings.nats_creds
    elif settings.nats_nkey_seed:
        opts["nkeys_seed"] = settings.nats_nkey_seed
    elif servers.user is not None:
        opts["user"] = servers.user
        opts["password"] = servers.password or ""
    elif servers.token is not None:
        opts["token"] = servers.token
    opts.update(overrides)
    return opts


def shim_env(settings: Settings) -> dict[str, str]:
    """The variables a shim (bridge/shim/hook.py, which reads no ``Settings``) needs to connect
    as ``settings`` do: the URL and whichever of user, password, token and TLS files are set
    (e.g. `aep-bridge up`'s generated credential, for demo's and simulate's shims)."""
    pairs = (("AEP_BRIDGE_NATS_URL", settings.nats_url), ("AEP_BRIDGE_NATS_USER", settings.nats_user),
             ("AEP_BRIDGE_NATS_PASSWORD", settings.nats_password), ("AEP_BRIDGE_NATS_TOKEN", settings.nats_token),
             ("AEP_BRIDGE_TLS_CA", settings.tls_ca), ("AEP_BRIDGE_TLS_CERT", settings.tls_cert),
             ("AEP_BRIDGE_TLS_KEY", settings.tls_key))
    return {k: str(v) for k, v in pairs if v}


def describe_auth(settings: Settings) -> str:
    """Which kind of credentials the options carry (never the secrets)."""
    servers = server_list(settings)
    if settings.nats_creds:
        return f"creds file {settings.nats_creds}"
    if settings.nats_nkey_seed:
        return f"nkey seed file {settings.nats_nkey_seed}"
    if servers.user is not None:
        return f"user {servers.user!r} with a password"
    if servers.token is not None:
        return "a token"
    return "no credentials"


async def connect(settings: Settings | None = None, *, name: str | None = None, role: str | None = None,
                  **overrides: Any) -> Any:
    """``nats.connect`` with the bridge's settings. Raises NatsConnectError naming the
    servers tried, what each said and, for an authorization error, what to set."""
    settings = settings or Settings.from_env()
    errors: list[BaseException] = []
    user_cb = overrides.pop("error_cb", None)

    async def error_cb(exc: BaseException) -> None:
        errors.append(exc)
        if user_cb is not None:
            await user_cb(exc)

    opts = connect_options(settings, name=name, role=role, error_cb=error_cb, **overrides)
    try:
        return await nats.connect(**opts)
    except (nats.errors.NoServersError, nats.errors.Error, OSError, TimeoutError) as exc:
        raise NatsConnectError(explain_failure(settings, exc, errors)) from exc


def explain_failure(settings: Settings, exc: BaseException, errors: list[BaseException]) -> str:
    seen: list[str] = []
    for e in [*errors, exc]:
        text = f"{type(e).__name__}: {e}"
        if text not in seen:
            seen.append(text)
    urls = ", ".join(server_list(settings).urls)
    message = f"cannot connect to NATS at {urls}: " + "; ".join(seen[-4:])
    joined = " ".join(seen).lower()
    if "authorization" in joined or "authentication" in joined or "permissions violation" in joined:
        message += (
            f" -- the server refused the credentials ({describe_auth(settings)}); set AEP_BRIDGE_NATS_USER and "
            "AEP_BRIDGE_NATS_PASSWORD, AEP_BRIDGE_NATS_TOKEN, AEP_BRIDGE_NATS_CREDS or AEP_BRIDGE_NATS_NKEY_SEED, "
            "or put them in the URL (nats://user:pass@host:port)"
        )
    elif "ssl" in joined or "certificate" in joined or "tls" in joined:
        message += " -- TLS failed; check AEP_BRIDGE_TLS_CA / AEP_BRIDGE_TLS_CERT / AEP_BRIDGE_TLS_KEY and the URL scheme"
    else:
        message += (" -- is a NATS server running there? `aep-bridge up` starts one; --nats URL or "
                    "AEP_BRIDGE_NATS_URL names another")
    return message


async def quick_connect(settings: Settings | None = None, *, name: str | None = None, timeout: float = 2.0,
                        role: str | None = None, **overrides: Any) -> Any:
    """For one-shot commands (bootstrap, doctor, drain): fail within seconds, not minutes.

    With several servers, a command that uses JetStream (any role but the shim's) takes the
    first server, from its hashed start, whose JetStream answers `follow.PROBE_SUBJECT` (the
    services' rule, `bridge.nats.follow`): a node cut off from its peers accepts the connection
    and then never answers. When none answers, the first connection is kept (the command then
    says what JetStream did)."""
    settings = settings or Settings.from_env()
    options = {"connect_timeout": timeout, "max_reconnect_attempts": 1, "reconnect_time_wait": 0.2,
               "allow_reconnect": False, **overrides}
    nc = await connect(settings, name=name, role=role, **options)
    urls = connect_options(settings, name=name, role=role)["servers"]
    if role == "shim" or len(urls) < 2 or await follow.answers(nc, timeout=min(timeout, 2.0)):
        return nc
    for url in urls[1:]:
        try:
            other = await connect(settings, name=name, role=role, servers=[url], **options)
        except NatsConnectError:
            continue
        if await follow.answers(other, timeout=min(timeout, 2.0)):
            await nc.close()
            return other
        await other.close()
    return nc


async def connect_client(settings: Settings | None = None, *, name: str | None = None, timeout: float = 3.0,
                         role: str | None = None, **overrides: Any) -> Any:
    """For the client commands (tail, demo, simulate, verify, control): the first connection fails
    within seconds with `NatsConnectError` (what, where, what to do; a dead server, a wrong URL
    and refused credentials alike: nats-py's defaults would retry it silently for two minutes),
    and once connected a server that goes away is reconnected to, as for a service."""
    nc = await quick_connect(settings, name=name, timeout=timeout, role=role, **overrides)
    nc.options["allow_reconnect"] = True
    nc.options["max_reconnect_attempts"] = -1
    nc.options["reconnect_time_wait"] = 1.0
    return nc


#: What a JetStream API request meets while a cluster elects a leader or has lost its quorum
#: (no answer in time, no responders, 503): waited out by `until_answered`.
UNANSWERED = (nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.js.errors.ServiceUnavailableError,
              asyncio.TimeoutError)


JETSTREAM_NOT_ENABLED = 10039  # a 503 that no wait cures


def transient(exc: BaseException, nc: Any = None) -> bool:
    """Is an `UNANSWERED` error worth waiting out? Not when JetStream is off for the account
    (503, err_code 10039), nor when the server refused the request's publish (nats-py only
    reports a permissions violation to its error callback and ``last_error``; the request then
    times out, which would hide the cause behind a minute of retries)."""
    if getattr(exc, "err_code", None) == JETSTREAM_NOT_ENABLED:
        return False
    last = getattr(nc, "last_error", None) if nc is not None else None
    return "permissions violation" not in str(last or "").lower()


async def until_answered(call: Any, *, what: str, log: Any, within_s: float = 60.0, nc: Any = None) -> Any:
    """``await call()``, again with backoff while JetStream does not answer (`UNANSWERED`), for
    at most ``within_s``; then the last error propagates (a service exits 1 and is started
    again). A service starting while its cluster elects (or a node comes back after a kill of
    all three) waits for it instead of exiting on nats-py's 5 s API timeout; any other error
    (a stream that does not exist, refused permissions seen on ``nc``, JetStream not enabled:
    `transient`) propagates at once."""
    deadline = time.monotonic() + within_s
    delay = 0.5
    while True:
        try:
            return await call()
        except UNANSWERED as exc:
            if time.monotonic() + delay > deadline or not transient(exc, nc):
                raise
            log.warning("jetstream_unanswered", what=what, error=f"{type(exc).__name__}: {exc}", retry_in_s=delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)


#: What a publish or request meets while its stream has no leader (a 503 "no response from
#: stream" during an election), its server is gone or the connection is between servers: the
#: message it carried is not at fault, and retrying it later will do (`outage`).
OUTAGE = UNANSWERED + (nats.js.errors.NoStreamResponseError, nats.errors.ConnectionClosedError,
                       nats.errors.ConnectionReconnectingError, nats.errors.StaleConnectionError,
                       nats.errors.OutboundBufferLimitError, nats.errors.ConnectionDrainingError)


#: 503s that are about what was sent, not the cluster's state: a bucket or stream full with
#: discard-new (10077 "maximum bytes exceeded"), insufficient resources (10023).
NOT_AN_OUTAGE_503 = frozenset({10077, 10023})

#: a 409 "duplicate message id is in process": a publish with the same Nats-Msg-Id is being
#: proposed (a resend while the first copy waits for its quorum, e.g. a partition healing).
#: Its fate is open: an outage, retried, not the message's fault (bridge/shim/hook.py agrees).
MSG_ID_IN_PROCESS = 10158
#: a 400 "wrong last sequence" with no number (JSStreamWrongLastSequenceConstantErr): on a
#: clustered stream another publish to the subject with an expected last sequence (a KV create
#: of the same key) is being proposed. Its fate is open too: the key's winner may not be
#: readable yet (bridge.nats.lanes.lost_create reads it; until then the message is retried).
WRONG_LAST_SEQUENCE_IN_FLIGHT = 10164
IN_PROCESS = frozenset({MSG_ID_IN_PROCESS, WRONG_LAST_SEQUENCE_IN_FLIGHT})


def outage(exc: BaseException) -> bool:
    """Did ``exc`` come from the cluster being unavailable rather than from what was sent? A
    refused publish (one too large, a full stream, a KV create that lost a race) is an
    ``APIError`` with its own code: not an outage; nor is JetStream not enabled (10039). (No
    ``nc.last_error`` look: a permissions violation seen once would stay there and turn every
    later outage into a message's fault.)"""
    if getattr(exc, "err_code", None) in IN_PROCESS:  # the first copy's (or create's) fate is open: retry
        return True
    if not isinstance(exc, OUTAGE) or not transient(exc):
        return False
    return getattr(exc, "err_code", None) not in NOT_AN_OUTAGE_503


def is_auth_failure(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "authorization" in text or "authentication" in text or "refused the credentials" in text


#: seconds between a service's attempts to reconnect once it was connected (nats-py's default)
RECONNECT_TIME_WAIT_S = 2.0

#: Told of each failed attempt of `connect_service` (the error explained, the seconds until the
#: next attempt): the runtime's `serve` sets it for the service it starts, so that the service's
#: log and /healthz say why it waits (every service, without a line of its own).
CONNECT_WAITING: contextvars.ContextVar[Callable[[str, float], None] | None] = contextvars.ContextVar(
    "aep_bridge_connect_waiting", default=None)


async def connect_service(settings: Settings | None = None, *, name: str | None = None, wait_s: float | None = None,
                          role: str | None = None, **overrides: Any) -> Any:
    """For the long-running services: refused credentials fail at once (a clear error, exit
    non-zero: Kubernetes shows it instead of a pod that hangs); an unreachable server is
    retried with backoff (0.5 s doubling to 5 s), for ever (NATS may start after us) or for
    ``wait_s``, each failed attempt told to `CONNECT_WAITING`. Cancelling the caller (a
    SIGTERM while connecting) ends it at once. Once connected, the connection reconnects
    forever."""
    deadline = None if wait_s is None else time.monotonic() + wait_s
    delay = 0.5
    while True:
        try:
            # Each server tried twice, 0.2 s apart: nats-py's defaults (60 attempts, 2 s apart)
            # made one attempt last two minutes, silently, whatever allow_reconnect says.
            nc = await connect(settings, name=name, role=role, **{
                "allow_reconnect": False, "connect_timeout": 3, "max_reconnect_attempts": 1,
                "reconnect_time_wait": 0.2, **overrides})
        except NatsConnectError as exc:
            if is_auth_failure(exc) or (deadline is not None and time.monotonic() + delay > deadline):
                raise
            waiting = CONNECT_WAITING.get()
            if waiting is not None:
                waiting(str(exc), delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
            continue
        nc.options["allow_reconnect"] = True
        nc.options["max_reconnect_attempts"] = -1
        nc.options["reconnect_time_wait"] = overrides.get("reconnect_time_wait", RECONNECT_TIME_WAIT_S)
        follow_servers(nc, settings, name, role)
        return nc


async def ordered_subscribe(js: Any, subject: str, stream: str, *, config: Any = None, **kwargs: Any) -> Any:
    """nats-py's ordered consumer (push, AckNone, flow control), created by NAME (issue 44).

    A reader of AEP_EVENTS may create consumers only through
    ``$JS.API.CONSUMER.CREATE.<stream>.<name>[.<filter>]``, never the nameless
    ``$JS.API.CONSUMER.CREATE.<stream>``: a request on that subject may name an existing
    durable in its body, and nats-server then updates that durable (its filter, limits,
    inactivity threshold) whoever sent it, past any permission on names. nats-py's ordered
    consumer takes the nameless subject unless its config has a name, and when it re-creates
    its consumer (a gap, missed heartbeats) it sends the same config again, which the server
    refuses for a name that exists with another start. So this gives it a fresh random name
    (a NUID, as nats.go's ordered consumers use) at creation and at every re-creation."""
    from nats.js.api import ConsumerConfig
    from nats.nuid import NUID

    nuid = NUID()
    config = config or ConsumerConfig()
    config.name = nuid.next().decode()
    sub = await js.subscribe(subject, stream=stream, ordered_consumer=True, config=config, **kwargs)
    jsi = sub._sub._jsi
    recreate = jsi.recreate_consumer

    async def renamed() -> None:
        jsi._ccreq.name = nuid.next().decode()
        await recreate()

    jsi.recreate_consumer = renamed
    return sub


def follow_servers(nc: Any, settings: Settings | None, name: str | None, role: str | None = None) -> None:
    """Leave a server that cannot serve JetStream (`bridge.nats.follow`; issue 42)."""
    settings = settings or Settings.from_env()
    follow.start(nc, after_s=settings.nats_leave_after_s, name=name or "",
                 options=connect_options(settings, name=name, role=role))
