"""Fault scenarios over the whole pipeline (issue 8), each on its own real nats-server.

Every scenario runs the fleet simulator (`bridge.sim.fleet`: in-process shims plus real
shim processes) against real `aep-bridge mapper` / `aep-bridge pairing` processes,
injects one kind of fault mid-run, lets every session finish, drains the spools, and
then runs the verifier (`bridge.sim.verify`) against the simulator's manifest: zero
loss, zero duplicates, no reused (epoch, seq), the pairing invariants, schema validity,
no canary secret anywhere. Each also asserts that its fault really happened (kills
counted, events spooled, copies stored twice, lag observed, ...), so a scenario that
silently did nothing fails.

Time is bounded by the pipeline's own timers, not by assertions on durations: a
mapper killed mid-batch leaves messages that JetStream redelivers after the consumer's
ack_wait (30 s); a pairing owner killed holds its leases until they expire (10 s).
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from bridge.services.pairing import POLL_S
from bridge.shim import hook
from bridge.sim.fleet import Fleet, FleetConfig
from tests.support.pipeline import Pipeline
from tests.support.faults import PRICED, SHORT_WINDOWS, assert_clean, finish
from tests.support.shim import run_hook, shim_env


def fleet_for(url: str, tmp_path: Path, **kw: Any) -> Fleet:
    cfg = dict(nats_url=url, instances=30, rate=300.0, duration=12.0, shim_fraction=0.1, shim_workers=3,
               canary_fraction=0.05, hostile_fraction=0.002, seed=int.from_bytes(os.urandom(2), "big"),
               manifest=str(tmp_path / "manifest.jsonl"), spool_dir=str(tmp_path / "spool"))
    cfg.update(kw)
    return Fleet(FleetConfig(**cfg))


def start(fleet: Fleet) -> threading.Thread:
    t = threading.Thread(target=fleet.run, name="fleet", daemon=True)
    t.start()
    return t


def pipeline(server: Any, tmp_path: Path, mappers: int = 1, pairings: int = 1, window: float | None = None,
             mapper_env: dict[str, str] | None = None, mapper_module: str = "bridge.cli") -> Pipeline:
    pipe = Pipeline(server.url, tmp_path / "logs", env=dict(SHORT_WINDOWS, **PRICED))
    pipe.bootstrap(duplicate_window_s=window)
    for _ in range(mappers):
        pipe.add("mapper", args=["--batch", "64"], env=mapper_env, module=mapper_module)
    for i in range(pairings):
        # Ticks every 2 s, not 15: a follow-up held for a start that never comes (its instance
        # lost it, or it is late) is released at its deadline plus at most one tick, and the
        # verifier waits for it; at 15 s a scenario spent up to 13 s more just waiting.
        pipe.add("pairing", name=f"pairing-{i}", env={"AEP_BRIDGE_TICK_S": "2"})
    pipe.wait_ready()
    return pipe


# ---------------------------------------------------------------- 1. kill -9 of the workers


@pytest.mark.slow
def test_kill_9_mappers_and_pairing_owners_at_random_moments(nats_server_fn, tmp_path):
    pipe = pipeline(nats_server_fn, tmp_path, mappers=2, pairings=2)
    fleet = fleet_for(nats_server_fn.url, tmp_path, rate=400.0, duration=12.0, instances=40)
    kills: Counter[str] = Counter()
    try:
        thread = start(fleet)
        seed = int.from_bytes(os.urandom(4), "big")
        print(f"kill schedule seed {seed} (fleet seed {fleet.config.seed})")
        rng = random.Random(seed)
        # The kinds take turns (which one first, which replica of it and when are random): a
        # free choice among the four workers picked pairing fewer than twice in ~2 % of runs
        # (9 kills: 10/512), and the guard below then failed a run that lost nothing.
        kinds = ["mapper", "pairing"]
        rng.shuffle(kinds)
        time.sleep(1.0)
        while thread.is_alive() and fleet.sent < 0.9 * 12.0 * 400:
            victim = rng.choice(pipe.of(kinds[sum(kills.values()) % 2]))
            victim.kill()  # SIGKILL: no final ack, checkpoint or lease release
            kills[victim.kind] += 1
            victim.start()
            time.sleep(rng.uniform(0.7, 1.6))
        report = finish(fleet, thread, pipe)
        assert kills["mapper"] >= 2 and kills["pairing"] >= 2, kills
        assert_clean(report, pipe)
        # Redelivery after a crash may put a mapped event behind a later one of its session:
        # reported as a backfill (AEP allows it), never a reused position.
        print(f"kills {dict(kills)}; backfills {report.backfills}")
    finally:
        pipe.stop()


# ---------------------------------------------------------------- 2. NATS killed and restarted


@pytest.mark.slow
def test_nats_killed_and_restarted_on_the_same_store(nats_server_fn, tmp_path):
    pipe = pipeline(nats_server_fn, tmp_path, mappers=1, pairings=1)
    fleet = fleet_for(nats_server_fn.url, tmp_path, duration=12.0)
    try:
        thread = start(fleet)
        time.sleep(4.0)
        before = pipe.counts()
        nats_server_fn.kill()  # SIGKILL mid-run
        time.sleep(2.5)  # the shims keep firing: they spool
        nats_server_fn.start()  # same port, same JetStream store
        after = pipe.counts()
        assert after["HERMES_RAW"] >= before["HERMES_RAW"], "the store survived the kill"
        report = finish(fleet, thread, pipe)
        assert fleet.outcomes["spooled"] > 0, "the outage was seen by the shims"
        assert all(w.alive() for w in pipe.workers), "the services rode out the restart:\n" + pipe.logs()
        assert_clean(report, pipe)
    finally:
        pipe.stop()


# ---------------------------------------------------------------- 2b. an operator's bad day (issue 17)


@pytest.mark.slow
def test_a_bad_day_mapper_pairing_and_nats_killed_approvals_keep_their_session_and_answer(nats_server_fn, tmp_path):
    """Issue 17's schedule, exactly: two mappers and two pairing workers on a server with a store;
    `simulate --instances 50 --rate 300 --duration 45 --seed 7`; 10 s in, kill -9 a mapper and
    restart it 5 s later; at 20 s kill -9 a pairing worker, restart it 6 s later; at 30 s SIGKILL
    nats-server and start it again on the same store 6 s later. Before, `verify` said OK while an
    approval's answer sat in `unknown` as `attention.answered {subject: <pattern key>}` and its
    request was closed `dismissed`: the verifier's approval checks and the follow-up subject
    invariant now catch that, and the stream must pass them."""
    pipe = pipeline(nats_server_fn, tmp_path, mappers=2, pairings=2)
    fleet = fleet_for(nats_server_fn.url, tmp_path, instances=50, rate=300.0, duration=45.0, seed=7)
    mapper, pairing = pipe.of("mapper")[0], pipe.of("pairing")[0]
    try:
        t0 = time.monotonic()
        thread = start(fleet)

        def at(seconds: float) -> None:
            time.sleep(max(0.0, t0 + seconds - time.monotonic()))

        at(10.0)
        mapper.kill()  # SIGKILL: its fetched batch stays unacked until ack_wait (30 s)
        at(15.0)
        mapper.start()
        at(20.0)
        pairing.kill()  # its leases lapse after 10 s; the other worker takes its partitions
        at(26.0)
        pairing.start()
        at(30.0)
        before = pipe.counts()
        nats_server_fn.kill()  # SIGKILL mid-run: the shims spool, the services reconnect
        at(36.0)
        nats_server_fn.start()  # same port, same JetStream store
        after = pipe.counts()
        assert after["HERMES_RAW"] >= before["HERMES_RAW"], "the store survived the kill"
        # A card open at its session's end waits hold_ns (45 s) for its answer: give the verifier time.
        report = finish(fleet, thread, pipe, wait=120.0)
        assert fleet.outcomes["spooled"] > 0, "the outage was seen by the shims"
        assert all(w.alive() for w in pipe.workers), "the services rode out the NATS restart:\n" + pipe.logs()
        assert report.approvals_checked > 0, "the run carried approvals to check:\n" + report.render()
        assert report.approval_count == 0, report.render()
        assert_clean(report, pipe)
        print(f"approvals checked {report.approvals_checked}; backfills {report.backfills}")
    finally:
        pipe.stop()


# ---------------------------------------------------------------- 3. NATS down longer than the duplicate window


@pytest.mark.slow
def test_outage_longer_than_the_duplicate_window_with_lost_acks(nats_server_fn, tmp_path):
    window = 2.0  # test-only: bootstrap(duplicate_window_s=...) so "longer than the window" fits in a short test
    pipe = pipeline(nats_server_fn, tmp_path, mappers=2, pairings=1, window=window)
    fleet = fleet_for(nats_server_fn.url, tmp_path, duration=9.0)
    try:
        thread = start(fleet)
        time.sleep(3.0)
        # The moment a server dies is when acks get lost: the shim already sent the message,
        # JetStream stored it, the ack never came back, so the shim spools it and will send
        # it again. Keep those copies in the spool until the server is back (as a dead server
        # would), then take the server down for longer than the duplicate window.
        fleet.drainer.hold.set()
        fleet.lose_acks(20)  # at most one per in-process instance: a spooled one stops publishing directly
        deadline = time.monotonic() + 10
        while fleet.sender.lose_acks and time.monotonic() < deadline:
            time.sleep(0.01)
        assert fleet.sender.lose_acks == 0
        nats_server_fn.kill()
        time.sleep(window + 3.0)  # the shims keep firing into their spools
        nats_server_fn.start()
        fleet.drainer.hold.clear()
        report = finish(fleet, thread, pipe)
        assert report.raw_duplicates >= 20, "the resends past the window were stored twice on HERMES_RAW:\n" + report.render()
        resends = sum(w.metrics().get("aep_bridge_mapper_resends_dropped_total", 0) for w in pipe.of("mapper"))
        assert resends >= 20, f"the mapper recognised the shims' resends ({resends}):\n" + report.render()
        # The mapper's own publishes whose acks died with the server may be stored twice on
        # BRIDGE_MAPPED (redelivered at once as first deliveries); pairing drops those copies.
        print(f"BRIDGE_MAPPED copies absorbed by pairing: {report.mapped_duplicates}")
        assert_clean(report, pipe)
    finally:
        pipe.stop()


# ---------------------------------------------------------------- 4. a slow consumer


POLL_S_SAMPLES = int(POLL_S) + 1  # the 1 s lag samples taken before the open pull requests expired


@pytest.mark.slow
def test_pairing_paused_then_resumed_lags_and_catches_up(nats_server_fn, tmp_path):
    pipe = pipeline(nats_server_fn, tmp_path, mappers=1, pairings=1)
    pairing = pipe.of("pairing")[0]
    fleet = fleet_for(nats_server_fn.url, tmp_path, rate=600.0, duration=16.0, instances=40)
    try:
        thread = start(fleet)
        time.sleep(3.0)
        pairing.pause()  # SIGSTOP: a consumer that stopped reading (its leases lapse meanwhile)
        lag_seen = []
        counts_at_pause = pipe.counts()
        for _ in range(12):
            time.sleep(1.0)
            lag_seen.append(pipe.lag()["pairing_pending"])
        counts_paused = pipe.counts()
        pairing.resume()
        # Lag grew while paused, and AEP_EVENTS stood still. The first samples may be 0: a busy
        # partition's open pull request (up to POLL_S, 2 s) still takes messages into the
        # stopped process's socket; once they expired, the backlog shows (a clean-clone CI run
        # of 74d4e39: [0, 557, 1166, ...]).
        assert lag_seen[-1] > lag_seen[0] >= 0 and all(n > 0 for n in lag_seen[POLL_S_SAMPLES:]), lag_seen
        assert counts_paused["AEP_EVENTS"] == counts_at_pause["AEP_EVENTS"]
        assert counts_paused["BRIDGE_MAPPED"] > counts_at_pause["BRIDGE_MAPPED"]
        # The service's own metric shows the backlog once it reads again.
        pending_metric = 0.0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and pending_metric == 0:
            m = pairing.metrics()
            pending_metric = max([v for k, v in m.items() if k.startswith("aep_bridge_consumer_pending_messages{")
                                  and 'stream="BRIDGE_MAPPED"' in k] or [0.0])
            time.sleep(0.05)
        assert pending_metric > 0, "aep_bridge_consumer_pending_messages showed the backlog"
        report = finish(fleet, thread, pipe)
        assert pairing.alive(), pairing.log()
        assert_clean(report, pipe)
        assert report.backfills == 0, "one mapper, no redelivery: every session in order\n" + report.render()
        print(f"pairing lag while paused: {lag_seen}; metric after resume: {pending_metric}")
    finally:
        pipe.stop()


# ---------------------------------------------------------------- 5. the spool's disk full or unwritable


@pytest.mark.slow
def test_spool_full_or_unwritable_answers_in_time_and_counts_the_loss(nats_server_fn, tmp_path):
    pipe = pipeline(nats_server_fn, tmp_path, mappers=1, pairings=1)
    fleet = fleet_for(nats_server_fn.url, tmp_path, duration=6.0, instances=20, shim_fraction=0.25)
    spool = Path(fleet.spool_dir)
    spool.mkdir(parents=True, exist_ok=True)
    full = sorted(fleet.shim_instances)[:2]
    # "Nowhere to spool": the spool files of two real-shim instances, in the spool dir and in
    # the private fallback the shim tries next, are links to /dev/full. The shim never
    # follows a link (it could be pointed at any file of the user: issue 13), so it can keep
    # their events nowhere; their counter files beside them still work.
    fallback = Path(fleet.shim_config.fallback_dir)
    fallback.mkdir(parents=True, mode=0o700)
    for name in full:
        os.symlink("/dev/full", spool / f"{hook.token(name)}.spool")
        os.symlink("/dev/full", fallback / f"{hook.token(name)}.spool")
    # "Unwritable": a real shim whose spool directory cannot be created at all.
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    ro_env = shim_env(f"nats://127.0.0.1:{hook.parse_server_url(nats_server_fn.url)[2]}", blocker / "spool", "ro-instance")
    try:
        thread = start(fleet)
        time.sleep(1.5)
        nats_server_fn.stop()
        runs = [run_hook(b'{"hook_event_name":"on_session_start","session_id":"s-ro","extra":{}}', ro_env) for _ in range(3)]
        time.sleep(2.0)  # the fleet keeps firing: most spool, the /dev/full ones lose events
        nats_server_fn.start()
        report = finish(fleet, thread, pipe)
        # The shim answered {} in time although it could neither publish nor spool, and said so.
        for r in runs:
            assert r.answered_empty_object and b"LOST" in r.stderr, r
            assert r.elapsed < 0.25 + 2.0, r.elapsed  # the deadline, with generous room for a busy box
        lost = [e for e in fleet_manifest(fleet) if e.get("o") == "lost"]
        assert lost and {e["i"] for e in lost} <= set(full), "only the instances whose spool is full lost events"
        counted = fleet.edge_losses()
        assert sum(counted.get(n, 0) for n in full) == len(lost), (counted, len(lost))
        assert report.edge_loss_counted == len(lost)
        snap = fleet.snapshot()
        assert snap["shim_failures"] == 0 and snap["shim_max_ms"] < 250 + 2000, snap
        assert_clean(report, pipe)  # every event not counted as lost arrived
    finally:
        pipe.stop()


def fleet_manifest(fleet: Fleet) -> list[dict[str, Any]]:
    from bridge.sim.verify import read_manifest

    return read_manifest(fleet.manifest_path)[1]


# ---------------------------------------------------------------- 6. a poisoned message


@pytest.mark.slow
def test_poisoned_message_is_dead_lettered_after_max_deliver_and_the_rest_flows(nats_server_fn, tmp_path):
    poison = "POISON-" + os.urandom(4).hex()
    pipe = pipeline(nats_server_fn, tmp_path, mappers=1, pairings=1, mapper_env={"AEP_BRIDGE_TEST_POISON": poison},
                    mapper_module="tests.support.poisoned_mapper")
    fleet = fleet_for(nats_server_fn.url, tmp_path, duration=8.0)
    try:
        thread = start(fleet)
        time.sleep(2.0)
        # One envelope, with a canary in it, that makes the mapper fail on every delivery.
        env = shim_env(nats_server_fn.url, tmp_path / "spool-poison", "poisoner")
        secret = fleet.canaries.aws_key
        body = (b'{"hook_event_name":"pre_tool_call","tool_name":"terminal","tool_input":{"command":"export AWS_KEY='
                + secret.encode() + b'"},"session_id":"' + poison.encode() + b'","cwd":"/tmp","extra":{}}')
        assert run_hook(body, env).answered_empty_object
        report = finish(fleet, thread, pipe, wait=90)
        dlq = dead_letters(pipe)
        # At the default capture a dead letter names its raw message, nothing of its content.
        poisoned = [d for d in dlq if d["headers"].get("Bridge-Raw-Subject", "").startswith("hermes.raw.poisoner.")]
        assert len(poisoned) == 1, dlq
        assert poisoned[0]["headers"]["Bridge-Dlq-Reason"] == "max_deliver"
        assert secret.encode() not in poisoned[0]["data"], "the dead letter holds no secret"
        assert poison.encode() not in poisoned[0]["data"], "nor any content"
        assert poisoned[0]["headers"]["Bridge-Dlq-Capture"] == "metadata"
        metrics = pipe.of("mapper")[0].metrics()
        assert metrics.get('aep_bridge_dead_letters_total{reason="max_deliver"}') == 1.0
        assert metrics.get("aep_bridge_mapper_retries_total", 0) >= 4
        assert_clean(report, pipe, max_deliver_letters=1)  # everything else flowed
        assert report.backfills == 0, report.render()
    finally:
        pipe.stop()


def dead_letters(pipe: Pipeline) -> list[dict[str, Any]]:
    async def read(js: Any) -> list[dict[str, Any]]:
        from bridge.sim.verify import StreamReader

        out: list[dict[str, Any]] = []
        r = StreamReader(js, "BRIDGE_DLQ", "bridge.dlq.>")
        await r.read_new(lambda m: out.append({"data": m.data, "headers": dict(m.headers or {}), "subject": m.subject}))
        await r.close()
        return out

    return pipe.run(read)
