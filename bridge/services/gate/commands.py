"""Commands on AEP_EVENTS: parse, authorise, dedupe, decide (a card answer or an
instruction), ack exactly once; resume a release a crash interrupted."""

from __future__ import annotations

import time
from typing import Any

import structlog

from bridge.core.control import (
    ACK_TYPES,
    INSTRUCT,
    RELEASING,
    RESPOND,
    Card,
    CmdRecord,
    Command,
    Reject,
    Where,
    dedupe_action,
    gate_command,
    gone_trigger,
    is_card_id,
    parse_command,
    respond_decision,
    transition,
)
from bridge.core.identity import source_uri
from bridge.services.gate.cards import Cards
from bridge.services.gate.steering import Steering

log = structlog.get_logger("aep_bridge.gate")


class Commands(Cards, Steering):
    """Commands: each is acked once, deduplicated on (source, id), and routed to a card or a queue."""

    async def handle_command(self, msg: Any) -> None:
        parts = msg.subject.split(".")
        if len(parts) < 4:
            return
        token, ctype = parts[2], ".".join(parts[3:])
        if ctype in ACK_TYPES:
            return  # our own acks match the filter too
        cmd, malformed = parse_command(msg.data, token, ctype)
        if cmd is None:
            self.metrics.command(ctype, "dropped").inc()
            log.warning("command_dropped", subject=msg.subject, why="not JSON or no id: cannot be acked")
            return
        stream_seq = msg.metadata.sequence.stream
        async with self.lane(token):
            record, _ = await self.kv_get(self.kv, f"cmd.{cmd.key}", CmdRecord)
            action = dedupe_action(record, stream_seq)
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

    async def process(self, token: str, cmd: Command, malformed: Reject | None, stream_seq: int) -> None:
        reject = gate_command(cmd, malformed, self.config.accepts, self.config.senders)
        if reject is None and cmd.type == RESPOND:
            card, rev = await self.kv_get(self.kv, f"card.{cmd.subject}", Card) if is_card_id(cmd.subject) else (None, 0)
            verdict = respond_decision(cmd, card)
            if isinstance(verdict, Reject):
                reject = verdict
            else:
                assert card is not None
                await self.kv_put(self.kv, f"cmd.{cmd.key}", CmdRecord(state="pending", id=cmd.id, lane=token,
                                                                        card=card.id, stream_seq=stream_seq), revision=0)
                t = transition(card.state, "respond")
                assert t is not None
                card.state, card.cmd, card.cmd_id = t.state, cmd.key, cmd.id
                card.verdict, card.message, card.answer = verdict.option, verdict.message or "", verdict.answer
                rev = await self.kv_put(self.kv, f"card.{card.id}", card, revision=rev)
                released = await self.release(card)
                trigger = "released" if released else gone_trigger(time.time_ns(), card.expires, self.grace_ns(card))
                await self.settle(token, card, rev, trigger, cmd)
                return
        elif reject is None and cmd.type == INSTRUCT:
            reject = await self.instruct(token, cmd, stream_seq)
            if reject is None:
                return
        await self.finish(token, cmd, reject or Reject("unsupported", cmd.type), stream_seq)

    async def finish(self, token: str, cmd: Command, reject: Reject | None, stream_seq: int) -> None:
        """Decide a command that touches no card: record its one ack, then publish it."""
        info = await self.session_info(token, cmd.session)
        source = info.source if info and info.source else source_uri("unknown", cmd.session)
        where = Where(session=cmd.session, source=source, epoch=self.epoch)
        now = time.time_ns()
        (seq,) = await self.alloc(token, 1)
        ack = self.ack_event(where, cmd, seq, now, reject)
        await self.record(cmd, token, "", ack, [ack], stream_seq)
        await self.publish([ack])
        self.metrics.command(cmd.type, reject.reason if reject else "accepted").inc()

    async def resume(self, token: str, cmd: Command) -> None:
        """The gate stopped while releasing this command's card: finish what it started."""
        record, _ = await self.kv_get(self.kv, f"cmd.{cmd.key}", CmdRecord)
        card, rev = await self.kv_get(self.kv, f"card.{record.card}", Card) if record and record.card else (None, 0)
        if card is None or card.state != RELEASING or card.cmd != cmd.key:
            return
        if await self.listening(card.inbox):
            released = await self.release(card)
            trigger = "released" if released else gone_trigger(time.time_ns(), card.expires, self.grace_ns(card))
        else:  # it left before the end of its window: it had the decision
            late = gone_trigger(time.time_ns(), card.expires, self.grace_ns(card)) == "gone_late"
            trigger = "gone_late" if late else "resumed_gone"
        await self.settle(token, card, rev, trigger, cmd)
