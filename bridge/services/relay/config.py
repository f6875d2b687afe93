"""The relay's settings (``AEP_BRIDGE_RELAY_*``, read as every command reads settings: flag,
environment, then the AEP_BRIDGE_CONFIG file; the table is bridge/config.py) and its tokens.

* ``AEP_BRIDGE_RELAY_LISTEN``: ``HOST:PORT`` (default ``127.0.0.1:8787``).
* ``AEP_BRIDGE_RELAY_TOKEN``: one bearer token with every right (consume, operate, emit).
* ``AEP_BRIDGE_RELAY_TOKENS_FILE``: per-client tokens, JSON or YAML::

      tokens:
        - {name: dashboard, token: "...", role: consumer, max_capture: metadata}
        - {name: oncall, token: "...", role: operator}
        - {name: ci, token: "...", role: emitter}

  ``role``: ``consumer`` (watch), ``operator`` (watch and steer: control on the WebSocket),
  ``emitter`` (POST /events only). ``max_capture`` (consumers and operators, default
  ``full``, i.e. as stored): the highest capture level this client ever receives; a
  subscription asking for more is served at this ceiling.

  Who a token may speak as (issue 44), checked on every event and command it sends:

  * ``agents`` (emitters and operators): the ``agent`` values it may carry, each exact or a
    prefix ending in ``*``. An operator's default is ``[<its name>]``: the approver on the
    stream is the token's, never the client's word. An emitter's default is any agent but
    ``hermes``.
  * ``sources`` (emitters): the ``source`` values it may carry, each exact or a prefix
    ending in ``*``. Default: any source but a Hermes instance's (``aep://<host>/agent/hermes...``).
  * ``hermes`` is granted only by name: ``agents`` listing ``hermes`` itself, and a
    ``sources`` pattern that is itself a Hermes one (``aep://gw-b/agent/hermes/*``; ``*``
    alone grants neither). No emitter token, granted or not, posts into a Hermes session
    (one the bridge's pipeline wrote): its positions are the pipeline's.
  * An operator's ``source`` of the AEP agent form (``aep://<host>/agent/<name>...``, the
    SDKs') must name one of its ``agents``; any other source belongs to the first operator
    token that used it (``replicas.SourceBindings``).

  ``AEP_BRIDGE_RELAY_TOKEN`` and the anonymous development relay: any agent and source but
  Hermes's for events; the all-rights token also commands as any agent.
* ``AEP_BRIDGE_RELAY_TLS_CERT`` / ``AEP_BRIDGE_RELAY_TLS_KEY``: serve HTTPS/WSS. Listening
  off loopback without TLS is refused unless ``AEP_BRIDGE_RELAY_INSECURE=1`` (or
  ``true``/``yes``/``on``; TLS terminated by a proxy in front, AEP-0003 §11); listening off
  loopback without any token is refused.
* ``AEP_BRIDGE_RELAY_REPLAY_BUFFER``: the replay buffer (default 10000), a GLOBAL count: the
  relay replays from the last N events AEP_EVENTS holds (fewer when the stream's age and
  byte limits have evicted more). A resume position older than that window is
  ``replay-exhausted``.
* ``AEP_BRIDGE_RELAY_QUEUE``: events queued per subscription before backpressure (default 10000).
* ``AEP_BRIDGE_RELAY_HEARTBEAT_S``: SSE ``: ping`` / idle interval (default 15).
* ``AEP_BRIDGE_RELAY_CLAIM_TTL_S``: how long a WebSocket emitter's claim, shared with the
  other replicas (the KV bucket aep_relay), outlives a replica that died without releasing it
  (default 30; renewed every third of it while the socket lives).
* ``AEP_BRIDGE_SESSION_IDLE_TTL_S`` (shared with the gate): a Hermes session with no raw
  message this long is no longer live (default 1800).

* ``AEP_BRIDGE_RELAY_REQUEST_TIMEOUT_S`` (default 10): a request's headers, a POST's body, a
  WebSocket's hello and a connection with no request must arrive within it (aiohttp's
  ``keepalive_timeout`` for the first and the last).
* ``AEP_BRIDGE_RELAY_MAX_CONNECTIONS_PER_CLIENT`` (default 256, 0: no cap): open connections
  per client address; one more is closed at once. Behind a proxy every client is the
  proxy's address: raise it there.

With no token configured at all (a development relay) it serves consumers and takes posted
events anonymously, on loopback only, and refuses control (AEP-0004: authentication is
required unconditionally). Every request of such a relay must name a loopback ``Host``
(``localhost``, ``127.0.0.1``, ``[::1]``) and, when it carries an ``Origin``, a loopback
``http(s)`` one: a web page elsewhere cannot read it or post to it, even through DNS
rebinding (the rule of ``hermes dashboard``, except that ``Origin: null`` is refused too).
Tokens are compared in constant time and never logged.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import unquote

from bridge.core.ceiling import FULL, LEVELS, level_rank
from bridge.runtime import SettingError, role_values

ROLES = ("consumer", "operator", "emitter", "all")


class RelayConfigError(SettingError):
    """A relay setting that cannot be used (the message names it, never a token value)."""


@dataclass(frozen=True)
class Principal:
    """Who a request authenticated as."""

    name: str
    role: str  # consumer | operator | emitter | all | anonymous
    max_capture: int = FULL
    agents: tuple[str, ...] | None = None  # agent patterns it may speak as (None: the role's default)
    sources: tuple[str, ...] | None = None  # emitters: source patterns (exact, or a prefix ending in *)

    def emit_refusal(self, event: dict[str, Any]) -> str | None:
        """Why this principal may not send ``event`` (its agent and source), or None."""
        agent, source = event.get("agent"), event.get("source")
        if not isinstance(agent, str) or not isinstance(source, str):
            return None  # the envelope check says what is missing
        return self.agent_refusal(agent) or self.source_refusal(source)

    def agent_refusal(self, agent: str) -> str | None:
        if self.agents is None:
            return "agent hermes is the bridge's: this token is not granted it" if is_hermes_agent(agent) else None
        if not any(pattern_matches(p, agent) and (not is_hermes_agent(agent) or is_hermes_agent(p)) for p in self.agents):
            return f"agent {agent[:200]!r} is not one this token may use ({', '.join(self.agents)})"
        return None

    def source_refusal(self, source: str) -> str | None:
        if self.sources is None:
            return "source names a Hermes instance: this token is not granted it" if is_hermes_source(source) else None
        for pattern in self.sources:
            if pattern_matches(pattern, source) and (not is_hermes_source(source) or is_hermes_source(pattern)):
                return None
        return f"source {source[:200]!r} is not one this token may use"

    def command_refusal(self, agent: Any, source: Any) -> str | None:
        """Why this operator may not send a command as (``agent``, ``source``), or None: its
        agent is one of the token's, and a source of the AEP agent form names one of them."""
        if self.agents is None:  # the all-rights token
            return None
        if not isinstance(agent, str) or self.agent_refusal(agent):
            return f"this token commands as {', '.join(self.agents)}, not {str(agent)[:200]!r}"
        named = source_agent(source) if isinstance(source, str) else None
        if named is not None and self.agent_refusal(named):
            return f"source {source[:200]!r} names agent {named[:200]!r}, not this token's"
        return None

    @property
    def may_consume(self) -> bool:
        return self.role in ("consumer", "operator", "all", "anonymous")

    @property
    def may_control(self) -> bool:
        return self.role in ("operator", "all")

    @property
    def may_emit(self) -> bool:
        return self.role in ("emitter", "all", "anonymous")


