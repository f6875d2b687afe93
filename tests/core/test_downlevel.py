"""A fan-out hop's capture ceiling (bridge/core/downlevel.py `downlevel_fields`, AEP-0001 §8.2):
field-level down-levelling against the AEP repository's corpus (tests/fixtures/aep/downlevel/),
never up-levelled, never a `redacted` claim minted, within the ceiling the event itself, and
types without known field levels reduced to their envelope. (The levels of the standard types
we do not emit, read from the spec's schemas: tests/core/test_spec_levels.py.)"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from bridge.core import aep
from bridge.core.ceiling import FULL, LEVEL_RANK, LEVELS, METADATA, NONE, REDACTED
from bridge.core.downlevel import downlevel_fields, payload_fields

CASES = json.loads((Path(__file__).parents[1] / "fixtures" / "aep" / "downlevel" / "cases.json").read_text())["cases"]


def _undeclared_or_higher(shape: dict[str, Any] | None, key: str) -> bool:
    """Does a type this bridge knows leave ``key`` out of its metadata-level fields?"""
    return shape is None or key not in shape or shape[key][0] > METADATA


def _legal_subset(got: Any, want: Any, shape: dict[str, Any] | None) -> None:
    """``got`` is ``want`` less fields this bridge does not declare at metadata (dropping more
    is legal, AEP-0001 §8.2 b); every value it keeps is the expected one."""
    if isinstance(want, dict) and isinstance(got, dict):
        assert set(got) <= set(want), (got, want)
        for key, value in want.items():
            if key not in got:
                assert _undeclared_or_higher(shape, key), f"{key} is declared at metadata and was dropped"
                continue
            inner = shape[key][1] if shape is not None and key in shape else None
            if isinstance(inner, list):
                assert isinstance(got[key], list) and len(got[key]) == len(value)
                for g, w in zip(got[key], value):
                    _legal_subset(g, w, inner[0])
            else:
                _legal_subset(got[key], value, inner if isinstance(inner, dict) else None)
    else:
        assert got == want


def test_the_corpus_is_all_there():
    assert len(CASES) == 18


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['event']['id']} {c['name']}")
def test_corpus(case):
    event = case["event"]
    before = copy.deepcopy(event)
    out = downlevel_fields(event, LEVEL_RANK[case["ceiling"]])
    assert event == before  # pure
    assert out["capture"] == case["expect_capture"]
    assert {k: v for k, v in out.items() if k not in ("capture", "data")} == \
        {k: v for k, v in event.items() if k not in ("capture", "data")}  # the envelope rides unchanged
    shape = payload_fields(event["type"])
    if case["expect_data"] is None:
        assert "data" not in out
    elif shape is None:  # a type whose field levels we do not know (DL8, a vendor type): the envelope alone
        assert "data" not in out
    else:
        _legal_subset(out["data"], case["expect_data"], shape)
    if LEVEL_RANK[case["ceiling"]] < LEVEL_RANK[event["capture"]]:
        assert "SECRET" not in json.dumps(out)  # the corpus marks what must not survive


# The corpus cases this bridge meets exactly: every one. The field levels of the types we emit
# are ours, plus the fields only the spec defines (tool.completed `status`: DL6, DL10); DL13-DL18
# are types we do not emit, read from the spec's payload schemas. Pinned so a narrowing shows up.
EXACT = {f"DL{i}" for i in range(1, 19)}


def test_corpus_exact_where_our_types_declare_the_fields():
    exact = set()
    for case in CASES:
        out = downlevel_fields(case["event"], LEVEL_RANK[case["ceiling"]])
        want = case["expect_data"]
        if out["capture"] == case["expect_capture"] and (("data" not in out) if want is None else out.get("data") == want):
            exact.add(case["event"]["id"])
    assert exact == EXACT


@pytest.mark.parametrize("ceiling", range(len(LEVELS)), ids=LEVELS)
def test_never_up_levels_and_never_mints_redacted(ceiling):
    for case in CASES:
        event = case["event"]
        for level in LEVELS:
            ev = {**event, "capture": level}
            out = downlevel_fields(ev, ceiling)
            assert LEVEL_RANK[out["capture"]] <= min(LEVEL_RANK[level], ceiling)
            if out["capture"] == "redacted":  # only a redacted source keeps its claim, unchanged
                assert level == "redacted" and out is ev


def test_within_the_ceiling_the_event_itself():
    for case in CASES:
        raw = json.dumps(case["event"]).encode()
        event = json.loads(raw)
        for ceiling in range(LEVEL_RANK[event["capture"]], FULL + 1):
            out = downlevel_fields(event, ceiling)
            assert out is event and json.dumps(out).encode() == raw
    # no `capture` means metadata (AEP-0001 §5.1)
    ev = {"type": "run.started", "agent": "a", "data": {"trigger": "user"}}
    assert downlevel_fields(ev, METADATA) is ev
    assert downlevel_fields(ev, NONE) == {"type": "run.started", "agent": "a", "capture": "none"}


def test_the_live_checkers_event():
    """conformance/live.js `capture-downlevel`: a redacted run.started at a metadata ceiling."""
    ev = {"aep": "0.1", "id": "E1", "type": "run.started", "time": "2026-12-01T10:00:00Z", "source": "urn:x",
          "agent": "a", "session": "s", "seq": 0, "run": "r1", "capture": "redacted",
          "data": {"trigger": "user", "prompt": "LIVE-CHECK-CANARY do not deliver at metadata"}}
    out = downlevel_fields(ev, METADATA)
    assert out["capture"] == "metadata" and out["data"] == {"trigger": "user"}
    assert "CANARY" not in json.dumps(out)


@pytest.mark.parametrize("event_type", ["x.acme.session.custom_blob", "tool.called", "x.hermes.not.ours", ""])
def test_unknown_types_keep_the_envelope_alone(event_type):
    ev = {"aep": "0.1", "id": "U1", "type": event_type, "agent": "a", "capture": "full", "data": {"name": "x", "n": 1}}
    for ceiling, landed in ((REDACTED, "metadata"), (METADATA, "metadata"), (NONE, "none")):
        out = downlevel_fields(ev, ceiling)
        assert out == {k: v for k, v in ev.items() if k != "data"} | {"capture": landed}


def test_odd_input_loses_content_never_raises():
    base = {"aep": "0.1", "id": "O1", "type": "tool.failed", "agent": "a", "capture": "full"}
    # an unknown capture level is above every ceiling
    assert downlevel_fields({**base, "capture": "total", "data": {"tool": {"name": "t"}}}, FULL) == \
        {**base, "capture": "metadata", "data": {"tool": {"name": "t"}}}
    # data that is not an object, fields of the wrong shape, undeclared fields: dropped
    assert "data" not in downlevel_fields({**base, "data": ["x"]}, METADATA)
    out = downlevel_fields({**base, "data": {"tool": "t", "error": {"type": "E", "message": "m"}, "extra": 1}}, METADATA)
    assert out["data"] == {"error": {"type": "E"}}
    out = downlevel_fields({**base, "type": "attention.requested", "subject": "S",
                            "data": {"kind": "permission", "prompt": "p", "options": ["x", {"id": "1", "label": "L"}, {"label": "no id"}]}},
                           METADATA)
    assert out["data"] == {"kind": "permission", "prompt": "a requests permission: S", "options": [{"id": "1", "label": "1"}, {}]}
    out = downlevel_fields({**base, "type": "attention.answered", "data": {"answer": {"values": {"f": "free text"}, "text": "t"}}}, METADATA)
    assert out["data"] == {"answer": {}}


def test_the_field_levels_are_the_annotations_of_our_types():
    """For the types we emit the table is read from `bridge.core.aep` (the types that are our
    schemas): it follows every payload type there and the `x-aep-capture` of each field."""
    schemas = msgspec.json.schema_components(list(aep.PAYLOAD_TYPES.values()))[1]
    for event_type, cls in aep.PAYLOAD_TYPES.items():
        props = schemas[cls.__name__].get("properties", {})
        fields = payload_fields(event_type)
        assert set(fields) >= set(props), event_type  # plus the fields only the spec defines (test_spec_levels.py)
        for name in props:
            assert LEVELS[fields[name][0]] == props[name]["x-aep-capture"], (event_type, name)
