"""The whole pipeline on a real nats-server: shim -> mapper -> pairing -> AEP_EVENTS, and a takeover."""

from __future__ import annotations

import json
import time
from collections import defaultdict

import msgspec
import pytest

from bridge.core.aep import decode_event, encode_event
from bridge.core.invariants import check_invariants
from bridge.core.pairing import PairingState, read_tick
from tests.support.pipeline import Pipeline
from bridge.sim.sessions import realistic_envelopes
from bridge.sim.verify import StreamReader
from tests.corpus import envelopes
from tests.natsfixture import JetStreamClient
from tests.support.services import Service, publish_all, raw_records, wait_for
from tests.support.shim import compiled_hook, run_hook, shim_env
from tests.support.streams import count, quiet
from tests.support.validators import validators


def replay_clean(mapped) -> list[bytes]:  # type: ignore[no-untyped-def]
    """What one clean pairing run makes of BRIDGE_MAPPED: the pure state machine, per partition, in stream order."""
    states: dict[int, PairingState] = {}
    out: list[bytes] = []
    for m in mapped:
        n = int(m.subject.split(".")[2])
        state = states.setdefault(n, PairingState(partition=n))
        if m.subject.endswith(".__tick__"):
            now, floor = read_tick(m.data)
            events = state.tick(now, m.seq, floor)
        else:
            events = state.process(decode_event(m.data), msgspec.json.decode(m.headers.get("Bridge-Hints", "{}")), m.seq)
        out.extend(encode_event(e) for e in events)
    return out


def test_real_sessions_through_the_whole_pipeline(nats_server_fn, tmp_path):
    client = JetStreamClient(nats_server_fn.url)
    client.bootstrap()
    mapper = Service("mapper", nats_server_fn.url, tmp_path).start()
    pairing_dir = tmp_path / "p"
    pairing_dir.mkdir()
    pairing = Service("pairing", nats_server_fn.url, pairing_dir, "--replica", "solo").start()
    try:
        env = shim_env(nats_server_fn.url, tmp_path / "spool", "gw-pipe")
        for e in envelopes():
            assert run_hook(json.dumps(e), env, script=compiled_hook()).answered_empty_object
        n_mapped = quiet(client, "BRIDGE_MAPPED")
        quiet(client, "AEP_EVENTS")
        out = client.fetch("aep.hermes.>", stream="AEP_EVENTS")
        events = [decode_event(m.data) for m in out]
        assert len(events) >= n_mapped - 5  # pairing may suppress a few (exclusivity), never many

        env_v, type_v = validators()
        for m in out:
            doc = json.loads(m.data)
            assert not list(env_v.iter_errors(doc)), doc
            if doc["type"] in type_v:
                assert not list(type_v[doc["type"]].iter_errors(doc.get("data", {}))), doc
            assert m.headers["Nats-Msg-Id"] == doc["id"]
            token = m.subject.split(".")[2]
            assert m.subject == f"aep.hermes.{token}.{doc['type']}"

        problems = check_invariants(events, complete=True)
        assert not problems, problems[:10]
        ids = [e.id for e in events]
        assert len(ids) == len(set(ids)), "every event appears once"

        # The interesting pairings really happened on real sessions.
        by_id = {e.id: e for e in events}
        finished = [e for e in events if e.type == "run.finished" and e.cause is not msgspec.UNSET]
        assert finished and all(by_id[e.cause].type == "run.started" for e in finished)
        completed = [e for e in events if e.type in ("tool.completed", "tool.failed", "tool.denied")]
        assert completed and all(e.cause is not msgspec.UNSET and by_id[e.cause].type == "tool.requested" for e in completed)
        resolved = [e for e in events if e.type == "attention.resolved" and e.data.get("resolution") == "answered"]
        assert resolved and all(by_id[e.subject].type == "attention.requested" for e in resolved)
        stops = [e for e in events if e.type == "delegation.subagent.stopped"]
        assert stops and all(by_id[e.cause].type == "delegation.subagent.started" for e in stops if e.cause is not msgspec.UNSET)
    finally:
        assert pairing.terminate() == 0, pairing.log()
        mapper.terminate()
        client.close()


