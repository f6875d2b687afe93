"""AEP <-> CloudEvents 1.0, JSON format, structured mode (AEP-0005 §1-2).

Forward (`to_cloudevent`): the B1 constants, the B2 attributes verbatim, the type under
the `dev.aep.` root (B3), the envelope attributes under their `aep*` names (B4, table
`ATTRIBUTES`), `traceparent` unprefixed (B5), AEP extension attributes verbatim.
Absent optional attributes stay absent. The inverse (`from_cloudevent`) undoes exactly
that, so ``from_cloudevent(to_cloudevent(e)) == e`` for every event within the ceiling.

Inbound CloudEvents keep unknown extension attributes whose names are legal AEP
extension names (§2 rule 2); any other attribute is dropped with a diagnostic. A
CloudEvent of another type is out of scope (§2 rule 3): `ForeignEvent`.

Both directions apply the ceiling first (forward) or last (inverse): a hop that
re-emits an event never passes content above its `max_capture` (`downlevel.downlevel`).
"""

from __future__ import annotations

from typing import Any

from bridge.core.bridges.common import (
    CORE_ATTRIBUTES,
    EXTENSION_NAME,
    TYPE_ROOT,
    BridgeError,
    check_event,
    extensions,
)
from bridge.core.ceiling import METADATA
from bridge.core.downlevel import downlevel

SPECVERSION = "1.0"
DATACONTENTTYPE = "application/json"

#: AEP-0005 §1 B4: envelope attribute -> CloudEvents extension attribute.
ATTRIBUTES: tuple[tuple[str, str], ...] = (
    ("aep", "aepversion"),
    ("agent", "aepagentid"),
    ("session", "aepsessionid"),
    ("run", "aeprunid"),
    ("step", "aepstep"),
    ("seq", "aepsequence"),
    ("epoch", "aepepoch"),
    ("cause", "aepcausationid"),
    ("severity", "aepseverity"),
    ("capture", "aepcapture"),
)
_FROM_CE = {ce: aep for aep, ce in ATTRIBUTES}

#: CloudEvents attributes the inverse reads itself (the B1 constants, B2, B3, B5).
_CE_OWN = frozenset(("specversion", "datacontenttype", "id", "source", "type", "subject", "time", "data", "traceparent"))

#: CloudEvents context attributes with no AEP counterpart: an AEP extension of that name
#: would overwrite one (forward), an inbound one has nowhere to go (inverse).
_CE_CONTEXT = frozenset(("specversion", "datacontenttype", "dataschema"))

#: The order of an AEP envelope on the wire (AEP-0001 §5.1).
_AEP_ORDER = (
    "aep", "id", "type", "subject", "time", "source", "agent", "session", "run", "step",
    "seq", "epoch", "cause", "traceparent", "severity", "capture",
)


class ForeignEvent(BridgeError):
    """A CloudEvent whose type is not under `dev.aep.`: not this bridge's to lift (§2 rule 3)."""


def to_cloudevent(event: dict[str, Any], max_capture: int = METADATA) -> dict[str, Any]:
    """One AEP event -> its CloudEvent (a JSON object), after the ceiling."""
    event = downlevel(check_event(event), max_capture)
    ce: dict[str, Any] = {
        "specversion": SPECVERSION,
        "id": event["id"],
        "source": event["source"],
        "type": TYPE_ROOT + event["type"],
    }
    if "subject" in event:
        ce["subject"] = event["subject"]
    ce["time"] = event["time"]
    if "data" in event:
        ce["datacontenttype"] = DATACONTENTTYPE
    for aep_name, ce_name in ATTRIBUTES:
        if aep_name in event:
            ce[ce_name] = event[aep_name]
    if "traceparent" in event:
        ce["traceparent"] = event["traceparent"]
    ext = extensions(event)
    for name in ext:
        if name in _CE_CONTEXT or name in _FROM_CE:
            raise BridgeError("bad_extension", f"extension attribute {name!r} collides with the CloudEvents attribute of that name")
    ce.update(ext)
    if "data" in event:
        ce["data"] = event["data"]
    return ce


def from_cloudevent(ce: Any, max_capture: int = METADATA) -> tuple[dict[str, Any], list[str]]:
    """One CloudEvent of an AEP type -> (the AEP event, diagnostics for what was dropped).

    Raises `ForeignEvent` for another type, `BridgeError` for a CloudEvent that cannot be
    an AEP event (not CloudEvents 1.0, binary data, no AEP version, a bad envelope).
    """
    if not isinstance(ce, dict):
        raise BridgeError("not_object", "a CloudEvent in JSON format is a JSON object")
    if ce.get("specversion") != SPECVERSION:
        raise BridgeError("not_cloudevent", f"specversion {ce.get('specversion')!r} is not {SPECVERSION!r}")
    ce_type = ce.get("type")
    if not isinstance(ce_type, str) or not ce_type:
        raise BridgeError("not_cloudevent", "'type' must be a non-empty string")
    if not ce_type.startswith(TYPE_ROOT):
        raise ForeignEvent("foreign_type", f"type {ce_type!r} is not under {TYPE_ROOT!r}: out of the bridge's scope")
    if "data_base64" in ce:
        raise BridgeError("binary_data", "'data_base64': an AEP payload is a JSON object")
    content_type = ce.get("datacontenttype", DATACONTENTTYPE)
    if not isinstance(content_type, str) or not (
        content_type.split(";")[0].strip() == DATACONTENTTYPE or content_type.split(";")[0].strip().endswith("+json")
    ):
        raise BridgeError("not_json", f"datacontenttype {content_type!r} is not JSON")
    if "aepversion" not in ce:
        raise BridgeError("not_aep", "no 'aepversion': not the CloudEvent of an AEP event")

    found: dict[str, Any] = {"type": ce_type[len(TYPE_ROOT):]}
    for name in ("id", "source", "subject", "time", "traceparent"):
        if name in ce:
            found[name] = ce[name]
    ext: dict[str, Any] = {}
    diagnostics: list[str] = []
    for name, value in ce.items():
        if name in _CE_OWN:
            continue
        if name in _FROM_CE:
            found[_FROM_CE[name]] = value
        elif name in _CE_CONTEXT:
            diagnostics.append(f"dropped attribute {name!r}: an AEP event has no such attribute")
        elif not EXTENSION_NAME.fullmatch(name):
            diagnostics.append(f"dropped attribute {name!r}: not a legal AEP extension name ([a-z0-9]{{1,20}})")
        elif name in CORE_ATTRIBUTES:
            diagnostics.append(f"dropped attribute {name!r}: collides with the AEP core attribute of that name")
        elif not isinstance(value, (str, int)):  # bool is an int
            diagnostics.append(f"dropped attribute {name!r}: an AEP extension value is a string, integer or boolean")
        else:
            ext[name] = value

    event = {name: found[name] for name in _AEP_ORDER if name in found}
    event.update(ext)
    if "data" in ce:
        event["data"] = ce["data"]
    return downlevel(check_event(event), max_capture), diagnostics
