"""The mapping stage as one pure step over a raw record: what the mapper service and
`aep-bridge map` both run, so the two give byte-identical events for the same input.
"""

from __future__ import annotations

from typing import Any

import msgspec

from bridge.core.ceiling import CapturePolicy
from bridge.core.envelope import EnvelopeError, HermesEnvelope, RawMessage, check_raw, envelope_from_obj, raw_envelope
from bridge.core.identity import Origin
from bridge.core.lanes import LaneLookup
from bridge.core.mapping import MapResult, map_envelope
from bridge.core.pricing import PriceTable

_generic = msgspec.json.Decoder()


class Record(msgspec.Struct, frozen=True):
    """One input to the mapping stage: an envelope plus where it came from."""

    envelope: HermesEnvelope
    raw_id: str
    ts_ns: int
    instance: str
    edge: dict[str, Any] | None = None


def record_from_raw(raw: RawMessage, default_instance: str = "", checked: bool = False) -> Record:
    if not checked:  # `checked`: the caller ran check_raw already
        check_raw(raw)  # EnvelopeError('bad_raw') for what the shim could not have written
    env = raw_envelope(raw)  # raises EnvelopeError for the shim's wrapped garbage
    return Record(env, raw.id, raw.ts, raw.instance or default_instance, raw.edge or None)  # type: ignore[arg-type]


def record_from_line(obj: Any, line_no: int, default_instance: str, base_ts_ns: int) -> Record:
    """A line of a hook log: a raw message, a corpus record ``{"envelope": ...}``, or a bare envelope.

    Bare envelopes get a deterministic identity from their line number.
    """
    if not isinstance(obj, dict):
        raise EnvelopeError("not_object", f"line is a JSON {type(obj).__name__}, not an object")
    if "v" in obj and "id" in obj and ("envelope" in obj or "error" in obj):
        try:
            raw = msgspec.convert(obj, RawMessage)
        except msgspec.ValidationError as exc:
            raise EnvelopeError("bad_raw", str(exc)) from None
        return record_from_raw(raw, default_instance)
    if "hook_event_name" not in obj and isinstance(obj.get("envelope"), dict):
        obj = obj["envelope"]
    env = envelope_from_obj(obj)
    return Record(env, f"line-{line_no}", base_ts_ns + line_no * 1_000_000, default_instance)


def map_record(record: Record, raw_seq: int, epoch: int, lanes: LaneLookup, policy: CapturePolicy,
               prices: PriceTable | None = None) -> MapResult:
    origin = Origin(raw_id=record.raw_id, raw_seq=raw_seq, ts_ns=record.ts_ns, instance=record.instance, epoch=epoch)
    return map_envelope(record.envelope, origin, lanes, policy, prices)