def acquired(service: Service) -> set[int]:
    """The partitions a pairing worker's log says it acquired."""
    out = set()
    try:
        text = service.log_path.read_text(errors="replace")
    except OSError:
        return out
    for line in text.splitlines():
        if '"partition_acquired"' in line:
            try:
                out.add(int(json.loads(line)["partition"]))
            except (ValueError, KeyError):
                pass
    return out


@pytest.mark.slow
def test_kill_9_the_owner_and_a_standby_takes_over(nats_server_fn, tmp_path):
    from bridge.sim.sessions import realistic_envelopes

    client = JetStreamClient(nats_server_fn.url)
    client.bootstrap()
    records = raw_records(realistic_envelopes(6000, seed=11), instance="takeover")
    # Half now, half after the kill: the owner dies with work left whatever its speed.
    client.run(publish_all(client.js, records[:3000]))
    mapper = Service("mapper", nats_server_fn.url, tmp_path).start()
    quiet(client, "BRIDGE_MAPPED")

    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    owner = Service("pairing", nats_server_fn.url, dirs[0], "--replica", "owner").start()
    wait_for(lambda: count(client, "AEP_EVENTS") > 0, 30, what="the owner to start publishing")
    # Publishing starts with the first partition, not the last: the owner holds all 8 first.
    wait_for(lambda: acquired(owner) == set(range(8)), 30, what="the owner to hold every partition")
    standby = Service("pairing", nats_server_fn.url, dirs[1], "--replica", "standby").start()
    try:
        time.sleep(0.3)
        owner.kill()  # kill -9 mid-run: no final checkpoint, no lease release
        before = count(client, "AEP_EVENTS")
        client.run(publish_all(client.js, records[3000:]))
        quiet(client, "BRIDGE_MAPPED")
        # The dead owner's leases expire (LEASE_TTL_S) and the standby takes them, every one.
        wait_for(lambda: acquired(standby) == set(range(8)), 40, what="the standby to take over")
        quiet(client, "AEP_EVENTS", settle=3.0, timeout=90)
        assert count(client, "AEP_EVENTS") > before, "the standby took over and went on"

        mapped = client.fetch("bridge.mapped.>", stream="BRIDGE_MAPPED")
        want = replay_clean(mapped)
        got = [m.data for m in client.fetch("aep.hermes.>", stream="AEP_EVENTS")]
        assert len(got) == len(set(got)), "no duplicates"
        assert sorted(got) == sorted(want), "the final stream equals a clean run's"
        # and in each lane the order is the clean run's order
        lanes_got, lanes_want = defaultdict(list), defaultdict(list)
        for blob in got:
            lanes_got[json.loads(blob)["session"]].append(blob)
        for blob in want:
            lanes_want[json.loads(blob)["session"]].append(blob)
        assert lanes_got == lanes_want
    finally:
        standby.terminate()
        owner.terminate()
        mapper.terminate()
        client.close()


def test_the_tick_interval_is_a_setting(nats_server_fn, tmp_path):
    """`--tick-s` (AEP_BRIDGE_TICK_S) sets how often an owner ticks its partitions: the clock of
    TTL closure and of held follow-ups. At the default 15 s, three ticks on one partition take
    over 30 s; at 0.5 s they come within the bound below. Bad values are refused."""
    from bridge.config import Settings

    client = JetStreamClient(nats_server_fn.url)
    client.bootstrap()
    pairing = Service("pairing", nats_server_fn.url, tmp_path, "--replica", "ticker", "--tick-s", "0.5").start()
    try:
        def ticks() -> int:
            info = client.run(client.js.stream_info("BRIDGE_MAPPED", subjects_filter="bridge.mapped.0.__tick__"))
            return (info.state.subjects or {}).get("bridge.mapped.0.__tick__", 0)

        wait_for(lambda: ticks() >= 3, 20, interval=0.2, what="three ticks on partition 0 at --tick-s 0.5")
    finally:
        pairing.terminate()
        client.close()
    assert Settings.from_env({"AEP_BRIDGE_CONFIG": "/dev/null", "AEP_BRIDGE_TICK_S": "2.5"}).tick_s == 2.5
    assert Settings.from_env({"AEP_BRIDGE_CONFIG": "/dev/null"}).tick_s == 15.0
    for bad in ("0", "-1", "soon"):
        with pytest.raises(ValueError, match="AEP_BRIDGE_TICK_S"):
            Settings.from_env({"AEP_BRIDGE_CONFIG": "/dev/null", "AEP_BRIDGE_TICK_S": bad})


