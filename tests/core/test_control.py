"""The control plane's pure protocol (bridge/core/control.py) as tables: text answers (AEP-0008),
command checks and their rejection reasons, the card and dedupe state machines, seq allocation,
the events it builds (schema-valid, capture honoured), and the shim's copies of its constants."""

from __future__ import annotations

import json

import jsonschema
import msgspec
import pytest

from bridge.core import aep
from bridge.core import control as C
from bridge.core.ceiling import CapturePolicy
from bridge.core.identity import SLOTS
from bridge.shim import hook
from tests.support.validators import validators

D = C.DEFAULT_DENY_MESSAGE


# ---------------------------------------------------------------- text answers (AEP-0008)

@pytest.mark.parametrize(("answer", "option", "message", "recorded"), [
    ({"option": "allow"}, "allow", None, {"option": "allow"}),
    ({"option": "deny"}, "deny", D, {"option": "deny"}),
    ({"option": "deny", "text": "  too risky "}, "deny", "too risky", {"option": "deny", "text": "too risky"}),
    ({"option": "allow", "text": "ok, once"}, "allow", None, {"option": "allow", "text": "ok, once"}),
    ({"text": "allow"}, "allow", None, {"option": "allow"}),
    ({"text": "  ALLOW\n"}, "allow", None, {"option": "allow"}),  # trimmed, any case: the option, no text residue
    ({"text": "Deny"}, "deny", D, {"option": "deny"}),
    ({"text": "use the staging registry"}, "deny", "use the staging registry", {"option": "deny", "text": "use the staging registry"}),
    ({"text": "yes"}, "deny", "yes", {"option": "deny", "text": "yes"}),  # unmatched text never grants
    ({"text": "allow it"}, "deny", "allow it", {"option": "deny", "text": "allow it"}),
    ({"text": "allow", "option": None}, "allow", None, {"option": "allow"}),
])
def test_text_answers(answer, option, message, recorded) -> None:
    v = C.interpret_answer(answer)
    assert v == C.Verdict(option, message, recorded)
    assert C.shim_answer(v.option, v.message) == ({} if option == "allow" else {"action": "block", "message": message})


@pytest.mark.parametrize("answer", [
    {}, {"text": ""}, {"text": "  \t"}, {"values": {"1": "x"}}, {"values": {}, "option": "allow"},
    {"option": "once"}, {"option": "Allow"}, {"option": 1}, {"text": 5}, "allow", None, ["allow"],
])
def test_text_answers_invalid(answer) -> None:
    r = C.interpret_answer(answer)
    assert isinstance(r, C.Reject) and r.reason == "invalid" and r.detail


# ---------------------------------------------------------------- commands

def cmd_bytes(**over) -> bytes:
    base = {"aep": "0.1", "id": "01CMD", "type": C.RESPOND, "time": "2026-01-01T00:00:00.000Z",
            "source": "aep://ops/agent/console", "agent": "console", "session": "s1", "subject": "01REQ",
            "data": {"answer": {"option": "allow"}}}
    base.update(over)
    return json.dumps({k: v for k, v in base.items() if v is not ...}).encode()


def test_parse_command_well_formed() -> None:
    cmd, problem = C.parse_command(cmd_bytes(), "s1", C.RESPOND)
    assert problem is None
    assert cmd == C.Command("01CMD", "aep://ops/agent/console", C.RESPOND, "s1", "console", "01REQ",
                            {"answer": {"option": "allow"}})
    assert cmd.key == C.command_key("aep://ops/agent/console", "01CMD")


@pytest.mark.parametrize("data", [b"not json", b"[1]", cmd_bytes(id=...), cmd_bytes(id=""), cmd_bytes(id=7)])
def test_parse_command_unackable(data) -> None:
    assert C.parse_command(data, "s1") == (None, None)