ANONYMOUS = Principal("anonymous", "anonymous")
HERMES_AGENT = "hermes"


def is_hermes_agent(agent: str) -> bool:
    return agent.strip().casefold() == HERMES_AGENT


def source_agent(source: str) -> str | None:
    """The agent an ``aep://<host>/agent/<name>[/...]`` source names (the AEP SDKs' form; the
    bridge's Hermes sources are ``aep://<instance>/agent/hermes/session/<id>``), else None."""
    scheme, sep, rest = source.partition("://")
    if not sep or scheme.casefold() != "aep":
        return None
    _host, _, path = rest.partition("/")
    parts = path.split("/")
    if len(parts) >= 2 and parts[0].casefold() == "agent":
        return unquote(parts[1])
    return None


def is_hermes_source(source: str) -> bool:
    """A Hermes instance's source (or a pattern of them): ``aep://<host>/agent/hermes...``."""
    named = source_agent(source.rstrip("*"))
    return named is not None and is_hermes_agent(named.rstrip("*"))


def pattern_matches(pattern: str, value: str) -> bool:
    return value.startswith(pattern[:-1]) if pattern.endswith("*") else value == pattern


@dataclass
class RelayConfig:
    host: str = "127.0.0.1"
    port: int = 8787
    tokens: list[tuple[bytes, Principal]] = field(default_factory=list)
    tls_cert: str | None = None
    tls_key: str | None = None
    insecure: bool = False
    replay_buffer: int = 10000
    queue: int = 10000
    heartbeat_s: float = 15.0
    claim_ttl_s: float = 30.0
    idle_ttl_s: float = 1800.0
    max_body: int = 4 * 1024 * 1024
    request_timeout_s: float = 10.0
    max_connections_per_client: int = 256

    @property
    def auth_required(self) -> bool:
        return bool(self.tokens)

    @property
    def loopback(self) -> bool:
        if self.host in ("localhost",):
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    def authenticate(self, token: str | None) -> Principal | None:
        """The principal of ``token``; ANONYMOUS when no token is configured at all; None
        when refused (a token is required, or the one given is unknown)."""
        if not self.tokens:
            return ANONYMOUS
        if not token:
            return None
        given = token.encode("utf-8", "surrogateescape")
        found = None
        for secret, principal in self.tokens:  # every comparison runs: no early exit on a match
            if hmac.compare_digest(secret, given) and found is None:
                found = principal
        return found

    def check(self) -> None:
        if not self.loopback:
            if not self.tokens:
                raise RelayConfigError(f"listening on {self.host} (off loopback) needs AEP_BRIDGE_RELAY_TOKEN or AEP_BRIDGE_RELAY_TOKENS_FILE")
            if not (self.tls_cert and self.tls_key) and not self.insecure:
                raise RelayConfigError(
                    f"listening on {self.host} (off loopback) needs TLS (AEP_BRIDGE_RELAY_TLS_CERT/_KEY), "
                    "or AEP_BRIDGE_RELAY_INSECURE=1 when a proxy in front terminates it")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise RelayConfigError("AEP_BRIDGE_RELAY_TLS_CERT and AEP_BRIDGE_RELAY_TLS_KEY go together")

    @property
    def url(self) -> str:
        scheme = "https" if self.tls_cert else "http"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}"


