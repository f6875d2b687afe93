"""The fleet simulator and the verifier (issue 8).

* The generator plays the whole Hermes surface (every status, every approval choice,
  clarify, subagents with late stops, resets, resumed sessions, execute_code inner
  calls, the exit safety net) and every envelope maps cleanly with the pure core.
* Canary secrets are shaped so the redaction pipeline must catch them, and none
  survives the mapping at the default capture level.
* The in-process path and a real shim process put the same bytes on HERMES_RAW.
* End to end through the CLI (`aep-bridge simulate`, `aep-bridge verify`) against real
  services, and the verifier fails when the streams are tampered with: a lost event, a
  duplicate, a reused position, an invalid event, a leaked canary.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from bridge.core.ceiling import CapturePolicy
from bridge.core.redaction import Redactor
from bridge.core.envelope import decode_raw
from bridge.core.lanes import MemoryLanes
from bridge.core.pipeline import map_record, record_from_raw
from bridge.shim import hook
from bridge.sim.fleet import MARKER_KEY, Fleet, FleetConfig
from bridge.sim.instances import Canaries, envelopes
from tests.support.pipeline import Pipeline
from bridge.sim.verify import verify
from tests.natsfixture import JetStreamClient
from tests.support.faults import SHORT_WINDOWS
from tests.support.services import publish_all, raw_records
from tests.support.shim import run_hook, shim_env
from tests.support.cli import cli as support_cli
from functools import partial

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def generated() -> list[tuple[str, dict]]:
    out = []
    for instance, data in envelopes(30_000, instances=24, seed=5):
        out.append((instance, json.loads(data)))
    return out


# ---------------------------------------------------------------- the generator


def test_generator_plays_the_whole_hermes_surface(generated):
    statuses, choices, keys, clarify, sentinels = Counter(), Counter(), Counter(), Counter(), Counter()
    finalized: dict[str, int] = Counter()
    finalized_at: dict[tuple[str, str], int] = {}
    late_stops = inner_calls = safety_nets = resets = gateway_resets = smart = 0
    for i, (instance, env) in enumerate(generated):
        hook_name, extra, sid = env["hook_event_name"], env["extra"], env["session_id"]
        if hook_name == "post_tool_call":
            statuses[extra["status"]] += 1
            if env["tool_name"] == "clarify" and extra["status"] == "ok":
                response = json.loads(extra["result"])["user_response"]
                clarify["choices" if env["tool_input"].get("choices") else "free"] += 1
                if response in ("", "[clarify prompt could not be delivered]", "[user did not respond within 5m]") \
                        or response.startswith("The user"):
                    sentinels[response[:20]] += 1
        if hook_name in ("pre_approval_request", "post_approval_response"):
            assert sid == "", "approvals carry an empty session_id"
            key = extra["session_key"]
            keys["session" if key == extra["turn_id"].split(":")[0] else key.split(":")[0]] += 1
            if hook_name == "post_approval_response":
                choices[extra["choice"]] += 1
            smart += extra["surface"] == "smart"
        if hook_name == "pre_tool_call" and sid == "":
            assert extra["tool_call_id"] == "" and extra["turn_id"] == "" and extra["task_id"], extra
            inner_calls += 1
        if hook_name == "on_session_end" and "turn_id" not in extra and "task_id" not in extra:
            safety_nets += 1
        if hook_name == "on_session_reset":
            resets += 1
            gateway_resets += "old_session_id" in extra
        if hook_name == "on_session_finalize":
            finalized[sid] += 1
            finalized_at[(instance, sid)] = i
        if hook_name == "subagent_stop" and (instance, sid) in finalized_at:
            late_stops += 1
    assert set(statuses) == {"ok", "error", "blocked", "cancelled", "timeout"}, statuses
    assert set(choices) == {"once", "session", "always", "deny", "timeout"}, choices
    assert set(keys) >= {"session", "default", "agent"}, keys  # the session id, `hermes chat -q`, a gateway key
    assert clarify["choices"] and clarify["free"] and len(sentinels) >= 4, (clarify, sentinels)
    assert late_stops > 0, "some subagent_stop arrive after the parent's on_session_finalize"
    assert inner_calls > 0 and safety_nets > 0 and smart > 0
    assert resets > 0 and gateway_resets > 0
    assert any(n >= 2 for n in finalized.values()), "a resumed session is finalized twice"


def test_every_generated_envelope_maps_cleanly(generated):
    lanes, policy = MemoryLanes(), CapturePolicy()
    cfg = hook.Config({"AEP_BRIDGE_CONFIG": os.devnull, "AEP_BRIDGE_INSTANCE": "gen"})
    types = Counter()
    for seq, (_, env) in enumerate(generated[:8000], start=1):
        record = hook.build_record(json.dumps(env).encode(), cfg)
        mapped = map_record(record_from_raw(decode_raw(record.body)), seq, 0, lanes, policy)
        assert not mapped.problems and mapped.drift is None, (env, mapped.problems)
        lanes.learn(mapped.learned)
        types.update(e.type for e in mapped.events)
    assert {"attention.requested", "attention.answered", "attention.timeout", "tool.denied", "tool.failed",
            "delegation.subagent.stopped", "x.hermes.session.reset", "session.ended"} <= set(types), types


def test_hostile_input_and_oversized_results_when_asked():
    out = envelopes(4000, instances=4, seed=2, hostile_fraction=0.05, big_fraction=0.1)
    kinds = Counter()
    for _, data in out:
        try:
            obj = json.loads(data)
        except ValueError:
            kinds["not json or not utf-8"] += 1
            continue
        if not isinstance(obj, dict):
            kinds["not an object"] += 1
        elif "hook_event_name" not in obj:
            kinds["no hook"] += 1
        elif len(data) > 65536:
            kinds["oversized"] += 1
    assert len(kinds) == 4, kinds


# ---------------------------------------------------------------- canaries


def test_canaries_are_shaped_for_the_redaction_pipeline():
    import random

    c = Canaries.make(random.Random(3))
    rng = random.Random(4)
    redactor = Redactor()
    for _ in range(200):
        for text in (c.command(rng), c.text(rng), c.result(rng)):
            red = redactor.text(text)
            assert not any(s in red for s in c.strings()), (text, red)


def test_no_canary_survives_the_mapping_at_the_default_capture_level():
    lanes, policy = MemoryLanes(), CapturePolicy()
    cfg = hook.Config({"AEP_BRIDGE_CONFIG": os.devnull, "AEP_BRIDGE_INSTANCE": "gen"})
    out = envelopes(6000, instances=6, seed=9, canary_fraction=0.5)
    import random

    strings = Canaries.make(random.Random(9 + 1)).strings()
    planted = sum(1 for _, d in out if any(s.encode() in d for s in strings))
    assert planted > 500
    from bridge.core.aep import encode_event

    for seq, (_, data) in enumerate(out, start=1):
        mapped = map_record(record_from_raw(decode_raw(hook.build_record(data, cfg).body)), seq, 0, lanes, policy)
        lanes.learn(mapped.learned)
        blob = b"".join(encode_event(e) for e in mapped.events) + json.dumps(mapped.hints).encode()
        assert not any(s.encode() in blob for s in strings), blob


# ---------------------------------------------------------------- the wire


def test_in_process_and_real_shim_put_the_same_bytes_on_hermes_raw(nats_server, jetstream, tmp_path):
    envelope = {"hook_event_name": "pre_tool_call", "tool_name": "terminal", "tool_input": {"command": "ls ✓"},
                "session_id": "s-wire", "cwd": "/home/dev/x", "extra": {"turn_id": "s-wire:t:1", "n": 1,
                "conversation_history": [{"role": "user", "content": "dropped at the edge"}]}}
    data = json.dumps(envelope, ensure_ascii=False).encode()
    instance = "wire-" + os.urandom(3).hex()
    fleet = Fleet(FleetConfig(nats_url=nats_server.url, instances=1, spool_dir=str(tmp_path / "spool"),
                              manifest=str(tmp_path / "m.jsonl")))
    cfg = fleet.shim_config
    cfg.instance = instance
    record = hook.build_record(data, cfg)
    assert fleet.sender.send([(instance, record)]) == ["published"]
    fleet.sender.close()
    fleet.manifest.close()
    assert run_hook(data, shim_env(nats_server.url, tmp_path / "spool2", instance)).answered_empty_object
    got = jetstream.fetch(f"hermes.raw.{instance}.>", expected=2, timeout=10)
    assert len(got) == 2

    def normal(m):  # the id and the receive time differ; everything else is the same bytes
        body = json.loads(m.data)
        assert m.headers["Nats-Msg-Id"] == body["id"]
        return m.data.replace(body["id"].encode(), b"ID").replace(str(body["ts"]).encode(), b"TS")

    assert normal(got[0]) == normal(got[1])
    assert got[0].subject == got[1].subject == f"hermes.raw.{instance}.pre_tool_call"
    assert json.loads(got[0].data)["edge"] == {"dropped": ["extra.conversation_history"]}


# ---------------------------------------------------------------- end to end, and a verifier that can fail


cli = partial(support_cli, env={"AEP_BRIDGE_CONFIG": os.devnull}, timeout=180)


@pytest.mark.slow
def test_simulate_and_verify_from_the_command_line_and_a_verifier_that_fails(nats_server_fn, tmp_path):
    url = nats_server_fn.url
    pipe = Pipeline(url, tmp_path / "logs", env=dict(SHORT_WINDOWS))
    pipe.bootstrap()
    pipe.add("mapper")
    # A card open at its session's end (a `smart` request before the user's) is dismissed its
    # hold (SHORT_WINDOWS: 8 s) after the end, at a tick: tick every 2 s and let the verifier wait.
    pipe.add("pairing", name="pairing-0", env={"AEP_BRIDGE_TICK_S": "2"})
    pipe.wait_ready()
    manifest = tmp_path / "manifest.jsonl"
    try:
        sim = cli("simulate", "--nats", url, "--instances", "12", "--rate", "150", "--duration", "5",
                  "--shim-fraction", "0.25", "--canary-fraction", "0.2", "--hostile-fraction", "0.01",
                  "--manifest", str(manifest), "--spool-dir", str(tmp_path / "spool"), "--quiet")
        assert sim.returncode == 0, sim.stderr
        summary = json.loads(sim.stdout)
        assert summary["complete"] and summary["via"]["shim"] > 0 and summary["shim_failures"] == 0, summary
        pipe.settle(timeout=60)
        ok = cli("verify", "--nats", url, "--manifest", str(manifest), "--wait", "90", "--strict-order")
        assert ok.returncode == 0, ok.stdout + ok.stderr
        assert "aep-bridge verify: OK" in ok.stdout and "loss         0" in ok.stdout
        entries = [json.loads(line) for line in manifest.read_text().splitlines()]
        shim_entries = [e for e in entries if e.get("v") == "shim"]
        assert shim_entries and all(e["m"] for e in shim_entries)
    finally:
        pipe.stop()

    # Tamper with the streams; the verifier must see each kind of violation.
    client = JetStreamClient(url)
    try:
        aep = client.fetch("aep.hermes.>", stream="AEP_EVENTS")
        by_type = defaultdict(list)
        for m in aep:
            by_type[json.loads(m.data)["type"]].append(m)
        victim = by_type["tool.completed"][0]
        client.run(client.js.delete_msg("AEP_EVENTS", victim.seq))  # a lost event
        bad = cli("verify", "--nats", url, "--manifest", str(manifest), "--wait", "0")
        assert bad.returncode == 1 and "loss         1" in bad.stdout, bad.stdout
        assert json.loads(victim.data)["id"] in bad.stdout

        canary = json.loads(manifest.read_text().splitlines()[0])["meta"]["canaries"][0]
        dup = json.loads(by_type["run.started"][0].data)
        reused = dict(json.loads(by_type["run.finished"][0].data), id="01ZZZZZZZZZZZZZZZZZZZZZZZZ")
        reused["seq"] = json.loads(by_type["run.started"][1].data)["seq"]
        reused["session"] = json.loads(by_type["run.started"][1].data)["session"]
        leaked = dict(json.loads(by_type["tool.requested"][0].data), id="01YYYYYYYYYYYYYYYYYYYYYYYY", seq=1)
        leaked["data"] = dict(leaked["data"], args={"key": canary})
        invalid = dict(dup, id="01XXXXXXXXXXXXXXXXXXXXXXXX", seq=2, data={"trigger": "sometimes"})

        async def tamper() -> None:
            for i, doc in enumerate((dup, reused, leaked, invalid)):
                await client.js.publish(f"aep.hermes.tamper{i}.{doc['type']}", json.dumps(doc).encode(),
                                        headers={"Nats-Msg-Id": f"tamper-{i}"})

        client.run(tamper())
    finally:
        client.close()
    report = verify(url, manifest)
    assert report.lost_count == 1
    assert report.duplicate_count == 1
    assert report.seq_reused >= 1
    assert report.canary_count >= 1 and canary in "".join(report.canary_hits)
    assert report.schema_count == 1
    assert not report.ok
    # the reused run.finished states its run's totals in a session where none of its calls are
    assert report.usage_count >= 1 and any("tamper1" in p or "01ZZZZZZZZZZZZZZZZZZZZZZZZ" in p for p in report.usage_problems), \
        report.usage_problems
    assert report.violations == {"lost": 1, "duplicates": 1, "seq_reused": report.seq_reused,
                                 "pairing_invariants": report.invariant_count, "approvals": 0, "schema": 1,
                                 "canaries": report.canary_count, "hostile": 0, "usage": report.usage_count}


def test_verifier_reads_incrementally_and_finds_shim_sent_messages_by_marker(nats_server, jetstream, tmp_path):
    """A manifest entry sent through a real shim has no id; the verifier finds it by its marker."""
    instance = "mark-" + os.urandom(3).hex()
    marker = f"{instance}#1"
    env = {"hook_event_name": "on_session_start", "session_id": "s-" + instance, "extra": {MARKER_KEY: marker}}
    assert run_hook(json.dumps(env), shim_env(nats_server.url, tmp_path, instance)).answered_empty_object
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"meta": {"canaries": []}}) + "\n"
                        + json.dumps({"id": None, "i": instance, "h": "on_session_start", "v": "shim", "o": "published",
                                      "m": marker}) + "\n" + json.dumps({"end": {"complete": True}}) + "\n")
    import nats

    from bridge.sim.verify import Verifier

    async def main() -> tuple[int, int]:
        nc = await nats.connect(nats_server.url)
        try:
            v = Verifier(nc, manifest)
            await v.collect()
            found = v.marker_to_id.get(marker)
            assert found and found in v.raw
            lost, examples, where, expected, _ = v.missing()
            again = await v.collect()  # nothing new: reads nothing
            await v.close()
            return lost, sum(again.values())
        finally:
            await nc.close()

    lost, again = asyncio.run(main())
    assert lost == 1  # no mapper runs on this shared server: the event never reached AEP_EVENTS
    assert again == 0


def test_a_real_shim_that_did_not_get_its_input_in_time_is_a_dead_letter_the_manifest_names(nats_server_fn, tmp_path):
    """tests/sim/test_faults.py failed at load 13-38 (2026-12-07, runs A1 and A3 of the slow part
    on two workers: 1 to 5 events a run, as many as the shim_invalid dead letters) with marked
    events "spooled" by real shims and "not on HERMES_RAW": the worker's subprocess.run (as
    Hermes' own) had not written stdin by the shim's deadline, the shim read 0 bytes and
    published `_invalid` stdin_timeout, dead-lettered shim_invalid, under an id the manifest
    did not know, the marker being in what it never read. Nothing was lost by the bridge: the
    manifest must name that id, and the verifier find the dead letter. Here the input is cut by
    its size (32 MiB does not go through a pipe within a 1 ms deadline), not by the load."""
    url = nats_server_fn.url
    pipe = Pipeline(url, tmp_path / "logs", env=dict(SHORT_WINDOWS))
    pipe.bootstrap()
    pipe.add("mapper")
    pipe.wait_ready()
    try:
        fleet = Fleet(FleetConfig(nats_url=url, instances=1, shim_fraction=1.0, shim_workers=1, deadline_ms=1,
                                  spool_dir=str(tmp_path / "spool"), manifest=str(tmp_path / "m.jsonl")))
        inst = fleet.instances[0].name
        marker = f"{inst}#1"
        env = {"hook_event_name": "pre_tool_call", "session_id": "s-cut", "tool_name": "terminal",
               "extra": {"blob": "x" * (32 << 20), MARKER_KEY: marker}}
        assert fleet.shims is not None
        fleet.manifest.write(fleet._meta())
        fleet.shims.start()
        fleet.shims.submit(0, inst, json.dumps(env).encode(), {"id": None, "i": inst, "h": "pre_tool_call",
                                                                 "v": "shim", "m": marker})
        fleet.shims.join()
        assert fleet.drain(timeout=30) == {}
        fleet.close()
        report = verify(url, fleet.manifest_path, wait=10)
    finally:
        pipe.stop()
    entry = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()][1]
    assert entry["o"] in ("published", "spooled") and fleet.shims.failures == 0, entry
    assert report.dlq_reasons == {"shim_invalid": 1}, report.render()
    assert report.lost_count == 0 and report.accounted_in_dlq == 1, report.render()
    assert entry["e"] == "stdin_timeout" and report.inputs_cut == 1
    assert "1 inputs the shims did not get in time" in report.render() and report.ok, report.render()


def test_verifier_waits_for_a_card_that_pairing_still_has_to_end(nats_server, jetstream, tmp_path):
    """A request that reached pairing after its session's end is closed by pairing's own timer
    (hold_ns, at the next tick): nothing is lost meanwhile, so a verifier that stopped as soon as
    nothing was missing reported "never ends". For a complete run it waits (up to ``wait``)
    until the card's ending is there; a card that never ends is still reported."""
    import threading

    from bridge.core.aep import encode_event
    from bridge.nats.subjects import events_subject
    from tests.support.pairing import Mk

    mk = Mk(instance="vw-" + os.urandom(3).hex())
    lane = "vw-" + os.urandom(3).hex()
    req, end = mk.appr_req(lane, sk=lane)[0], mk.ended(lane)[0]
    # the ending pairing will publish: a session_end closure right after the request
    closing = dict(json.loads(encode_event(req)), type="attention.resolved", id="01" + os.urandom(12).hex().upper()[:24],
                   seq=req.seq + 264, subject=req.id, cause=req.id, data={"resolution": "dismissed"})
    closing.pop("run", None)
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"meta": {"canaries": []}}) + "\n" + json.dumps({"end": {"complete": True}}) + "\n")

    def publish(events: list[bytes]) -> None:
        async def pub() -> None:
            for data in events:
                doc = json.loads(data)
                await jetstream.js.publish(events_subject(lane, doc["type"]), data)
        jetstream.run(pub())

    publish([encode_event(end), encode_event(req)])  # the request overtaken by its session's end
    report = verify(nats_server.url, manifest, wait=2.5, settle=0.5)
    assert report.invariant_count == 1 and f"request {req.id} never ends" in report.invariant_problems[0]
    assert report.elapsed_s >= 2.0, "it waited for the card before reporting it"

    later = threading.Timer(3.0, publish, args=([json.dumps(closing).encode()],))
    later.start()
    try:
        report = verify(nats_server.url, manifest, wait=60, settle=0.5)
    finally:
        later.join()
    assert report.invariant_count == 0, report.render()
    assert report.elapsed_s >= 2.5