@pytest.mark.parametrize(("over", "lane", "detail"), [
    ({"aep": "0.2"}, "s1", "aep"),
    ({"type": ...}, "s1", "type is missing"),
    ({"type": C.INSTRUCT}, "s1", "type does not match"),
    ({"source": ...}, "s1", "source"),
    ({"agent": ""}, "s1", "agent"),
    ({"session": ...}, "s1", "session (the target)"),
    ({"session": "other"}, "s1", "does not match the subject's lane"),
    ({"seq": 3}, "s1", "no seq"),
    ({"data": [1]}, "s1", "data must be an object"),
    ({"session": "a b"}, "=YSBi", None),  # a non-plain session id travels as its reversible token: fine
])
def test_parse_command_malformed_is_invalid(over, lane, detail) -> None:
    cmd, problem = C.parse_command(cmd_bytes(**over), lane, C.RESPOND)
    assert cmd is not None and cmd.id == "01CMD"
    if detail is None:
        assert problem is None and cmd.session == "a b"
    else:
        assert problem is not None and problem.reason == "invalid" and detail in problem.detail


def test_check_order_unauthorized_unsupported_invalid() -> None:
    cmd, malformed = C.parse_command(cmd_bytes(seq=1), "s1", C.RESPOND)
    both = C.accepted_verbs(True, True)
    assert C.gate_command(cmd, malformed, both, frozenset({"someone-else"})).reason == "unauthorized"
    assert C.gate_command(cmd, malformed, [], frozenset({"console"})).reason == "unsupported"
    assert C.gate_command(cmd, malformed, [], None).reason == "unsupported"
    assert C.gate_command(cmd, malformed, both, None).reason == "invalid"
    ok, none = C.parse_command(cmd_bytes(), "s1", C.RESPOND)
    assert C.gate_command(ok, none, both, frozenset({"console"})) is None
    cancel, none = C.parse_command(cmd_bytes(type="control.cancel"), "s1", "control.cancel")
    assert C.gate_command(cancel, none, both, None).reason == "unsupported"  # declared accepts are authoritative


def test_capabilities_follow_the_opt_ins() -> None:
    assert C.accepted_verbs(False, False) == []
    assert C.accepted_verbs(True, False) == [C.RESPOND]
    assert C.accepted_verbs(False, True) == [C.INSTRUCT]
    off, on = C.hello([]), C.hello(C.accepted_verbs(True, True), instance="gw-1")
    assert off["capabilities"]["control"] == {"accepts": [], "ack_window_ms": 10_000}
    assert on["capabilities"]["control"] == {"accepts": [C.RESPOND, C.INSTRUCT], "ack_window_ms": 10_000}
    assert on["type"] == "hello" and on["versions"] == ["0.1"] and on["identity"] == {"agent": "hermes", "instance": "gw-1"}


# ---------------------------------------------------------------- respond and the card machine

def card(state: str = C.OPEN, session: str = "s1") -> C.Card:
    return C.Card(id="01M8QEAP49VX5GSEQW6F06NS1N", state=state, session=session, lane=session, source="aep://i/agent/hermes/session/s1",
                  tool="terminal", ts=1_000_000_000_000, expires=1_055_000_000_000)


def respond(**data) -> C.Command:
    return C.Command("01CMD", "src", C.RESPOND, "s1", "console", "01M8QEAP49VX5GSEQW6F06NS1N", data)


@pytest.mark.parametrize(("cmd", "c", "reason", "detail"), [
    (C.Command("01CMD", "src", C.RESPOND, "s1", "console", "", {"answer": {"option": "allow"}}), card(), "invalid", "subject"),
    (respond(answer={"option": "allow"}), None, "refused", "no gate request"),
    (respond(answer={"option": "allow"}), card(session="s2"), "refused", "no gate request"),
    (respond(answer={"option": "allow"}), card(C.ANSWERED), "refused", "already answered"),
    (respond(answer={"option": "allow"}), card(C.TIMEOUT), "refused", "expired"),
    (respond(answer={"option": "allow"}), card(C.DISMISSED), "refused", "no longer held"),
    (respond(answer={"option": "allow"}), card(C.RELEASING), "refused", "another command"),
    (respond(answer={"text": ""}), card(), "invalid", "empty"),
    (respond(answer={"values": {"1": "1"}}), card(), "invalid", "values"),
    (respond(), card(), "invalid", "object"),
])
def test_respond_rejections(cmd, c, reason, detail) -> None:
    r = C.respond_decision(cmd, c)
    assert isinstance(r, C.Reject) and r.reason == reason and detail in r.detail


