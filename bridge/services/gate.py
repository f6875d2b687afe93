"""`aep-bridge gate`: the opt-in control plane (operator-deny gate and steering), a thin shell.

The protocol is pure (``bridge.core.control``: decisions, text answers, the card
and dedupe state machines, event building); this file does the I/O around it.
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
  ``sess.<lane token>`` session source / ended; ``aep_instruct`` (TTL 30 d):
  ``q.<lane token>`` the instruction queue.
* Time: an expiry sweep (``SWEEP_S``) and an is-the-hook-still-there probe of every
  open card (``AEP_GATE_PROBE_MS``, default 1000): a NATS "no responders" means the
  shim is gone (dismissed; at the end of the window: the expiry).

One replica: work on one session is serialised by a per-lane lock in this process,
and KV writes of cards and commands use create / compare-and-set so a second
replica cannot double-decide, but only the replica that opened a card sweeps it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import msgspec
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge

from bridge.config import Settings, load_environ
from bridge.core import control as C
from bridge.core.aep import Event, decode_event, encode_event
from bridge.core.capture import CapturePolicy
from bridge.core.envelope import EnvelopeError, decode_raw
from bridge.core.identity import source_uri
from bridge.core.lanes import UNKNOWN, lane_token
from bridge.core.pipeline import map_record, record_from_raw
from bridge.nats import streams as S
from bridge.services.runtime import BoundedLabel, Health, HttpServer, Stopper

log = structlog.get_logger("aep_bridge.gate")

GATE_METRICS_PORT = 9466
CONTROL_BUCKET = S.BucketSpec("aep_control", "control plane: commands (cmd.), held calls (card.), seq. and sess. per session",
                              ttl_s=7 * S.DAY, max_bytes=S.GiB)
INSTRUCT_BUCKET = S.BucketSpec("aep_instruct", "steering: instruction queues per session (q.<lane token>)",
                               ttl_s=30 * S.DAY, max_bytes=S.GiB)
RAW_DURABLE = "gate"
COMMAND_DURABLE = "gate-commands"
RAW_HOOKS = ("pre_tool_call", "pre_llm_call", "on_session_start", "on_session_finalize")
QUEUE_GROUP = "aep-gate"
SWEEP_S = 0.1
MAX_DELIVER = 4  # a raw message or command whose handling keeps failing is given up (logged) on this delivery
MAX_HOLD_MS = 300_000  # Hermes clamps a hook timeout to 300 s


def _on(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


@dataclass
class GateConfig:
    control: bool = False
    instruct: bool = False
    senders: frozenset[str] | None = None  # AEP_CONTROL_SENDERS: allowed command `agent`s (None: any)
    probe_ms: int = 1000
    release_timeout_s: float = 5.0  # how long the shim has to confirm a release
    pull_timeout_s: float = 1.0  # ... an instruction delivery
    ack_window_ms: int = C.ACK_WINDOW_MS
    policy: CapturePolicy = field(default_factory=CapturePolicy)

    @property
    def accepts(self) -> list[str]:
        return C.accepted_verbs(self.control, self.instruct)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, policy: CapturePolicy | None = None) -> "GateConfig":
        env = load_environ(environ)
        senders = env.get("AEP_CONTROL_SENDERS", "").strip()
        return cls(
            control=_on(env.get("AEP_HERMES_CONTROL")),
            instruct=_on(env.get("AEP_INSTRUCT")),
            senders=frozenset(s.strip() for s in senders.split(",") if s.strip()) if senders else None,
            probe_ms=int(env.get("AEP_GATE_PROBE_MS") or 1000),
            policy=policy or CapturePolicy(),
        )


class GateMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        ns = "aep_bridge_gate"
        self.commands = Counter(f"{ns}_commands_total", "Commands by type and ack (accepted or the rejection reason; reack, dropped)",
                                ["type", "ack"], registry=registry)
        self.cards = Counter(f"{ns}_cards_total", "Held calls by how they ended", ["state"], registry=registry)
        self.open = Gauge(f"{ns}_open_cards", "Held calls open now", registry=registry)
        self.instructions = Counter(f"{ns}_instructions_total", "Instructions queued, delivered, dropped", ["event"], registry=registry)
        # A command's type comes from the wire: the known ones by name, the rest `other`.
        self.type_label = BoundedLabel(known=(C.RESPOND, C.INSTRUCT, "control.cancel", "control.pause", "control.resume"))

    def command(self, command_type: str, ack: str) -> Any:
        return self.commands.labels(type=self.type_label(command_type), ack=ack)


class Gate:
    def __init__(self, settings: Settings, config: GateConfig | None = None, registry: CollectorRegistry | None = None) -> None:
        self.settings = settings
        self.config = config or GateConfig.from_env()
        self.registry = registry or CollectorRegistry()
        self.metrics = GateMetrics(self.registry)
        self.health = Health("gate")
        self.stopper = Stopper()
        self.hello = C.hello(self.config.accepts, self.config.ack_window_ms, settings.instance)
        self.health.info.update(control=self.hello["capabilities"]["control"], hello=self.hello)
        self.nc: Any = None
        self.js: Any = None
        self.kv: Any = None  # aep_control
        self.queues: Any = None  # aep_instruct
        self.lanes: Any = None
        self.epoch = 0
        self.cards: dict[str, tuple[str, int]] = {}  # open/releasing card id -> (lane token, expires ns): swept
        self._locks: dict[str, asyncio.Lock] = {}
        self._last_probe = 0.0

    # ------------------------------------------------------------ small helpers

    @contextlib.asynccontextmanager
    async def lane(self, token: str) -> AsyncIterator[None]:
        """Serialise everything done for one session (cards, commands, queue, seq)."""
        lock = self._locks.get(token)
        if lock is None:
            lock = self._locks[token] = asyncio.Lock()
        async with lock:
            yield
        if not lock.locked() and not getattr(lock, "_waiters", None):
            self._locks.pop(token, None)

    async def kv_get(self, bucket: Any, key: str, tp: Any) -> tuple[Any, int]:
        from nats.js.errors import KeyDeletedError, KeyNotFoundError

        try:
            entry = await bucket.get(key)
        except (KeyNotFoundError, KeyDeletedError):
            return None, 0
        if entry is None or not entry.value:
            return None, int(entry.revision or 0) if entry else 0
        return msgspec.json.decode(entry.value, type=tp), int(entry.revision or 0)

    async def kv_put(self, bucket: Any, key: str, value: Any, revision: int | None = None) -> int:
        """put; ``revision=0`` creates (fails when the key exists), a revision compares-and-sets."""
        data = msgspec.json.encode(value)
        if revision is None:
            return int(await bucket.put(key, data))
        if revision == 0:
            return int(await bucket.create(key, data))
        return int(await bucket.update(key, data, last=revision))

    async def raw_last_seq(self) -> int:
        info = await self.js.stream_info(S.HERMES_RAW)
        return int(info.state.last_seq or 0)

    async def alloc(self, token: str, n: int, anchor: int | None = None, slot: int = C.GATE_SLOT) -> list[int]:
        """``n`` consecutive seqs of the session (caller holds the lane lock). ``anchor``: the raw
        stream position to sort after (default: the raw stream's last sequence now)."""
        if n <= 0:
            return []
        if anchor is None:
            anchor = await self.raw_last_seq()
        last, _ = await self.kv_get(self.kv, f"seq.{token}", C.Position)
        first = C.next_seq(last, self.epoch, anchor, slot)
        seqs = list(range(first, first + n))
        if not last or last.epoch != self.epoch or seqs[-1] > last.seq:
            await self.kv_put(self.kv, f"seq.{token}", C.Position(epoch=self.epoch, seq=seqs[-1]))
        return seqs

    async def publish(self, events: list[Event] | list[bytes]) -> None:
        for ev in events:
            if isinstance(ev, bytes):
                data, ev = ev, decode_event(ev)
            else:
                data = encode_event(ev)
            subject = f"{S.EVENTS_PREFIX}.{lane_token(ev.session)}.{ev.type}"  # type: ignore[arg-type]
            await self.js.publish(subject, data, headers={"Nats-Msg-Id": ev.id})

    async def session_info(self, token: str, lane: str) -> C.SessionInfo | None:
        """What the gate knows of a session (it saw its raw events); else the source of the
        session's last turn or start on AEP_EVENTS (the gate started after the session did).
        A command on the stream proves nothing: anyone can address any session."""
        info, _ = await self.kv_get(self.kv, f"sess.{token}", C.SessionInfo)
        if info is not None:
            return info
        for etype in ("run.started", "session.started"):
            try:
                msg = await self.js.get_last_msg(S.AEP_EVENTS, f"{S.EVENTS_PREFIX}.{token}.{etype}")
                return C.SessionInfo(source=decode_event(msg.data).source)
            except Exception:
                continue
        return None

    async def learn(self, token: str, source: str, instance: str, ended: bool = False) -> None:
        info, _ = await self.kv_get(self.kv, f"sess.{token}", C.SessionInfo)
        new = C.SessionInfo(source=source, instance=instance, ended=ended)
        if info != new:
            await self.kv_put(self.kv, f"sess.{token}", new)

    # ------------------------------------------------------------ held calls (HERMES_RAW)

    async def handle_raw(self, msg: Any) -> None:
        hook = msg.subject.rsplit(".", 1)[-1]
        try:
            raw = decode_raw(msg.data)
            record = record_from_raw(raw)
        except EnvelopeError as exc:  # the mapper dead-letters it; nothing to hold or learn
            log.warning("raw_skipped", subject=msg.subject, reason=exc.reason)
            return
        await self.lanes.prefetch(record.envelope)
        raw_seq = msg.metadata.sequence.stream
        result = map_record(record, raw_seq, self.epoch, self.lanes.cache, self.config.policy)
        if not result.events:
            return
        token = lane_token(result.lane)
        source = result.events[0].source
        if hook == "on_session_finalize":
            await self.finalize(token, result.lane, source, raw.instance or "", raw_seq)
            return
        if result.lane != UNKNOWN:
            await self.learn(token, source, raw.instance or "")
        reply = (msg.headers or {}).get(C.GATE_REPLY_HEADER)
        if hook == "pre_tool_call" and reply:
            tool_event = next((e for e in result.events if e.type == "tool.requested"), result.events[0])
            try:
                hold_ms = min(MAX_HOLD_MS, max(1, int((msg.headers or {}).get(C.GATE_HOLD_HEADER) or C.DEFAULT_HOLD_MS)))
            except ValueError:
                hold_ms = C.DEFAULT_HOLD_MS
            await self.open_card(token, result.lane, tool_event, raw.id, raw_seq, raw.ts, hold_ms, reply)

    async def open_card(self, token: str, lane: str, tool_event: Event, raw_id: str, raw_seq: int, ts: int,
                        hold_ms: int, inbox: str) -> None:
        if not self.config.control:  # the shim holds, this gate does not take answers: let the call go now
            log.warning("held_call_without_control", lane=lane, inbox=inbox)
            with contextlib.suppress(Exception):
                await self.nc.request(inbox, json.dumps({"op": "release", "decision": "allow"}).encode(),
                                      timeout=self.config.release_timeout_s)
            return
        tool = (tool_event.data or {}).get("tool") or {}
        card = C.Card(
            id=C.gate_id(f"{raw_id}/request", ts // 1_000_000), session=lane, lane=token, source=tool_event.source,
            run=tool_event.run or "", tool=tool.get("name", ""), call_id=tool.get("call_id", ""),  # type: ignore[arg-type]
            tool_event=tool_event.id, inbox=inbox, raw_id=raw_id, raw_seq=raw_seq, ts=ts,
            expires=ts + hold_ms * 1_000_000, epoch=self.epoch,
        )
        async with self.lane(token):
            existing, _ = await self.kv_get(self.kv, f"card.{card.id}", C.Card)
            if existing is not None:  # a redelivered raw message: the card exists already
                if existing.state in (C.OPEN, C.RELEASING):
                    self.cards[card.id] = (token, existing.expires)
                return
            now = time.time_ns()
            expired = now >= card.expires - self.grace_ns(card)
            seqs = await self.alloc(token, 2 if expired else 1, anchor=raw_seq)
            where = C.Where(session=lane, source=card.source, epoch=self.epoch, run=card.run)
            etype, payload = C.card_payload(self.config.policy, "requested", card, now)
            requested = C.build_event(self.config.policy, etype, payload, where=where, event_id=card.id, seq=seqs[0],
                                      time_ns=ts, subject=card.tool, cause=card.tool_event)
            events = [requested]
            if expired:  # the gate saw it too late (it was down): the shim has released it already
                card.state = C.TIMEOUT
                events += self.card_events(card, ("timeout",), seqs[1:], now, "")
                self.metrics.cards.labels(state=C.TIMEOUT).inc()
            await self.publish(events)
            await self.kv_put(self.kv, f"card.{card.id}", card, revision=0)
            if card.state == C.OPEN:
                self.cards[card.id] = (token, card.expires)
                self.metrics.open.set(len(self.cards))
        log.info("card_opened", card=card.id, lane=lane, tool=card.tool, hold_ms=hold_ms, state=card.state)

    def grace_ns(self, card: C.Card) -> int:
        """How close to the end of the hold window a vanished shim counts as the expiry."""
        return min(1_000_000_000, (card.expires - card.ts) // 10)

    def card_events(self, card: C.Card, kinds: tuple[str, ...], seqs: list[int], now: int, cmd_id: str) -> list[Event]:
        where = C.Where(session=card.session, source=card.source, epoch=card.epoch, run=card.run)
        out: list[Event] = []
        for kind, seq in zip(kinds, seqs):
            etype, payload = C.card_payload(self.config.policy, kind, card, now)
            if kind == "answered":
                cause = cmd_id
            elif kind == "resolved_answered":
                cause = out[-1].id if out else card.id
            else:
                cause = card.id
            eid = C.gate_id(f"{card.id}/{kind}", now // 1_000_000)
            out.append(C.build_event(self.config.policy, etype, payload, where=where, event_id=eid, seq=seq,
                                     time_ns=now, subject=card.id, cause=cause))
        return out

    def ack_event(self, where: C.Where, cmd: C.Command, seq: int, now: int, reject: C.Reject | None) -> Event:
        etype, payload = C.ack_payload(self.config.policy, "rejected" if reject else "accepted", reject)
        eid = C.gate_id(f"ack/{cmd.key}", now // 1_000_000)
        return C.build_event(self.config.policy, etype, payload, where=where, event_id=eid, seq=seq, time_ns=now,
                             cause=cmd.id)

    async def settle(self, token: str, card: C.Card, revision: int, trigger: str, cmd: C.Command | None) -> bool:
        """Apply a card transition (caller holds the lane lock): events, card, command record."""
        t = C.transition(card.state, trigger)
        if t is None:
            return False
        now = time.time_ns()
        card.state = t.state
        with_ack = t.ack is not None and cmd is not None
        seqs = await self.alloc(token, len(t.emits) + (1 if with_ack else 0))
        card_events = self.card_events(card, t.emits, seqs[1:] if with_ack and t.ack == "accepted" else seqs, now,
                                       cmd.id if cmd else "")
        events: list[Event] = list(card_events)
        ack = None
        if with_ack:
            assert cmd is not None
            where = C.Where(session=card.session, source=card.source, epoch=card.epoch, run=card.run)
            if t.ack == "accepted":
                ack = self.ack_event(where, cmd, seqs[0], now, None)
                events = [ack, *card_events]
            else:  # refused: the card event says why, the ack follows
                ack = self.ack_event(where, cmd, seqs[-1], now, C.Reject("refused", C.CLOSED_DETAIL[t.state]))
                events = [*card_events, ack]
        await self.kv_put(self.kv, f"card.{card.id}", card, revision=revision)  # compare-and-set: one decision
        if cmd is not None and ack is not None:
            await self.record(cmd, token, card.id, ack, events, stream_seq=None)
        await self.publish(events)
        if t.state not in (C.OPEN, C.RELEASING):
            self.cards.pop(card.id, None)
            self.metrics.open.set(len(self.cards))
            self.metrics.cards.labels(state=t.state).inc()
        if ack is not None and cmd is not None:
            self.metrics.command(cmd.type, t.ack).inc()
        log.info("card_settled", card=card.id, trigger=trigger, state=t.state, command=cmd.id if cmd else None)
        return True

    async def sweep(self) -> None:
        """Expire open cards; probe them (no responders = the shim is gone)."""
        now = time.time_ns()
        probe = time.monotonic() - self._last_probe >= self.config.probe_ms / 1000
        if probe:
            self._last_probe = time.monotonic()
        for card_id, (token, expires) in list(self.cards.items()):
            if not probe and now < expires:
                continue
            async with self.lane(token):
                card, rev = await self.kv_get(self.kv, f"card.{card_id}", C.Card)
                if card is None or card.state not in (C.OPEN, C.RELEASING):
                    self.cards.pop(card_id, None)
                    continue
                if card.state != C.OPEN:
                    continue
                if time.time_ns() >= card.expires:
                    await self.settle(token, card, rev, "expired", None)
                elif probe and not await self.listening(card.inbox):
                    await self.settle(token, card, rev, C.gone_trigger(time.time_ns(), card.expires, self.grace_ns(card)), None)

    async def listening(self, inbox: str) -> bool:
        import nats.errors

        # Two "no responders" 100 ms apart before a hook is declared gone: one alone dismisses a
        # held call for good, and a loop of requests to freshly made subscriptions saw ~3 % of
        # them answered "no responders" (deploy tests, 2026-12-01).
        for attempt in range(2):
            try:
                await self.nc.request(inbox, b'{"op":"ping"}', timeout=0.5)
            except nats.errors.NoRespondersError:
                if attempt == 0:
                    await asyncio.sleep(0.1)
                    continue
                return False
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                return True  # delivered to a subscriber that did not answer in time: still there
            return True
        return False

    async def release(self, card: C.Card) -> bool:
        """Send the decision; True when the shim confirmed it (then it applies it)."""
        import nats.errors

        body = {"op": "release", "decision": card.verdict}
        if card.verdict == C.DENY:
            body["message"] = card.message or C.DEFAULT_DENY_MESSAGE
        try:
            await self.nc.request(card.inbox, json.dumps(body).encode(), timeout=self.config.release_timeout_s)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError, asyncio.TimeoutError):
            return False
        return True

    # ------------------------------------------------------------ commands (AEP_EVENTS)

    async def handle_command(self, msg: Any) -> None:
        parts = msg.subject.split(".")
        if len(parts) < 4:
            return
        token, ctype = parts[2], ".".join(parts[3:])
        if ctype in C.ACK_TYPES:
            return  # our own acks match the filter too
        cmd, malformed = C.parse_command(msg.data, token, ctype)
        if cmd is None:
            self.metrics.command(ctype, "dropped").inc()
            log.warning("command_dropped", subject=msg.subject, why="not JSON or no id: cannot be acked")
            return
        stream_seq = msg.metadata.sequence.stream
        async with self.lane(token):
            record, _ = await self.kv_get(self.kv, f"cmd.{cmd.key}", C.CmdRecord)
            action = C.dedupe_action(record, stream_seq)
            if action == "reack":
                await self.publish([record.ack.encode()])
                self.metrics.command(cmd.type, "reack").inc()
            elif action == "republish":
                await self.publish([e.encode() for e in record.events])
            elif action == "resume":
                await self.resume(token, cmd)
            elif action == "process":
                await self.process(token, cmd, malformed, stream_seq)
            log.info("command", id=cmd.id, type=cmd.type, lane=cmd.session, action=action)

    async def process(self, token: str, cmd: C.Command, malformed: C.Reject | None, stream_seq: int) -> None:
        reject = C.gate_command(cmd, malformed, self.config.accepts, self.config.senders)
        if reject is None and cmd.type == C.RESPOND:
            card, rev = await self.kv_get(self.kv, f"card.{cmd.subject}", C.Card) if C.is_card_id(cmd.subject) else (None, 0)
            verdict = C.respond_decision(cmd, card)
            if isinstance(verdict, C.Reject):
                reject = verdict
            else:
                assert card is not None
                await self.kv_put(self.kv, f"cmd.{cmd.key}", C.CmdRecord(state="pending", id=cmd.id, lane=token,
                                                                        card=card.id, stream_seq=stream_seq), revision=0)
                t = C.transition(card.state, "respond")
                assert t is not None
                card.state, card.cmd, card.cmd_id = t.state, cmd.key, cmd.id
                card.verdict, card.message, card.answer = verdict.option, verdict.message or "", verdict.answer
                rev = await self.kv_put(self.kv, f"card.{card.id}", card, revision=rev)
                released = await self.release(card)
                trigger = "released" if released else C.gone_trigger(time.time_ns(), card.expires, self.grace_ns(card))
                await self.settle(token, card, rev, trigger, cmd)
                return
        elif reject is None and cmd.type == C.INSTRUCT:
            reject = await self.instruct(token, cmd, stream_seq)
            if reject is None:
                return
        await self.finish(token, cmd, reject or C.Reject("unsupported", cmd.type), stream_seq)

    async def finish(self, token: str, cmd: C.Command, reject: C.Reject | None, stream_seq: int) -> None:
        """Decide a command that touches no card: record its one ack, then publish it."""
        info = await self.session_info(token, cmd.session)
        source = info.source if info and info.source else source_uri("unknown", cmd.session)
        where = C.Where(session=cmd.session, source=source, epoch=self.epoch)
        now = time.time_ns()
        (seq,) = await self.alloc(token, 1)
        ack = self.ack_event(where, cmd, seq, now, reject)
        await self.record(cmd, token, "", ack, [ack], stream_seq)
        await self.publish([ack])
        self.metrics.command(cmd.type, reject.reason if reject else "accepted").inc()

    async def record(self, cmd: C.Command, token: str, card: str, ack: Event, events: list[Event],
                     stream_seq: int | None) -> None:
        old, rev = await self.kv_get(self.kv, f"cmd.{cmd.key}", C.CmdRecord)
        rec = C.CmdRecord(
            state="done", id=cmd.id, lane=token, card=card,
            stream_seq=stream_seq if stream_seq is not None else (old.stream_seq if old else 0),
            ack=encode_event(ack).decode(), events=[encode_event(e).decode() for e in events],
        )
        await self.kv_put(self.kv, f"cmd.{cmd.key}", rec, revision=rev if old else 0)

    async def resume(self, token: str, cmd: C.Command) -> None:
        """The gate stopped while releasing this command's card: finish what it started."""
        record, _ = await self.kv_get(self.kv, f"cmd.{cmd.key}", C.CmdRecord)
        card, rev = await self.kv_get(self.kv, f"card.{record.card}", C.Card) if record and record.card else (None, 0)
        if card is None or card.state != C.RELEASING or card.cmd != cmd.key:
            return
        if await self.listening(card.inbox):
            released = await self.release(card)
            trigger = "released" if released else C.gone_trigger(time.time_ns(), card.expires, self.grace_ns(card))
        else:  # it left before the end of its window: it had the decision
            late = C.gone_trigger(time.time_ns(), card.expires, self.grace_ns(card)) == "gone_late"
            trigger = "gone_late" if late else "resumed_gone"
        await self.settle(token, card, rev, trigger, cmd)

    # ------------------------------------------------------------ steering

    async def instruct(self, token: str, cmd: C.Command, stream_seq: int) -> C.Reject | None:
        """Queue an instruction and ack it; or say why not (the caller acks the rejection)."""
        info = await self.session_info(token, cmd.session)
        queue, rev = await self.kv_get(self.queues, f"q.{token}", list[C.Instruction])
        queue = queue or []
        text = C.instruct_decision(cmd, info, len(queue))
        if isinstance(text, C.Reject):
            return text
        assert info is not None
        now = time.time_ns()
        queue.append(C.Instruction(cmd=cmd.id, key=cmd.key, text=text, queued=now))
        where = C.Where(session=cmd.session, source=info.source, epoch=self.epoch)
        (seq,) = await self.alloc(token, 1)
        ack = self.ack_event(where, cmd, seq, now, None)
        await self.record(cmd, token, "", ack, [ack], stream_seq)
        await self.kv_put(self.queues, f"q.{token}", queue, revision=rev)
        await self.publish([ack])
        self.metrics.command(cmd.type, "accepted").inc()
        self.metrics.instructions.labels(event="queued").inc()
        return None

    async def handle_pull(self, msg: Any) -> None:
        """The shim's pre_llm_call: deliver the session's queue, or answer {}."""
        import nats.errors

        if not msg.reply:
            return
        try:
            body = json.loads(msg.data)
            session = body["session"]
            assert isinstance(session, str) and session
        except Exception:
            await msg.respond(b"{}")
            return
        token = lane_token(session)
        async with self.lane(token):
            queue, rev = await self.kv_get(self.queues, f"q.{token}", list[C.Instruction]) if self.config.instruct else (None, 0)
            if not queue:
                await msg.respond(b"{}")
                return
            info = await self.session_info(token, session)
            try:
                await self.nc.request(msg.reply, json.dumps({"context": C.joined_context(queue)}).encode(),
                                      timeout=self.config.pull_timeout_s)
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError, asyncio.TimeoutError):
                log.info("instructions_not_delivered", lane=session, queued=len(queue))
                return  # still queued: the next turn gets them
            now = time.time_ns()
            await self.kv_put(self.queues, f"q.{token}", [], revision=rev)
            source = info.source if info and info.source else source_uri("unknown", session)
            where = C.Where(session=session, source=source, epoch=self.epoch)
            seqs = await self.alloc(token, len(queue))
            events = [
                C.build_event(self.config.policy, "x.hermes.instruction.delivered",
                              C.aep.HermesInstructionDelivered(queued_ms=max(0, (now - i.queued) // 1_000_000)),
                              where=where, event_id=C.gate_id(f"{i.key}/delivered", now // 1_000_000), seq=seq,
                              time_ns=now, cause=i.cmd)
                for i, seq in zip(queue, seqs)
            ]
            await self.publish(events)
            self.metrics.instructions.labels(event="delivered").inc(len(queue))
            log.info("instructions_delivered", lane=session, count=len(queue))

    async def finalize(self, token: str, lane: str, source: str, instance: str, raw_seq: int) -> None:
        """The real session end: drop what is still queued, audited before its session.ended."""
        async with self.lane(token):
            await self.learn(token, source, instance, ended=True)
            queue, rev = await self.kv_get(self.queues, f"q.{token}", list[C.Instruction])
            if not queue:
                return
            now = time.time_ns()
            where = C.Where(session=lane, source=source, epoch=self.epoch)
            seqs = C.drop_seqs(raw_seq, len(queue))
            events = [
                C.build_event(self.config.policy, "x.hermes.instruction.dropped",
                              C.aep.HermesInstructionDropped(reason=C.DROP_REASON, queued_ms=max(0, (now - i.queued) // 1_000_000)),
                              where=where, event_id=C.gate_id(f"{i.key}/dropped", now // 1_000_000), seq=seq,
                              time_ns=now, cause=i.cmd)
                for i, seq in zip(queue, seqs)
            ]
            await self.publish(events)
            await self.kv_put(self.queues, f"q.{token}", [], revision=rev)
            self.metrics.instructions.labels(event="dropped").inc(len(queue))
            log.info("instructions_dropped", lane=lane, count=len(queue))

    # ------------------------------------------------------------ loops

    async def handle_hello(self, msg: Any) -> None:
        if msg.reply:
            await msg.respond(json.dumps(self.hello).encode())

    async def consume(self, sub: Any, handler: Any, what: str) -> None:
        import nats.errors

        while not self.stopper.stopping:
            self.health.beat()
            try:
                msgs = await sub.fetch(64, timeout=0.5)
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                continue
            except Exception as exc:
                self.health.set_ready(False, f"{what} fetch failed: {exc}")
                log.warning("fetch_failed", what=what, error=f"{type(exc).__name__}: {exc}")
                await self.stopper.sleep(1.0)
                continue
            self.health.set_ready(True)
            for msg in msgs:
                try:
                    await handler(msg)
                except Exception as exc:  # retried (handling is idempotent), then given up: never stops the loop
                    delivered = msg.metadata.num_delivered or 1
                    log.error("handle_failed", what=what, subject=msg.subject, delivered=delivered,
                              error=f"{type(exc).__name__}: {exc}")
                    if delivered < MAX_DELIVER:
                        with contextlib.suppress(Exception):
                            await msg.nak(delay=0.5 * delivered)
                        continue
                with contextlib.suppress(Exception):
                    await msg.ack()

    async def sweep_loop(self) -> None:
        while not self.stopper.stopping:
            try:
                await self.sweep()
            except Exception as exc:
                log.warning("sweep_failed", error=f"{type(exc).__name__}: {exc}")
            if await self.stopper.sleep(SWEEP_S):
                return

    async def connect(self) -> tuple[Any, Any]:
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

        from bridge.nats.bootstrap import default_replicas, ensure_stream
        from bridge.nats.connection import connect_service
        from bridge.services.mapper import KvLanes, epoch_of

        self.nc = await connect_service(self.settings, name=f"aep-bridge-gate-{self.settings.instance}")
        self.js = self.nc.jetstream()
        replicas = default_replicas(self.settings)  # AEP_BRIDGE_STREAM_REPLICAS, like `bootstrap`
        for spec in (CONTROL_BUCKET, INSTRUCT_BUCKET):
            await ensure_stream(self.js, spec.config(replicas))
        self.kv = await self.js.key_value(CONTROL_BUCKET.bucket)
        self.queues = await self.js.key_value(INSTRUCT_BUCKET.bucket)
        self.lanes = KvLanes(await self.js.key_value(S.LANES_BUCKET))
        info = await self.js.stream_info(S.HERMES_RAW)
        self.epoch = epoch_of(info.created)  # the mapper's rule: the session's events share one epoch
        raw = await self.js.pull_subscribe("", durable=RAW_DURABLE, stream=S.HERMES_RAW, config=ConsumerConfig(
            durable_name=RAW_DURABLE, description="aep-bridge gate: held calls and session boundaries",
            deliver_policy=DeliverPolicy.NEW, ack_policy=AckPolicy.EXPLICIT, ack_wait=30.0,
            filter_subjects=[f"{S.RAW_PREFIX}.*.{h}" for h in RAW_HOOKS]))
        commands = await self.js.pull_subscribe("", durable=COMMAND_DURABLE, stream=S.AEP_EVENTS, config=ConsumerConfig(
            durable_name=COMMAND_DURABLE, description="aep-bridge gate: control commands",
            deliver_policy=DeliverPolicy.NEW, ack_policy=AckPolicy.EXPLICIT, ack_wait=30.0,
            filter_subjects=list(C.COMMAND_FILTERS)))
        await self.nc.subscribe(C.HELLO_SUBJECT, queue=QUEUE_GROUP, cb=self.handle_hello)
        await self.nc.subscribe(f"{C.INSTRUCT_PULL_PREFIX}.*", queue=QUEUE_GROUP, cb=self.handle_pull)
        await self.load_cards()
        return raw, commands

    async def load_cards(self) -> None:
        """After a restart: sweep the cards that were open (they live in KV)."""
        watcher = await self.kv.watch("card.*", ignore_deletes=True)
        try:
            async for entry in watcher:
                if entry is None:
                    break
                try:
                    card = msgspec.json.decode(entry.value, type=C.Card)
                except Exception:
                    continue
                if card.state in (C.OPEN, C.RELEASING):
                    self.cards[card.id] = (card.lane, card.expires)
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()
        self.metrics.open.set(len(self.cards))

    async def run(self, http_port: int | None = None) -> int:
        self.stopper.install()
        port = http_port if http_port is not None else (GATE_METRICS_PORT if self.settings.metrics_port is None else self.settings.metrics_port)
        http = HttpServer(self.health, self.registry, port=port).start()
        log.info("gate_starting", metrics_port=http.port, accepts=self.config.accepts)
        try:
            raw, commands = await self.connect()
        except Exception as exc:
            log.error("gate_start_failed", error=f"{type(exc).__name__}: {exc}")
            http.stop()
            await self.close()
            raise
        self.health.set_ready(True)
        log.info("gate_ready", accepts=self.config.accepts, epoch=self.epoch, open_cards=len(self.cards))
        tasks = [
            asyncio.create_task(self.consume(raw, self.handle_raw, "raw")),
            asyncio.create_task(self.consume(commands, self.handle_command, "commands")),
            asyncio.create_task(self.sweep_loop()),
        ]
        try:
            await self.stopper.event.wait()
        finally:
            log.info("gate_stopping", signal=self.stopper.signal)
            done, pending = await asyncio.wait(tasks, timeout=10)
            for t in pending:
                t.cancel()
            await self.close()
            http.stop()
        return 0

    async def close(self) -> None:
        if self.nc is not None and not self.nc.is_closed:
            with contextlib.suppress(Exception):
                await self.nc.flush(timeout=3)
            await self.nc.close()


__all__ = ["CONTROL_BUCKET", "GATE_METRICS_PORT", "Gate", "GateConfig", "INSTRUCT_BUCKET"]
