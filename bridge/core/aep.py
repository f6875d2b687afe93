"""AEP 0.1 types: the envelope (AEP-0001) and the payloads the Hermes mapping emits (AEP-0002).

The types are the schema: `aep-bridge schemas` generates `schemas/` from these
classes, never the other way round. Every payload field carries its capture
level (`x-aep-capture`, the lowest ceiling at which it may appear) as JSON
Schema metadata, and tests check that no emitted event carries a field above its
own `capture`. Where we are stricter than the upstream schema we say so
(`tool.denied.rule` is a hook-provided message, so we gate it at `redacted`).

Optional attributes default to `UNSET` and are omitted on the wire, never `null`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

AEP_VERSION = "0.1"

Level = Literal["none", "metadata", "redacted", "full"]
Severity = Literal["debug", "info", "notice", "warning", "error", "critical"]

# Capture-level annotations (AEP-0002 §5.1): the lowest ceiling a field may appear at.
_M = Meta(extra_json_schema={"x-aep-capture": "metadata"})
_R = Meta(extra_json_schema={"x-aep-capture": "redacted"})
_F = Meta(extra_json_schema={"x-aep-capture": "full"})

TYPE_PATTERN = (
    r"^((agent|session|run|progress|tool|delegation|attention|resource|error|state|assessment"
    r"|message|control)(\.[a-z0-9_]+)+|x\.[a-z0-9_-]+\.[a-z0-9_]+(\.[a-z0-9_]+)+)$"
)
NonEmpty = Annotated[str, Meta(min_length=1)]


class _Payload(Struct, omit_defaults=True, kw_only=True):
    """Base of every payload: optional fields are UNSET and omitted."""


# ---------------------------------------------------------------- shared pieces


class ToolRef(_Payload):
    name: Annotated[str, _M]
    call_id: Annotated[str, _M] | UnsetType = UNSET


class ErrorInfo(_Payload):
    type: Annotated[str, _M] | UnsetType = UNSET
    message: Annotated[str, _R] | UnsetType = UNSET


class Client(_Payload):
    name: Annotated[str, _M]
    version: Annotated[str, _M] | UnsetType = UNSET


class SessionRef(_Payload):
    session: Annotated[str, _M] | UnsetType = UNSET
    run: Annotated[str, _M] | UnsetType = UNSET
    agent: Annotated[str, _M] | UnsetType = UNSET


class ParentRef(_Payload):
    session: Annotated[str, _M]
    run: Annotated[str, _M] | UnsetType = UNSET
    agent: Annotated[str, _M] | UnsetType = UNSET


class Option(_Payload):
    id: Annotated[str, _M]
    # Structural (static menu wording or a 1-based index) at metadata; real labels at redacted+.
    label: Annotated[str, _M]


class Choice(_Payload):
    id: Annotated[str, _M]
    label: Annotated[str, _M]


class FieldSpec(_Payload):
    id: Annotated[str, _M]
    type: Annotated[Literal["string", "number", "boolean", "select"], _M]
    # Structural placeholder at metadata, the real (redacted) question at redacted+.
    label: Annotated[str, _M]
    required: Annotated[bool, _M] | UnsetType = UNSET
    multi: Annotated[bool, _M] | UnsetType = UNSET
    other: Annotated[bool, _M] | UnsetType = UNSET
    choices: Annotated[list[Choice], _M] | UnsetType = UNSET


class Answer(_Payload):
    option: Annotated[str, _M] | UnsetType = UNSET
    text: Annotated[str, _R] | UnsetType = UNSET
    # Form answers: a closed-select id is structural (metadata); free text is redacted-gated.
    values: Annotated[dict[str, str], _M] | UnsetType = UNSET


# ---------------------------------------------------------------- usage and cost (issue 40)


_Count = Annotated[int, _M, Meta(ge=0)]
_Money = Annotated[float, _M, Meta(ge=0)]


class Cost(_Payload):
    """AEP-0002 §5.2 ``cost``: what the bridge computed from the operator's price table
    (`bridge.core.pricing`), in ``currency`` units (emitter-asserted)."""

    currency: Annotated[str, _M, Meta(pattern=r"^[A-Z]{3}$")]
    total: _Money | UnsetType = UNSET
    prompt: _Money | UnsetType = UNSET
    completion: _Money | UnsetType = UNSET
    cache: _Money | UnsetType = UNSET
    reasoning: _Money | UnsetType = UNSET


class Usage(_Payload):
    """The ``usage`` members, FLAT in a payload (AEP-0002 §5.2, as in ``run.started``): OTel GenAI
    names. Hermes's ``input_tokens`` excludes cache reads and writes; ``output_tokens`` includes
    the reasoning tokens (``bridge.core.pricing``)."""

    input_tokens: _Count | UnsetType = msgspec.field(default=UNSET, name="gen_ai.usage.input_tokens")
    output_tokens: _Count | UnsetType = msgspec.field(default=UNSET, name="gen_ai.usage.output_tokens")
    cache_read_tokens: _Count | UnsetType = msgspec.field(default=UNSET, name="gen_ai.usage.cache_read.input_tokens")
    cache_write_tokens: _Count | UnsetType = msgspec.field(default=UNSET, name="gen_ai.usage.cache_creation.input_tokens")
    reasoning_tokens: _Count | UnsetType = msgspec.field(default=UNSET, name="gen_ai.usage.reasoning.output_tokens")
    cost: Annotated[Cost, _M] | UnsetType = UNSET


#: the usage members in the order pairing keeps their sums, and the Hermes bucket each comes from
USAGE_MEMBERS = (
    ("gen_ai.usage.input_tokens", "input_tokens"),
    ("gen_ai.usage.output_tokens", "output_tokens"),
    ("gen_ai.usage.cache_read.input_tokens", "cache_read_tokens"),
    ("gen_ai.usage.cache_creation.input_tokens", "cache_write_tokens"),
    ("gen_ai.usage.reasoning.output_tokens", "reasoning_tokens"),
)
API_CALL_TYPE = "x.hermes.api.call"
API_ERROR_TYPE = "x.hermes.api.error"
#: pairing: a run's totals amended by a model call that reached it after the run's end
RUN_USAGE_TYPE = "x.hermes.run.usage"


class HermesApiCall(Usage, kw_only=True):
    """One model call (Hermes ``post_api_request``): the model, how long it took, its tokens and
    (with a price table naming the model) its cost. Never the request or response text."""

    request_model: Annotated[str, _M] | UnsetType = msgspec.field(default=UNSET, name="gen_ai.request.model")
    response_model: Annotated[str, _M] | UnsetType = msgspec.field(default=UNSET, name="gen_ai.response.model")
    provider: Annotated[str, _M] | UnsetType = msgspec.field(default=UNSET, name="gen_ai.provider.name")
    api_mode: Annotated[str, _M] | UnsetType = UNSET
    duration_ms: _Count | UnsetType = UNSET
    finish_reason: Annotated[str, _M] | UnsetType = UNSET
    call_index: Annotated[int, _M, Meta(ge=1)] | UnsetType = UNSET


class RunTotals(Usage, kw_only=True):
    """What pairing adds to a run's end (``run.finished`` / ``run.cancelled`` / ``run.failed``,
    or the ``x.hermes.pairing.orphaned`` that closes it): the sums over the run's
    ``x.hermes.api.call`` events, and how many there were (``model_calls``)."""

    model_calls: _Count | UnsetType = UNSET


# ---------------------------------------------------------------- payloads by type


class SessionStarted(_Payload):
    client: Annotated[Client, _M] | UnsetType = UNSET
    parent: Annotated[ParentRef, _M] | UnsetType = UNSET
    cwd: Annotated[str, _R] | UnsetType = UNSET


class SessionEnded(_Payload):
    reason: Annotated[Literal["normal", "error", "timeout", "killed", "compaction"], _M]
    duration_ms: Annotated[int, _M, Meta(ge=0)] | UnsetType = UNSET
    runs: Annotated[int, _M, Meta(ge=0)] | UnsetType = UNSET


class RunStarted(_Payload):
    trigger: Annotated[Literal["user", "schedule", "agent", "control", "resume"], _M] | UnsetType = UNSET
    message_digest: Annotated[str, _M] | UnsetType = UNSET
    prompt: Annotated[str, _R] | UnsetType = UNSET


class RunFinished(RunTotals, kw_only=True):
    duration_ms: Annotated[int, _M, Meta(ge=0)] | UnsetType = UNSET
    summary: Annotated[str, _R] | UnsetType = UNSET


class RunFailed(RunTotals, kw_only=True):
    reason: Annotated[str, _M]
    error: Annotated[ErrorInfo, _M] | UnsetType = UNSET
    duration_ms: Annotated[int, _M, Meta(ge=0)] | UnsetType = UNSET


class RunCancelled(RunTotals, kw_only=True):
    by: Annotated[Literal["user", "control", "policy", "shutdown"], _M] | UnsetType = UNSET
    reason: Annotated[str, _R] | UnsetType = UNSET
    duration_ms: Annotated[int, _M, Meta(ge=0)] | UnsetType = UNSET


class ToolRequested(_Payload):
    tool: Annotated[ToolRef, _M]
    args_digest: Annotated[str, _M] | UnsetType = UNSET
    args_redacted: Annotated[dict[str, Any], _R] | UnsetType = UNSET
    args: Annotated[dict[str, Any], _F] | UnsetType = UNSET


class ToolCompleted(_Payload):
    tool: Annotated[ToolRef, _M]
    duration_ms: Annotated[int, _M, Meta(ge=0)] | UnsetType = UNSET
    result_digest: Annotated[str, _M] | UnsetType = UNSET
    result_redacted: Annotated[Any, _R] | UnsetType = UNSET
    result: Annotated[Any, _F] | UnsetType = UNSET


class ToolFailed(_Payload):
    tool: Annotated[ToolRef, _M]
    error: Annotated[ErrorInfo, _M]
    duration_ms: Annotated[int, _M, Meta(ge=0)] | UnsetType = UNSET


class ToolDenied(_Payload):
    tool: Annotated[ToolRef, _M]
    by: Annotated[Literal["policy", "user_setting", "runtime"], _M]
    duration_ms: Annotated[int, _M, Meta(ge=0)] | UnsetType = UNSET
    # Upstream tags `rule` metadata; a Hermes block message is free text, so we gate it higher.
    rule: Annotated[str, _R] | UnsetType = UNSET


class SubagentStarted(_Payload):
    child: Annotated[SessionRef, _M] | UnsetType = UNSET
    role: Annotated[str, _M] | UnsetType = UNSET
    goal: Annotated[str, _R] | UnsetType = UNSET


class SubagentStopped(_Payload):
    child: Annotated[SessionRef, _M] | UnsetType = UNSET
    role: Annotated[str, _M] | UnsetType = UNSET
    status: Annotated[str, _M] | UnsetType = UNSET
    duration_ms: Annotated[int, _M, Meta(ge=0)] | UnsetType = UNSET
    summary: Annotated[str, _R] | UnsetType = UNSET


class AttentionRequested(_Payload):
    kind: Annotated[Literal["permission", "input", "auth", "review", "form", "other"], _M]
    # Structural text at metadata (AEP-0003 §9.2); hook text through the redaction pipeline at redacted+.
    prompt: Annotated[str, _M]
    options: Annotated[list[Option], _M] | UnsetType = UNSET
    fields: Annotated[list[FieldSpec], _M] | UnsetType = UNSET
    expires_at: Annotated[str, _M] | UnsetType = UNSET
    respond_via: Annotated[list[Literal["control", "oob"]], _M] | UnsetType = UNSET


class AttentionAnswered(_Payload):
    answer: Annotated[Answer, _M]
    by: Annotated[str, _M] | UnsetType = UNSET
    via: Annotated[Literal["control", "oob"], _M] | UnsetType = UNSET


class AttentionResolved(_Payload):
    resolution: Annotated[Literal["answered", "auto", "dismissed"], _M]
    latency_ms: Annotated[int, _M, Meta(ge=0)] | UnsetType = UNSET


class AttentionTimeout(_Payload):
    after_ms: Annotated[int, _M, Meta(ge=0)] | UnsetType = UNSET


# Vendor types (x.hermes.*): no upstream schema; ours are published in schemas/ for consumers.


class HermesSessionReset(_Payload):
    reason: Annotated[str, _M] | UnsetType = UNSET
    previous_session: Annotated[str, _M] | UnsetType = UNSET


class HermesApiError(_Payload):
    status_code: Annotated[int, _M] | UnsetType = UNSET
    retry_count: Annotated[int, _M] | UnsetType = UNSET
    reason: Annotated[str, _M] | UnsetType = UNSET
    error_type: Annotated[str, _M] | UnsetType = UNSET
    message: Annotated[str, _R] | UnsetType = UNSET
    # issue 40: the failed call's model, provider and duration, when the envelope has them
    request_model: Annotated[str, _M] | UnsetType = msgspec.field(default=UNSET, name="gen_ai.request.model")
    provider: Annotated[str, _M] | UnsetType = msgspec.field(default=UNSET, name="gen_ai.provider.name")
    duration_ms: Annotated[int, _M, Meta(ge=0)] | UnsetType = UNSET


class HermesSessionFinalized(_Payload):
    """A second finalize of a session that already ended (a resumed session): pairing's vendor event."""

    reason: Annotated[str, _M] | UnsetType = UNSET