def test_respond_to_an_open_card_is_a_verdict() -> None:
    assert C.respond_decision(respond(answer={"text": "no"}), card()) == C.Verdict("deny", "no", {"option": "deny", "text": "no"})
    assert C.is_card_id("01M8QEAP49VX5GSEQW6F06NS1N") and not C.is_card_id("../x") and not C.is_card_id("")


TRANSITIONS = [
    # state, trigger, new state, card events, ack of the releasing command
    (C.OPEN, "respond", C.RELEASING, (), None),
    (C.OPEN, "gone", C.DISMISSED, ("resolved_dismissed",), None),
    (C.OPEN, "gone_late", C.TIMEOUT, ("timeout",), None),
    (C.OPEN, "expired", C.TIMEOUT, ("timeout",), None),
    (C.RELEASING, "released", C.ANSWERED, ("answered", "resolved_answered"), "accepted"),
    (C.RELEASING, "resumed_gone", C.ANSWERED, ("answered", "resolved_answered"), "accepted"),
    (C.RELEASING, "gone", C.DISMISSED, ("resolved_dismissed",), "refused"),
    (C.RELEASING, "gone_late", C.TIMEOUT, ("timeout",), "refused"),
]


@pytest.mark.parametrize(("state", "trigger", "new", "emits", "ack"), TRANSITIONS)
def test_card_transitions(state, trigger, new, emits, ack) -> None:
    assert C.transition(state, trigger) == C.Transition(new, emits, ack)


def test_card_transitions_are_exactly_the_table() -> None:
    listed = {(s, t) for s, t, *_ in TRANSITIONS}
    for state in (C.OPEN, C.RELEASING, C.ANSWERED, C.TIMEOUT, C.DISMISSED):
        for trigger in ("respond", "released", "gone", "gone_late", "expired", "resumed_gone"):
            assert (C.transition(state, trigger) is not None) == ((state, trigger) in listed), (state, trigger)
    # closed cards never move again; a releasing card does not expire under the release
    assert C.transition(C.RELEASING, "expired") is None


@pytest.mark.parametrize(("now", "trigger"), [(0, "gone"), (8_999, "gone"), (9_000, "gone_late"), (20_000, "gone_late")])
def test_a_vanished_shim_near_the_end_of_its_window_is_the_expiry(now, trigger) -> None:
    assert C.gone_trigger(now, expires_ns=10_000, grace_ns=1_000) == trigger


# ---------------------------------------------------------------- steering

def instruct(text) -> C.Command:
    return C.Command("01I", "src", C.INSTRUCT, "s1", "console", "", {"text": text})


@pytest.mark.parametrize(("text", "session", "queued", "reason"), [
    (5, C.SessionInfo(source="x"), 0, "invalid"),
    ("", C.SessionInfo(source="x"), 0, "invalid"),
    ("   ", C.SessionInfo(source="x"), 0, "invalid"),
    ("x" * (C.MAX_TEXT + 1), C.SessionInfo(source="x"), 0, "invalid"),
    ("hello", None, 0, "refused"),
    ("hello", C.SessionInfo(source="x", ended=True), 0, "refused"),
    ("hello", C.SessionInfo(source="x"), C.MAX_QUEUE, "busy"),
])
def test_instruct_rejections(text, session, queued, reason) -> None:
    r = C.instruct_decision(instruct(text), session, queued)
    assert isinstance(r, C.Reject) and r.reason == reason


