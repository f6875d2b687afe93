"""The field levels of the standard AEP types this bridge does not emit, read from the vendored
payload schemas (bridge/data/aep_spec/, `downlevel.spec_payload_fields`): a fan-out hop down-levels
them field by field (AEP-0001 §8.2) instead of dropping their payload; our own types stay
authoritative for what we emit and are never looser than the spec's."""

from __future__ import annotations

import copy
import hashlib
import json
from importlib import resources
from typing import Any

import msgspec
import pytest

from bridge.core import aep
from bridge.core.ceiling import FULL, LEVEL_RANK, LEVELS, METADATA, NONE, REDACTED
from bridge.core.downlevel import _fields, downlevel_fields, payload_fields, schema_payload_fields, spec_payload_fields

SPEC = resources.files("bridge.data").joinpath("aep_spec")
REGISTRY = json.loads(SPEC.joinpath("registry", "types.json").read_text(encoding="utf-8"))
WITH_SCHEMA = {t["type"]: t["schema"] for t in REGISTRY["types"] if t.get("schema")}
M, R, F = METADATA, REDACTED, FULL


def _schema(event_type: str) -> dict[str, Any]:
    return json.loads(SPEC.joinpath("types", WITH_SCHEMA[event_type]).read_text(encoding="utf-8"))


# ---------------------------------------------------------------- the vendored data


def test_the_vendored_files_are_the_pinned_ones():
    """Byte for byte what SHA256SUMS lists (the upstream files at the commit the README names)."""
    sums = [line.split("  ", 1) for line in SPEC.joinpath("SHA256SUMS").read_text().splitlines()]
    assert len(sums) == 46
    for digest, name in sums:
        assert hashlib.sha256(SPEC.joinpath(*name.split("/")).read_bytes()).hexdigest() == digest, name
    types = sorted(p.name for p in SPEC.joinpath("types").iterdir() if p.name.endswith(".schema.json"))
    assert len(types) == 44 and sorted(WITH_SCHEMA.values()) == types
    assert {f"types/{n}" for n in types} <= {name for _, name in sums}


def test_the_spec_orders_the_levels_as_we_do():
    capture = json.loads(SPEC.joinpath("registry", "capture.json").read_text(encoding="utf-8"))
    assert tuple(capture["order"]) == LEVELS and capture["default"] == "metadata"


def test_every_registered_type_with_a_schema_has_its_fields():
    table = spec_payload_fields()
    assert set(table) == set(WITH_SCHEMA) and len(table) == 44
    reserved = {t["type"] for t in REGISTRY["types"] if not t.get("schema")}
    assert reserved == {"message.user.submitted", "message.agent.replied"}
    for event_type in reserved:
        assert payload_fields(event_type) is None


def _annotated(node: dict[str, Any], shape: dict[str, Any], where: str) -> None:
    """Every field of the table carries its property's `x-aep-capture` (none: full), nested
    objects and arrays of objects as nested shapes, walking the JSON itself."""
    assert set(shape) == set(node["properties"]), where
    for name, prop in node["properties"].items():
        level, inner = shape[name]
        assert level == LEVEL_RANK[prop.get("x-aep-capture", "full")], f"{where}.{name}"
        if "properties" in prop:
            _annotated(prop, inner, f"{where}.{name}")
        elif "properties" in prop.get("items", {}):
            assert isinstance(inner, list)
            _annotated(prop["items"], inner[0], f"{where}.{name}[]")
        else:
            assert inner is None, f"{where}.{name}"


@pytest.mark.parametrize("event_type", sorted(WITH_SCHEMA))
def test_the_table_is_the_schemas_annotations(event_type):
    schema = _schema(event_type)
    if "properties" in schema:
        _annotated(schema, spec_payload_fields()[event_type], event_type)
    else:
        assert spec_payload_fields()[event_type] == {}