class HermesRunClosed(_Payload):
    """A run end that is not the run's AEP terminal: no open run to close, or the run already ended.

    Pairing emits it for an `on_session_end` without a turn id while no run is open, and for a
    second terminal of a run that already has one (then `cause` names the run's start).
    """

    completed: Annotated[bool, _M] | UnsetType = UNSET
    interrupted: Annotated[bool, _M] | UnsetType = UNSET


class HermesOrphaned(RunTotals, kw_only=True):
    """Pairing closed an open start that never got its terminal (TTL, session end, cap): no invented outcome.

    `reason`: `ttl` (open past its kind's TTL), `session_end` (open when its session ended;
    a subagent: its parent's session ended and no stop came within the grace), `overflow`
    (the oldest start of a session that reached the bridge's per-session cap),
    `delegate_returned` (a subagent: the parent's `delegate_task` call reached its terminal
    and no `subagent_stop` came within the grace). It says the bridge stopped waiting, not
    how the subagent ended.
    """

    kind: Annotated[Literal["run", "tool", "subagent"], _M]
    reason: Annotated[Literal["ttl", "session_end", "overflow", "delegate_returned"], _M]
    start: Annotated[str, _M]
    age_ms: Annotated[int, _M, Meta(ge=0)] | UnsetType = UNSET


