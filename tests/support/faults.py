"""Winding a simulated fault run down and judging it: shared by the single-server fault tests
(tests/sim/test_faults.py) and the cluster fault suite (tests/cluster)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from bridge.sim.fleet import Fleet
from tests.support.pipeline import Pipeline
from bridge.sim.verify import Report, verify

#: The fault runs' windows, shorter than production's by configuration (the suite's time):
#: a message a killed mapper held comes back after 5 s, not 30, and pairing holds a terminal
#: (and a card past its session's end) 8 s, not 45 -- still above the ack wait, as in production.
SHORT_WINDOWS = {"AEP_BRIDGE_MAPPER_ACK_WAIT_S": "5", "AEP_BRIDGE_PAIRING_HOLD_S": "8"}
#: the mappers of the fault runs price the fleet's model calls, so the verifier's run-totals
#: check covers the cost too (issue 40)
PRICED = {"AEP_BRIDGE_PRICE_TABLE": str(Path(__file__).resolve().parent.parent / "fixtures" / "prices.yaml")}


def finish(fleet: Fleet, thread: threading.Thread, pipe: Pipeline, wait: float = 90.0) -> Report:
    """Wind the run down and verify it. `wait` covers a card open at its session's end, which
    pairing closes its hold (AEP_BRIDGE_PAIRING_HOLD_S) later at a tick (issue 17: its answer
    may still come)."""
    t0 = time.monotonic()
    thread.join(timeout=180)
    assert not thread.is_alive(), "the simulator did not finish"
    left = fleet.drain(timeout=30)
    fleet.close()
    assert not left, f"spools not drained: {left}"
    assert fleet.complete, "every simulated session ended (wind-down)"
    t1 = time.monotonic()
    try:
        pipe.settle(timeout=90)
    except TimeoutError as exc:
        # The verifier is the judge: it waits for what is missing and names where each miss
        # stopped. A settle that never came (stop 46's CI: the mapper durable's ack pending
        # stuck at 7 for 90 s with nothing pending) is printed with its evidence, not a failure
        # by itself: if every event is there, what stayed pending was counted, not lost.
        print(f"finish: {exc}")
    t2 = time.monotonic()
    report = verify(pipe.url, fleet.manifest_path, wait=wait)
    print(f"finish: simulator + spools {t1 - t0:.1f} s, settle {t2 - t1:.1f} s, verify {time.monotonic() - t2:.1f} s")
    return report


def assert_clean(report: Report, pipe: Pipeline, max_deliver_letters: int = 0) -> None:
    """The run lost, duplicated and leaked nothing. A `max_deliver` dead letter is a well-formed
    event given up on (the verifier counts it as accounted for in the DLQ): a fault run
    allows none unless the test poisoned that many messages itself."""
    text = report.render()
    print(text)
    if not report.ok:  # keep the evidence: every stream, to replay offline (pytest keeps tmp_path)
        try:
            text += f"\nstreams dumped to {pipe.dump(pipe.dir.parent / 'dump')}"
        except Exception as exc:  # the dump is a courtesy; the report is the failure
            text += f"\n(stream dump failed: {exc!r})"
    assert report.manifest_events > 0
    assert report.lost_count == 0, text + "\n" + pipe.logs()
    assert report.duplicate_count == 0 and report.id_under_two_sources == 0, text
    assert report.seq_reused == 0, text
    assert report.invariant_count == 0, text
    # issue 40: every model call counted once in its run's totals (and its cost), through the faults
    assert report.usage_count == 0 and report.usage_runs > 0 and report.usage_calls > 0, text
    assert report.schema_count == 0, text
    assert report.canary_count == 0, text
    assert report.canaries_planted > 0, "the scenario must carry canaries to prove anything"
    assert report.dlq_reasons.get("max_deliver", 0) == max_deliver_letters, text
    assert report.ok, text