def test_instruct_accepts_up_to_the_limits() -> None:
    assert C.instruct_decision(instruct("x" * C.MAX_TEXT), C.SessionInfo(source="x"), C.MAX_QUEUE - 1) == "x" * C.MAX_TEXT
    q = [C.Instruction(cmd="a", key="k", text="first", queued=1), C.Instruction(cmd="b", key="l", text="second", queued=2)]
    assert C.joined_context(q) == "first\n\nsecond"


# ---------------------------------------------------------------- dedupe and identity

@pytest.mark.parametrize(("record", "seq", "action"), [
    (None, 5, "process"),
    (C.CmdRecord(state="done", id="c", lane="s", stream_seq=5), 5, "republish"),  # the same message redelivered
    (C.CmdRecord(state="done", id="c", lane="s", stream_seq=5), 9, "reack"),  # another copy: the recorded ack
    (C.CmdRecord(state="pending", id="c", lane="s", stream_seq=5), 5, "resume"),
    (C.CmdRecord(state="pending", id="c", lane="s", stream_seq=5), 9, "ignore"),  # the coming ack answers it
])
def test_dedupe_actions(record, seq, action) -> None:
    assert C.dedupe_action(record, seq) == action


def test_command_key_is_source_and_id() -> None:
    assert C.command_key("a", "1") == C.command_key("a", "1")
    assert len({C.command_key("a", "1"), C.command_key("b", "1"), C.command_key("a", "2"), C.command_key("a\n1", "")}) == 4


def test_an_ack_id_names_its_command_whatever_its_time() -> None:
    ack = C.ack_id(C.command_key("aep://ops/a", "01CMD"), 1_700_000_000_000)
    assert C.is_ack_of(ack, "aep://ops/a", "01CMD") and C.is_ack_of(ack.lower(), "aep://ops/a", "01CMD")
    assert C.is_ack_of(C.ack_id(C.command_key("aep://ops/a", "01CMD"), 5), "aep://ops/a", "01CMD")
    assert not C.is_ack_of(ack, "aep://ops/b", "01CMD")  # the same id from another source
    assert not C.is_ack_of(ack, "aep://ops/a", "01CME")
    assert not any(C.is_ack_of(x, "aep://ops/a", "01CMD") for x in (None, 1, "", ack[:-1], ack + "0"))


@pytest.mark.parametrize(("last", "epoch", "anchor", "slot", "expected"), [
    (None, 7, 3, C.GATE_SLOT, 3 * SLOTS + C.GATE_SLOT),
    (C.Position(epoch=7, seq=3 * SLOTS + C.GATE_SLOT), 7, 3, C.GATE_SLOT, 3 * SLOTS + C.GATE_SLOT + 1),
    (C.Position(epoch=7, seq=5 * SLOTS + 900), 7, 3, C.GATE_SLOT, 5 * SLOTS + 901),  # never below its own last
    (C.Position(epoch=7, seq=2 * SLOTS + 1000), 7, 3, C.GATE_SLOT, 3 * SLOTS + C.GATE_SLOT),
    (C.Position(epoch=6, seq=9 * SLOTS), 7, 3, C.GATE_SLOT, 3 * SLOTS + C.GATE_SLOT),  # a new epoch starts over
    (None, 7, 4, C.DROP_SLOT, 4 * SLOTS + C.DROP_SLOT),  # before the finalize's session.ended (slot 512)
])
def test_next_seq(last, epoch, anchor, slot, expected) -> None:
    assert C.next_seq(last, epoch, anchor, slot) == expected


def test_drops_sort_before_the_session_end_whatever_came_before() -> None:
    assert C.drop_seqs(9, 3) == [9 * SLOTS + C.DROP_SLOT + i for i in range(3)]
    assert max(C.drop_seqs(9, C.MAX_QUEUE)) < 9 * SLOTS + 512  # session.ended of raw message 9: the mapper's slot 512