def test_pipeline_dump_writes_every_stored_message_of_each_stream(nats_server_fn, tmp_path):
    """A failed fault scenario keeps its evidence with `Pipeline.dump`: every message of every
    stream, in order, with its headers, as JSON lines (replayable offline)."""
    pipe = Pipeline(nats_server_fn.url, tmp_path / "logs")
    pipe.bootstrap()
    records = raw_records([{"hook_event_name": "on_session_start", "session_id": f"dump-{i}", "extra": {}} for i in range(700)],
                          instance="dumper")
    pipe.run(lambda js: publish_all(js, records))
    out = pipe.dump(tmp_path / "dump")
    rows = [json.loads(line) for line in (out / "HERMES_RAW.jsonl").read_text().splitlines()]
    assert [r["seq"] for r in rows] == list(range(1, 701))  # more than one fetch of 512, in order
    assert [(r["subject"], r["data"].encode(), r["headers"]["Nats-Msg-Id"]) for r in rows] == records
    for name in ("BRIDGE_MAPPED", "BRIDGE_DLQ", "AEP_EVENTS"):
        assert (out / f"{name}.jsonl").read_text() == ""


def test_half_the_approvals_are_answered_right_behind_their_request(tmp_path):
    """Issue 17: the race that filed an answer under `unknown` needs the answer right behind its
    request on HERMES_RAW, where two mapper replicas take them apart. The fleet sends a glued
    request's answer next, before any other instance's event (no NATS needed to see the order)."""
    from bridge.sim.fleet import Fleet, FleetConfig

    fleet = Fleet(FleetConfig(nats_url="nats://127.0.0.1:1", instances=20, seed=3, manifest=str(tmp_path / "m.jsonl"),
                              spool_dir=str(tmp_path / "spool")))
    pool = list(fleet.instances)
    sent = [fleet._next_event(pool) for _ in range(20_000)]
    pairs = behind = 0
    for (inst, ev), (nxt_inst, nxt) in zip(sent, sent[1:]):
        if ev.glue:
            pairs += 1
            assert ev.hook == "pre_approval_request" and json.loads(ev.data)["extra"]["surface"] != "smart"
            behind += nxt_inst is inst and nxt.hook == "post_approval_response"
    requests = sum(1 for _, ev in sent if ev.hook == "pre_approval_request" and b'"smart"' not in ev.data)
    assert pairs == behind > 0
    assert 0.3 < pairs / requests < 0.7, (pairs, requests)
    cli_q = [json.loads(ev.data) for _, ev in sent if ev.glue and b'"default"' in ev.data]
    assert cli_q and all(e["session_id"] == "" and e["extra"]["turn_id"].startswith(e["extra"]["turn_id"].split(":")[0] + ":")
                         for e in cli_q), "the CLI `-q` shape is among them"
    fleet.manifest.close()