def test_a_few_tables_by_hand():
    """Read off the schemas by eye, so a reader that went wrong in the same way as the walk
    above would still show."""
    table = spec_payload_fields()
    assert table["progress.status"] == {"message": (R, None), "phase": (M, None), "percent": (M, None)}
    assert table["agent.health"] == {"status": (M, None), "detail": (R, None)}
    assert table["state.delta"] == {"delta": (R, None), "key": (M, None), "rev": (M, None)}
    assert table["resource.retrieval.returned"]["documents"] == (M, [{
        "id": (M, None), "score": (M, None), "content_redacted": (R, None), "content": (F, None), "metadata": (M, None)}])
    citation = table["resource.citation.recorded"]["citations"][1][0]
    assert citation["source"] == (M, {"id": (M, None), "uri": (R, None), "title": (R, None)})
    assert citation["offset"][1]["char"] == (M, {"start": (M, None), "end": (M, None)})


# ---------------------------------------------------------------- reading a schema


def test_schema_reading_rules():
    schema = {
        "type": "object",
        "$defs": {
            "doc": {"type": "object", "x-aep-capture": "metadata",
                    "properties": {"id": {"$ref": "#/$defs/id"}, "text": {"type": "string", "x-aep-capture": "redacted"}}},
            "id": {"type": "string", "x-aep-capture": "metadata"},
            "loop": {"$ref": "#/$defs/loop"},
            "tree": {"type": "object", "x-aep-capture": "metadata", "properties": {"kids": {
                "type": "array", "x-aep-capture": "metadata", "items": {"$ref": "#/$defs/tree"}}}},
        },
        "properties": {
            "plain": {"type": "string"},  # no annotation: content
            "odd": {"type": "string", "x-aep-capture": "everything"},  # an unknown level: content
            "doc": {"$ref": "#/$defs/doc"},
            "docs": {"type": "array", "x-aep-capture": "metadata", "items": {"$ref": "#/$defs/doc"}},
            "elsewhere": {"$ref": "other.schema.json#/x", "x-aep-capture": "metadata"},  # not followed: content
            "missing": {"$ref": "#/$defs/nope", "x-aep-capture": "metadata"},
            "loop": {"$ref": "#/$defs/loop", "x-aep-capture": "metadata"},
            # annotations the shape does not model raise the leaf to the highest of them
            "either": {"x-aep-capture": "metadata", "oneOf": [{"type": "string"}, {
                "type": "object", "properties": {"secret": {"type": "string", "x-aep-capture": "full"}}}]},
            "bag": {"type": "object", "x-aep-capture": "metadata",
                    "additionalProperties": {"type": "string", "x-aep-capture": "redacted"}},
            "open": {"type": "object", "x-aep-capture": "metadata"},
            "items_above": {"type": "array", "x-aep-capture": "metadata",
                            "items": {"type": "object", "x-aep-capture": "redacted", "properties": {"k": {"x-aep-capture": "metadata"}}}},
            "tree": {"$ref": "#/$defs/tree"},
        },
    }
    doc = {"id": (M, None), "text": (R, None)}
    got = schema_payload_fields(schema)
    assert got["plain"] == (F, None) and got["odd"] == (F, None)
    assert got["doc"] == (M, doc) and got["docs"] == (M, [doc])
    assert got["elsewhere"] == (F, None) and got["missing"] == (F, None) and got["loop"] == (F, None)
    assert got["either"] == (F, None) and got["bag"] == (R, None) and got["open"] == (M, None)
    assert got["items_above"] == (R, [{"k": (M, None)}])
    level, kids = got["tree"][1]["kids"]  # a recursive definition ends, deep down, in a content leaf
    depth = 0
    while kids is not None:
        level, kids = kids[0]["kids"]
        depth += 1
    assert level == FULL and depth > 5
    assert schema_payload_fields({"type": "object"}) == {}
    assert schema_payload_fields({"$ref": "#/$defs/p", "$defs": {"p": {"properties": {"a": {"x-aep-capture": "metadata"}}}}}) == \
        {"a": (M, None)}


