"""The AEP validators the tests check events with: the envelope schema (with its formats) and
each payload type's schema, as `aep-bridge schemas` generates them (bridge/core/schemas.py)."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import jsonschema

from bridge.core.schemas import generate


@lru_cache(maxsize=1)
def validators() -> tuple[jsonschema.Draft202012Validator, dict[str, jsonschema.Draft202012Validator]]:
    """(envelope, {event type: payload validator}) for the generated schemas."""
    docs = generate()
    envelope = jsonschema.Draft202012Validator(docs["aep-event.schema.json"], format_checker=jsonschema.FormatChecker())
    types = {name[len("types/"):-len(".schema.json")]: jsonschema.Draft202012Validator(doc)
             for name, doc in docs.items() if name.startswith("types/")}
    return envelope, types


def schema_problems(event: dict[str, Any]) -> list[str]:
    """Every way `event` (decoded JSON) breaks the envelope schema or its type's payload schema."""
    envelope, types = validators()
    out = [e.message for e in envelope.iter_errors(event)]
    if event.get("type") in types:
        out += [e.message for e in types[event["type"]].iter_errors(event.get("data", {}))]
    return out
