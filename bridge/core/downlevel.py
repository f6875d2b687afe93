"""Down-levelling: a finished AEP event passed on by a hop with a lower ceiling (AEP-0001 §8.2).

* Exporters (the AEP-0005 bridges) apply their ceiling, ``max_capture``, event by event: an
  event above it keeps its envelope and loses its payload (``exported_payload``,
  ``downlevel``).
* A fan-out hop (the relay) delivers each subscription at its ceiling field by field
  (``downlevel_fields``): an event above it lands on ``metadata`` with its metadata-level
  fields: the levels ``bridge.core.aep`` declares for the types this bridge emits, those of
  the AEP payload schemas for the other standard types; vendor and unknown types keep their
  envelope alone.

This is the one core module that reads a file: the AEP payload schemas vendored in
``bridge/data/aep_spec/`` (``spec_payload_fields``), because the field levels of the
standard types the bridge does not emit itself (what other emitters POST to the relay)
exist only there. It reads them once, at first use, through ``importlib.resources`` (a
package resource, no path, no other floor imported), so the core stays a pure function of
its arguments and of files shipped inside the package.
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from typing import Any, Callable

import msgspec

from bridge.core import aep
from bridge.core.ceiling import FULL, LEVEL_RANK, LEVELS, METADATA, NONE, level_rank

# ---------------------------------------------------------------- an exporter's ceiling (AEP-0005 §3.3, §4.6)
#
# The bridges (bridge/core/bridges/) apply one rule before they project an AEP event: an
# event whose `capture` is above the exporter's `max_capture` keeps its envelope and loses
# its whole payload. Dropping more than the field levels require is always a legal
# down-level (AEP-0001 §8.2 b), it needs no schema of the event's type (the exporters see
# foreign and vendor types too), and it is what the AEP-0005 pins assert (§4.3: "a level
# above max_capture": the payload does not survive; §4.6: "created from the envelope alone").


def event_capture(event: dict[str, Any]) -> int:
    """The rank of an AEP event's `capture` (absent: `metadata`, AEP-0001 §5.1)."""
    return level_rank(event.get("capture", "metadata"))


def exported_payload(event: dict[str, Any], max_capture: int) -> dict[str, Any] | None:
    """The payload an exporter with ceiling ``max_capture`` may pass on, or None.

    None when the event is above the ceiling, when it is `capture: none` (envelope only,
    AEP-0005 §3.3), or when it has no object `data`.
    """
    level = event_capture(event)
    data = event.get("data")
    if level == NONE or level > max_capture or not isinstance(data, dict):
        return None
    return data


def downlevel(event: dict[str, Any], max_capture: int) -> dict[str, Any]:
    """The event as a re-emitting hop under ``max_capture`` passes it on (AEP-0001 §8.2 b).

    Within the ceiling: the event itself, unchanged (the CloudEvents bridge stays lossless).
    Above it: the envelope without `data`, its `capture` rewritten to `none`, the level of
    what it now carries (the rule of `exported_payload`; never up-levelled, never a
    `redacted` claim minted, §8.2 e).
    """
    if event_capture(event) <= max_capture:
        return event
    out = {k: v for k, v in event.items() if k != "data"}
    out["capture"] = "none"
    return out


# ---------------------------------------------------------------- a fan-out hop's ceiling (AEP-0001 §8.2, AEP-0003 §6.4)
#
# The relay delivers each subscription at its ceiling. Down-levelling there is field by field
# for the types whose payload fields carry their capture levels: the event keeps what its new
# level admits. The levels of a type come from `bridge.core.aep` when this bridge emits it (our
# types are our schemas, at least as strict as the spec's: tests/core/test_spec_levels.py),
# else from the AEP payload schema of the standard type (`bridge/data/aep_spec/types/`, what
# other emitters POST to the relay). Where it lands: an event above the ceiling goes to
# `metadata` (or to `none` under a `none` ceiling), never to `redacted`: that level claims the
# text passed the §9.4 pipeline, which a mechanical hop cannot mint (§8.2 e), and a `redacted`
# source event is within a `redacted` ceiling anyway. A type without known levels (vendor
# types we do not emit, unregistered ones, registered ones without a schema) keeps its
# envelope and loses its payload: dropping more than the levels require is always legal (§8.2 b).


def _shape(tp: Any) -> tuple[int, Any]:
    """(capture level, shape) of one field's msgspec type info. A shape is a dict of the
    fields of a nested payload, ``[shape]`` for a list of payloads, or None (a leaf)."""
    level = FULL  # a field without an annotation is content, to be safe
    while True:
        if isinstance(tp, msgspec.inspect.Metadata):
            schema = tp.extra_json_schema or {}
            if "x-aep-capture" in schema:
                level = LEVEL_RANK[schema["x-aep-capture"]]
            tp = tp.type
        elif isinstance(tp, msgspec.inspect.UnionType):
            kinds = [t for t in tp.types if not isinstance(t, msgspec.inspect.UnsetType)]
            if len(kinds) != 1:
                return level, None
            tp = kinds[0]
        else:
            break
    if isinstance(tp, msgspec.inspect.StructType):
        return level, _fields(tp)
    if isinstance(tp, msgspec.inspect.ListType):
        _, inner = _shape(tp.item_type)
        return level, [inner] if isinstance(inner, dict) else None
    return level, None


