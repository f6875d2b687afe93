"""The AEP-0005 bridges: pure projections of finished AEP events.

| format | module | what one AEP event becomes |
|---|---|---|
| `cloudevents` | `cloudevents` | a CloudEvents 1.0 event, JSON format, structured mode (and back: `from_cloudevent`) |
| `otlp-json` | `otlp` | an OTLP LogRecord in the JSON form of the OTLP data model |
| `ocsf` | `ocsf` | an OCSF 1.8.0 record, or nothing outside the §4.2 families |

Each takes the event as its wire JSON object and the exporter's `max_capture` (a rank of
`bridge.core.ceiling.LEVELS`, default `metadata`), applies the ceiling before it projects
(`downlevel.exported_payload` / `downlevel.downlevel`), and raises `BridgeError` on an event
it cannot project. No I/O here: the `aep-bridge export` command and the exporter service
are the shells.
"""

from __future__ import annotations

from typing import Any, Callable

from bridge.core.bridges.cloudevents import ForeignEvent, from_cloudevent, to_cloudevent
from bridge.core.bridges.common import BridgeError, check_event
from bridge.core.bridges.ocsf import to_ocsf
from bridge.core.bridges.otlp import to_log_record
from bridge.core.ceiling import METADATA

__all__ = ["FORMATS", "BridgeError", "ForeignEvent", "check_event", "from_cloudevent", "project"]

Projection = Callable[[dict[str, Any], int], "dict[str, Any] | None"]

FORMATS: dict[str, Projection] = {
    "cloudevents": to_cloudevent,
    "otlp-json": to_log_record,
    "ocsf": to_ocsf,
}


def project(fmt: str, event: dict[str, Any], max_capture: int = METADATA) -> dict[str, Any] | None:
    """The record of ``event`` in ``fmt``, or None when that format has none for it."""
    return FORMATS[fmt](event, max_capture)
