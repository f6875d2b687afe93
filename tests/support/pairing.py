"""Mapped events built as the mapper would (`Mk`), for the pairing tests and the simulator's,
and `assert_valid`: an output event re-decodes as an AEP Event with its payload type."""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET

from bridge.core import aep
from bridge.core.aep import Event, encode_event
from bridge.core.identity import MAPPED_SLOT, SLOTS, event_id, rfc3339, source_uri
from bridge.core.pairing import SECOND, PairingConfig, PairingState


BASE_NS = 1_764_500_000 * SECOND


MS = 1_000_000


Msg = tuple[Event, dict[str, Any]]


DEFAULT_DATA: dict[str, Any] = {
    "session.started": {"client": {"name": "hermes"}},
    "session.ended": {"reason": "normal"},
    "run.started": {"trigger": "user"},
    "run.finished": {},
    "run.failed": {"reason": "incomplete"},
    "run.cancelled": {"by": "user"},
    "attention.requested": {"kind": "permission", "prompt": "hermes requests permission", "respond_via": ["oob"]},
    "attention.answered": {"answer": {"option": "once"}, "via": "oob"},
    "attention.timeout": {},
    "attention.resolved": {"resolution": "dismissed"},
}


TOOL_END_DATA: dict[str, dict[str, Any]] = {
    "tool.completed": {"duration_ms": 5},
    "tool.failed": {"error": {"type": "tool_error"}, "duration_ms": 5},
    "tool.denied": {"by": "policy", "duration_ms": 0},
}


