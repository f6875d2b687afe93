"""Live claims (AEP-0003 §4.1, AEP-0004 §4): who the relay can route a command to.

Two kinds of claimant terminate here:

* **WebSocket emitters.** A connection whose hello says ``emitter`` (or ``both``) claims every
  session it sends an Event for, for as long as it stays open. Its roster entry relays its
  hello's ``identity.agent``/``identity.instance`` and its declared ``capabilities.control``
  and ``capabilities.emits`` verbatim. The replica that terminates the connection shares
  its claims with the other replicas (``replicas.SharedClaims``: the KV bucket aep_relay,
  renewed while the socket lives), and routes to it the commands they receive: every
  replica lists, and can command, every replica's WebSocket emitters.
* **Hermes sessions** (the fleet). The gate is their control target on NATS: a Hermes session
  is live while the gate has seen it and not seen its ``on_session_finalize`` (its
  ``live.<lane token>`` record in the control bucket). Every replica sees the same set. The
  entry carries the Hermes instance the session runs on, and the gate's declared control
  block verbatim (the gate answers for every shim).

A live Hermes session shadows WebSocket emitters' claims of its name: its commands go to the
gate, and the roster lists the Hermes session only (an emitter cannot block its operators by
naming it; its events are stored all the same, under ``aep.ingest.>``). Otherwise a command
is routed only to exactly one live claimant: none is ``no-route``, more than one is
``ambiguous`` (never a guess, never a broadcast).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from bridge.services.relay.replicas import new_id

MAX_CLAIMS_PER_CONNECTION = 4096  # sessions one emitter connection may claim (memory bound)
MAX_CLAIMS = 50_000  # claims of all the connections of one replica
MAX_CLAIM_SESSION_CHARS = 1024  # a longer session name is stored, not claimed
MAX_DECLARATIONS_BYTES = 4096  # an emitter hello's identity + control + emits, as JSON: a roster entry's bound


@dataclass(eq=False)
class Claimant:
    """One emitter connection: its hello's declarations and the sessions it claimed."""

    send: Any  # async callable: a frame or bytes to that connection
    identity: dict[str, Any]
    capabilities: dict[str, Any]
    close: Any = None  # async callable: end that connection (it stopped reading)
    sessions: set[str] = field(default_factory=set)
    conn: str = field(default_factory=new_id)  # its id among the replicas (shared claims, forwarding)

    @classmethod
    def from_hello(cls, send: Any, hello: dict[str, Any], close: Any = None) -> Claimant:
        identity = hello.get("identity")
        capabilities = hello.get("capabilities")
        return cls(send, identity if isinstance(identity, dict) else {},
                   capabilities if isinstance(capabilities, dict) else {}, close)

    @property
    def agent(self) -> str | None:
        agent = self.identity.get("agent")
        return agent if isinstance(agent, str) and agent else None

    def declarations_size(self) -> int:
        """The JSON size of what a roster entry repeats per claim."""
        return len(json.dumps([self.identity, self.control, self.capabilities.get("emits")], default=str))

    @property
    def control(self) -> dict[str, Any] | None:
        control = self.capabilities.get("control")
        return control if isinstance(control, dict) else None

    def accepts(self, command_type: str) -> bool:
        accepts = (self.control or {}).get("accepts")
        return isinstance(accepts, list) and command_type in accepts

    def entry(self, session: str) -> dict[str, Any]:
        """The roster entry of one claim: declarations verbatim, nothing inferred (§4.1 rule 4)."""
        out: dict[str, Any] = {"session": session}
        for key in ("agent", "instance"):
            if isinstance(self.identity.get(key), str):
                out[key] = self.identity[key]
        if self.control is not None:
            out["control"] = self.control
        if "emits" in self.capabilities:
            out["emits"] = self.capabilities["emits"]
        return out


class Claims:
    """The WebSocket emitters' claims of this replica: session -> claimants."""

    def __init__(self, shared: Any = None) -> None:
        self.by_session: dict[str, list[Claimant]] = {}
        self.by_conn: dict[str, Claimant] = {}
        self.count = 0
        self.shared = shared  # replicas.SharedClaims: the claims published for the other replicas

    def claim(self, who: Claimant, session: str) -> bool:
        """Record that ``who`` claims ``session``; False past a bound (the connection's, the
        replica's, or a session name too long to list)."""
        if session in who.sessions:
            return True
        if (len(who.sessions) >= MAX_CLAIMS_PER_CONNECTION or self.count >= MAX_CLAIMS
                or len(session) > MAX_CLAIM_SESSION_CHARS):
            return False
        who.sessions.add(session)
        self.by_session.setdefault(session, []).append(who)
        self.by_conn[who.conn] = who
        self.count += 1
        if self.shared is not None:
            self.shared.put(session, who.conn, who.entry(session))
        return True

    def release(self, who: Claimant) -> None:
        """The connection closed: every claim it held ends."""
        for session in who.sessions:
            left = [c for c in self.by_session.get(session, []) if c is not who]
            if left:
                self.by_session[session] = left
            else:
                self.by_session.pop(session, None)
        self.count -= len(who.sessions)
        if self.shared is not None:
            self.shared.drop(who.sessions, who.conn)
        self.by_conn.pop(who.conn, None)
        who.sessions.clear()

    def of(self, session: str) -> list[Claimant]:
        return list(self.by_session.get(session, ()))

    def entries(self) -> list[dict[str, Any]]:
        return [c.entry(session) for session, claimants in self.by_session.items() for c in claimants]
