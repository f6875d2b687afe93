"""`PairingService.subject_of`: the AEP_EVENTS subject of an output, its lane's part remembered
per session (issue 43), must be `subjects.event_subject`'s exactly, and refuse what it refuses."""

from __future__ import annotations

import os
from types import SimpleNamespace

import msgspec
import pytest

from bridge.config import Settings
from bridge.nats import subjects as subj
from bridge.services import pairing as P


def _service() -> P.PairingService:
    settings = Settings.from_env({"AEP_BRIDGE_NATS_URL": "nats://127.0.0.1:1", "AEP_BRIDGE_CONFIG": os.devnull})
    return P.PairingService(settings, replica="subjects")


def _event(session, etype: str, lane=msgspec.UNSET):  # type: ignore[no-untyped-def]
    return SimpleNamespace(session=session, type=etype, lane=lane)


def _outcome(f, event):  # type: ignore[no-untyped-def]
    try:
        return f(event)
    except subj.SubjectError as exc:
        return ("refused", exc.reason)


def test_subject_of_is_event_subject_for_every_lane_and_type_and_refuses_the_same(monkeypatch) -> None:
    svc = _service()
    sessions = ["20261130_224913_888866-c7", "unknown", "with space/and:colon", "é" * 40, "x" * 300, msgspec.UNSET]
    types = ["tool.completed", "x.hermes.api.call", "run.finished", "Bad Type", "x." + "a" * 1100]
    events = [_event(s, t) for s in sessions for t in types] + [_event("unknown", "tool.completed", lane="unknown"),
                                                                _event("unknown", "run.finished", lane="unknown")]
    for _ in range(2):  # the second pass takes what the first remembered
        for event in events:
            assert _outcome(svc.subject_of, event) == _outcome(subj.event_subject, event), (event.session, event.type)
    assert svc.subject_of(_event("unknown", "tool.completed")) == "aep.hermes.unknown.tool.completed"
    assert svc.subject_of(_event("unknown", "tool.completed", lane="unknown")) == "aep.hermes._unknown.tool.completed"
    # Bounded: both memories are cleared when full.
    monkeypatch.setattr(P, "SUBJECT_CACHE", 8)
    for i in range(50):
        svc.subject_of(_event(f"s{i}", f"x.hermes.t.n{i}"))
    assert len(svc._lane_prefixes) <= 8 and len(svc._types_checked) <= 8
