"""The relay's routing rules (`bridge.services.relay.routing`), alone: pure functions, no
relay process, no aiohttp application, no NATS server. The end-to-end behaviour (a real relay,
gate and emitters) is in test_relay_claims.py and test_relay_control.py."""

from __future__ import annotations

import datetime

import pytest

from bridge.core.control import ack_id, command_key
from bridge.services.relay.claims import Claimant
from bridge.services.relay.routing import (
    DEFAULT_ACK_WINDOW_MS, Pending, ack_window_ms, claimant_refusal, emitter_refusal, gate_refusal, late_retry,
    settles, shape_refusal,
)

RESPOND = "control.attention.respond"
INSTRUCT = "x.hermes.control.instruct"
COMMAND = {"type": RESPOND, "id": "c1", "source": "urn:op", "session": "s1"}


@pytest.mark.parametrize("change,code", [
    ({"id": None}, "unsupported"), ({"id": ""}, "unsupported"), ({"id": 7}, "unsupported"),
    ({"source": None}, "unsupported"), ({"session": None}, "no-route"), ({"session": ""}, "no-route"),
    ({"session": 3}, "no-route"),
])
def test_a_command_without_id_source_or_session_is_refused(change, code):
    frame = {k: v for k, v in {**COMMAND, **change}.items() if v is not None}
    refusal = shape_refusal(frame)
    assert refusal is not None and refusal[0] == code
    assert shape_refusal(COMMAND) is None


@pytest.mark.parametrize("emitters,hermes,code", [
    (0, False, "no-route"), (1, True, None), (2, False, "ambiguous"), (3, True, None),
    (1, False, None), (0, True, None),
])
def test_exactly_one_live_claimant_or_a_refusal(emitters, hermes, code):
    """A live Hermes session shadows emitters' claims of its name (issue 25 item 3)."""
    refusal = claimant_refusal(emitters, hermes)
    assert (refusal[0] if refusal else None) == code
    if code == "ambiguous":
        assert f"{emitters} live claimants" in refusal[1]


def emitter(accepts) -> Claimant:  # type: ignore[no-untyped-def]
    return Claimant.from_hello(None, {"identity": {"agent": "a"}, "capabilities": {"control": {"accepts": accepts}}})


def test_an_emitter_takes_only_the_types_it_declares():
    assert emitter_refusal("x.acme.control.stop", emitter(["x.acme.control.stop"])) is None
    refusal = emitter_refusal(RESPOND, emitter(["x.acme.control.stop"]))
    assert refusal == ("unsupported", "the claimant accepts ['x.acme.control.stop']")
    assert emitter_refusal(RESPOND, emitter("control.attention.respond")) is not None  # not a list: nothing


def hello(accepts, **control) -> dict:  # type: ignore[no-untyped-def]
    return {"type": "hello", "capabilities": {"control": {"accepts": accepts, **control}}}


def test_the_gate_takes_what_it_declares_of_what_the_relay_routes_and_no_gate_is_no_route():
    assert gate_refusal(RESPOND, None)[0] == "no-route"  # type: ignore[index]
    assert gate_refusal(RESPOND, hello([RESPOND, INSTRUCT])) is None
    assert gate_refusal(INSTRUCT, hello([RESPOND])) == ("unsupported", f"the gate accepts {[RESPOND]}")
    # a type the gate declares but the relay does not route to it (only the gate's two)
    assert gate_refusal("control.session.stop", hello(["control.session.stop"]))[0] == "unsupported"  # type: ignore[index]
    assert gate_refusal(RESPOND, {"type": "hello"})[0] == "unsupported"  # type: ignore[index]


@pytest.mark.parametrize("declared,window", [
    (5000, 5000), (1, 1), (600_000, 600_000), (600_001, DEFAULT_ACK_WINDOW_MS), (0, DEFAULT_ACK_WINDOW_MS),
    (-5, DEFAULT_ACK_WINDOW_MS), ("5000", DEFAULT_ACK_WINDOW_MS), (None, DEFAULT_ACK_WINDOW_MS),
    (True, DEFAULT_ACK_WINDOW_MS), (2.5, DEFAULT_ACK_WINDOW_MS),
])
def test_an_ack_window_is_taken_when_sane(declared, window):
    assert ack_window_ms(declared) == window


def test_a_command_older_than_half_the_duplicate_window_may_be_a_late_retry():
    now = datetime.datetime(2026, 12, 1, 10, 0, 0, tzinfo=datetime.timezone.utc).timestamp()

    def sent(seconds_ago: float) -> str:
        return datetime.datetime.fromtimestamp(now - seconds_ago, tz=datetime.timezone.utc).isoformat()

    assert late_retry(sent(61), now, 120.0) is True
    assert late_retry(sent(59), now, 120.0) is False
    assert late_retry(sent(-30), now, 120.0) is False  # a sender's clock ahead
    for odd in ("not a time", None, "9999-99-99T00:00:00Z", 12):
        assert late_retry(odd, now, 120.0) is True  # cannot place it: look in the history


def test_an_ack_settles_only_its_own_command_from_its_target():
    key = ("urn:op", "c1")
    gate_ack = {"type": "control.accepted", "cause": "c1", "session": "s1",
                "id": ack_id(command_key(*key), 1_764_583_200_000)}
    to_gate = Pending("s1", [], 0.0, None)
    assert settles(key, to_gate, gate_ack, None)
    assert not settles(("urn:other", "c1"), to_gate, gate_ack, None)  # another source's command, same id
    assert not settles(key, to_gate, {**gate_ack, "id": "01JAAAAAAAAAAAAAAAAAAAAAAA"}, None)
    assert not settles(key, to_gate, {**gate_ack, "session": "s2"}, None)
    target = emitter([RESPOND])
    to_emitter = Pending("s1", [], 0.0, target)
    emitter_ack = {"type": "control.accepted", "cause": "c1", "session": "s1", "id": "any-id"}
    assert settles(key, to_emitter, emitter_ack, target)  # an emitter's ack names its command by cause alone
    assert not settles(key, to_emitter, emitter_ack, emitter([RESPOND]))  # from another connection
    assert not settles(key, to_emitter, gate_ack, None)  # the gate's word for an emitter's command
    assert not settles(key, to_gate, emitter_ack, target)