class Mk:
    """Builds mapped events (and their hints) as the mapper would, one raw message per call."""

    def __init__(self, instance: str = "dev", epoch: int = 0) -> None:
        self.raw = 0
        self.instance = instance
        self.epoch = epoch

    def next_raw(self) -> int:
        self.raw += 1
        return self.raw

    def ev(
        self,
        etype: str,
        session: str | None = "S",
        *,
        run: str | None = None,
        subject: str | None = None,
        data: dict[str, Any] | None = None,
        raw: int | None = None,
        slot: int = 0,
        ts: int | None = None,
        capture: str = "metadata",
        **hints: Any,
    ) -> Msg:
        if raw is None:
            raw = self.next_raw()
        ts = ts if ts is not None else BASE_NS + raw * MS
        lane = session or "unknown"
        ev = Event(
            aep="0.1",
            id=event_id(f"raw-{self.instance}-{raw}", MAPPED_SLOT + slot, ts // MS),
            type=etype,
            time=rfc3339(ts),
            source=source_uri(self.instance, lane),
            agent="hermes",
            session=lane if session is not None or not etype.startswith("agent.") else UNSET,
            run=run or UNSET,
            seq=raw * SLOTS + MAPPED_SLOT + slot,
            epoch=self.epoch,
            subject=subject or UNSET,
            capture=capture,  # type: ignore[arg-type]
            data=dict(DEFAULT_DATA.get(etype, {})) if data is None else data,
            lane="unknown" if lane == "unknown" else UNSET,
        )
        return ev, {"ts": ts, **{k: v for k, v in hints.items() if v}}

    # -------------------------------------------------------- per hook

    def started(self, s: str = "S") -> Msg:
        return self.ev("session.started", s, hook="on_session_start")

    def ended(self, s: str = "S", **kw: Any) -> Msg:
        return self.ev("session.ended", s, hook="on_session_finalize", **kw)

    def run_start(self, s: str = "S", run: str = "S:t:r1", **kw: Any) -> Msg:
        return self.ev("run.started", s, run=run, hook="pre_llm_call", **kw)

    def run_end(self, s: str = "S", run: str | None = "S:t:r1", etype: str = "run.finished", **kw: Any) -> Msg:
        return self.ev(etype, s, run=run, hook="on_session_end", **kw)

    def api_call(self, s: str = "S", run: str = "S:t:r1", tokens: tuple[int, ...] = (100, 10, 0, 0, 0),
                 cost: dict[str, Any] | None = None, **kw: Any) -> Msg:
        """An ``x.hermes.api.call`` (post_api_request) with these five token counts (input, output,
        cache read, cache write, reasoning; a negative one is left out) and ``cost``."""
        from bridge.core.aep import USAGE_MEMBERS

        data: dict[str, Any] = {"gen_ai.request.model": "fake-model"}
        data.update({member: n for (member, _), n in zip(USAGE_MEMBERS, tokens) if n >= 0})
        if cost is not None:
            data["cost"] = cost
        return self.ev("x.hermes.api.call", s, run=run, data=data, hook="post_api_request", **kw)

    def tool_req(
        self, s: str = "S", run: str | None = "S:t:r1", cid: str = "call_1", name: str = "terminal",
        args: str = "d1", task: str = "t", **kw: Any,
    ) -> Msg:
        tool = {"name": name, **({"call_id": cid} if cid else {})}
        return self.ev(
            "tool.requested", s, run=run, subject=name, data={"tool": tool, "args_digest": args},
            hook="pre_tool_call", tool_call_id=cid, task_id=task, args_digest=args, **kw,
        )

    def tool_end(
        self, s: str = "S", run: str | None = "S:t:r1", cid: str = "call_1", etype: str = "tool.completed",
        name: str = "terminal", args: str = "d1", task: str = "t", **kw: Any,
    ) -> Msg:
        tool = {"name": name, **({"call_id": cid} if cid else {})}
        return self.ev(
            etype, s, run=run, subject=name, data={"tool": tool, **TOOL_END_DATA[etype]},
            hook="post_tool_call", tool_call_id=cid, task_id=task, args_digest=args, **kw,
        )

    def appr_req(self, s: str = "S", sk: str = "S", pk: str = "rm", cid: str = "call_1", run: str = "S:t:r1", **kw: Any) -> Msg:
        return self.ev(
            "attention.requested", s, run=run, subject=pk, hook="pre_approval_request",
            session_key=sk, pattern_key=pk, tool_call_id=cid, **kw,
        )

    def appr_ans(
        self, s: str = "S", sk: str = "S", pk: str = "rm", cid: str = "call_1", run: str = "S:t:r1",
        choice: str = "once", **kw: Any,
    ) -> Msg:
        if choice == "timeout":
            etype, data = "attention.timeout", {}
        else:
            etype, data = "attention.answered", {"answer": {"option": choice}, "via": "oob"}
        return self.ev(
            etype, s, run=run, subject=pk, data=data, hook="post_approval_response",
            session_key=sk, pattern_key=pk, tool_call_id=cid, **kw,
        )

    def clar_req(self, s: str = "S", run: str = "S:t:r1", cid: str = "call_c") -> list[Msg]:
        raw = self.next_raw()
        h = {"hook": "pre_tool_call", "tool_call_id": cid, "task_id": "t", "args_digest": "q"}
        form = {"kind": "form", "prompt": "hermes asks a question", "fields": [{"id": "1", "type": "string", "label": "question 1"}]}
        return [
            self.ev("tool.requested", s, run=run, subject="clarify", raw=raw, slot=0,
                    data={"tool": {"name": "clarify", "call_id": cid}}, **h),
            self.ev("attention.requested", s, run=run, subject=cid, raw=raw, slot=1, data=form, **h),
        ]

    def clar_post(self, s: str = "S", run: str = "S:t:r1", cid: str = "call_c", outcome: str = "answered") -> list[Msg]:
        raw = self.next_raw()
        h = {"hook": "post_tool_call", "tool_call_id": cid, "task_id": "t", "args_digest": "q"}
        follow = {
            "answered": ("attention.answered", {"answer": {"values": {"1": "2"}}, "via": "oob"}),
            "timeout": ("attention.timeout", {}),
            "dismissed": ("attention.resolved", {"resolution": "dismissed"}),
        }[outcome]
        return [
            self.ev("tool.completed", s, run=run, subject="clarify", raw=raw, slot=0,
                    data={"tool": {"name": "clarify", "call_id": cid}}, **h),
            self.ev(follow[0], s, run=run, subject=cid, raw=raw, slot=1, data=follow[1], **h),
        ]

    def sub_start(self, s: str = "S", child: str = "C", run: str = "S:t:r1") -> Msg:
        return self.ev("delegation.subagent.started", s, run=run, subject=child,
                       data={"child": {"session": child}, "role": "leaf"}, hook="subagent_start")

    def sub_stop(self, s: str = "S", child: str = "C", run: str = "S:t:r1") -> Msg:
        return self.ev("delegation.subagent.stopped", s, run=run, subject=child,
                       data={"child": {"session": child}, "status": "completed"}, hook="subagent_stop")


def assert_valid(event: Event) -> None:
    """Every output event re-decodes as an AEP Event and its data as its payload type."""
    again = aep.decode_event(encode_event(event))
    assert again == event
    payload = aep.PAYLOAD_TYPES.get(event.type)
    if payload is not None:
        msgspec.convert(event.data, payload)


#: HERMES_RAW's epoch in the floors the tests' ticks carry
EPOCH = 1_764_400_000_000


class Run:
    """Feeds a PairingState with increasing positions and keeps everything it emitted (each
    checked against the schemas); a tick may carry the mapper's floor (tests/core/test_pairing_floor.py)."""

    def __init__(self, config: PairingConfig | None = None) -> None:
        self.state = PairingState(config)
        self.pos = 0
        self.out: list[Event] = []

    def feed(self, *items: "Msg | list[Msg]") -> list[Event]:
        got: list[Event] = []
        for item in items:
            for ev, h in item if isinstance(item, list) else [item]:
                self.pos += 1
                got += self.state.process(ev, h, self.pos)
        return self._keep(got)

    def tick(self, now_ns: int, floor: int | None = None, epoch: int = EPOCH) -> list[Event]:
        self.pos += 1
        return self._keep(self.state.tick(now_ns, self.pos, None if floor is None else (epoch, floor)))

    def _keep(self, got: list[Event]) -> list[Event]:
        for e in got:
            assert_valid(e)
        self.out += got
        return got


def types(events: list[Event]) -> list[str]:
    return [e.type for e in events]
