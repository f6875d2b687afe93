"""The Hermes mapping (AEP-0002 Annex A §A.10), as a table keyed by hook name.

``map_envelope`` turns ONE Hermes envelope into a list of AEP events. It is pure:
lane knowledge comes in through a `LaneLookup`, identity through an `Origin`,
and what the lane table should learn goes back out in the result.

The table (``HOOKS``) maps a hook name to a builder that returns
``[(type, payload, subject)]``; ``post_tool_call`` dispatches again on its
``status`` (``POST_TOOL_STATUS``). One visible exception sits on top: the
clarify FORM overlay (``_clarify_pre`` / ``_clarify_post``), which adds attention
events beside the pinned tool events of the ``clarify`` tool. Hooks not in the
table fall back to ``x.hermes.<name with _ as .>`` with an empty payload.

Beyond the upstream pins, real Hermes sends (HERMES.md) and we map:
* ``post_tool_call`` status ``cancelled`` / ``timeout`` -> ``tool.failed`` whose
  ``error.type`` keeps the vendor ``error_type`` (``keyboard_interrupt``,
  ``tool_timeout``), severity ``warning``; an unknown status -> ``tool.failed``
  with ``error.type`` = ``status:<value>``.
* approval ``choice: "deny"`` stays ``deny`` even when the CLI meant a timeout.
* ``on_session_end`` without a ``turn_id`` -> ``run.finished``/``run.cancelled``
  with no ``run``; the pairing stage attaches it to the session's open run.
* ``on_session_end`` neither completed nor interrupted -> ``run.failed
  {reason: "incomplete"}``.
* a missing or unexpected ``telemetry_schema_version`` is mapped as usual and
  every event of it carries the extension attribute ``drift`` (the drift sentinel).

Capture: each builder receives a `Ceiling` (`bridge.core.ceiling`) for the event type it builds and adds a
field only when the ceiling admits it (free text through `bridge.core.redaction`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable

import msgspec
from msgspec import UNSET

from bridge.core import aep
from bridge.core.ceiling import FULL, LEVELS, NONE, REDACTED, CapturePolicy, Ceiling, strip_to_required
from bridge.core.digest import digest
from bridge.core.envelope import EnvelopeError, HermesEnvelope
from bridge.core.identity import MAPPED_SLOT, MAX_MAPPED, Origin, rfc3339, source_uri
from bridge.core.lanes import UNKNOWN, LaneLookup, Learned, lane_of, learned_from
from bridge.core.pricing import COST_NANOS_MAX, NANOS, TOKEN_MAX, PriceTable, cost_nanos

Spec = tuple[str, aep._Payload, str | None]  # (type, payload, subject)
Builder = Callable[[HermesEnvelope, "Ctx"], list[Spec]]


@dataclass
class Ctx:
    policy: CapturePolicy
    #: the operator's price table (AEP_BRIDGE_PRICE_TABLE); None: no ``cost`` anywhere
    prices: PriceTable | None = None
    #: what the builders left out (field names, ``INVALID_FIELDS``) and the models the table
    #: lacks: the mapper counts them (aep_bridge_usage_invalid_total, _model_unpriced_total)
    invalid: list[str] | None = None
    unpriced: list[str] | None = None

    def ceiling(self, event_type: str) -> Ceiling:
        return Ceiling(self.policy.ceiling(event_type), self.policy)

    def bad(self, name: str) -> None:
        if self.invalid is None:
            self.invalid = []
        self.invalid.append(name)


# ---------------------------------------------------------------- small readers


INT64_MAX = 2**63 - 1


def _int(value: Any) -> int | Any:
    """A count, size or duration from the wire: a non-negative integer that every later
    stage can hold (int64: checkpoints, OTLP, OCSF), else UNSET (NaN, infinities, 2**64...)."""
    if isinstance(value, bool):
        return UNSET
    if isinstance(value, int) and 0 <= value <= INT64_MAX:
        return value
    if isinstance(value, float) and 0 <= value <= INT64_MAX:  # NaN compares False
        return int(value)
    return UNSET


#: the largest count a JSON number holds exactly (and every later stage: OTLP, checkpoints)
COUNT_MAX = 2**53


def _count(value: Any, most: int = COUNT_MAX) -> int | Any:
    """A token count (``most`` = `TOKEN_MAX`) or call number from Hermes: an integer (or an
    integral float) in 0..most, else UNSET (negative, fractional, bool, string, NaN, huge, missing)."""
    if isinstance(value, bool):
        return UNSET
    if isinstance(value, int):
        return value if 0 <= value <= most else UNSET
    if isinstance(value, float) and value.is_integer() and 0 <= value <= most:  # NaN/inf: not integer
        return int(value)
    return UNSET


def _seconds_ms(value: Any) -> int | Any:
    """``api_duration`` (seconds, a float) in whole ms, else UNSET."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return UNSET
    if not (0 <= value <= COUNT_MAX / 1000):  # NaN compares False
        return UNSET
    return round(value * 1000)