# ---------------------------------------------------------------- ours against the spec


def _compare(event_type: str, ours: dict[str, Any], spec: dict[str, Any], path: str,
             looser: list[str], stricter: set[tuple[str, str]]) -> None:
    for name in sorted(ours.keys() & spec.keys()):
        (mine, my_inner), (theirs, their_inner) = ours[name], spec[name]
        where = f"{path}{name}"
        if isinstance(their_inner, (dict, list)) and my_inner is None:
            # our leaf keeps the whole value at our level: every field the spec declares inside must admit it
            theirs = max(theirs, _highest(their_inner))
        if mine < theirs:
            looser.append(f"{event_type}: {where} is {LEVELS[mine]} here, {LEVELS[theirs]} in the spec")
        elif mine > theirs:
            stricter.add((event_type, where))
        if isinstance(my_inner, dict) and isinstance(their_inner, dict):
            _compare(event_type, my_inner, their_inner, where + ".", looser, stricter)
        elif isinstance(my_inner, list) and isinstance(their_inner, list):
            _compare(event_type, my_inner[0], their_inner[0], where + "[].", looser, stricter)


def _highest(shape: Any) -> int:
    fields = shape[0] if isinstance(shape, list) else shape
    return max((max(level, _highest(inner) if inner is not None else NONE) for level, inner in fields.values()), default=NONE)


# Where we are stricter than the spec, on purpose (bridge/core/aep.py says why). Pinned so a new
# divergence shows up here.
STRICTER = {("tool.denied", "rule")}


def test_our_levels_are_never_looser_than_the_spec():
    looser: list[str] = []
    stricter: set[tuple[str, str]] = set()
    shared = sorted(aep.PAYLOAD_TYPES.keys() & spec_payload_fields().keys())
    assert len(shared) == 19
    for event_type in shared:
        ours = _fields(msgspec.inspect.type_info(aep.PAYLOAD_TYPES[event_type]))
        _compare(event_type, ours, spec_payload_fields()[event_type], "", looser, stricter)
    assert looser == []
    assert stricter == STRICTER


def test_the_comparison_sees_a_looser_field():
    looser: list[str] = []
    spec = {"a": (M, None), "b": (M, {"c": (R, None)}), "d": (M, [{"e": (F, None)}]), "f": (M, {"g": (R, None)})}
    ours = {"a": (NONE, None), "b": (M, {"c": (M, None)}), "d": (M, [{"e": (R, None)}]), "f": (M, None)}
    _compare("t", ours, spec, "", looser, set())
    assert looser == ["t: a is none here, metadata in the spec", "t: b.c is metadata here, redacted in the spec",
                      "t: d[].e is redacted here, full in the spec", "t: f is metadata here, redacted in the spec"]


def test_the_types_we_emit_keep_our_levels_and_gain_the_spec_only_fields():
    spec = spec_payload_fields()
    for event_type, cls in aep.PAYLOAD_TYPES.items():
        ours = _fields(msgspec.inspect.type_info(cls))
        table = payload_fields(event_type)
        for name, (level, _) in ours.items():
            assert table[name][0] == level, (event_type, name)  # ours decide every field we define
        for name in set(table) - set(ours):
            assert table[name] == spec[event_type][name], (event_type, name)  # the rest is the spec's
        assert set(table) == set(ours) | set(spec.get(event_type, {})), event_type
    # a field the spec declares and we do not: kept at the spec's level (status is metadata)
    ev = {"aep": "0.1", "id": "T1", "type": "tool.completed", "agent": "a", "capture": "full",
          "data": {"tool": {"name": "t"}, "status": "success", "result": "x"}}
    assert downlevel_fields(ev, METADATA)["data"] == {"tool": {"name": "t"}, "status": "success"}
    # nested: attention.requested's fields[] keep our members and gain the spec's min/max
    inner = payload_fields("attention.requested")["fields"][1][0]
    assert {"min", "max"} <= set(inner) and set(spec["attention.requested"]["fields"][1][0]) <= set(inner)