def test_the_hold_is_a_setting(nats_server_fn, tmp_path):
    """AEP_BRIDGE_PAIRING_HOLD_S is how long a terminal waits for its start: a lone
    `post_tool_call` (its `pre_tool_call` never sent) is released when its hold expires, at
    the next tick. At the default 45 s it would still be held at the bound below; at 1 s it
    is out. Bad values are refused."""
    from bridge.config import Settings

    client = JetStreamClient(nats_server_fn.url)
    client.bootstrap()
    lone = next(e for e in envelopes() if e["hook_event_name"] == "post_tool_call")
    mapper = Service("mapper", nats_server_fn.url, tmp_path).start()
    pairing = Service("pairing", nats_server_fn.url, tmp_path, "--replica", "hold", "--tick-s", "0.5",
                      env={"AEP_BRIDGE_PAIRING_HOLD_S": "1"}).start()
    try:
        client.run(publish_all(client.js, raw_records([lone], instance="hold")))
        wait_for(lambda: count(client, "BRIDGE_MAPPED") - ticks_in(client) >= 1, 20, what="the mapped terminal")
        wait_for(lambda: count(client, "AEP_EVENTS") >= 1, 15, interval=0.2,
                 what="the lone terminal released after a 1 s hold")
        (event,) = [json.loads(m.data) for m in client.fetch("aep.>", stream="AEP_EVENTS")]
        assert event["type"] == "tool.completed" and "cause" not in event, event
    finally:
        pairing.terminate()
        mapper.terminate()
        client.close()
    assert Settings.from_env({"AEP_BRIDGE_CONFIG": "/dev/null"}).pairing_hold_s == 45.0
    for bad in ("-1", "121", "soon"):
        with pytest.raises(ValueError, match="AEP_BRIDGE_PAIRING_HOLD_S"):
            Settings.from_env({"AEP_BRIDGE_CONFIG": "/dev/null", "AEP_BRIDGE_PAIRING_HOLD_S": bad})


def ticks_in(client: JetStreamClient) -> int:
    info = client.run(client.js.stream_info("BRIDGE_MAPPED", subjects_filter="bridge.mapped.*.__tick__"))
    return sum((info.state.subjects or {}).values())


@pytest.mark.slow
def test_a_pairing_owner_back_after_the_duplicate_window_publishes_nothing_twice(nats_server_fn, tmp_path):
    """The owner dies before its first checkpoint; the next one restores later than AEP_EVENTS'
    duplicate window. Before the fix every event of the partition reached consumers twice."""
    pipe = Pipeline(nats_server_fn.url, tmp_path / "logs")
    pipe.bootstrap(duplicate_window_s=2.0)
    records = raw_records(realistic_envelopes(3000, seed=3), instance="tail")
    pipe.run(lambda js: publish_all(js, records))
    pipe.add("mapper")
    try:
        wait_for(lambda: pipe.counts()["BRIDGE_MAPPED"] >= 3000, 60, what="the mapped events")
        owner = pipe.add("pairing", name="owner")
        wait_for(lambda: pipe.counts()["AEP_EVENTS"] >= 1500, 60, interval=0.02, what="the owner publishing")
        owner.kill()  # SIGKILL: no checkpoint yet, leases held until they expire (10 s > the 2 s window)
        published_before = pipe.counts()["AEP_EVENTS"]
        successor = pipe.add("pairing", name="successor")
        wait_for(lambda: "partition_acquired" in successor.log(), 40, what="the takeover")
        pipe.settle(timeout=60)

        async def ids(js) -> list[str]:  # type: ignore[no-untyped-def]
            out: list[str] = []
            r = StreamReader(js, "AEP_EVENTS", "aep.hermes.>")
            await r.read_new(lambda m: out.append(json.loads(m.data)["id"]))
            await r.close()
            return out

        got = pipe.run(ids)
        assert len(got) > published_before, "the successor went on"
        assert len(got) == len(set(got)), f"{len(got) - len(set(got))} events published twice"
        skipped = successor.metrics().get("aep_bridge_pairing_republish_skipped_total", 0)
        assert skipped >= published_before * 0.5, skipped
    finally:
        pipe.stop()