def _str(value: Any) -> str | Any:
    return value if isinstance(value, str) and value else UNSET


def _tool(env: HermesEnvelope) -> aep.ToolRef:
    return aep.ToolRef(name=env.tool_name or "unknown", call_id=_str(env.x("tool_call_id")))


# ---------------------------------------------------------------- session, run


def _session_start(env: HermesEnvelope, ctx: Ctx) -> list[Spec]:
    g = ctx.ceiling("session.started")
    payload = aep.SessionStarted(client=aep.Client(name="hermes"), cwd=g.text(env.cwd or None))
    return [("session.started", payload, None)]


def _session_finalize(env: HermesEnvelope, ctx: Ctx) -> list[Spec]:
    return [("session.ended", aep.SessionEnded(reason="normal"), None)]


def _session_reset(env: HermesEnvelope, ctx: Ctx) -> list[Spec]:
    payload = aep.HermesSessionReset(reason=_str(env.x("reason")), previous_session=_str(env.x("old_session_id")))
    return [("x.hermes.session.reset", payload, None)]


def _run_start(env: HermesEnvelope, ctx: Ctx) -> list[Spec]:
    g = ctx.ceiling("run.started")
    message = env.x("user_message")
    payload = aep.RunStarted(
        trigger="user",
        message_digest=digest(message) if message is not None else UNSET,
        prompt=g.text(message if isinstance(message, str) else None),
    )
    return [("run.started", payload, None)]


def _run_end(env: HermesEnvelope, ctx: Ctx) -> list[Spec]:
    if env.x("interrupted") is True:
        return [("run.cancelled", aep.RunCancelled(by="user"), None)]
    if env.x("completed") is False:
        return [("run.failed", aep.RunFailed(reason="incomplete"), None)]
    return [("run.finished", aep.RunFinished(), None)]


# ---------------------------------------------------------------- tools


def _tool_pre(env: HermesEnvelope, ctx: Ctx) -> list[Spec]:
    g = ctx.ceiling("tool.requested")
    args = env.tool_input if env.tool_input is not None else {}
    payload = aep.ToolRequested(
        tool=_tool(env),
        args_digest=digest(args),
        args_redacted=g.text(args) if g.level == REDACTED else UNSET,
        args=args if g.admits(FULL) else UNSET,
    )
    specs: list[Spec] = [("tool.requested", payload, env.tool_name or None)]
    if env.tool_name == "clarify":
        specs += _clarify_pre(env, ctx)
    return specs


def _result_fields(env: HermesEnvelope, g: Ceiling) -> dict[str, Any]:
    result = env.x("result")
    if result is None:
        return {}
    return {
        "result_digest": digest(result),
        "result_redacted": g.text(result) if g.level == REDACTED else UNSET,
        "result": result if g.admits(FULL) else UNSET,
    }


def _post_ok(env: HermesEnvelope, ctx: Ctx) -> list[Spec]:
    g = ctx.ceiling("tool.completed")
    payload = aep.ToolCompleted(tool=_tool(env), duration_ms=_int(env.x("duration_ms")), **_result_fields(env, g))
    return [("tool.completed", payload, env.tool_name or None)]