class HermesAttentionUnmatched(_Payload):
    """An approval / clarify follow-up whose request never reached its lane within pairing's hold.

    Not an attention lifecycle event: with no request there is no id for `subject` (AEP-0002
    §7.1), so pairing files what Hermes reported here instead. `follow_up`: the type it would
    have had; `pattern_key` (approvals) / `tool_call_id`: the keys it was looked for by;
    `choice`: the option the user picked (approvals; `timeout` for a gateway timeout).
    """

    follow_up: Annotated[Literal["attention.answered", "attention.timeout", "attention.resolved"], _M]
    pattern_key: Annotated[str, _M] | UnsetType = UNSET
    tool_call_id: Annotated[str, _M] | UnsetType = UNSET
    choice: Annotated[str, _M] | UnsetType = UNSET


class Empty(_Payload):
    """Payload of fallback `x.hermes.*` events: structure travels in the envelope (run, subject)."""


# ---------------------------------------------------------------- control (AEP-0004), the opt-in control plane

RejectReason = Literal["unsupported", "unauthorized", "busy", "refused", "invalid"]


class ControlAccepted(_Payload):
    """The target will attempt the command (AEP-0004 §3); `cause` = the command's id."""


class ControlRejected(_Payload):
    """The target will not attempt the command (AEP-0004 §3); `cause` = the command's id."""

    reason: Annotated[RejectReason, _M]
    detail: Annotated[str, _R] | UnsetType = UNSET


