"""`aep-bridge simulate`'s verdict (issue 38): never `complete` with an event refused, dropped,
lost or left in a spool; `landed` counts what reached HERMES_RAW."""

from __future__ import annotations

from bridge.commands.sim import honest


def test_everything_spooled_and_not_drained_is_not_complete_and_nothing_landed() -> None:
    verdict = honest(True, {"sent": 409, "outcomes": {"spooled": 409}, "sender_errors": {"Authorization Violation": 80}},
                     {"*": "NATS not reachable"}, drained=True)
    assert verdict["complete"] is False and verdict["landed"] == 0
    assert "nothing landed" in verdict["incomplete"] and "Authorization Violation" in verdict["incomplete"]


def test_a_refused_event_makes_a_run_incomplete() -> None:
    verdict = honest(True, {"sent": 7, "outcomes": {"published": 5, "rejected": 2}}, {}, drained=True)
    assert verdict == {"complete": False, "landed": 5, "incomplete": "2 events rejected"}


def test_spooled_events_the_drain_delivered_landed() -> None:
    verdict = honest(True, {"sent": 7, "outcomes": {"published": 5, "spooled": 2}}, {}, drained=True)
    assert verdict == {"complete": True, "landed": 7}
    assert honest(True, {"sent": 7, "outcomes": {"published": 5, "spooled": 2}}, {}, drained=False)["complete"] is False
