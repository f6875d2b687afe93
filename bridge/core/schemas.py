"""JSON Schemas generated from the msgspec types (the types are the schema).

`aep-bridge schemas --out schemas/` writes what `generate()` returns; a test fails
when the committed files differ from it.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from bridge.core import aep
from bridge.core.envelope import HermesEnvelope, RawMessage

DIALECT = "https://json-schema.org/draft/2020-12/schema"


def _schema(tp: Any, schema_id: str, title: str, description: str) -> dict[str, Any]:
    body = msgspec.json.schema(tp)
    out: dict[str, Any] = {"$schema": DIALECT, "$id": schema_id, "title": title, "description": description}
    out.update(body)
    return out


def generate() -> dict[str, dict[str, Any]]:
    """Relative file path -> schema document."""
    files: dict[str, dict[str, Any]] = {}
    files["aep-event.schema.json"] = _schema(
        Annotated[aep.Event, msgspec.Meta(extra_json_schema=aep.EVENT_SCHEMA_EXTRA)],
        "aep-bridge://schemas/aep-event.schema.json",
        "AEP 0.1 event envelope, as aep-bridge emits it",
        "AEP-0001 §5 envelope; `lane` and `drift` are aep-bridge extension attributes.",
    )
    for event_type, payload in sorted(aep.PAYLOAD_TYPES.items()):
        files[f"types/{event_type}.schema.json"] = _schema(
            payload,
            f"aep-bridge://schemas/types/{event_type}.schema.json",
            f"AEP payload: {event_type}",
            (payload.__doc__ or f"The data of a {event_type} event.").strip().splitlines()[0],
        )
    files["hermes-envelope.schema.json"] = _schema(
        HermesEnvelope,
        "aep-bridge://schemas/hermes-envelope.schema.json",
        "Hermes shell-hook stdin envelope",
        "What Hermes writes to a shell hook's stdin (`unknown` and `problems` are added by the decoder).",
    )
    files["raw-message.schema.json"] = _schema(
        RawMessage,
        "aep-bridge://schemas/raw-message.schema.json",
        "aep-bridge raw message on HERMES_RAW",
        "The shim's wrapper around one Hermes envelope (docs/ARCHITECTURE.md).",
    )
    return files


def render(schema: dict[str, Any]) -> bytes:
    return msgspec.json.format(msgspec.json.encode(schema), indent=2) + b"\n"