class CommandAnswer(_Payload):
    option: Annotated[str, _M] | UnsetType = UNSET
    text: Annotated[str, _R] | UnsetType = UNSET
    # Answers a kind=form request (AEP-0006); the gate's permission cards reject it (`invalid`).
    values: Annotated[dict[str, Any], _M] | UnsetType = UNSET


class ControlAttentionRespond(_Payload):
    """A command answering an `attention.requested` (AEP-0004 §5); `subject` = the request's id."""

    answer: Annotated[CommandAnswer, _M]


class HermesControlInstruct(_Payload):
    """A steering command: text delivered into the session's next turn (the `pre_llm_call` answer)."""

    text: Annotated[str, _R, Meta(min_length=1, max_length=4000)]


class HermesInstructionDelivered(_Payload):
    """A queued instruction reached the agent (the `pre_llm_call` answer carried it); `cause` = the command."""

    queued_ms: Annotated[int, _M, Meta(ge=0)]


class HermesInstructionDropped(_Payload):
    """A queued instruction that was never delivered; `cause` = the command. `reason`: `session_ended`."""

    reason: Annotated[str, _M]
    queued_ms: Annotated[int, _M, Meta(ge=0)] | UnsetType = UNSET


PAYLOAD_TYPES: dict[str, type[_Payload]] = {
    "session.started": SessionStarted,
    "session.ended": SessionEnded,
    "run.started": RunStarted,
    "run.finished": RunFinished,
    "run.failed": RunFailed,
    "run.cancelled": RunCancelled,
    "tool.requested": ToolRequested,
    "tool.completed": ToolCompleted,
    "tool.failed": ToolFailed,
    "tool.denied": ToolDenied,
    "delegation.subagent.started": SubagentStarted,
    "delegation.subagent.stopped": SubagentStopped,
    "attention.requested": AttentionRequested,
    "attention.answered": AttentionAnswered,
    "attention.resolved": AttentionResolved,
    "attention.timeout": AttentionTimeout,
    "x.hermes.session.reset": HermesSessionReset,
    "x.hermes.api.error": HermesApiError,
    API_CALL_TYPE: HermesApiCall,
    # A model call that reached pairing after its run's end: the run's totals, amended (pairing
    # inserts it right after that call; `cause` = the run's end). The last totals of a run stated
    # (its end or this) are its total.
    RUN_USAGE_TYPE: RunTotals,
    "x.hermes.session.finalized": HermesSessionFinalized,
    "x.hermes.run.closed": HermesRunClosed,
    "x.hermes.pairing.orphaned": HermesOrphaned,
    "x.hermes.attention.unmatched": HermesAttentionUnmatched,
    # A subagent_stop after the bridge closed its delegation (x.hermes.pairing.orphaned): what
    # Hermes reported, not a second terminal; `cause` = the delegation's start.
    "x.hermes.delegation.stopped_late": SubagentStopped,
    "control.accepted": ControlAccepted,
    "control.rejected": ControlRejected,
    "control.attention.respond": ControlAttentionRespond,
    "x.hermes.control.instruct": HermesControlInstruct,
    "x.hermes.instruction.delivered": HermesInstructionDelivered,
    "x.hermes.instruction.dropped": HermesInstructionDropped,
}