def test_gate_slots_stay_clear_of_pairing_and_mapper() -> None:
    from bridge.core.identity import AFTER_SLOT, MAPPED_SLOT
    from bridge.core.pairing import CLOSE_SLOT, PairingConfig

    from bridge.core.envelope import envelope_from_obj
    from bridge.core.mapping import map_specs
    from tests.corpus import envelopes

    # pairing's after-slots: 768 (resolved after an answer) and CLOSE_SLOT + the start's index among its
    # raw message's events; no envelope of the real corpus maps to more than a few events
    most = max(len(map_specs(envelope_from_obj(env), CapturePolicy())) for env in envelopes())
    assert most <= 3 and CLOSE_SLOT + most < C.GATE_SLOT < SLOTS
    # pairing's before-slots: the session-end sweep, at most max_open of them; drops sit above, below 512
    assert PairingConfig().max_open <= C.DROP_SLOT and C.DROP_SLOT + C.MAX_QUEUE <= MAPPED_SLOT < AFTER_SLOT


# ---------------------------------------------------------------- events: schema-valid, capture honoured

def events_at(level: str) -> list[aep.Event]:
    policy = CapturePolicy(default=level, overrides={"attention": level})
    c = card()
    c.answer = {"option": "deny", "text": "mail bob@example.com"}
    where = C.Where(session="s1", source=c.source, epoch=1, run="s1:t:1")
    out = []
    for i, kind in enumerate(("requested", "answered", "resolved_answered", "resolved_dismissed", "timeout")):
        etype, payload = C.card_payload(policy, kind, c, c.ts + 2_000_000_000)
        out.append(C.build_event(policy, etype, payload, where=where, event_id=C.gate_id(kind, 1), seq=i, time_ns=c.ts,
                                 subject=c.id, cause="01X"))
    for i, (ack, reject) in enumerate((("accepted", None), ("rejected", C.Reject("refused", "the request expired")))):
        etype, payload = C.ack_payload(policy, ack, reject)
        out.append(C.build_event(policy, etype, payload, where=where, event_id=C.gate_id(ack, 1), seq=10 + i, time_ns=c.ts, cause="01CMD"))
    out.append(C.build_event(policy, "x.hermes.instruction.delivered", aep.HermesInstructionDelivered(queued_ms=5),
                             where=where, event_id=C.gate_id("d", 1), seq=20, time_ns=c.ts, cause="01I"))
    out.append(C.build_event(policy, "x.hermes.instruction.dropped", aep.HermesInstructionDropped(reason=C.DROP_REASON, queued_ms=5),
                             where=where, event_id=C.gate_id("x", 1), seq=21, time_ns=c.ts, cause="01I"))
    return out


@pytest.mark.parametrize("level", ["none", "metadata", "redacted", "full"])
def test_gate_events_are_schema_valid_and_honour_capture(level) -> None:
    env, types = validators()
    for ev in events_at(level):
        doc = json.loads(aep.encode_event(ev))
        env.validate(doc)
        types[ev.type].validate(doc["data"])
        assert doc["capture"] == level
    answered = next(e for e in events_at(level) if e.type == "attention.answered").data["answer"]
    rejected = next(e for e in events_at(level) if e.type == "control.rejected").data
    if level in ("none", "metadata"):
        assert "text" not in answered and "detail" not in rejected
    elif level == "redacted":
        assert answered["text"] == "mail [REDACTED:pii]" and rejected["detail"] == "the request expired"
    else:
        assert answered["text"] == "mail bob@example.com"


def test_request_card_payload() -> None:
    etype, payload = C.card_payload(CapturePolicy(), "requested", card(), 0)
    assert etype == "attention.requested"
    assert aep.payload_to_data(payload) == {
        "kind": "permission", "prompt": "Allow the terminal tool call?",
        "options": [{"id": "allow", "label": "Allow"}, {"id": "deny", "label": "Deny"}],
        "expires_at": "1970-01-01T00:17:35.000Z", "respond_via": ["control"],
    }
    _, timeout = C.card_payload(CapturePolicy(), "timeout", card(), card().expires + 5_000_000_000)
    assert timeout.after_ms == 55_000  # measured to the end of the window, not to when it was noticed


