"""`aep-bridge gate` end to end, as processes: a real nats-server, the real shim held the way
Hermes runs it, the gate, the mapper and pairing, commands sent the way any sender sends them.

Every outcome of the spec (allow, deny, text answers, expiry, the hook gone, steering delivered
and dropped), every rejection reason, the dedupe rule (one decision, a byte-identical re-ack,
also across a gate restart), and the capabilities document. Hold windows are short."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

from bridge.commands.control import build_command, send_command
from bridge.config import Settings
from bridge.core import control as C
from bridge.core.identity import SLOTS
from bridge.nats.streams import CONTROL_BUCKET
from bridge.nats.subjects import HELLO_SUBJECT
from bridge.services.gate.config import COMMAND_DURABLE
from tests.support.plane import Plane, new_session, ready, start_plane, start_session, stop_plane, types
from tests.support.services import wait_for
from tests.support.shim import envelope
from tests.support.cli import cli

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def plane(nats_backend: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plane]:
    if nats_backend == "external":
        pytest.skip("the control-plane tests start servers of their own")
    p, services = start_plane(nats_backend, tmp_path_factory.mktemp("control"),
                              {"AEP_HERMES_CONTROL": "1", "AEP_INSTRUCT": "1"})
    try:
        yield p
    finally:
        logs = {s.name: s.log() for s in services}
        stop_plane(p, services)
        for name, text in logs.items():
            assert "Traceback" not in text and "handle_failed" not in text, f"{name}:\n{text}"


# ---------------------------------------------------------------- capabilities


def test_hello_on_nats_and_in_healthz(plane: Plane) -> None:
    import asyncio

    import nats

    async def ask() -> dict[str, Any]:
        nc = await nats.connect(plane.url)
        try:
            return json.loads((await nc.request(HELLO_SUBJECT, b"", timeout=2)).data)
        finally:
            await nc.close()

    doc = asyncio.run(ask())
    assert doc["capabilities"]["control"] == {"accepts": [C.RESPOND, C.INSTRUCT], "ack_window_ms": C.ACK_WINDOW_MS}
    port = next(json.loads(line)["metrics_port"] for line in plane.gate.log_path.read_text().splitlines()
                if '"gate_starting"' in line)
    health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5).read())
    assert health["control"] == doc["capabilities"]["control"] and health["hello"] == doc
    cli = subprocess.run([sys.executable, "-m", "bridge.cli", "control", "hello", "--nats", plane.url],
                         capture_output=True, text=True, cwd=ROOT, timeout=30)
    assert cli.returncode == 0 and json.loads(cli.stdout) == doc


# ---------------------------------------------------------------- the gate's outcomes


@pytest.mark.parametrize(("answer", "printed", "recorded"), [
    ({"option": "allow"}, {}, {"option": "allow"}),
    ({"option": "deny", "text": "not on a Friday"}, {"action": "block", "message": "not on a Friday"},
     {"option": "deny", "text": "not on a Friday"}),
    ({"text": "  DENY "}, {"action": "block", "message": C.DEFAULT_DENY_MESSAGE}, {"option": "deny"}),
    ({"text": "Allow"}, {}, {"option": "allow"}),
    ({"text": "use the staging registry"}, {"action": "block", "message": "use the staging registry"},
     {"option": "deny", "text": "use the staging registry"}),
])
def test_an_answer_releases_the_held_call(plane: Plane, answer: dict[str, str], printed: dict[str, str],
                                          recorded: dict[str, str]) -> None:
    session = new_session()
    start_session(plane, session)
    shim = plane.held(session, "call-1")
    req = plane.request_of(session, "call-1")
    kind, ack, _ = plane.respond(session, req["id"], answer)
    out, err = shim.communicate(timeout=10)
    assert kind == "accepted", ack
    assert json.loads(out) == printed and err == b""
    # the observed post_tool_call, as Hermes sends it after a block or after the tool ran
    blocked = printed.get("action") == "block"
    extra = {"status": "blocked", "error_type": "plugin_block", "error_message": printed["message"],
             "result": json.dumps({"error": printed["message"]})} if blocked else {"status": "ok", "result": "done"}
    plane.hook(envelope("post_tool_call", session=session, turn_id=f"{session}:t:1", tool_call_id="call-1", **extra))
    terminal = "tool.denied" if blocked else "tool.completed"
    evs = plane.wait(session, lambda e: terminal in types(e), terminal)
    by = {e["type"]: e for e in evs}
    cmd = next(e for e in evs if e["type"] == C.RESPOND)  # the command is in the session's history
    tool_req = by["tool.requested"]
    assert req["cause"] == tool_req["id"] and req["run"] == tool_req["run"] == f"{session}:t:1"
    assert req["data"] == {
        "kind": "permission", "prompt": "Allow the terminal tool call?",
        "options": [{"id": "allow", "label": "Allow"}, {"id": "deny", "label": "Deny"}],
        "expires_at": req["data"]["expires_at"], "respond_via": ["control"],
    }
    assert by["control.accepted"]["cause"] == cmd["id"] and by["control.accepted"]["data"] == {}
    assert by["attention.answered"]["data"] == {"answer": recorded, "via": "control"}
    assert by["attention.answered"]["cause"] == cmd["id"] and by["attention.answered"]["subject"] == req["id"]
    resolved = by["attention.resolved"]
    assert resolved["data"]["resolution"] == "answered" and resolved["subject"] == req["id"]
    assert resolved["cause"] == by["attention.answered"]["id"]
    if blocked:  # the pinned mapping, linked to its request by pairing
        assert by["tool.denied"]["data"]["by"] == "policy" and by["tool.denied"]["cause"] == tool_req["id"]
    else:
        assert by["tool.completed"]["cause"] == tool_req["id"]
    seqs = [by[t]["seq"] for t in ("tool.requested", "attention.requested", "control.accepted", "attention.answered",
                                   "attention.resolved", terminal)]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert req["seq"] % SLOTS >= C.GATE_SLOT and {e["epoch"] for e in evs if "seq" in e} == {tool_req["epoch"]}
    assert types(evs).count("control.accepted") == 1 and "control.rejected" not in types(evs)
    # a second, different answer to the closed card: refused
    kind, ack, _ = plane.respond(session, req["id"], {"option": "allow"})
    assert kind == "rejected" and ack["data"] == {"reason": "refused"}


def test_expiry_proceeds_and_a_late_answer_is_refused(plane: Plane) -> None:
    session = new_session()
    start_session(plane, session)
    t0 = time.monotonic()
    shim = plane.held(session, "call-x", hold_ms=1200)
    out, err = shim.communicate(timeout=10)
    assert out == b"{}\n" and err == b"" and time.monotonic() - t0 >= 1.2
    evs = plane.wait(session, lambda e: "attention.timeout" in types(e), "attention.timeout")
    req = next(e for e in evs if e["type"] == "attention.requested")
    timeout = next(e for e in evs if e["type"] == "attention.timeout")
    assert timeout["subject"] == req["id"] and timeout["cause"] == req["id"] and timeout["data"] == {"after_ms": 1200}
    assert "attention.resolved" not in types(evs)
    kind, ack, _ = plane.respond(session, req["id"], {"option": "deny"})
    assert kind == "rejected" and ack["data"]["reason"] == "refused"


def test_a_hook_gone_before_the_release_is_dismissed_and_answers_are_refused(plane: Plane) -> None:
    session = new_session()
    start_session(plane, session)
    shim = plane.held(session, "call-k", hold_ms=30_000)
    req = plane.request_of(session, "call-k")
    shim.kill()  # Hermes interrupted: the hook process is gone
    shim.wait()
    kind, ack, _ = plane.respond(session, req["id"], {"option": "allow"})
    assert kind == "rejected" and ack["data"]["reason"] == "refused"
    evs = plane.wait(session, lambda e: "attention.resolved" in types(e), "attention.resolved")
    resolved = next(e for e in evs if e["type"] == "attention.resolved")
    assert resolved["data"]["resolution"] == "dismissed" and resolved["subject"] == req["id"]
    assert "attention.answered" not in types(evs) and "control.accepted" not in types(evs)
    assert types(evs).index("attention.resolved") < types(evs).index("control.rejected")


def test_the_probe_dismisses_a_vanished_hook_without_any_answer(plane: Plane) -> None:
    session = new_session()
    start_session(plane, session)
    shim = plane.held(session, "call-p", hold_ms=30_000)
    req = plane.request_of(session, "call-p")
    shim.kill()
    shim.wait()
    evs = plane.wait(session, lambda e: "attention.resolved" in types(e), "the probe's dismissal", timeout=5)
    resolved = next(e for e in evs if e["type"] == "attention.resolved")
    assert resolved["data"]["resolution"] == "dismissed" and resolved["cause"] == req["id"]


# ---------------------------------------------------------------- dedupe


def test_a_command_sent_twice_gets_one_decision_and_a_byte_identical_ack(plane: Plane) -> None:
    session = new_session()
    start_session(plane, session)
    shim = plane.held(session, "call-d")
    req = plane.request_of(session, "call-d")
    cmd = build_command(C.RESPOND, session, {"answer": {"option": "deny", "text": "twice"}}, sender="test-console",
                        subject=req["id"])
    first = plane.send(cmd)
    second = plane.send(cmd)  # a retry under the same id (e.g. the sender lost the first ack)
    assert json.loads(shim.communicate(timeout=10)[0]) == {"action": "block", "message": "twice"}
    assert first[0] == second[0] == "accepted" and first[2] == second[2]  # byte-identical
    # a restart keeps the dedupe state (KV): a third copy still gets the recorded ack
    plane.gate.kill()
    plane.gate.start()
    wait_for(lambda: ready(plane.url), 20, interval=0.1, what="the gate after a restart")
    third = plane.send(cmd)
    assert third[2] == first[2]
    evs = plane.wait(session, lambda e: types(e).count(C.RESPOND) == 3, "three copies of the command")
    assert types(evs).count("attention.answered") == 1 and types(evs).count("attention.resolved") == 1
    acks = [e for e in evs if e["type"] in C.ACK_TYPES]
    assert len(acks) == 1 and acks[0]["cause"] == cmd.id  # the stream kept one copy (same Nats-Msg-Id)


def test_the_same_id_from_another_source_is_another_command(plane: Plane) -> None:
    session = new_session()
    start_session(plane, session)
    a = build_command(C.INSTRUCT, session, {"text": "one"}, sender="console-a", command_id="01SAMEIDSAMEIDSAMEIDSAMEID")
    b = build_command(C.INSTRUCT, session, {"text": "two"}, sender="console-b", command_id="01SAMEIDSAMEIDSAMEIDSAMEID")
    ra, rb = plane.send(a), plane.send(b)
    assert ra[0] == rb[0] == "accepted" and ra[2] != rb[2]
    # both waiting at once (the gate paused): `aep-bridge control` takes its own ack, not the
    # other's (`cause` is the id alone; the ack's id names the source too)
    import asyncio

    c = build_command(C.INSTRUCT, session, {"text": "three"}, sender="console-a", command_id="01SAMEIDSAMEIDSAMEIDSAMEI2")
    d = build_command(C.INSTRUCT, session, {"text": " "}, sender="console-b", command_id="01SAMEIDSAMEIDSAMEIDSAMEI2")
    settings = Settings()
    settings.nats_url = plane.url

    async def both() -> tuple[Any, Any]:
        with plane.gate_paused():
            tc = asyncio.ensure_future(send_command(settings, c, 10))
            td = asyncio.ensure_future(send_command(settings, d, 10))
            for _ in range(200):  # both stored for the paused gate (each sender subscribed before publishing)
                info = await plane.client.js.consumer_info("AEP_EVENTS", COMMAND_DURABLE)
                if info.num_pending + info.num_ack_pending >= 2:
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the two commands never reached the paused gate's consumer")
        return await tc, await td

    (kc, dc), (kd, dd) = plane.client.run(both())
    assert (kc, kd) == ("accepted", "rejected"), (dc, dd)
    assert json.loads(dd)["data"]["reason"] == "invalid"


# ---------------------------------------------------------------- every rejection reason


def test_rejected_unsupported(plane: Plane) -> None:
    session = new_session()
    start_session(plane, session)
    kind, ack, _ = plane.send(build_command("control.cancel", session, {"scope": "run"}, sender="test-console"))
    assert kind == "rejected" and ack["data"] == {"reason": "unsupported"} and ack["session"] == session


@pytest.mark.parametrize(("verb", "data", "extra"), [
    (C.RESPOND, {"answer": {"text": ""}}, {}),
    (C.RESPOND, {"answer": {"values": {"1": "1"}}}, {}),
    (C.RESPOND, {"answer": {"option": "once"}}, {}),
    (C.RESPOND, {}, {}),
    (C.INSTRUCT, {"text": "   "}, {}),
    (C.INSTRUCT, {"text": "x" * (C.MAX_TEXT + 1)}, {}),
    (C.INSTRUCT, {"text": "fine"}, {"seq": 5}),  # commands carry no seq
])
def test_rejected_invalid(plane: Plane, verb: str, data: dict[str, Any], extra: dict[str, Any]) -> None:
    session = new_session()
    start_session(plane, session)
    request = ""
    shim = None
    if verb == C.RESPOND:
        shim = plane.held(session, "call-i")
        request = plane.request_of(session, "call-i")["id"]
    cmd = build_command(verb, session, data, sender="test-console", subject=request or None)
    for k, v in extra.items():
        setattr(cmd, k, v)
    kind, ack, _ = plane.send(cmd)
    assert kind == "rejected" and ack["data"] == {"reason": "invalid"} and ack["cause"] == cmd.id
    if shim is not None:  # an invalid answer decides nothing: the call is still held, and can be answered
        assert shim.poll() is None
        assert plane.respond(session, request, {"option": "allow"})[0] == "accepted"
        assert shim.communicate(timeout=10)[0] == b"{}\n"


def test_rejected_refused(plane: Plane) -> None:
    session = new_session()
    start_session(plane, session)
    assert plane.respond(session, "01M8QEAP49VX5GSEQW6F06NS1N", {"option": "allow"})[1]["data"]["reason"] == "refused"
    assert plane.instruct(new_session(), "nobody is there")[1]["data"]["reason"] == "refused"  # unknown session


def test_rejected_busy(plane: Plane) -> None:
    session = new_session()
    start_session(plane, session)
    for i in range(C.MAX_QUEUE):
        assert plane.instruct(session, f"step {i}")[0] == "accepted"
    kind, ack, _ = plane.instruct(session, "one too many")
    assert kind == "rejected" and ack["data"]["reason"] == "busy"
    out = json.loads(plane.hook(envelope("pre_llm_call", session=session, turn_id=f"{session}:t:2"), AEP_INSTRUCT="1"))
    assert out == {"context": "\n\n".join(f"step {i}" for i in range(C.MAX_QUEUE))}
    assert plane.instruct(session, "room again")[0] == "accepted"


@pytest.fixture(scope="module")
def off_plane(nats_backend: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plane]:
    """A gate with both opt-ins off and a sender allowlist, on a server of its own."""
    if nats_backend == "external":
        pytest.skip("the control-plane tests start servers of their own")
    p, services = start_plane(nats_backend, tmp_path_factory.mktemp("control-off"), {"AEP_CONTROL_SENDERS": "ops-console"},
                              with_pipeline=False)
    try:
        yield p
    finally:
        stop_plane(p, services)


def test_rejected_unauthorized(off_plane: Plane) -> None:
    """A sender allowlist is checked first: a sender not on it learns nothing else."""
    session = new_session()
    start_session(off_plane, session)
    for verb, data in ((C.RESPOND, {"answer": {"option": "allow"}}), (C.INSTRUCT, {"text": "hello"}), ("control.cancel", {})):
        cmd = build_command(verb, session, data, sender="mallory", subject="01M8QEAP49VX5GSEQW6F06NS1N")
        kind, ack, _ = off_plane.send(cmd)
        assert kind == "rejected" and ack["data"] == {"reason": "unauthorized"} and ack["cause"] == cmd.id


def test_gated_off_nothing_is_accepted_and_a_held_call_is_let_go(off_plane: Plane) -> None:
    """Both opt-ins off: control.accepts is empty, every command is unsupported, and a shim that
    holds anyway (configured on) is released at once instead of waiting out its window."""
    session = new_session()
    start_session(off_plane, session)
    for verb, data in ((C.RESPOND, {"answer": {"option": "allow"}}), (C.INSTRUCT, {"text": "hello"})):
        kind, ack, _ = off_plane.send(build_command(verb, session, data, sender="ops-console", subject="01M8QEAP49VX5GSEQW6F06NS1N"))
        assert kind == "rejected" and ack["data"] == {"reason": "unsupported"}
    t0 = time.monotonic()
    out, _ = off_plane.held(session, "call-off", hold_ms=20_000).communicate(timeout=30)
    assert out == b"{}\n" and time.monotonic() - t0 < 5  # released by the gate, not by the 20 s window
    assert "attention.requested" not in types(off_plane.events(session))
    hello = subprocess.run([sys.executable, "-m", "bridge.cli", "control", "hello", "--nats", off_plane.url],
                           capture_output=True, text=True, cwd=ROOT, timeout=30)
    assert json.loads(hello.stdout)["capabilities"]["control"] == {"accepts": [], "ack_window_ms": C.ACK_WINDOW_MS}


# ---------------------------------------------------------------- steering


def test_instructions_are_delivered_once_in_order(plane: Plane) -> None:
    session = new_session()
    start_session(plane, session)
    a = plane.instruct(session, "first: use the staging registry")
    b = plane.instruct(session, "second: keep answers short")
    assert a[0] == b[0] == "accepted"
    out = json.loads(plane.hook(envelope("pre_llm_call", session=session, turn_id=f"{session}:t:2"), AEP_INSTRUCT="1"))
    assert out == {"context": "first: use the staging registry\n\nsecond: keep answers short"}
    again = plane.hook(envelope("pre_llm_call", session=session, turn_id=f"{session}:t:3"), AEP_INSTRUCT="1")
    assert again == b"{}\n"  # delivered once
    # the gate publishes its deliveries straight to AEP_EVENTS, the turn's run.started comes
    # through mapper and pairing: arrival order is not seq order, so wait for both
    run = f"{session}:t:2"
    evs = plane.wait(session, lambda e: types(e).count("x.hermes.instruction.delivered") == 2
                     and any(x["type"] == "run.started" and x.get("run") == run for x in e),
                     "two deliveries and the turn's run.started")
    delivered = [e for e in evs if e["type"] == "x.hermes.instruction.delivered"]
    assert [d["cause"] for d in delivered] == [a[1]["cause"], b[1]["cause"]]
    assert all(d["data"]["queued_ms"] >= 0 for d in delivered)
    started = [e for e in evs if e["type"] == "run.started" and e["run"] == run]
    assert started and all(d["seq"] > started[0]["seq"] for d in delivered)


def test_the_queue_survives_a_gate_restart(plane: Plane) -> None:
    session = new_session()
    start_session(plane, session)
    assert plane.instruct(session, "after the restart")[0] == "accepted"
    plane.gate.kill()
    plane.gate.start()
    wait_for(lambda: ready(plane.url), 20, interval=0.1, what="the gate after a restart")
    out = json.loads(plane.hook(envelope("pre_llm_call", session=session, turn_id=f"{session}:t:2"), AEP_INSTRUCT="1"))
    assert out == {"context": "after the restart"}


def test_queued_instructions_are_dropped_before_the_session_ends(plane: Plane) -> None:
    session = new_session()
    start_session(plane, session)
    ids = [plane.instruct(session, t)[1]["cause"] for t in ("never delivered", "nor this")]
    plane.hook(envelope("on_session_end", session=session, turn_id=f"{session}:t:1", completed=True, interrupted=False))
    plane.hook(envelope("on_session_finalize", session=session, reason="shutdown"))
    evs = plane.wait(session, lambda e: "session.ended" in types(e) and types(e).count("x.hermes.instruction.dropped") == 2,
                     "the drops and session.ended")
    ended = next(e for e in evs if e["type"] == "session.ended")
    dropped = [e for e in evs if e["type"] == "x.hermes.instruction.dropped"]
    assert [d["cause"] for d in dropped] == ids
    assert all(d["data"]["reason"] == C.DROP_REASON and d["seq"] < ended["seq"] for d in dropped)
    kind, ack, _ = plane.instruct(session, "too late")
    assert kind == "rejected" and ack["data"]["reason"] == "refused"
    assert plane.hook(envelope("pre_llm_call", session=new_session()), AEP_INSTRUCT="1") == b"{}\n"


# ---------------------------------------------------------------- the operator's terminal


def test_the_cli_lists_and_answers_held_calls(plane: Plane) -> None:
    session = new_session()
    start_session(plane, session)
    shim = plane.held(session, "call-cli")
    req = plane.request_of(session, "call-cli")

    def control(*args: str) -> subprocess.CompletedProcess[str]:
        return cli("control", *args, "--nats", plane.url, timeout=30)

    pending = control("pending")
    assert pending.returncode == 0 and req["id"] in pending.stdout and session in pending.stdout
    denied = control("respond", req["id"], "deny", "--reason", "ask me tomorrow")  # the session is looked up
    assert denied.returncode == 0 and denied.stdout.startswith("accepted"), denied.stderr
    assert json.loads(shim.communicate(timeout=10)[0]) == {"action": "block", "message": "ask me tomorrow"}
    again = control("respond", req["id"], "allow", "--session", session)
    assert again.returncode == 1 and "rejected (refused)" in again.stdout
    steer = control("instruct", "--session", session, "--json", "mind the budget")
    assert steer.returncode == 0 and json.loads(steer.stdout)["type"] == C.ACCEPTED
    assert control("instruct", "--session", session, "").returncode == 1  # invalid


def test_the_gate_buckets_take_the_stream_replicas_setting(nats_server_fn, monkeypatch) -> None:
    """`AEP_BRIDGE_STREAM_REPLICAS` reaches the gate's own buckets as it reaches `bootstrap`'s:
    the default creates them with one replica; 3 is refused by this single, non-clustered server
    (proving the value is asked for, not ignored)."""
    import asyncio

    from bridge.config import Settings
    from bridge.nats.streams import CONTROL_BUCKET, INSTRUCT_BUCKET
    from bridge.services.gate import Gate
    from tests.natsfixture import JetStreamClient

    client = JetStreamClient(nats_server_fn.url)
    client.bootstrap()

    async def start(replicas: str) -> Gate:
        monkeypatch.setenv("AEP_BRIDGE_STREAM_REPLICAS", replicas)
        gate = Gate(Settings(nats_url=nats_server_fn.url, instance="gate-replicas"))
        try:
            await gate.connect()
        finally:
            if gate.nc is not None:
                await gate.nc.close()
        return gate

    with pytest.raises(Exception, match="(?i)replica"):
        asyncio.run(start("3"))
    asyncio.run(start("1"))
    for spec in (CONTROL_BUCKET, INSTRUCT_BUCKET):
        assert client.stream_info(spec.stream_name).config.num_replicas == 1
    client.close()