def _post_error(env: HermesEnvelope, ctx: Ctx, error_type: str | None = None) -> list[Spec]:
    g = ctx.ceiling("tool.failed")
    error = aep.ErrorInfo(
        type=error_type or _str(env.x("error_type")) or "error",
        message=g.text(_str(env.x("error_message")) or None),
    )
    payload = aep.ToolFailed(tool=_tool(env), error=error, duration_ms=_int(env.x("duration_ms")))
    return [("tool.failed", payload, env.tool_name or None)]


def _post_blocked(env: HermesEnvelope, ctx: Ctx) -> list[Spec]:
    g = ctx.ceiling("tool.denied")
    payload = aep.ToolDenied(
        tool=_tool(env),
        by="policy",
        duration_ms=_int(env.x("duration_ms")),
        rule=g.text(_str(env.x("error_message")) or None),
    )
    return [("tool.denied", payload, env.tool_name or None)]


def _post_cancelled(env: HermesEnvelope, ctx: Ctx) -> list[Spec]:
    return _post_error(env, ctx, _str(env.x("error_type")) or "cancelled")


def _post_timeout(env: HermesEnvelope, ctx: Ctx) -> list[Spec]:
    return _post_error(env, ctx, _str(env.x("error_type")) or "timeout")


POST_TOOL_STATUS: dict[str, Builder] = {
    "ok": _post_ok,
    "error": _post_error,
    "blocked": _post_blocked,
    "cancelled": _post_cancelled,
    "timeout": _post_timeout,
}
#: statuses real Hermes sends that the upstream pins do not cover; their events are warnings.
WARNING_STATUSES = frozenset({"cancelled", "timeout"})


def _tool_post(env: HermesEnvelope, ctx: Ctx) -> list[Spec]:
    status = env.x("status")
    builder = POST_TOOL_STATUS.get(status) if isinstance(status, str) else None
    if builder is None:
        specs = _post_error(env, ctx, f"status:{status}")
    else:
        specs = builder(env, ctx)
    if env.tool_name == "clarify":
        specs += _clarify_post(env, ctx, status if isinstance(status, str) else "")
    return specs


# ---------------------------------------------------------------- approvals

APPROVAL_OPTIONS = (
    ("once", "Allow once"),
    ("session", "Allow for this session"),
    ("always", "Add to permanent allowlist"),
    ("deny", "Deny"),
)


def _approval_pre(env: HermesEnvelope, ctx: Ctx) -> list[Spec]:
    g = ctx.ceiling("attention.requested")
    pattern = env.xstr("pattern_key") or None
    command = env.x("command")
    if g.admits(REDACTED) and isinstance(command, str):
        prompt = "Approval requested: " + g.text(command)
    else:
        prompt = f"hermes requests permission: {pattern}" if pattern else "hermes requests permission"
    payload = aep.AttentionRequested(
        kind="permission",
        prompt=prompt,
        options=[aep.Option(id=i, label=label) for i, label in APPROVAL_OPTIONS],
        respond_via=["oob"],
    )
    return [("attention.requested", payload, pattern)]


def _approval_post(env: HermesEnvelope, ctx: Ctx) -> list[Spec]:
    pattern = env.xstr("pattern_key") or None
    choice = env.x("choice")
    if choice == "timeout":
        return [("attention.timeout", aep.AttentionTimeout(), pattern)]
    option = choice if isinstance(choice, str) and choice else "unknown"
    payload = aep.AttentionAnswered(answer=aep.Answer(option=option), via="oob")
    return [("attention.answered", payload, pattern)]


# ---------------------------------------------------------------- clarify: the form overlay

MAX_CHOICES = 4  # Hermes's tools/clarify_tool.py MAX_CHOICES
CLI_TIMEOUT = "The user did not provide a response within the time limit. Use your best judgement to make the choice and proceed."
CLI_CANCEL = "The user cancelled. Use your best judgement to proceed."
GATEWAY_UNDELIVERABLE = "[clarify prompt could not be delivered]"
GATEWAY_TIMEOUT = re.compile(r"^\[user did not respond within \d+m\]$")