# ---------------------------------------------------------------- the envelope


class Event(Struct, omit_defaults=True, kw_only=True):
    """One AEP 0.1 event (AEP-0001 §5). Field order is the wire order.

    `lane` and `drift` are extension attributes (lowercase alphanumeric, scalar):
    `lane: "unknown"` marks events filed under the unknown lane, `drift` carries
    the `telemetry_schema_version` seen when it is not the pinned one
    (`"missing"` when absent).
    """

    aep: Literal["0.1"]
    id: NonEmpty
    type: Annotated[str, Meta(pattern=TYPE_PATTERN)]
    time: Annotated[str, Meta(extra_json_schema={"format": "date-time"})]
    source: Annotated[str, Meta(min_length=1, extra_json_schema={"format": "uri"})]
    agent: NonEmpty
    session: NonEmpty | UnsetType = UNSET
    run: NonEmpty | UnsetType = UNSET
    step: NonEmpty | UnsetType = UNSET
    seq: Annotated[int, Meta(ge=0)] | UnsetType = UNSET
    epoch: Annotated[int, Meta(ge=0)] | UnsetType = UNSET
    subject: NonEmpty | UnsetType = UNSET
    cause: NonEmpty | UnsetType = UNSET
    traceparent: Annotated[str, Meta(pattern=r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")] | UnsetType = UNSET
    severity: Severity | UnsetType = UNSET
    capture: Level | UnsetType = UNSET
    data: dict[str, Any] | UnsetType = UNSET
    lane: Literal["unknown"] | UnsetType = UNSET
    drift: str | UnsetType = UNSET


# AEP-0001 §5.2 requiredness that a struct cannot express: agent.* events carry no
# session/run/step/seq; commands and attention.routed carry session but no seq;
# every other event requires session and seq.
EVENT_SCHEMA_EXTRA: dict[str, Any] = {
    "allOf": [
        {
            "if": {"properties": {"type": {"pattern": r"^agent\."}}, "required": ["type"]},
            "then": {"properties": {"session": False, "run": False, "step": False, "seq": False}},
            "else": {
                "if": {
                    "properties": {
                        "type": {
                            "pattern": r"^(control\.attention\.respond|control\.cancel|control\.pause"
                            r"|control\.resume|x\.[a-z0-9_-]+\.control\..+|attention\.routed)$"
                        }
                    },
                    "required": ["type"],
                },
                "then": {"required": ["session"], "properties": {"seq": False}},
                "else": {"required": ["session", "seq"]},
            },
        }
    ]
}

_event_encoder = msgspec.json.Encoder()
_event_decoder = msgspec.json.Decoder(Event)


def encode_event(event: Event) -> bytes:
    return _event_encoder.encode(event)


def decode_event(data: bytes | str) -> Event:
    return _event_decoder.decode(data)


def payload_to_data(payload: _Payload) -> dict[str, Any]:
    return msgspec.to_builtins(payload)  # type: ignore[no-any-return]
