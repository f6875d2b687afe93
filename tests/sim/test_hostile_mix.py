"""The simulator's hostile mix (issue 13, "Done when" 2): hostile input interleaved with
normal traffic at rate, against real services.

* `aep-bridge simulate --hostile-mix` sends every kind of the mix (through the shim's code
  path, real shim processes included, and raw messages straight to HERMES_RAW); the
  verifier shows the normal traffic whole, every hostile input in BRIDGE_DLQ with the
  reason the manifest owes it (checked here against the streams too), the ones that must
  map mapped, and no canary outside HERMES_RAW.
* The checks can fail: a hostile input missing from the DLQ, one dead-lettered with
  another reason and a canary in a dead letter are each reported.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path


from bridge.sim.fleet import Fleet, FleetConfig
from tests.support.pipeline import Pipeline
from bridge.sim.instances import HOSTILE_MIX
from bridge.sim.verify import read_manifest, verify
from tests.natsfixture import JetStreamClient
from tests.support.faults import SHORT_WINDOWS
from tests.support.cli import cli as support_cli
from functools import partial

ROOT = Path(__file__).resolve().parents[2]


cli = partial(support_cli, env={"AEP_BRIDGE_CONFIG": os.devnull}, timeout=180)


def test_simulate_with_the_hostile_mix_and_verify(nats_server_fn, tmp_path):
    url = nats_server_fn.url
    pipe = Pipeline(url, tmp_path / "logs", env=dict(SHORT_WINDOWS))
    pipe.bootstrap()
    pipe.add("mapper")
    pipe.add("pairing", name="pairing-0", env={"AEP_BRIDGE_TICK_S": "2"})
    pipe.wait_ready()
    manifest = tmp_path / "manifest.jsonl"
    try:
        sim = cli("simulate", "--nats", url, "--instances", "12", "--rate", "120", "--duration", "4",
                  "--shim-fraction", "0.25", "--hostile-mix", "0.08", "--canary-fraction", "0.1",
                  "--manifest", str(manifest), "--spool-dir", str(tmp_path / "spool"), "--quiet")
        assert sim.returncode == 0, sim.stderr
        summary = json.loads(sim.stdout)
        assert summary["complete"] and summary["shim_failures"] == 0, summary
        assert set(summary["hostile"]) == set(HOSTILE_MIX), summary["hostile"]
        pipe.settle(timeout=60)
        out = cli("verify", "--nats", url, "--manifest", str(manifest), "--wait", "60")
        print(out.stdout)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "aep-bridge verify: OK" in out.stdout and "loss         0" in out.stdout
        assert "hostile " in out.stdout
    finally:
        pipe.stop()

    _, entries, _ = read_manifest(manifest)
    hostile = [e for e in entries if e.get("x") and e["o"] in ("published", "spooled")]
    owed = [e for e in hostile if e["r"]]
    assert {e["v"] for e in hostile} == {"inproc", "shim", "raw"}
    assert {e["x"] for e in hostile} == set(HOSTILE_MIX)
    assert all(e["r"] == HOSTILE_MIX[e["x"]] for e in hostile)

    client = JetStreamClient(url)
    try:
        raw = client.fetch("hermes.raw.>")
        dlq = client.fetch("bridge.dlq.>", stream="BRIDGE_DLQ")
    finally:
        client.close()
    seq_of = {m.headers.get("Nats-Msg-Id"): m.seq for m in raw}
    for m in raw:  # real shim processes mint the id: find theirs by the marker
        marker = (((json.loads(m.data) if m.data.startswith(b"{") and len(m.data) < 100_000 else {})
                   .get("envelope") or {}).get("extra") or {}).get("x_aep_sim") if b"x_aep_sim" in m.data else None
        if marker:
            seq_of[marker] = m.seq
    # `unknown` is one session id in every instance that draws session_unknown: the first
    # instance seen for it owns it, the others' inputs are dead-lettered as instance_conflict.
    unknown = sorted((seq_of[e["id"] or e["m"]], e["i"]) for e in hostile if e["x"] == "session_unknown")
    for e in hostile:
        if e["x"] == "session_unknown" and e["i"] != unknown[0][1]:
            e["r"] = "instance_conflict"
    owed = [e for e in hostile if e["r"]]

    report = verify(url, manifest)
    assert report.ok, report.render()
    assert report.lost_count == 0 and report.duplicate_count == 0 and report.invariant_count == 0
    assert report.hostile_count == 0 and report.hostile_sent == len(hostile)
    assert report.hostile_in_dlq == Counter(e["r"] for e in owed)
    assert report.hostile_mapped == len(hostile) - len(owed)
    assert report.canary_count == 0 and report.canaries_planted >= len(hostile)

    reason_of = {int(m.headers["Bridge-Raw-Seq"]): m.headers["Bridge-Dlq-Reason"] for m in dlq
                 if m.headers.get("Bridge-Stage") == "mapper"}
    # Independently of the verifier: each owed input's stored copy has a dead letter with its reason.
    for e in owed:
        assert reason_of.get(seq_of[e["id"] or e["m"]]) == e["r"], e
    # and nothing of the mix that must map was dead-lettered
    for e in hostile:
        if not e["r"]:
            assert seq_of[e["id"] or e["m"]] not in reason_of, e


def test_the_verifier_fails_on_a_hostile_input_missing_or_misfiled_and_on_a_canary_in_a_dead_letter(
        nats_server, jetstream, tmp_path):
    """No services run: the dead letters are written by hand, three of them wrong."""
    prefix = "hm" + os.urandom(3).hex()
    fleet = Fleet(FleetConfig(nats_url=nats_server.url, instances=1, rate=500, duration=None,
                              count=len(HOSTILE_MIX), hostile_mix=1.0, wind_down=False, instance_prefix=prefix,
                              spool_dir=str(tmp_path / "spool"), manifest=str(tmp_path / "m.jsonl")))
    fleet.run()
    assert fleet.drain() == {}
    fleet.close()
    meta, entries, _ = read_manifest(fleet.manifest_path)
    owed = [e for e in entries if e.get("r")]
    assert {e["x"] for e in entries} == set(HOSTILE_MIX) and all(e["o"] == "published" for e in entries)
    seq_of = {m.headers["Nats-Msg-Id"]: m.seq for m in jetstream.fetch(f"hermes.raw.{prefix}-0000.>",
                                                                       expected=len(entries))}
    missing, misfiled, leaky = owed[0], owed[1], owed[2]
    canary = meta["canaries"][0]

    async def letters() -> None:
        for e in owed:
            if e is missing:
                continue
            reason = "pairing_error" if e is misfiled else e["r"]
            body = {"dlq": 1, "stage": "mapper", "reason": reason, "error": reason}
            if e is leaky:
                body["content_text"] = f"password={canary}"
            await jetstream.js.publish(f"bridge.dlq.{reason}", json.dumps(body).encode(), headers={
                "Bridge-Stage": "mapper", "Bridge-Dlq-Reason": reason, "Bridge-Raw-Seq": str(seq_of[e["id"]]),
                "Nats-Msg-Id": f"dlq:{prefix}:{e['id']}"})

    jetstream.run(letters())
    report = verify(nats_server.url, fleet.manifest_path)
    assert not report.ok
    assert report.hostile_count == 2, report.hostile_problems
    problems = "\n".join(report.hostile_problems)
    assert f"hostile {missing['x']} " in problems and f"not in BRIDGE_DLQ (owed {missing['r']})" in problems
    assert f"hostile {misfiled['x']} " in problems and f"dead-lettered as pairing_error, owed {misfiled['r']}" in problems
    assert sum(report.hostile_in_dlq.values()) == len(owed) - 2
    assert report.canary_count == 1 and "BRIDGE_DLQ" in report.canary_hits[0] and canary in report.canary_hits[0]
    assert report.violations["hostile"] == 2 and report.violations["canaries"] == 1
    assert "hostile      %d inputs of %d kinds" % (len(entries), len(HOSTILE_MIX)) in report.render()