def flatten_choice(c: Any) -> str:
    """Hermes's own ``_flatten_choice``: unwrap label/description/text/title, trim, drop junk."""
    if c is None:
        return ""
    if isinstance(c, str):
        return c.strip()
    if isinstance(c, dict):
        for key in ("label", "description", "text", "title"):
            v = c.get(key)
            if isinstance(v, str) and v.strip():
                return v.strip()
        return ""
    if isinstance(c, (list, tuple)):
        return " ".join(flatten_choice(x) for x in c).strip()
    return str(c).strip()


def clarify_card(args: dict[str, Any] | None) -> tuple[str, list[str] | None] | None:
    """(question, choices or None) as Hermes would ask it, or None when no question is asked."""
    if not args:
        return None
    question = args.get("question")
    if not isinstance(question, str) or not question.strip():
        return None
    choices = args.get("choices")
    if choices is None:
        return question.strip(), None
    if not isinstance(choices, list):
        return None  # Hermes answers with a tool error and never asks
    flat = [s for s in (flatten_choice(c) for c in choices) if s][:MAX_CHOICES]
    return question.strip(), (flat or None)


def _clarify_pre(env: HermesEnvelope, ctx: Ctx) -> list[Spec]:
    card = clarify_card(env.tool_input)
    if card is None:
        return []
    question, choices = card
    g = ctx.ceiling("attention.requested")
    real = g.admits(REDACTED)
    label = g.text(question) if real else "question 1"
    if choices:
        spec = aep.FieldSpec(
            id="1",
            type="select",
            label=label,
            required=True,
            other=True,
            choices=[
                aep.Choice(id=str(i), label=g.text(c) if real else str(i)) for i, c in enumerate(choices, start=1)
            ],
        )
    else:
        spec = aep.FieldSpec(id="1", type="string", label=label, required=True)
    payload = aep.AttentionRequested(kind="form", prompt="hermes asks a question", fields=[spec], respond_via=["oob"])
    return [("attention.requested", payload, _str(env.x("tool_call_id")) or None)]


def _clarify_response(result: Any) -> tuple[str | None, list[str] | None]:
    """(user_response, choices_offered) from the clarify tool's JSON result string."""
    if isinstance(result, str):
        try:
            result = msgspec.json.decode(result)
        except msgspec.DecodeError:
            return None, None
    if not isinstance(result, dict) or "error" in result:
        return None, None
    response = result.get("user_response")
    offered = result.get("choices_offered")
    return (response if isinstance(response, str) else None), (offered if isinstance(offered, list) else None)


def _clarify_post(env: HermesEnvelope, ctx: Ctx, status: str) -> list[Spec]:
    subject = _str(env.x("tool_call_id")) or None
    if env.tool_input is not None and clarify_card(env.tool_input) is None:
        return []  # no card was raised for this call, so there is nothing to close
    if status == "timeout":
        return [("attention.timeout", aep.AttentionTimeout(), subject)]
    if status != "ok":
        return [("attention.resolved", aep.AttentionResolved(resolution="dismissed"), subject)]
    response, offered = _clarify_response(env.x("result"))
    if response is None or not response.strip():
        return [("attention.resolved", aep.AttentionResolved(resolution="dismissed"), subject)]
    response = response.strip()
    if response == CLI_TIMEOUT or GATEWAY_TIMEOUT.match(response):
        return [("attention.timeout", aep.AttentionTimeout(), subject)]
    if response in (CLI_CANCEL, GATEWAY_UNDELIVERABLE):
        return [("attention.resolved", aep.AttentionResolved(resolution="dismissed"), subject)]
    if offered and response in offered:
        values = {"1": str(offered.index(response) + 1)}  # a closed choice: structural
    else:
        g = ctx.ceiling("attention.answered")
        text = g.text(response)  # free text ("Other"): redacted-gated
        values = {"1": text} if text is not UNSET else UNSET
    return [("attention.answered", aep.AttentionAnswered(answer=aep.Answer(values=values), via="oob"), subject)]


# ---------------------------------------------------------------- subagents, API errors


def _child(env: HermesEnvelope) -> aep.SessionRef:
    return aep.SessionRef(session=_str(env.x("child_session_id")))