def parse_tokens(doc: Any, where: str) -> list[tuple[bytes, Principal]]:
    entries = doc.get("tokens") if isinstance(doc, dict) else doc
    if not isinstance(entries, list):
        raise RelayConfigError(f"{where}: expected {{tokens: [...]}}")
    out: list[tuple[bytes, Principal]] = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise RelayConfigError(f"{where}: tokens[{i}] is not an object")
        name = str(entry.get("name") or f"token{i}")
        token = entry.get("token")
        role = entry.get("role", "consumer")
        if not isinstance(token, str) or len(token) < 16:
            raise RelayConfigError(f"{where}: tokens[{i}] ({name}): token must be a string of at least 16 characters")
        if role not in ("consumer", "operator", "emitter"):
            raise RelayConfigError(f"{where}: tokens[{i}] ({name}): role {role!r} (expected consumer, operator or emitter)")
        cap = entry.get("max_capture", "full")
        if cap not in LEVELS:
            raise RelayConfigError(f"{where}: tokens[{i}] ({name}): max_capture {cap!r} (expected one of {', '.join(LEVELS)})")
        agents = _names(entry, "agents", where, i, name)
        sources = _names(entry, "sources", where, i, name)
        if sources is not None and role != "emitter":
            raise RelayConfigError(f"{where}: tokens[{i}] ({name}): sources is for emitter tokens")
        if agents is not None and role == "consumer":
            raise RelayConfigError(f"{where}: tokens[{i}] ({name}): agents is for emitter and operator tokens")
        if role == "operator" and agents is None:
            agents = [name]  # the approver is the token's own name unless it says otherwise
        out.append((token.encode(), Principal(name, role, level_rank(cap),
                                              tuple(agents) if agents is not None else None,
                                              tuple(sources) if sources is not None else None)))
    return out


def _names(entry: dict[str, Any], key: str, where: str, i: int, name: str) -> list[str] | None:
    value = entry.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise RelayConfigError(f"{where}: tokens[{i}] ({name}): {key} is a non-empty list of strings")
    return value


def load_tokens_file(path: str) -> list[tuple[bytes, Principal]]:
    text = Path(path).read_text(encoding="utf-8")
    try:
        doc = json.loads(text)
    except ValueError:
        from ruamel.yaml import YAML

        doc = YAML(typ="safe").load(text)
    return parse_tokens(doc, path)


def from_env(environ: Mapping[str, str] | None = None, flags: Mapping[str, Any] | None = None) -> RelayConfig:
    """The relay's settings (bridge/config.py FIELDS, role ``relay``): flags (``--listen`` as
    ``{"AEP_BRIDGE_RELAY_LISTEN": ...}``) over the environment over the AEP_BRIDGE_CONFIG file."""
    try:
        values = role_values("relay", environ, flags)
    except SettingError as exc:
        raise RelayConfigError(str(exc)) from None

    def get(name: str) -> Any:
        return values["AEP_BRIDGE_RELAY_" + name]

    host, port = get("LISTEN")
    tokens: list[tuple[bytes, Principal]] = []
    single = get("TOKEN")
    if single:
        tokens.append((single.encode(), Principal("relay-token", "all")))
    if get("TOKENS_FILE"):
        tokens.extend(load_tokens_file(get("TOKENS_FILE")))
    cfg = RelayConfig(
        host=host, port=port, tokens=tokens, tls_cert=get("TLS_CERT"), tls_key=get("TLS_KEY"),
        insecure=get("INSECURE"), replay_buffer=get("REPLAY_BUFFER"), queue=get("QUEUE"),
        heartbeat_s=float(get("HEARTBEAT_S")), claim_ttl_s=float(get("CLAIM_TTL_S")),
        idle_ttl_s=float(values["AEP_BRIDGE_SESSION_IDLE_TTL_S"]),
        request_timeout_s=float(get("REQUEST_TIMEOUT_S")), max_connections_per_client=get("MAX_CONNECTIONS_PER_CLIENT"),
    )
    cfg.check()
    return cfg