# ---------------------------------------------------------------- down-levelling the types we do not emit


def _ev(event_type: str, data: dict[str, Any], capture: str = "full") -> dict[str, Any]:
    return {"aep": "0.1", "id": "S1", "type": event_type, "time": "2026-12-01T10:00:00Z", "source": "urn:other:emitter",
            "agent": "claude-code", "session": "s1", "seq": 4, "capture": capture, "data": data}


CASES = [
    ("progress.status", {"message": "SECRET compiling /home/me/x", "phase": "build", "percent": 40},
     {"phase": "build", "percent": 40}),
    ("agent.health", {"status": "degraded", "detail": "SECRET disk full at /home/me"}, {"status": "degraded"}),
    ("state.delta", {"key": "plan", "rev": 7, "delta": [{"op": "replace", "path": "/x", "value": "SECRET"}]},
     {"key": "plan", "rev": 7}),
    ("resource.retrieval.returned",
     {"documents": [{"id": "d1", "score": 0.9, "content": "SECRET text", "content_redacted": "SECRET [REDACTED]",
                     "metadata": {"rank": 1}}, {"id": "d2", "content": "SECRET"}],
      "count": 2, "corpus": "kb", "duration_ms": 12},
     {"documents": [{"id": "d1", "score": 0.9, "metadata": {"rank": 1}}, {"id": "d2"}], "count": 2, "corpus": "kb",
      "duration_ms": 12}),
    ("error.raised", {"error": {"type": "Timeout", "message": "SECRET at /home/me"}, "code": "E42", "fatal": False},
     {"error": {"type": "Timeout"}, "code": "E42", "fatal": False}),
    ("resource.citation.recorded",
     {"citations": [{"source": {"id": "doc-1", "uri": "SECRET uri", "title": "SECRET title"}, "cited_text": "SECRET",
                     "offset": {"page": {"page": 3, "start": 1, "end": 9}}, "document_index": 0}], "count": 1},
     {"citations": [{"source": {"id": "doc-1"}, "offset": {"page": {"page": 3, "start": 1, "end": 9}},
                     "document_index": 0}], "count": 1}),
    ("control.cancel", {"scope": "run", "reason": "SECRET because I said so"}, {"scope": "run"}),
    ("assessment.feedback.received", {"rating": 1, "comment": "SECRET words", "source": "human"},
     {"rating": 1, "source": "human"}),
]


@pytest.mark.parametrize("event_type,data,want", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("capture", ["full", "redacted"])
def test_standard_types_we_do_not_emit_keep_exactly_their_metadata_fields(event_type, data, want, capture):
    assert event_type not in aep.PAYLOAD_TYPES
    ev = _ev(event_type, data, capture)
    before = copy.deepcopy(ev)
    for ceiling in range(NONE, LEVEL_RANK[capture]):
        out = downlevel_fields(ev, ceiling)
        assert ev == before
        envelope = {k: v for k, v in ev.items() if k not in ("data", "capture")}
        if ceiling == NONE:
            assert out == envelope | {"capture": "none"}
        else:
            assert out == envelope | {"capture": "metadata", "data": want}
            assert "SECRET" not in json.dumps(out)
    assert downlevel_fields(ev, LEVEL_RANK[capture]) is ev


@pytest.mark.parametrize("event_type", ["x.foo.bar", "x.foo.bar.baz", "x.acme.progress.status", "message.user.submitted", "progress.unknown"])
def test_vendor_unregistered_and_schemaless_types_still_lose_their_payload(event_type):
    ev = _ev(event_type, {"phase": "build", "message": "SECRET"})
    for ceiling, landed in ((REDACTED, "metadata"), (METADATA, "metadata"), (NONE, "none")):
        assert downlevel_fields(ev, ceiling) == {k: v for k, v in ev.items() if k != "data"} | {"capture": landed}