def test_model_calls_report_their_own_counts_and_run_totals_sum_them(generated):
    """Issue 40: every simulated post_api_request reports its own token counts, and through the
    pure core (mapping with a price table, then pairing) every run's end carries the sums of its
    calls; `check_usage` (the verifier's run-totals check) finds nothing, and finds a tampered total."""
    import msgspec

    from bridge.config import load_price_table
    from bridge.core.invariants import check_usage
    from bridge.core.pairing import PairingState

    prices = load_price_table(str(ROOT / "tests" / "fixtures" / "prices.yaml"))
    lanes, policy, state = MemoryLanes(), CapturePolicy(), PairingState()
    cfg = hook.Config({"AEP_BRIDGE_CONFIG": os.devnull, "AEP_BRIDGE_INSTANCE": "gen"})
    out, counts = [], Counter()
    position = 0
    for seq, (_, env) in enumerate(generated[:8000], start=1):
        record = hook.build_record(json.dumps(env).encode(), cfg)
        mapped = map_record(record_from_raw(decode_raw(record.body)), seq, 0, lanes, policy, prices)
        lanes.learn(mapped.learned)
        assert not mapped.invalid and not mapped.unpriced
        for ev in mapped.events:
            position += 1
            out += state.process(ev, mapped.hints, position)
            if ev.type == "x.hermes.api.call":
                counts[(ev.data["gen_ai.usage.input_tokens"], ev.data["gen_ai.usage.output_tokens"])] += 1
    calls = sum(counts.values())
    assert calls > 300 and len(counts) > 0.95 * calls  # different counts on (nearly) every call
    check = check_usage(out)
    assert check.problems == [] and check.late == 0
    assert check.runs > 100 and check.calls > 0.9 * calls  # (the rest: runs still open at the cut)
    ends = [e for e in out if e.type == "run.finished" and "cost" in (e.data or {})]
    assert ends and all(e.data["cost"]["currency"] == "USD" for e in ends)
    # the check can fail: one token more in one run's end
    i = out.index(ends[0])
    out[i] = msgspec.structs.replace(ends[0], data={**ends[0].data, "gen_ai.usage.input_tokens": ends[0].data["gen_ai.usage.input_tokens"] + 1})
    assert len(check_usage(out).problems) == 1
    # ... or one call counted twice (its copy under a new id, before the run's end)
    call = next(e for e in out[:i] if e.type == "x.hermes.api.call" and e.run == ends[0].run)
    out[i] = ends[0]
    out.insert(i, msgspec.structs.replace(call, id=call.id[:-1] + ("A" if call.id[-1] != "A" else "B")))
    assert len(check_usage(out).problems) == 1
