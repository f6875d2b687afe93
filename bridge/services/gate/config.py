"""The gate's settings (`GateConfig`, from the environment), constants and metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from bridge.core.ceiling import CapturePolicy
from bridge.core.control import ACK_WINDOW_MS, INSTRUCT, RESPOND, accepted_verbs
from bridge.runtime import BoundedLabel, role_values

RAW_DURABLE = "gate"
COMMAND_DURABLE = "gate-commands"
RAW_HOOKS = ("pre_tool_call", "pre_llm_call", "on_session_start", "on_session_finalize")
QUEUE_GROUP = "aep-gate"
SWEEP_S = 0.1
MAX_DELIVER = 4  # a raw message or command whose handling keeps failing is given up (logged) on this delivery
MAX_DELIVER_UNAVAILABLE = 34  # ... when NATS did not answer (timeouts, no responders): ~65 s of naks, past an election (one took 20-30 s on the loaded 2-core machine while a restarted peer caught up: 14, ~22 s, gave messages up)
MAX_HOLD_MS = 300_000  # Hermes clamps a hook timeout to 300 s


@dataclass
class GateConfig:
    control: bool = False
    instruct: bool = False
    senders: frozenset[str] | None = None  # AEP_CONTROL_SENDERS: allowed command `agent`s (None: any)
    probe_ms: int = 1000
    idle_ttl_s: float = 1800.0  # AEP_BRIDGE_SESSION_IDLE_TTL_S: live.<token> is re-stamped well within it
    release_timeout_s: float = 5.0  # how long the shim has to confirm a release
    pull_timeout_s: float = 1.0  # ... an instruction delivery
    ack_window_ms: int = ACK_WINDOW_MS
    policy: CapturePolicy = field(default_factory=CapturePolicy)

    @property
    def accepts(self) -> list[str]:
        return accepted_verbs(self.control, self.instruct)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, policy: CapturePolicy | None = None,
                 flags: dict[str, Any] | None = None) -> "GateConfig":
        v = role_values("gate", environ, flags)  # bridge/config.py FIELDS
        senders = v["AEP_CONTROL_SENDERS"]
        return cls(
            control=v["AEP_HERMES_CONTROL"],
            instruct=v["AEP_INSTRUCT"],
            senders=frozenset(senders) if senders else None,
            probe_ms=v["AEP_GATE_PROBE_MS"],
            idle_ttl_s=float(v["AEP_BRIDGE_SESSION_IDLE_TTL_S"]),
            policy=policy or CapturePolicy(),
        )


class GateMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        ns = "aep_bridge_gate"
        self.commands = Counter(f"{ns}_commands_total", "Commands by type and ack (accepted or the rejection reason; reack, dropped)",
                                ["type", "ack"], registry=registry)
        self.cards = Counter(f"{ns}_cards_total", "Held calls by how they ended", ["state"], registry=registry)
        self.open = Gauge(f"{ns}_open_cards", "Held calls open now", registry=registry)
        self.foreign = Counter(f"{ns}_foreign_instance_total", "Raw messages naming a session of another instance "
                               "(ignored, dead-lettered as instance_conflict)", registry=registry)
        self.recreated = Counter(f"{ns}_consumers_recreated_total", "Durables found gone and created again",
                                 ["consumer"], registry=registry)
        self.instructions = Counter(f"{ns}_instructions_total", "Instructions queued, delivered, dropped", ["event"], registry=registry)
        # A command's type comes from the wire: the known ones by name, the rest `other`.
        self.type_label = BoundedLabel(known=(RESPOND, INSTRUCT, "control.cancel", "control.pause", "control.resume"))

    def command(self, command_type: str, ack: str) -> Any:
        return self.commands.labels(type=self.type_label(command_type), ack=ack)
