"""Steering (AEP-0008 instructions): queue an instruction, deliver the queue on the shim's
``pre_llm_call`` pull, drop it when the session is finalized."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import nats.errors
import structlog

from bridge.core import aep
from bridge.core.control import (
    DROP_REASON,
    Command,
    Instruction,
    Reject,
    Where,
    build_event,
    drop_seqs,
    gate_id,
    instruct_decision,
    joined_context,
)
from bridge.core.identity import source_uri
from bridge.core.lanes import lane_token
from bridge.runtime import subjects as subj
from bridge.services.gate.base import GateBase

log = structlog.get_logger("aep_bridge.gate")


class Steering(GateBase):
    """Instruction queues: queued by a command, pulled by the shim, dropped at the session's end."""

    async def instruct(self, token: str, cmd: Command, stream_seq: int) -> Reject | None:
        """Queue an instruction and ack it; or say why not (the caller acks the rejection)."""
        info = await self.session_info(token, cmd.session)
        queue, rev = await self.kv_get(self.queues, f"q.{token}", list[Instruction])
        queue = queue or []
        text = instruct_decision(cmd, info, len(queue))
        if isinstance(text, Reject):
            return text
        assert info is not None
        now = time.time_ns()
        queue.append(Instruction(cmd=cmd.id, key=cmd.key, text=text, queued=now))
        where = Where(session=cmd.session, source=info.source, epoch=self.epoch)
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
        if not msg.reply or not subj.shim_pull_reply_ok(msg.reply):  # answers go to a shim's inbox only
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
            queue, rev = await self.kv_get(self.queues, f"q.{token}", list[Instruction]) if self.config.instruct else (None, 0)
            if not queue:
                await msg.respond(b"{}")
                return
            info = await self.session_info(token, session)
            try:
                await self.nc.request(msg.reply, json.dumps({"context": joined_context(queue)}).encode(),
                                      timeout=self.config.pull_timeout_s)
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError, asyncio.TimeoutError):
                log.info("instructions_not_delivered", lane=session, queued=len(queue))
                return  # still queued: the next turn gets them
            now = time.time_ns()
            await self.kv_put(self.queues, f"q.{token}", [], revision=rev)
            source = info.source if info and info.source else source_uri("unknown", session)
            where = Where(session=session, source=source, epoch=self.epoch)
            seqs = await self.alloc(token, len(queue))
            events = [
                build_event(self.config.policy, "x.hermes.instruction.delivered",
                              aep.HermesInstructionDelivered(queued_ms=max(0, (now - i.queued) // 1_000_000)),
                              where=where, event_id=gate_id(f"{i.key}/delivered", now // 1_000_000), seq=seq,
                              time_ns=now, cause=i.cmd)
                for i, seq in zip(queue, seqs)
            ]
            await self.publish(events)
            self.metrics.instructions.labels(event="delivered").inc(len(queue))
            log.info("instructions_delivered", lane=session, count=len(queue))

    async def finalize(self, token: str, lane: str, source: str, instance: str, raw_seq: int) -> None:
        """The real session end: drop what is still queued, audited before its session.ended."""
        async with self.lane(token):
            await self.learn(token, source, instance, ended=True, session=lane)
            queue, rev = await self.kv_get(self.queues, f"q.{token}", list[Instruction])
            if not queue:
                return
            now = time.time_ns()
            where = Where(session=lane, source=source, epoch=self.epoch)
            seqs = drop_seqs(raw_seq, len(queue))
            events = [
                build_event(self.config.policy, "x.hermes.instruction.dropped",
                              aep.HermesInstructionDropped(reason=DROP_REASON, queued_ms=max(0, (now - i.queued) // 1_000_000)),
                              where=where, event_id=gate_id(f"{i.key}/dropped", now // 1_000_000), seq=seq,
                              time_ns=now, cause=i.cmd)
                for i, seq in zip(queue, seqs)
            ]
            await self.publish(events)
            await self.kv_put(self.queues, f"q.{token}", [], revision=rev)
            self.metrics.instructions.labels(event="dropped").inc(len(queue))
            log.info("instructions_dropped", lane=lane, count=len(queue))