def _fields(info: msgspec.inspect.StructType) -> dict[str, tuple[int, Any]]:
    return {f.encode_name: _shape(f.type) for f in info.fields}


# ---- the levels of the AEP payload schemas

SPEC_DATA = "bridge.data"  # the package holding aep_spec/ (a name, not an import: the core imports no other floor)


def _level_of(value: Any) -> int:
    """An `x-aep-capture` value's rank; an unknown one is `full` (to be safe)."""
    return LEVEL_RANK.get(value, FULL) if isinstance(value, str) else FULL


def _pointer(ref: str, root: dict[str, Any]) -> Any:
    """The node a local reference (`#`, `#/$defs/x`, `#/definitions/x`) names in ``root``, or None."""
    if not ref.startswith("#"):
        return None  # another document: not followed
    node: Any = root
    for part in ref[2:].split("/") if len(ref) > 1 else ():
        node = node.get(part.replace("~1", "/").replace("~0", "~")) if isinstance(node, dict) else None
    return node


def _resolve(node: Any, root: dict[str, Any]) -> tuple[dict[str, Any] | None, list[int]]:
    """A schema node with its `$ref` chain followed, and the capture levels annotated along the
    chain; ``{}`` for no schema object, None for a reference that leaves the document, does not
    resolve to a schema object or loops (what it stands for is unknown: content)."""
    levels: list[int] = []
    seen: set[str] = set()
    while isinstance(node, dict):
        if "x-aep-capture" in node:
            levels.append(_level_of(node["x-aep-capture"]))
        ref = node.get("$ref")
        if not isinstance(ref, str):
            return node, levels
        if ref in seen:
            return None, levels
        seen.add(ref)
        node = _pointer(ref, root)
        if not isinstance(node, dict):
            return None, levels
    return {}, levels


def _deepest_level(node: Any, root: dict[str, Any]) -> int:
    """The highest `x-aep-capture` anywhere within a schema node, references followed (one that
    does not resolve: `full`); NONE if none."""
    top, stack, seen = NONE, [node], set()
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if "x-aep-capture" in item:
                top = max(top, _level_of(item["x-aep-capture"]))
            ref = item.get("$ref")
            if isinstance(ref, str) and ref not in seen:
                seen.add(ref)
                target = _pointer(ref, root)
                if target is None:
                    top = FULL
                stack.append(target)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return top


def _schema_field(node: Any, root: dict[str, Any], depth: int = 0) -> tuple[int, Any]:
    """(capture level, shape) of one property of a payload schema, the way `_shape` reads a
    struct field: an object with `properties` is a nested shape, an array whose `items` has
    `properties` is ``[shape]``, anything else a leaf. A field without `x-aep-capture` is
    `full` (content, to be safe); a leaf (or an array's items) holding annotations the shape
    does not model (combinators, `additionalProperties`...) is raised to the highest of them."""
    node, levels = _resolve(node, root)
    if node is None or depth > 32:
        return FULL, None
    level = max(levels) if levels else FULL
    if isinstance(node.get("properties"), dict):
        return level, _schema_fields(node, root, depth + 1)
    items, item_levels = _resolve(node.get("items"), root)
    if items is not None and isinstance(items.get("properties"), dict):
        return max([level, *item_levels]), [_schema_fields(items, root, depth + 1)]
    return max(level, _deepest_level(node, root)), None


def _schema_fields(node: dict[str, Any], root: dict[str, Any], depth: int = 0) -> dict[str, tuple[int, Any]]:
    return {name: _schema_field(sub, root, depth) for name, sub in node["properties"].items()}


def schema_payload_fields(schema: dict[str, Any]) -> dict[str, tuple[int, Any]]:
    """The payload fields of a payload JSON Schema, name -> (capture level, shape), as `payload_fields`."""
    node, _ = _resolve(schema, schema)
    return _schema_fields(node, schema) if node is not None and isinstance(node.get("properties"), dict) else {}


@lru_cache(maxsize=1)
def spec_payload_fields() -> dict[str, dict[str, tuple[int, Any]]]:
    """The payload fields of every registered AEP type with a payload schema, read once from
    the vendored registry (`bridge/data/aep_spec/`)."""
    spec = resources.files(SPEC_DATA).joinpath("aep_spec")
    registry = json.loads(spec.joinpath("registry", "types.json").read_text(encoding="utf-8"))
    table = {}
    for entry in registry["types"]:
        if entry.get("schema"):
            schema = json.loads(spec.joinpath("types", entry["schema"]).read_text(encoding="utf-8"))
            table[entry["type"]] = schema_payload_fields(schema)
    return table


