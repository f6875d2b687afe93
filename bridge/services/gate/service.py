"""The gate service: its inputs (HERMES_RAW, commands, the pull and hello requests), the
loops that consume them, start-up (buckets, consumers, open cards) and shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
import structlog

from bridge.core import deadletter
from bridge.core.control import (
    DEFAULT_HOLD_MS,
    GATE_HOLD_HEADER,
    GATE_REPLY_HEADER,
    OPEN,
    RELEASING,
    Card,
    SessionInfo,
)
from bridge.core.envelope import EnvelopeError, decode_raw
from bridge.core.lanes import event_lane_token
from bridge.core.pipeline import map_record, record_from_raw
from bridge.runtime import KvLanes, Loop, configured_replicas, connect_service, ensure_stream, epoch_of, follow
from bridge.runtime import streams as S
from bridge.runtime import subjects as subj
from bridge.services.gate.commands import Commands
from bridge.services.gate.config import (
    COMMAND_DURABLE,
    MAX_DELIVER,
    MAX_DELIVER_UNAVAILABLE,
    MAX_HOLD_MS,
    QUEUE_GROUP,
    RAW_DURABLE,
    SWEEP_S,
)

log = structlog.get_logger("aep_bridge.gate")

# NATS did not answer: a leader election, a node lost. Waited out (MAX_DELIVER_UNAVAILABLE).
UNAVAILABLE = (nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.js.errors.ServiceUnavailableError,
               asyncio.TimeoutError, nats.errors.ConnectionClosedError)


class Gate(Commands):
    """`aep-bridge gate`: held calls, commands and steering, served from NATS."""

    name = "gate"

    async def handle_raw(self, msg: Any) -> None:
        hook = msg.subject.rsplit(".", 1)[-1]
        try:
            raw = decode_raw(msg.data)
            # a forged instance: the mapper dead-letters it; one subject speaks for one instance
            raw = msgspec.structs.replace(raw, instance=subj.check_raw_instance(msg.subject, raw.instance))
            record = record_from_raw(raw)
            await self.lanes.prefetch(record.envelope)
            raw_seq = msg.metadata.sequence.stream
            result = map_record(record, raw_seq, self.epoch, self.lanes.cache, self.config.policy)
            if not result.events:
                return
            token = event_lane_token(result.lane, result.unknown)
        except (EnvelopeError, subj.SubjectError) as exc:  # the mapper dead-letters it; nothing to hold or learn
            log.warning("raw_skipped", subject=msg.subject, reason=exc.reason)
            return
        source = result.events[0].source
        if not result.unknown and await self.foreign_instance(msg, token, raw.instance or "", raw_seq, result.lane):
            return  # another instance's session: never its state (issue 44 item 3)
        if hook == "on_session_finalize":
            await self.finalize(token, result.lane, source, raw.instance or "", raw_seq)
            return
        if not result.unknown:
            await self.learn(token, source, raw.instance or "", session=result.lane)
        reply = (msg.headers or {}).get(GATE_REPLY_HEADER)
        if hook == "pre_tool_call" and reply and not subj.shim_reply_ok(reply, msg.subject.split(".")[2], "g"):
            # Only the publisher's own inbox space: never a stream, a bucket or another role's inbox.
            self.metrics.cards.labels(state="bad_reply").inc()
            log.warning("gate_reply_refused", subject=msg.subject, raw_seq=raw_seq, reply=reply[:120])
            return
        if hook == "pre_tool_call" and reply:
            tool_event = next((e for e in result.events if e.type == "tool.requested"), result.events[0])
            try:
                hold_ms = min(MAX_HOLD_MS, max(1, int((msg.headers or {}).get(GATE_HOLD_HEADER) or DEFAULT_HOLD_MS)))
            except ValueError:
                hold_ms = DEFAULT_HOLD_MS
            await self.open_card(token, result.lane, tool_event, raw.id, raw_seq, raw.ts, hold_ms, reply)

    async def foreign_instance(self, msg: Any, token: str, instance: str, raw_seq: int, session: str = "") -> bool:
        """Whether the raw message comes from another instance than the one the session
        belongs to: the first instance seen for it, the record the mapper keeps too
        (``o.<token>`` in aep_lane_facts, a KV create: whichever of the two sees the session
        first records it, both read the same), else (that bucket not there) the first the gate
        saw, in ``sess.<token>`` of aep_control. Such a message changes nothing (no finalize,
        no card, no record): it is counted and dead-lettered (``bridge.dlq.instance_conflict``)."""
        owner = None
        if session and self.lanes.facts is not None:
            try:
                owner = await self.lanes.session_owner(session, subj.token(instance))
            except Exception as exc:  # cannot tell now: the gate's own record decides
                log.warning("session_owner_failed", raw_seq=raw_seq, error=f"{type(exc).__name__}: {exc}")
        if owner is None:
            info, _ = await self.kv_get(self.kv, f"sess.{token}", SessionInfo)
            owner = info.instance if info is not None else None
        # compared as subject tokens: a record written before names became their token (6c) still matches
        if not owner or subj.token(owner) == subj.token(instance):
            return False
        self.metrics.foreign.inc()
        reason = "instance_conflict"
        detail = f"session of instance {owner[:100]!r}, message from {instance[:100]!r}"
        log.warning("foreign_instance", subject=msg.subject, raw_seq=raw_seq, owner=owner[:100],
                    instance=instance[:100])
        original = deadletter.Original(S.HERMES_RAW, raw_seq, msg.subject, msg.data, msg.headers)
        letter = deadletter.build("gate", reason, reason, detail, original, self.config.policy)
        with contextlib.suppress(Exception):  # counted and logged whatever happens to the letter
            await self.js.publish(subj.dlq_subject(reason), letter.body,
                                  headers={**letter.headers, "Nats-Msg-Id": f"dlq:{S.HERMES_RAW}:gate:{raw_seq}"})
        return True

    async def handle_hello(self, msg: Any) -> None:
        if msg.reply and subj.requester_reply_ok(msg.reply):  # an inbox: never a stream or bucket subject
            await msg.respond(json.dumps(self.hello).encode())

    async def consume(self, sub: Any, handler: Any, what: str) -> None:
        while not self.stopper.stopping:
            self.health.beat()
            try:
                msgs = await sub.fetch(64, timeout=0.5)
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                continue
            except Exception as exc:
                self.health.set_ready(False, f"{what} fetch failed: {exc}")
                log.warning("fetch_failed", what=what, error=f"{type(exc).__name__}: {exc}")
                sub = await self.rebind(sub, what)
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
                    # NATS not answering (a bucket's leader changing, a node lost) is waited out
                    # for longer than an election takes; other failures are given up sooner.
                    limit = MAX_DELIVER_UNAVAILABLE if isinstance(exc, UNAVAILABLE) else MAX_DELIVER
                    if delivered < limit:
                        with contextlib.suppress(Exception):
                            await msg.nak(delay=min(2.0, 0.5 * delivered))
                        continue
                    log.error("handle_given_up", what=what, subject=msg.subject, delivered=delivered)
                with contextlib.suppress(Exception):
                    await msg.ack()

    async def rebind(self, sub: Any, what: str) -> Any:
        """After a failed fetch: when the durable is gone (deleted by hand, or by a role that
        should not have been able to: issue 44), create it again and pull from the new one.
        Until it is back the gate is neither ready nor healthy (/healthz 503: its supervisor
        may restart it, which creates both durables too)."""
        stream, durable = (S.HERMES_RAW, RAW_DURABLE) if what == "raw" else (S.AEP_EVENTS, COMMAND_DURABLE)
        try:
            await self.js.consumer_info(stream, durable)
            return sub  # still there: another failure (an election, a lost server), waited out
        except nats.js.errors.NotFoundError:
            pass
        except Exception:
            return sub
        self.metrics.recreated.labels(consumer=durable).inc()
        self.health.failed = f"{what} consumer {durable} on {stream} is gone: recreating it"
        log.error("consumer_gone", what=what, stream=stream, durable=durable)
        try:
            new = await (self.bind_raw() if what == "raw" else self.bind_commands())
        except Exception as exc:
            log.error("consumer_recreate_failed", durable=durable, error=f"{type(exc).__name__}: {exc}")
            return sub
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
        if self.health.failed and self.health.failed.startswith(f"{what} consumer"):
            self.health.failed = None  # healthy again (ready again with its next fetch)
        log.warning("consumer_recreated", what=what, stream=stream, durable=durable)
        return new

    async def bind_raw(self) -> Any:
        return await self.js.pull_subscribe("", durable=RAW_DURABLE, stream=S.HERMES_RAW, config=S.GATE_RAW_CONSUMER.config(RAW_DURABLE))

    async def bind_commands(self) -> Any:
        return await self.js.pull_subscribe("", durable=COMMAND_DURABLE, stream=S.AEP_EVENTS, config=S.GATE_COMMAND_CONSUMER.config(COMMAND_DURABLE))

    async def sweep_loop(self) -> None:
        while not self.stopper.stopping:
            try:
                await self.sweep()
            except Exception as exc:
                log.warning("sweep_failed", error=f"{type(exc).__name__}: {exc}")
            if await self.stopper.sleep(SWEEP_S):
                return

    async def connect(self) -> tuple[Any, Any]:
        self.nc = await connect_service(self.settings, name=f"aep-bridge-gate-{self.settings.instance}", role="gate")
        if (follower := follow.of(self.nc)) is not None:
            follower.lead(S.HERMES_RAW)  # a server that cannot reach its leader is left (bridge.nats.follow)
        self.js = self.nc.jetstream()
        replicas = configured_replicas(self.settings)  # AEP_BRIDGE_STREAM_REPLICAS, like `bootstrap`
        for spec in S.CONTROL_BUCKETS:  # unset: 1 for new buckets, existing ones keep theirs (never scaled down)
            await ensure_stream(self.js, spec.config(replicas or 1), keep_more_replicas=replicas is None)
        self.kv = await follow.kv(self.js, S.CONTROL_BUCKET.bucket)
        self.queues = await follow.kv(self.js, S.INSTRUCT_BUCKET.bucket)
        try:  # the sessions' instances, shared with the mapper (o.<lane token>: `foreign_instance`)
            facts = await follow.kv(self.js, S.LANE_FACTS_BUCKET)
        except Exception as exc:  # not there (a release before it) or not granted: the gate's own record only
            log.warning("lane_facts_unavailable", error=f"{type(exc).__name__}: {exc}")
            facts = None
        self.lanes = KvLanes(await follow.kv(self.js, S.LANES_BUCKET), facts=facts)
        info = await self.js.stream_info(S.HERMES_RAW)
        self.epoch = epoch_of(info.created)  # the mapper's rule: the session's events share one epoch
        raw = await self.bind_raw()
        commands = await self.bind_commands()
        await self.nc.subscribe(subj.HELLO_SUBJECT, queue=QUEUE_GROUP, cb=self.handle_hello)
        await self.nc.subscribe(subj.instruct_filter(), queue=QUEUE_GROUP, cb=self.handle_pull)
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
                    card = msgspec.json.decode(entry.value, type=Card)
                except Exception:
                    continue
                if card.state in (OPEN, RELEASING):
                    self.cards[card.id] = (card.lane, card.expires)
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()
        self.metrics.open.set(len(self.cards))

    def starting(self) -> dict[str, Any]:
        return {"accepts": self.config.accepts}

    async def start(self) -> list[Loop]:
        raw, commands = await self.connect()
        self.health.set_ready(True)
        log.info("gate_ready", accepts=self.config.accepts, epoch=self.epoch, open_cards=len(self.cards))
        return [self.consume(raw, self.handle_raw, "raw"), self.consume(commands, self.handle_command, "commands"),
                self.sweep_loop()]
