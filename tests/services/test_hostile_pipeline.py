"""Hostile inputs that once stopped the pipeline, against a real nats-server (issue 13,
findings 1, 2, 4 and 7).

Each end-to-end test sends the hostile input first and a normal session after it, and
requires the normal session to come out of AEP_EVENTS whole: a hostile input may end in
the DLQ with its reason, never stop a service, and never reach the wire as a subject the
server refuses (nats-server closes such a connection and nats-py never reopens it).

How each failed on the code before the fix (ea04170), recorded by running this file there:
* 1: the 5,000-character session_id made the mapper publish a ~6.7 KB subject; the server
  closed its connection ("maximum control line exceeded"), the mapper looped on
  fetch_failed and the normal session never reached AEP_EVENTS. "nl-sess\\n" passed the
  `^...$` check, nats-py refused the subject and its events went to the DLQ.
  A session named "unknown" came out with `lane: "unknown"` on `aep.hermes._unknown.*`.
* 2: the 6 KB hook name became a ~6 KB type; pairing's publish closed its connection, every
  partition stopped, and the normal session never reached AEP_EVENTS.
* 4: `ts: -1` went through; the pairing partition's checkpoint could not be encoded, so the
  partition task died every ~10 s and was taken over from zero (no checkpoint object ever
  written); `ts: 2**80` was retried towards max_deliver, no `bad_raw` dead letter.
* 7: a body saying `"instance": "gateway-7"` on `hermes.raw.gateway-0.*` came out with
  `source: aep://gateway-7/...`.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from bridge.core.identity import event_id
from tests.natsfixture import JetStreamClient
from tests.support.services import Service, wait_for
from tests.support.shim import compiled_hook, run_hook, shim_env

NORMAL = "20261201_101500_c0ffee"


def session(sid: str, n_tools: int = 2) -> list[dict[str, Any]]:
    """A complete, ordinary Hermes session: start, a turn with tool calls, end."""
    turn = f"{sid}:{sid}:0a1b2c3d"
    envs: list[dict[str, Any]] = [{"hook_event_name": "on_session_start", "session_id": sid, "extra": {}}]
    envs.append({"hook_event_name": "pre_llm_call", "session_id": sid, "extra": {"turn_id": turn, "user_message": "hi"}})
    for i in range(n_tools):
        call = {"tool_call_id": f"call_{i}", "turn_id": turn}
        envs.append({"hook_event_name": "pre_tool_call", "session_id": sid, "tool_name": "terminal",
                     "tool_input": {"command": "ls"}, "extra": call})
        envs.append({"hook_event_name": "post_tool_call", "session_id": sid, "tool_name": "terminal",
                     "tool_input": {"command": "ls"}, "extra": {**call, "status": "ok", "duration_ms": 5}})
    envs.append({"hook_event_name": "on_session_end", "session_id": sid, "extra": {"turn_id": turn}})
    envs.append({"hook_event_name": "on_session_finalize", "session_id": sid, "extra": {}})
    return envs


def expected_types(n_tools: int = 2) -> list[str]:
    return ["session.started", "run.started", *["tool.requested", "tool.completed"] * n_tools, "run.finished", "session.ended"]


def through_shim(envelopes: list[dict[str, Any]], url: str, spool: Path, instance: str = "gw-hostile", **settings: Any) -> None:
    env = shim_env(url, spool, instance, deadline_ms=3000, **settings)
    for e in envelopes:
        run = run_hook(json.dumps(e), env, script=compiled_hook())
        assert run.answered_empty_object, run.stderr
    assert not any(p.stat().st_size for p in spool.glob("*.spool")), "the shim published everything"


def events_of(client: JetStreamClient, sid: str) -> list[dict[str, Any]]:
    return [m.json() for m in client.fetch("aep.hermes.>", stream="AEP_EVENTS") if m.json().get("session") == sid]


def wait_whole(client: JetStreamClient, sid: str, services: list[Service], timeout: float = 45) -> list[dict[str, Any]]:
    """The normal session's events on AEP_EVENTS, all of them (or the services' logs on failure)."""
    want = sorted(expected_types())
    try:
        wait_for(lambda: sorted(e["type"] for e in events_of(client, sid)) == want, timeout,
                 what=f"session {sid} whole on AEP_EVENTS")
    except AssertionError as exc:
        logs = "\n".join(f"--- {s.name} (alive={s.alive()}):\n{s.log()[-1500:]}" for s in services)
        raise AssertionError(f"{exc}; got {[e['type'] for e in events_of(client, sid)]}\n{logs}") from None
    return events_of(client, sid)


def dlq(client: JetStreamClient) -> list[Any]:
    return client.fetch("bridge.dlq.>", stream="BRIDGE_DLQ")


class Pipeline:
    """Bootstrap, one mapper and one pairing replica on a fresh server."""

    def __init__(self, url: str, tmp: Path, env: dict[str, str] | None = None) -> None:
        self.client = JetStreamClient(url)
        self.client.bootstrap()
        self.mapper = Service("mapper", url, tmp, env=env).start()
        self.pairing = Service("pairing", url, tmp, "--replica", "solo", env=env).start()

    @property
    def services(self) -> list[Service]:
        return [self.mapper, self.pairing]

    def close(self) -> None:
        for s in self.services:
            s.terminate()
        self.client.close()


@pytest.fixture
def pipeline(nats_server_fn, tmp_path):  # type: ignore[no-untyped-def]
    p = Pipeline(nats_server_fn.url, tmp_path)
    yield p
    p.close()


# ---------------------------------------------------------------- finding 1: over-long and odd session ids


def test_a_5000_character_session_id_neither_stops_the_mapper_nor_loses_the_session(pipeline, nats_server_fn, tmp_path):
    long_sid = "S" * 5000
    hostile = [{"hook_event_name": "on_session_start", "session_id": long_sid, "extra": {}},
               *session("nl-sess\n", n_tools=1)]
    through_shim(hostile, nats_server_fn.url, tmp_path / "spool")
    through_shim(session(NORMAL), nats_server_fn.url, tmp_path / "spool")
    client = pipeline.client
    events = wait_whole(client, NORMAL, pipeline.services)
    assert [e["seq"] for e in events] == sorted(e["seq"] for e in events)

    # The long session is mapped too, under a bounded (hashed) lane token.
    (started,) = wait_for_events(client, long_sid)
    subjects = [m.subject for m in client.fetch("aep.hermes.>", stream="AEP_EVENTS")]
    assert max(len(s) for s in subjects) < 300, max(subjects, key=len)[:120]
    assert started["type"] == "session.started" and started["session"] == long_sid
    # "nl-sess\n" is not a plain id (a full match): its whole session comes out, none in the DLQ.
    nl = wait_for_events(client, "nl-sess\n", n=len(expected_types(1)))
    assert sorted(e["type"] for e in nl) == sorted(expected_types(1))
    assert not dlq(client), [m.headers.get("Bridge-Dlq-Reason") for m in dlq(client)]
    assert all(s.alive() for s in pipeline.services)


def wait_for_events(client: JetStreamClient, sid: str, n: int = 1, timeout: float = 30) -> list[dict[str, Any]]:
    wait_for(lambda: len(events_of(client, sid)) >= n, timeout, what=f"{n} events of {sid[:20]!r}")
    return events_of(client, sid)


def test_a_session_named_unknown_is_not_the_unknown_lane(pipeline, nats_server_fn, tmp_path):
    # An approval nobody can place (the unknown lane), then a real session called "unknown".
    stray = {"hook_event_name": "pre_approval_request", "session_id": "",
             "extra": {"session_key": "agent:main:nowhere", "command": "rm -rf /tmp/x", "pattern_key": "rm"}}
    through_shim([stray, *session("unknown")], nats_server_fn.url, tmp_path / "spool")
    through_shim(session(NORMAL), nats_server_fn.url, tmp_path / "spool")
    client = pipeline.client
    wait_whole(client, NORMAL, pipeline.services)
    # and the session called "unknown" whole too: another partition, not done when NORMAL is
    # (this test read AEP_EVENTS too early once, 2026-12-04)
    wait_for(lambda: len([m for m in client.fetch("aep.hermes.>", stream="AEP_EVENTS")
                          if m.json().get("session") == "unknown" and "lane" not in m.json()]) >= len(expected_types()),
             45, what="the session called unknown whole on AEP_EVENTS")
    stored = client.fetch("aep.hermes.>", stream="AEP_EVENTS")
    lane = [m for m in stored if m.json().get("lane") == "unknown"]
    real = [m for m in stored if m.json().get("session") == "unknown" and "lane" not in m.json()]
    assert lane and all(m.subject.startswith("aep.hermes._unknown.") for m in lane)
    assert all(m.json()["type"].startswith("attention.") for m in lane), "only the stray approval is in the unknown lane"
    assert sorted(m.json()["type"] for m in real) == sorted(expected_types())
    assert all(m.subject.startswith("aep.hermes.unknown.") for m in real)


# ---------------------------------------------------------------- finding 2: a 6 KB hook name


def test_a_6kb_hook_name_goes_to_the_dlq_and_pairing_goes_on(pipeline, nats_server_fn, tmp_path):
    hook = "a_" * 3000  # under the shim's field cap
    through_shim([{"hook_event_name": hook, "session_id": "hooky", "extra": {}},
                  {"hook_event_name": "pre_verify", "session_id": "hooky", "extra": {}}],  # a short unknown hook: mapped
                 nats_server_fn.url, tmp_path / "spool")
    through_shim(session(NORMAL), nats_server_fn.url, tmp_path / "spool")
    client = pipeline.client
    wait_whole(client, NORMAL, pipeline.services)
    (dead,) = dlq(client)
    assert dead.subject == "bridge.dlq.bad_hook" and dead.headers["Bridge-Dlq-Reason"] == "bad_hook"
    assert [e["type"] for e in wait_for_events(client, "hooky")] == ["x.hermes.pre.verify"]
    assert all(s.alive() for s in pipeline.services)


# ---------------------------------------------------------------- finding 4: raw values no stage can hold


def raw_body(ts: int, sid: str, seq: int, instance: str = "gw-raw", **over: Any) -> tuple[str, bytes, str]:
    rid = event_id(f"hostile-{sid}", seq, max(0, min(ts, 2**47)) // 1_000_000)
    env = {"hook_event_name": "pre_tool_call", "session_id": sid, "tool_name": "terminal", "tool_input": {"command": "id"},
           "extra": {"tool_call_id": f"c{seq}"}}
    body = {"v": 1, "id": rid, "instance": instance, "ts": ts, "hook": "pre_tool_call", "envelope": env, **over}
    return f"hermes.raw.{instance}.pre_tool_call", json.dumps(body).encode(), rid


def publish(client: JetStreamClient, records: list[tuple[str, bytes, str]]) -> None:
    for subject, body, rid in records:
        client.run(client.js.publish(subject, body, headers={"Nats-Msg-Id": rid}))


async def _checkpoint_exists(url: str, n: int) -> bool:
    import nats

    nc = await nats.connect(url)
    try:
        store = await nc.jetstream().object_store("aep_checkpoints")
        try:
            await store.get_info(f"p.{n}")
            return True
        except Exception:
            return False
    finally:
        await nc.close()


def test_raw_timestamps_out_of_range_are_bad_raw_and_no_partition_wedges(pipeline, nats_server_fn, tmp_path):
    client = pipeline.client
    now = time.time_ns()
    publish(client, [raw_body(-1, "neg", 1), raw_body(2**80, "huge", 2), raw_body(now, "notulid", 3, id="not-a-ulid"),
                     raw_body(now, "v2", 4, v=2)])
    through_shim(session(NORMAL), nats_server_fn.url, tmp_path / "spool")
    wait_whole(client, NORMAL, pipeline.services)
    wait_for(lambda: len(dlq(client)) >= 4, 20, what="four dead letters")
    dead = dlq(client)
    assert sorted(m.subject for m in dead) == ["bridge.dlq.bad_raw"] * 4
    # At the default capture a dead letter names its reason only (no text of the message:
    # tests/services/test_hostile_capture.py); each names the raw message it stands for.
    assert sorted(m.headers["Bridge-Dlq-Error"] for m in dead) == ["bad_raw"] * 4
    assert len({m.headers["Bridge-Raw-Seq"] for m in dead}) == 4
    assert not events_of(client, "neg") and not events_of(client, "huge")


def test_a_mapped_value_no_checkpoint_can_hold_is_dead_lettered_and_the_partition_checkpoints(pipeline, nats_server_fn, tmp_path):
    """Pairing's own guard (the mapper now refuses such raw messages, so the hostile event is
    published straight into BRIDGE_MAPPED, as a mapper of an older release would have)."""
    from bridge.core.lanes import lane_token, partition_of

    client = pipeline.client
    partition = partition_of(lane_token(NORMAL), 8)
    # What the mapper made of `ts: -1` before: an id whose ULID time is 2**48-1 ms.
    ev = {"aep": "0.1", "id": event_id("wedge", 512, -1 & (2**48 - 1)), "type": "tool.requested",
          "time": "1969-12-31T23:59:59.999Z", "source": "aep://gw/agent/hermes/session/" + NORMAL, "agent": "hermes",
          "session": NORMAL + "-x", "seq": 1024 + 512, "epoch": 0, "capture": "metadata",
          "data": {"tool": {"name": "t", "call_id": "c1"}, "args_digest": "0" * 32}}
    client.run(client.js.publish(f"bridge.mapped.{partition}.{NORMAL}-x", json.dumps(ev).encode(),
                                 headers={"Nats-Msg-Id": ev["id"], "Bridge-Hints": json.dumps({"ts": -1, "tool_call_id": "c1"})}))
    through_shim(session(NORMAL), nats_server_fn.url, tmp_path / "spool")
    wait_whole(client, NORMAL, pipeline.services)
    # The partition writes its checkpoint (every 10 s): before, encoding it failed, the
    # partition task died and was taken over from zero, again and again.
    wait_for(lambda: asyncio.run(_checkpoint_exists(nats_server_fn.url, partition)), 40, interval=1.0,
             what=f"a checkpoint of partition {partition}")
    wait_for(lambda: any(m.subject == "bridge.dlq.bad_mapped" for m in dlq(client)), 20, what="a bad_mapped dead letter")
    assert "partition_task_ended" not in pipeline.pairing.log()


def test_an_output_pairing_cannot_publish_is_dead_lettered_within_the_ceiling(pipeline, nats_server_fn, tmp_path):
    """An event whose type breaks the subject rules (as a mapper of another release could
    have made it) is never published: pairing dead-letters it like every other stage,
    through bridge.core.deadletter (no content at the default posture, the event named)."""
    from bridge.core.lanes import lane_token, partition_of

    client = pipeline.client
    sid = NORMAL + "-t"
    partition = partition_of(lane_token(sid), 8)
    ev = {"aep": "0.1", "id": event_id("badtype", 512, 1_764_000_000_000), "type": "x.hermes." + "a." * 80 + "b",
          "time": "2026-12-01T10:15:00.000Z", "source": "aep://gw/agent/hermes/session/" + sid, "agent": "hermes",
          "session": sid, "seq": 1024 + 512, "epoch": 0, "capture": "redacted",
          "data": {"text": "approve CANARY-PAIRING-OUT please"}}
    client.run(client.js.publish(f"bridge.mapped.{partition}.{sid}", json.dumps(ev).encode(),
                                 headers={"Nats-Msg-Id": ev["id"], "Bridge-Hints": json.dumps({"ts": 1_764_000_000_000_000_000})}))
    through_shim(session(NORMAL), nats_server_fn.url, tmp_path / "spool")
    wait_whole(client, NORMAL, pipeline.services)
    wait_for(lambda: any(m.subject == "bridge.dlq.bad_type" for m in dlq(client)), 30, what="a bad_type dead letter")
    (letter,) = [m for m in dlq(client) if m.subject == "bridge.dlq.bad_type"]
    assert b"CANARY" not in letter.data and "CANARY" not in json.dumps(dict(letter.headers or {}))
    assert letter.headers["Bridge-Event-Id"] == ev["id"] and letter.headers["Bridge-Stage"] == "pairing"
    body = json.loads(letter.data)
    assert body["original"]["id"] == ev["id"] and body["original"]["stream"] == "BRIDGE_MAPPED"
    assert body["original"]["seq"] == int(letter.headers["Bridge-Mapped-Seq"]) > 0
    assert all(s.alive() for s in pipeline.services)


def test_pairing_state_refuses_what_a_checkpoint_cannot_hold():
    from bridge.core.aep import decode_event
    from bridge.core.pairing import PairingInputError, PairingState

    state = PairingState(partition=0)
    ev = {"aep": "0.1", "id": event_id("x", 512, 1_764_000_000_000), "type": "tool.requested", "time": "2026-12-01T10:15:00.000Z",
          "source": "aep://gw/agent/hermes/session/s", "agent": "hermes", "session": "s", "seq": 1536, "epoch": 0,
          "data": {"tool": {"name": "t"}}}
    wedge_id = event_id("x", 512, 2**48 - 1)  # `ts: -1` made this id; its time is the fallback for ts <= 0
    for eid, hints, data in ((wedge_id, {"ts": -1}, {}), (ev["id"], {"ts": 2**80}, {}), (ev["id"], {"ts": 1}, {"n": 2**70}),
                             (ev["id"], {"ts": 1, "tool_call_id": "\ud800"}, {})):
        bad = decode_event(json.dumps({**ev, "id": eid, "data": {**ev["data"], **data}}))
        with pytest.raises(PairingInputError):
            state.process(bad, hints, 1)
    assert state.position == 0 and not state.counters.get("events_in")
    assert state.process(decode_event(json.dumps(ev)), {"ts": 1_764_000_000_000_000_000}, 1)
    msgspec.msgpack.decode(state.snapshot())  # the checkpoint encodes


# ---------------------------------------------------------------- finding 7: posting as another instance


def test_mapper_takes_the_instance_from_the_subject():
    from bridge.core.envelope import EnvelopeError
    from bridge.nats.subjects import check_raw_instance

    check_raw_instance("hermes.raw.gateway-0.pre_tool_call", "gateway-0")
    check_raw_instance("hermes.raw.gw_1_example.pre_tool_call", "gw.1.example")  # the shim's token rule
    for subject, instance in (("hermes.raw.gateway-0.pre_tool_call", "gateway-7"),
                              ("hermes.raw.gw_1.pre_tool_call", "gw-1")):
        with pytest.raises(EnvelopeError) as err:
            check_raw_instance(subject, instance)
        assert err.value.reason == "instance_mismatch"


def test_a_gateway_user_cannot_post_as_another_instance(tmp_path):
    """The sample deploy/nats/nats.conf users: the shim as hermes-gateway-0, the mapper as
    aep-mapper, pairing as aep-pairing, the reader as aep-consumer."""
    from tests.support.nats_roles import INBOX, USERS, configured_server, ensure_streams, sample_nats_conf
    from bridge.nats.connection import ordered_subscribe

    import nats

    def as_user(role: str) -> dict[str, str]:
        user, password = USERS[role]
        return {"AEP_BRIDGE_NATS_USER": user, "AEP_BRIDGE_NATS_PASSWORD": password}

    with configured_server(tmp_path, sample_nats_conf(tmp_path / "js")) as url:
        asyncio.run(ensure_streams(url))
        mapper = Service("mapper", url, tmp_path, env=as_user("mapper")).start()
        pairing = Service("pairing", url, tmp_path, "--replica", "solo", env=as_user("pairing")).start()
        try:
            async def forge() -> None:
                user, password = USERS["gateway-0"]
                nc = await nats.connect(url, user=user, password=password, inbox_prefix=INBOX["gateway-0"])
                try:
                    _, body, rid = raw_body(time.time_ns(), "forged", 1, instance="gateway-7")
                    await nc.jetstream().publish("hermes.raw.gateway-0.pre_tool_call", body, headers={"Nats-Msg-Id": rid})
                finally:
                    await nc.close()

            asyncio.run(forge())
            user, password = USERS["gateway-0"]
            through_shim(session(NORMAL), url, tmp_path / "spool", instance="gateway-0",
                         nats_user=user, nats_password=password)

            async def read(role: str, stream: str, filt: str, want: int) -> list[Any]:
                user, password = USERS[role]
                nc = await nats.connect(url, user=user, password=password, inbox_prefix=INBOX[role])
                got: list[Any] = []
                try:
                    sub = await ordered_subscribe(nc.jetstream(), filt, stream,  # by name: the reader's right
                                                  deliver_policy=nats.js.api.DeliverPolicy.ALL)
                    deadline = time.monotonic() + 45
                    while time.monotonic() < deadline and len(got) < want:
                        try:
                            got.append(await sub.next_msg(timeout=1))
                        except Exception:
                            pass
                    await asyncio.sleep(1.0)  # anything more (the forgery) would arrive now
                    while True:
                        try:
                            got.append(await sub.next_msg(timeout=0.5))
                        except Exception:
                            break
                finally:
                    await nc.close()
                return [json.loads(m.data) for m in got]

            events = asyncio.run(read("consumer", "AEP_EVENTS", "aep.hermes.>", len(expected_types())))
            assert sorted(e["type"] for e in events if e["session"] == NORMAL) == sorted(expected_types()), \
                (events, mapper.log()[-1500:], pairing.log()[-1500:])
            assert not [e for e in events if "gateway-7" in e["source"] or e["session"] == "forged"]
            assert all(e["source"].startswith("aep://gateway-0/") for e in events)

            async def dlq_subjects() -> dict[str, int]:
                user, password = USERS["bootstrap"]
                nc = await nats.connect(url, user=user, password=password, inbox_prefix=INBOX["bootstrap"])
                try:
                    info = await nc.jetstream().stream_info("BRIDGE_DLQ", subjects_filter=">")
                    return dict(info.state.subjects or {})
                finally:
                    await nc.close()

            wait_for(lambda: asyncio.run(dlq_subjects()) == {"bridge.dlq.instance_mismatch": 1}, 15,
                     what="the forgery in the DLQ as instance_mismatch")
        finally:
            mapper.terminate()
            pairing.terminate()