def _subagent_start(env: HermesEnvelope, ctx: Ctx) -> list[Spec]:
    g = ctx.ceiling("delegation.subagent.started")
    payload = aep.SubagentStarted(
        child=_child(env), role=_str(env.x("child_role")), goal=g.text(_str(env.x("child_goal")) or None)
    )
    return [("delegation.subagent.started", payload, _str(env.x("child_session_id")) or None)]


def _subagent_stop(env: HermesEnvelope, ctx: Ctx) -> list[Spec]:
    g = ctx.ceiling("delegation.subagent.stopped")
    payload = aep.SubagentStopped(
        child=_child(env),
        status=_str(env.x("child_status")),
        duration_ms=_int(env.x("duration_ms")),
        summary=g.text(_str(env.x("child_summary")) or None),
    )
    return [("delegation.subagent.stopped", payload, _str(env.x("child_session_id")) or None)]


def _duration(env: HermesEnvelope, ctx: Ctx) -> int | Any:
    raw = env.x("api_duration")
    ms = _seconds_ms(raw)
    if ms is UNSET and (raw is not None or env.hook_event_name == "post_api_request"):
        ctx.bad("api_duration")
    return ms


def _api_error(env: HermesEnvelope, ctx: Ctx) -> list[Spec]:
    g = ctx.ceiling("x.hermes.api.error")
    error = env.x("error")
    error = error if isinstance(error, dict) else {}
    payload = aep.HermesApiError(
        status_code=_int(env.x("status_code")),
        retry_count=_int(env.x("retry_count")),
        reason=_str(env.x("reason")),
        message=g.text(_str(error.get("message")) or None),
        request_model=_str(env.x("model")),
        provider=_str(env.x("provider")),
        duration_ms=_duration(env, ctx),
    )
    return [("x.hermes.api.error", payload, None)]


# ---------------------------------------------------------------- model calls (issue 40)

API_CALL_TYPE = aep.API_CALL_TYPE
#: the Hermes usage buckets (``usage.<name>``) and the price-table key each is priced by
USAGE_BUCKETS = (("input_tokens", "input"), ("output_tokens", "output"), ("cache_read_tokens", "cache_read"),
                 ("cache_write_tokens", "cache_write"), ("reasoning_tokens", "reasoning"))
#: every value `aep_bridge_usage_invalid_total{field}` can name (a bounded label set)
INVALID_FIELDS = ("usage", *(name for name, _ in USAGE_BUCKETS), "api_duration", "api_call_count", "cost")


def _api_call(env: HermesEnvelope, ctx: Ctx) -> list[Spec]:
    """``post_api_request`` -> ``x.hermes.api.call``: metadata only (never the response, the
    messages or the request; ``base_url`` is not carried). A bad number is left out and counted."""
    usage = env.x("usage")
    counts: dict[str, int] = {}
    bad = False
    if isinstance(usage, dict):
        for name, _ in USAGE_BUCKETS:
            # input and output are always reported; a provider without cache or reasoning
            # buckets may leave those out (not reported: not counted, priced as 0)
            if name not in usage and name not in ("input_tokens", "output_tokens"):
                continue
            value = _count(usage.get(name), TOKEN_MAX)
            if value is UNSET:
                ctx.bad(name)
                bad = True
            else:
                counts[name] = value
    else:
        ctx.bad("usage")
        bad = True
    call_index = _count(env.x("api_call_count"))
    if call_index is UNSET or call_index < 1:
        ctx.bad("api_call_count")
        call_index = UNSET
    model = _str(env.x("model"))
    response_model = _str(env.x("response_model"))
    cost: Any = UNSET
    if ctx.prices is not None:
        prices = ctx.prices.prices(model) if model else None
        if prices is None and response_model:
            prices = ctx.prices.prices(response_model)
        if prices is None:
            if ctx.unpriced is None:
                ctx.unpriced = []
            ctx.unpriced.append(model or response_model or "unknown")
        elif not bad:  # never the cost of a partial count
            n = cost_nanos(prices, {key: counts.get(name, 0) for name, key in USAGE_BUCKETS})
            if n["total"] > COST_NANOS_MAX:  # a cost no sum downstream could hold: left out, counted
                ctx.bad("cost")
            else:
                cost = aep.Cost(currency=ctx.prices.currency, total=n["total"] / NANOS, prompt=n["prompt"] / NANOS,
                                completion=n["completion"] / NANOS, cache=n["cache"] / NANOS,
                                reasoning=n["reasoning"] / NANOS)
    payload = aep.HermesApiCall(
        request_model=model,
        response_model=response_model,
        provider=_str(env.x("provider")),
        api_mode=_str(env.x("api_mode")),
        duration_ms=_duration(env, ctx),
        finish_reason=_str(env.x("finish_reason")),
        call_index=call_index,
        cost=cost,
        **counts,
    )
    return [(API_CALL_TYPE, payload, None)]


