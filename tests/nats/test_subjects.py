"""Subjects are built in one place (bridge/nats/subjects.py, over the shim's own rules); what
cannot be shared by import is compared here: the rules the shim mints by and the gate checks
by, the constants the pure core keeps for the shim, and the NATS permissions in deploy/."""

from __future__ import annotations

from pathlib import Path

import pytest

from bridge.core import control as C
from bridge.core import digest
from bridge.core.envelope import EnvelopeError
from bridge.nats import subjects
from bridge.shim import hook

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("instance", ["gw-1", "my.host", "ü*>", "", "x" * 300])
def test_the_inbox_a_shim_mints_passes_the_gates_checks_for_its_own_instance_only(instance: str) -> None:
    conn = hook.NatsConnection(None, {}, "nats://127.0.0.1:4222", instance)
    mine = subjects.raw_tokens(subjects.raw_subject(instance, "pre_tool_call"))[0]
    assert conn.inbox.startswith(subjects.shim_inbox_prefix(instance) + ".")
    assert subjects.shim_reply_ok(conn.inbox + ".g", mine, "g")  # a held call's decision
    assert subjects.shim_pull_reply_ok(conn.inbox + ".i")  # an instruction pull's answer
    assert subjects.requester_reply_ok(conn.inbox + ".i")
    assert not subjects.shim_reply_ok(conn.inbox + ".g", mine + "x", "g")  # another instance's space
    subjects.check_raw_instance(subjects.raw_subject(instance, "pre_tool_call"), instance)


def test_a_body_naming_another_instance_than_its_subject_is_refused() -> None:
    with pytest.raises(EnvelopeError) as err:
        subjects.check_raw_instance(subjects.raw_subject("gw-1", "pre_tool_call"), "gw-2")
    assert err.value.reason == "instance_mismatch"
    with pytest.raises(EnvelopeError) as err:
        subjects.check_raw_instance("aep.hermes.s1.tool.requested", "gw-1")
    assert err.value.reason == "bad_raw"


def test_the_instruction_pull_the_shim_sends_is_what_the_gate_subscribes_to() -> None:
    pull = hook.instruct_subject("sess.1 *")
    assert pull == "aep.gate.instruct.sess_1__"
    head, _, last = subjects.instruct_filter().rpartition(".")
    assert last == "*" and pull.rpartition(".")[0] == head and "." not in pull[len(head) + 1:]


def test_the_core_keeps_the_shims_constants() -> None:
    """The pure core and the shim may not import each other: their copies are equal."""
    assert hook.STUB_KEY == digest.STUB_KEY
    assert hook.GATE_REPLY_HEADER == C.GATE_REPLY_HEADER and hook.GATE_HOLD_HEADER == C.GATE_HOLD_HEADER
    assert hook.DEFAULT_HOLD_MS == C.DEFAULT_HOLD_MS and hook.DEFAULT_DENY_MESSAGE == C.DEFAULT_DENY_MESSAGE


def test_the_command_filters_cover_the_command_subjects_and_the_acks() -> None:
    first, vendor = subjects.COMMAND_FILTERS
    for subject, flt in ((subjects.command_subject("s1", C.RESPOND), first),
                         (subjects.command_subject("s1", C.INSTRUCT), vendor),
                         (subjects.ack_subjects("s1")[0], first)):
        assert _matches(flt, subject), (flt, subject)
    assert not _matches(first, subjects.events_subject("s1", "tool.requested"))


@pytest.mark.parametrize("conf", ["deploy/nats/nats.conf", "deploy/helm/aep-bridge/values.yaml"])
def test_the_permissions_name_the_subjects_the_code_builds(conf: str) -> None:
    """The NATS permissions are written out by hand: every control-plane subject the code
    builds appears in them exactly (a renamed subject would be refused by the server)."""
    text = (REPO / conf).read_text(encoding="utf-8")
    built = [
        subjects.HELLO_SUBJECT, subjects.instruct_filter(), subjects.SHIM_INBOX_PREFIX + ">",
        subjects.RAW_PREFIX + ".>", f"{subjects.EVENTS_PREFIX}.*.{C.RESPOND}", f"{subjects.EVENTS_PREFIX}.*.{C.INSTRUCT}",
    ]
    for subject in built:
        assert f'"{subject}"' in text, f"{subject} is not in {conf}"


def _matches(flt: str, subject: str) -> bool:
    """NATS wildcard matching (``*`` one token, ``>`` the rest)."""
    f, s = flt.split("."), subject.split(".")
    for i, tok in enumerate(f):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(f) == len(s)