def _merged(ours: dict[str, tuple[int, Any]], spec: dict[str, tuple[int, Any]]) -> dict[str, tuple[int, Any]]:
    """Our fields over the spec's: ours decide every field both define (level and shape, merged
    one level down into nested objects and lists of objects); a field only the spec defines
    keeps the spec's level (a posted ``tool.completed`` keeps its ``status`` at metadata)."""
    out = dict(spec)
    for name, (level, shape) in ours.items():
        other = spec.get(name)
        if other is not None and isinstance(shape, dict) and isinstance(other[1], dict):
            shape = _merged(shape, other[1])
        elif (other is not None and isinstance(shape, list) and isinstance(other[1], list)
              and isinstance(shape[0], dict) and isinstance(other[1][0], dict)):
            shape = [_merged(shape[0], other[1][0])]
        out[name] = (level, shape)
    return out


@lru_cache(maxsize=1)
def _field_table() -> dict[str, dict[str, tuple[int, Any]]]:
    spec = spec_payload_fields()
    table = dict(spec)
    for t, cls in aep.PAYLOAD_TYPES.items():
        table[t] = _merged(_fields(msgspec.inspect.type_info(cls)), spec.get(t, {}))
    return table


def payload_fields(event_type: str) -> dict[str, tuple[int, Any]] | None:
    """The payload fields of a type whose field levels are known, name -> (capture level, shape):
    ours for the types this bridge emits (with the fields only the AEP payload schema defines
    added at the schema's levels), the schema's for the other standard types; None for others.
    One table, built once: no cache keyed by the type strings events carry."""
    return _field_table().get(event_type)


def _project(value: Any, shape: dict[str, tuple[int, Any]], level: int) -> dict[str, Any]:
    """The fields of an object ``value`` that ``level`` admits, recursively; fields the shape
    does not declare, and values that do not have the declared shape, are dropped."""
    out: dict[str, Any] = {}
    for key, item in value.items():
        declared = shape.get(key)
        if declared is None or declared[0] > level:
            continue
        inner = declared[1]
        if isinstance(inner, dict):
            if not isinstance(item, dict):
                continue
            item = _project(item, inner, level)
        elif isinstance(inner, list):
            if not isinstance(item, list):
                continue
            item = [_project(x, inner[0], level) for x in item if isinstance(x, dict)]
        out[key] = item
    return out


# The `[metadata*]` fields (AEP-0002 §5.1): at `metadata` they hold structural text only, at
# `redacted`+ authored text. A hop cannot tell which an event above metadata carries, so it
# rebuilds them from structure (AEP-0003 §9.2): the prompt from agent, kind and subject, a
# label from its id; a form answer keeps its booleans and numbers, never a string (a select
# id and typed free text look alike).


def _label_ids(items: Any) -> None:
    if isinstance(items, list):
        for item in items:
            if "id" in item:
                item["label"] = item["id"]
            else:
                item.pop("label", None)


def _structural_request(event: dict[str, Any], data: dict[str, Any]) -> None:
    if "prompt" in data:
        agent, kind, subject = event.get("agent"), data.get("kind"), event.get("subject")
        prompt = f"{agent if isinstance(agent, str) else 'agent'} requests {kind if isinstance(kind, str) else 'attention'}"
        data["prompt"] = f"{prompt}: {subject}" if isinstance(subject, str) else prompt
    _label_ids(data.get("options"))
    for spec in data.get("fields") or ():
        if "label" in spec:
            spec["label"] = spec.get("id", "")
        _label_ids(spec.get("choices"))


def _structural_answer(event: dict[str, Any], data: dict[str, Any]) -> None:
    answer = data.get("answer")
    if isinstance(answer, dict) and "values" in answer:
        values = answer["values"]
        kept = {k: v for k, v in values.items() if isinstance(v, (bool, int, float))} if isinstance(values, dict) else {}
        if kept:
            answer["values"] = kept
        else:
            del answer["values"]


_STRUCTURAL: dict[str, Callable[[dict[str, Any], dict[str, Any]], None]] = {
    "attention.requested": _structural_request,
    "attention.answered": _structural_answer,
    "control.attention.respond": _structural_answer,
}


def downlevel_fields(event: dict[str, Any], max_capture: int) -> dict[str, Any]:
    """The event as a fan-out hop with ceiling ``max_capture`` delivers it (AEP-0001 §8.2).

    Within the ceiling: the event itself, unchanged. Above it: `capture` becomes `metadata`
    (`none` under a `none` ceiling); at `metadata` the payload keeps its metadata-level fields
    (`[metadata*]` fields rebuilt from structure) when the type is known, else the event loses
    its payload. An unknown `capture` value counts as above every ceiling. Pure: ``event`` is
    not modified.
    """
    try:
        level = event_capture(event)
    except ValueError:
        level = FULL + 1
    if level <= max_capture:
        return event
    new = min(max_capture, METADATA)
    out = {k: v for k, v in event.items() if k != "data"}
    out["capture"] = LEVELS[new]
    shape = payload_fields(event.get("type")) if isinstance(event.get("type"), str) else None
    data = event.get("data")
    if new == METADATA and shape is not None and isinstance(data, dict):
        kept = _project(data, shape, METADATA)
        fix = _STRUCTURAL.get(event["type"])
        if fix is not None:
            fix(event, kept)
        out["data"] = kept
    return out