# ---------------------------------------------------------------- the table

HOOKS: dict[str, Builder] = {
    "on_session_start": _session_start,
    "pre_llm_call": _run_start,
    "pre_tool_call": _tool_pre,
    "post_tool_call": _tool_post,
    "pre_approval_request": _approval_pre,
    "post_approval_response": _approval_post,
    "on_session_end": _run_end,
    "on_session_finalize": _session_finalize,
    "on_session_reset": _session_reset,
    "subagent_start": _subagent_start,
    "subagent_stop": _subagent_stop,
    "api_request_error": _api_error,
    "post_api_request": _api_call,
}

ERROR_TYPES = frozenset({"x.hermes.api.error"})


# An event type is at most this long (AEP sets no limit; ours keeps subjects, metric labels
# and consumers' indexes bounded). Every type the tables make is far shorter; only the
# fallback of a hook name nobody knows can reach it.
TYPE_MAX_CHARS = 128
_TYPE_RE = re.compile(aep.TYPE_PATTERN)


# Cached: the hooks the tables do not name are a handful of names seen on every message of their
# kind (5 % of bench_mapping.py's time went to the regex and splits). What raises is not cached.
@lru_cache(maxsize=1024)
def fallback_type(hook: str) -> str:
    """``x.hermes.<name with _ as .>``, squeezed into the AEP type grammar.

    ``EnvelopeError('bad_hook')`` when the result would be longer than TYPE_MAX_CHARS
    (a hook name of thousands of ``a_`` would otherwise make a type of thousands of tokens)."""
    if len(hook) > TYPE_MAX_CHARS:
        raise EnvelopeError("bad_hook", f"hook_event_name of {len(hook)} characters (at most {TYPE_MAX_CHARS})")
    cleaned = re.sub(r"[^a-z0-9_]+", "_", hook.lower()).strip("_")
    parts = [p for p in cleaned.split("_") if p]
    if len(parts) < 2:
        parts = (parts or ["unnamed"]) + ["event"]
    event_type = "x.hermes." + ".".join(parts)
    if len(event_type) > TYPE_MAX_CHARS or not _TYPE_RE.match(event_type):
        raise EnvelopeError("bad_hook", f"no AEP type of at most {TYPE_MAX_CHARS} characters for this hook_event_name")
    return event_type


def valid_type(event_type: str) -> bool:
    """Does ``event_type`` obey the AEP type grammar (AEP-0001 §6) and our length cap?"""
    return len(event_type) <= TYPE_MAX_CHARS and _TYPE_RE.match(event_type) is not None


def _fallback(env: HermesEnvelope, ctx: Ctx) -> list[Spec]:
    return [(fallback_type(env.hook_event_name), aep.Empty(), None)]


# ---------------------------------------------------------------- the entry point