def test_commands_validate_as_events_without_seq() -> None:
    env, types = validators()
    doc = json.loads(cmd_bytes())
    env.validate(doc)
    types[C.RESPOND].validate(doc["data"])
    with pytest.raises(jsonschema.ValidationError):
        env.validate({**doc, "seq": 1})
    types[C.INSTRUCT].validate({"text": "x" * C.MAX_TEXT})
    with pytest.raises(jsonschema.ValidationError):
        types[C.INSTRUCT].validate({"text": "x" * (C.MAX_TEXT + 1)})


# ---------------------------------------------------------------- the shim's copies (constants: tests/nats/test_subjects.py)

@pytest.mark.parametrize(("env", "control", "instruct", "hold", "tools"), [
    ({}, False, False, C.DEFAULT_HOLD_MS, None),
    ({"AEP_HERMES_CONTROL": "1"}, True, False, C.DEFAULT_HOLD_MS, None),
    ({"AEP_HERMES_CONTROL": "true", "AEP_HERMES_HOLD_MS": "1500", "AEP_HERMES_GATE_TOOLS": "terminal|write_.*"},
     True, False, 1500, "terminal|write_.*"),
    ({"AEP_INSTRUCT": "on", "AEP_HERMES_CONTROL": "0"}, False, True, C.DEFAULT_HOLD_MS, None),
    ({"AEP_HERMES_CONTROL": "1", "AEP_HERMES_HOLD_MS": "soon"}, True, False, C.DEFAULT_HOLD_MS, None),
])
def test_shim_reads_the_opt_ins(env, control, instruct, hold, tools) -> None:
    cfg = hook.Config({"AEP_BRIDGE_CONFIG": "/nonexistent", "HOME": "/h", **env})
    assert (cfg.control, cfg.instruct, cfg.hold_ms, cfg.gate_tools) == (control, instruct, hold, tools)


@pytest.mark.parametrize(("pattern", "tool", "gated"), [
    (None, "terminal", True), ("", "anything", True), ("terminal|write_.*", "terminal", True),
    ("terminal|write_.*", "write_file", True), ("terminal|write_.*", "read_file", False),
    ("term", "terminal", False),  # fullmatch, like Hermes's own matcher
    ("([", "read_file", True),  # an invalid regex gates every tool (an operator-deny gate errs toward holding)
])
def test_shim_gate_tools(pattern, tool, gated) -> None:
    assert hook._gated(tool, pattern) is gated


# ---------------------------------------------------------------- liveness (issue 25 item 5)


def test_a_session_is_idle_past_the_ttl_since_the_gate_last_saw_it():
    seen = C.SessionInfo(source="x", session="s", seen=1000.0)
    assert not C.is_idle(seen, 1000.0 + 1800, 1800)
    assert C.is_idle(seen, 1000.0 + 1800.5, 1800)
    assert not C.is_idle(C.SessionInfo(source="x", session="s"), 10**10, 1800)  # an older gate's record: live


def test_the_gate_restamps_on_a_change_or_a_quarter_of_the_ttl():
    old = C.SessionInfo(source="x", instance="h", session="s", seen=1000.0)
    assert C.restamp(None, old, 1800)
    assert not C.restamp(old, msgspec.structs.replace(old, seen=1000.0 + 449), 1800)
    assert C.restamp(old, msgspec.structs.replace(old, seen=1000.0 + 450), 1800)
    assert C.restamp(old, msgspec.structs.replace(old, seen=1001.0, ended=True), 1800)
    assert C.restamp(old, msgspec.structs.replace(old, seen=1001.0, instance="other"), 1800)
