"""Held calls (AEP-0004 cards): open one for a held ``pre_tool_call``, settle it (answer,
expiry, a hook gone), sweep the open ones, release the shim with its decision."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time

import nats.errors
import structlog

from bridge.core.aep import Event
from bridge.core.control import (
    CLOSED_DETAIL,
    DEFAULT_DENY_MESSAGE,
    DENY,
    OPEN,
    RELEASING,
    TIMEOUT,
    Card,
    Command,
    Reject,
    Where,
    build_event,
    card_payload,
    gate_id,
    gone_trigger,
    transition,
)
from bridge.services.gate.base import GateBase

log = structlog.get_logger("aep_bridge.gate")


class Cards(GateBase):
    """Held calls: opening, settling, sweeping and releasing cards."""

    async def open_card(self, token: str, lane: str, tool_event: Event, raw_id: str, raw_seq: int, ts: int,
                        hold_ms: int, inbox: str) -> None:
        if not self.config.control:  # the shim holds, this gate does not take answers: let the call go now
            log.warning("held_call_without_control", lane=lane, inbox=inbox)
            with contextlib.suppress(Exception):
                await self.nc.request(inbox, json.dumps({"op": "release", "decision": "allow", "id": raw_id}).encode(),
                                      timeout=self.config.release_timeout_s)
            return
        tool = (tool_event.data or {}).get("tool") or {}
        card = Card(
            id=gate_id(f"{raw_id}/request", ts // 1_000_000), session=lane, lane=token, source=tool_event.source,
            run=tool_event.run or "", tool=tool.get("name", ""), call_id=tool.get("call_id", ""),  # type: ignore[arg-type]
            tool_event=tool_event.id, inbox=inbox, raw_id=raw_id, raw_seq=raw_seq, ts=ts,
            expires=ts + hold_ms * 1_000_000, epoch=self.epoch,
        )
        async with self.lane(token):
            existing, _ = await self.kv_get(self.kv, f"card.{card.id}", Card)
            if existing is not None:  # a redelivered raw message: the card exists already
                if existing.state in (OPEN, RELEASING):
                    self.cards[card.id] = (token, existing.expires)
                return
            if not await self.claim_inbox(inbox, card.id):  # one card per held call's inbox
                self.metrics.cards.labels(state="bad_reply").inc()
                log.warning("gate_reply_reused", card=card.id, lane=lane, raw_seq=raw_seq)
                return
            now = time.time_ns()
            expired = now >= card.expires - self.grace_ns(card)
            seqs = await self.alloc(token, 2 if expired else 1, anchor=raw_seq)
            where = Where(session=lane, source=card.source, epoch=self.epoch, run=card.run)
            etype, payload = card_payload(self.config.policy, "requested", card, now)
            requested = build_event(self.config.policy, etype, payload, where=where, event_id=card.id, seq=seqs[0],
                                      time_ns=ts, subject=card.tool, cause=card.tool_event)
            events = [requested]
            if expired:  # the gate saw it too late (it was down): the shim has released it already
                card.state = TIMEOUT
                events += self.card_events(card, ("timeout",), seqs[1:], now, "")
                self.metrics.cards.labels(state=TIMEOUT).inc()
            await self.publish(events)
            await self.kv_put(self.kv, f"card.{card.id}", card, revision=0)
            if card.state == OPEN:
                self.cards[card.id] = (token, card.expires)
                self.metrics.open.set(len(self.cards))
        log.info("card_opened", card=card.id, lane=lane, tool=card.tool, hold_ms=hold_ms, state=card.state)

    async def claim_inbox(self, inbox: str, card_id: str) -> bool:
        """Bind a held call's inbox to the card it opened (KV create): a later raw message naming
        the same inbox (copied by someone who overheard it) opens no card, so an answer to
        another card can never reach this call."""
        key = "inbox." + hashlib.sha256(inbox.encode()).hexdigest()[:32]
        try:
            await self.kv.create(key, card_id.encode())
            return True
        except Exception:
            entry = await self.kv.get(key)
            return entry is not None and entry.value == card_id.encode()  # a redelivery of the same call

    def grace_ns(self, card: Card) -> int:
        """How close to the end of the hold window a vanished shim counts as the expiry."""
        return min(1_000_000_000, (card.expires - card.ts) // 10)

    def card_events(self, card: Card, kinds: tuple[str, ...], seqs: list[int], now: int, cmd_id: str) -> list[Event]:
        where = Where(session=card.session, source=card.source, epoch=card.epoch, run=card.run)
        out: list[Event] = []
        for kind, seq in zip(kinds, seqs):
            etype, payload = card_payload(self.config.policy, kind, card, now)
            if kind == "answered":
                cause = cmd_id
            elif kind == "resolved_answered":
                cause = out[-1].id if out else card.id
            else:
                cause = card.id
            eid = gate_id(f"{card.id}/{kind}", now // 1_000_000)
            out.append(build_event(self.config.policy, etype, payload, where=where, event_id=eid, seq=seq,
                                     time_ns=now, subject=card.id, cause=cause))
        return out

    async def settle(self, token: str, card: Card, revision: int, trigger: str, cmd: Command | None) -> bool:
        """Apply a card transition (caller holds the lane lock): events, card, command record."""
        t = transition(card.state, trigger)
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
            where = Where(session=card.session, source=card.source, epoch=card.epoch, run=card.run)
            if t.ack == "accepted":
                ack = self.ack_event(where, cmd, seqs[0], now, None)
                events = [ack, *card_events]
            else:  # refused: the card event says why, the ack follows
                ack = self.ack_event(where, cmd, seqs[-1], now, Reject("refused", CLOSED_DETAIL[t.state]))
                events = [*card_events, ack]
        await self.kv_put(self.kv, f"card.{card.id}", card, revision=revision)  # compare-and-set: one decision
        if cmd is not None and ack is not None:
            await self.record(cmd, token, card.id, ack, events, stream_seq=None)
        await self.publish(events)
        if t.state not in (OPEN, RELEASING):
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
                card, rev = await self.kv_get(self.kv, f"card.{card_id}", Card)
                if card is None or card.state not in (OPEN, RELEASING):
                    self.cards.pop(card_id, None)
                    continue
                if card.state != OPEN:
                    continue
                if time.time_ns() >= card.expires:
                    await self.settle(token, card, rev, "expired", None)
                elif probe and not await self.listening(card.inbox):
                    await self.settle(token, card, rev, gone_trigger(time.time_ns(), card.expires, self.grace_ns(card)), None)

    async def listening(self, inbox: str) -> bool:
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

    async def release(self, card: Card) -> bool:
        """Send the decision; True when the shim confirmed it (then it applies it)."""
        body = {"op": "release", "decision": card.verdict, "id": card.raw_id}  # the shim checks the id
        if card.verdict == DENY:
            body["message"] = card.message or DEFAULT_DENY_MESSAGE
        try:
            await self.nc.request(card.inbox, json.dumps(body).encode(), timeout=self.config.release_timeout_s)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError, asyncio.TimeoutError):
            return False
        return True