class MapResult(msgspec.Struct):
    lane: str  # the events' session (``UNKNOWN`` in the unknown lane, and for a real session named so)
    events: list[aep.Event]
    learned: Learned
    unknown: bool = False  # filed under the unknown lane (token ``_unknown``, attribute ``lane``)
    drift: str | None = None
    problems: list[str] = msgspec.field(default_factory=list)
    #: Pairing keys that the AEP events themselves do not carry (the mapper sends them to
    #: the pairing stage in the ``Bridge-Hints`` header): hook, receive time, and whichever
    #: of session_key / tool_call_id / task_id / args_digest the envelope has.
    hints: dict[str, Any] = msgspec.field(default_factory=dict)
    #: issue 40: the numbers left out (``INVALID_FIELDS``) and the models the price table lacks
    invalid: list[str] = msgspec.field(default_factory=list)
    unpriced: list[str] = msgspec.field(default_factory=list)


HINT_KEYS = ("session_key", "tool_call_id", "task_id", "pattern_key")  # the extra keys `pairing_hints` passes on


def pairing_hints(env: HermesEnvelope, ts_ns: int) -> dict[str, Any]:
    hints: dict[str, Any] = {"hook": env.hook_event_name, "ts": ts_ns}
    extra = env.extra
    for key in HINT_KEYS:
        value = extra.get(key)  # (env.xstr's test, inline: four calls a message)
        if value and isinstance(value, str):
            hints[key] = value
    if env.hook_event_name in ("pre_tool_call", "post_tool_call") and env.tool_input is not None and "tool_call_id" not in hints:
        # Only a call without a tool_call_id (inside execute_code) is paired by its arguments.
        hints["args_digest"] = digest(env.tool_input)
    return hints


def map_specs(env: HermesEnvelope, policy: CapturePolicy, prices: PriceTable | None = None,
              ctx: Ctx | None = None) -> list[Spec]:
    """The projection the Annex A fixture pins: ``[(type, payload, subject)]``."""
    builder = HOOKS.get(env.hook_event_name, _fallback)
    return builder(env, ctx or Ctx(policy, prices))


def map_envelope(env: HermesEnvelope, origin: Origin, lanes: LaneLookup, policy: CapturePolicy,
                 prices: PriceTable | None = None) -> MapResult:
    filed = lane_of(env, lanes)
    unknown = filed is None
    lane = UNKNOWN if filed is None else filed
    ctx = Ctx(policy, prices)
    specs = map_specs(env, policy, ctx=ctx)[:MAX_MAPPED]
    drift = env.drift
    run = env.xstr("turn_id") or (env.xstr("parent_turn_id") if env.hook_event_name.startswith("subagent_") else "")
    status = env.x("status") if env.hook_event_name == "post_tool_call" else None
    status = status if isinstance(status, str) else None
    time = rfc3339(origin.ts_ns)
    source = source_uri(origin.instance or "unknown", lane)
    events = []
    for i, (event_type, payload, subject) in enumerate(specs):
        slot = MAPPED_SLOT + i
        level = policy.ceiling(event_type)
        if level == NONE:
            payload = strip_to_required(payload)
        severity: Any = UNSET
        if event_type in ERROR_TYPES:
            severity = "error"
        elif status in WARNING_STATUSES and event_type.startswith("tool."):
            severity = "warning"
        events.append(
            aep.Event(
                aep="0.1",
                id=origin.id_for(slot),
                type=event_type,
                time=time,
                source=source,
                agent="hermes",
                session=lane,
                run=run or UNSET,
                seq=origin.seq_for(slot),
                epoch=origin.epoch,
                subject=subject or UNSET,
                severity=severity,
                capture=LEVELS[level],  # type: ignore[arg-type]
                data=aep.payload_to_data(payload),
                lane="unknown" if unknown else UNSET,
                drift=drift if drift is not None else UNSET,
            )
        )
    return MapResult(
        lane=lane,
        unknown=unknown,
        events=events,
        learned=learned_from(env),
        drift=drift,
        problems=list(env.problems),
        hints=pairing_hints(env, origin.ts_ns),
        invalid=ctx.invalid or [],
        unpriced=ctx.unpriced or [],
    )


__all__ = [
    "API_CALL_TYPE",
    "HOOKS",
    "INVALID_FIELDS",
    "MapResult",
    "POST_TOOL_STATUS",
    "clarify_card",
    "TYPE_MAX_CHARS",
    "fallback_type",
    "flatten_choice",
    "map_envelope",
    "map_specs",
    "valid_type",
]
