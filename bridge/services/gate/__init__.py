"""`aep-bridge gate`: the opt-in control plane (operator-deny gate and steering), a thin shell.

The protocol is pure (``bridge.core.control``: decisions, text answers, the card
and dedupe state machines, event building); this package does the I/O around it:
``config`` (settings, constants, metrics), ``base`` (shared state: locks, KV records, seqs,
publishing, command records), ``cards`` (held calls), ``steering`` (instruction queues),
``commands`` (acks, dedupe, routing) and ``service`` (inputs, loops, start-up).
docs/ARCHITECTURE.md "Control plane" is the contract; in short:

* Switches: ``AEP_HERMES_CONTROL=1`` accepts ``control.attention.respond`` (the
  gate), ``AEP_INSTRUCT=1`` accepts ``x.hermes.control.instruct`` (steering): the
  same variables the shim reads. Off, ``control.accepts`` is empty and every
  command is ``rejected {unsupported}``; a held call is released at once.
* Inputs: a durable consumer ``gate`` on HERMES_RAW (``pre_tool_call``,
  ``pre_llm_call``, ``on_session_start``, ``on_session_finalize``): a held call carries
  ``Aep-Gate-Reply`` / ``Aep-Gate-Hold-Ms`` headers; a durable consumer
  ``gate-commands`` on AEP_EVENTS (``aep.hermes.*.control.>``,
  ``aep.hermes.*.x.*.control.>``): commands, stored in the session's history by
  being published there; core requests on ``aep.gate.instruct.*`` (the shim's pull)
  and ``aep.gate.hello`` (the capabilities document), queue group ``aep-gate``.
* Outputs: events on AEP_EVENTS (``aep.hermes.<lane token>.<type>``,
  ``Nats-Msg-Id`` = event id), bypassing pairing (their pairs are closed here);
  decisions to the shim's inbox as requests whose reply is the shim's confirmation.
* State, in JetStream KV so a restart loses nothing:
  ``aep_control`` (TTL 7 d): ``cmd.<key>`` dedupe record + recorded ack and events,
  ``card.<request id>`` held calls, ``seq.<lane token>`` the session's last gate seq,
  ``sess.<lane token>`` session source / ended; ``live.<lane token>`` while it is live (the
  relay's roster); ``aep_instruct`` (TTL 30 d):
  ``q.<lane token>`` the instruction queue.
* Time: an expiry sweep (``SWEEP_S``) and an is-the-hook-still-there probe of every
  open card (``AEP_GATE_PROBE_MS``, default 1000): a NATS "no responders" means the
  shim is gone (dismissed; at the end of the window: the expiry).

One replica: work on one session is serialised by a per-lane lock in this process,
and KV writes of cards and commands use create / compare-and-set so a second
replica cannot double-decide, but only the replica that opened a card sweeps it.
"""

from bridge.services.gate.config import GateConfig
from bridge.services.gate.service import Gate

__all__ = ["Gate", "GateConfig"]
