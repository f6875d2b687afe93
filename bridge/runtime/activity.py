"""What the fleet does and spends, as Prometheus metrics (issue 40): model calls, their tokens,
duration and cost, tool calls, approvals and runs, counted from the AEP events published.

One call site: pairing's publish to AEP_EVENTS (`ActivityMetrics.seen`, once per event it
publishes), the one place every event of the stream passes, the run ends pairing closes
itself and the run totals it adds included. The counters are approximate the way Prometheus
counters are: an event published again (a pairing takeover replaying from its checkpoint, a
batch retried after a lost ack; JetStream drops the copy on the stream) is counted again,
and a crash loses what the process counted since the last scrape. The exact figures are on
the stream: `aep-bridge usage` reads them.

Labels are bounded (no session, run or call id): `model` comes from the wire (the event's
`gen_ai.request.model`, else `gen_ai.response.model`, else ``unknown``), cut to
MODEL_LABEL_LEN characters; the first MAX_MODELS distinct models are their own series, the
rest ``other`` (so does a name with characters outside MODEL_SHAPE). `currency` is an
ISO 4217 code (at most 8, first come), `choice` an approval option (Hermes's four).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from bridge.runtime.labels import BoundedLabel

API_CALL = "x.hermes.api.call"
API_ERROR = "x.hermes.api.error"
MAX_MODELS = 50
MODEL_LABEL_LEN = 64
MODEL_SHAPE = r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,63}"

#: `gen_ai.usage.*` member -> the `kind` label.
TOKEN_KINDS = (
    ("gen_ai.usage.input_tokens", "input"),
    ("gen_ai.usage.output_tokens", "output"),
    ("gen_ai.usage.cache_read.input_tokens", "cache_read"),
    ("gen_ai.usage.cache_creation.input_tokens", "cache_write"),
    ("gen_ai.usage.reasoning.output_tokens", "reasoning"),
)
TOOL_OUTCOMES = {"tool.completed": "completed", "tool.failed": "failed", "tool.denied": "denied"}
RUN_OUTCOMES = {"run.finished": "finished", "run.cancelled": "cancelled", "run.failed": "failed"}
APPROVAL_CHOICES = ("once", "session", "always", "deny", "unknown")
WATCHED = frozenset((API_CALL, API_ERROR, "attention.answered", *TOOL_OUTCOMES, *RUN_OUTCOMES))

#: Seconds; a model call takes from well under a second to minutes.
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300)


def _count(value: Any) -> bool:
    """A number the metrics may add: an int or float >= 0 (never a bool), finite."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 2**53


class ActivityMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.tokens = Counter("aep_bridge_model_tokens_total", "Tokens the model calls reported, by model and kind "
                              "(input, output, cache_read, cache_write, reasoning)", ["model", "kind"], registry=registry)
        self.calls = Counter("aep_bridge_model_calls_total", "Model calls, by model and outcome (ok: x.hermes.api.call, "
                             "error: x.hermes.api.error)", ["model", "outcome"], registry=registry)
        self.duration = Histogram("aep_bridge_model_call_duration_seconds", "Duration of the model calls that answered "
                                  "(x.hermes.api.call duration_ms)", ["model"], buckets=DURATION_BUCKETS, registry=registry)
        self.cost = Counter("aep_bridge_model_cost_total", "Cost of the model calls the bridge computed from the operator's "
                            "price table, by model and currency", ["model", "currency"], registry=registry)
        self.tools = Counter("aep_bridge_tool_calls_total", "Tool calls ended, by outcome (completed, failed, denied)",
                             ["outcome"], registry=registry)
        self.approvals = Counter("aep_bridge_approvals_total", "Approvals answered, by choice (once, session, always, "
                                 "deny)", ["choice"], registry=registry)
        self.runs = Counter("aep_bridge_runs_total", "Runs ended, by outcome (finished, cancelled, failed)", ["outcome"],
                            registry=registry)
        self.model_label = BoundedLabel(known=("unknown",), cap=MAX_MODELS, shape=MODEL_SHAPE)
        self.currency_label = BoundedLabel(cap=8, shape=r"[A-Z]{3}")
        self.choice_label = BoundedLabel(known=APPROVAL_CHOICES)
        self._children: dict[tuple[Any, ...], Any] = {}

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:  # bounded: every label is
            child = self._children[key] = metric.labels(*labels)
        return child

    def model(self, data: dict[str, Any]) -> str:
        name = data.get("gen_ai.request.model")
        if not isinstance(name, str) or not name:
            name = data.get("gen_ai.response.model")
        if not isinstance(name, str) or not name:
            return "unknown"
        return self.model_label(name[:MODEL_LABEL_LEN])

    def seen(self, event: Any) -> None:
        """Count one published event (an `bridge.core.aep.Event`); most types cost one set look-up."""
        etype = event.type
        if etype not in WATCHED:
            return
        data = event.data if isinstance(event.data, dict) else {}
        if etype == API_CALL:
            model = self.model(data)
            self._child(self.calls, model, "ok").inc()
            for member, kind in TOKEN_KINDS:
                n = data.get(member)
                if _count(n) and n:
                    self._child(self.tokens, model, kind).inc(n)
            ms = data.get("duration_ms")
            if _count(ms):
                self._child(self.duration, model).observe(ms / 1000)
            cost = data.get("cost")
            if isinstance(cost, dict) and isinstance(cost.get("currency"), str) and _count(cost.get("total")):
                self._child(self.cost, model, self.currency_label(cost["currency"])).inc(cost["total"])
        elif etype == API_ERROR:
            self._child(self.calls, self.model(data), "error").inc()
        elif etype in TOOL_OUTCOMES:
            self._child(self.tools, TOOL_OUTCOMES[etype]).inc()
        elif etype in RUN_OUTCOMES:
            self._child(self.runs, RUN_OUTCOMES[etype]).inc()
        else:  # attention.answered: an approval carries its option; a form's answer (values) is no approval
            answer = data.get("answer")
            option = answer.get("option") if isinstance(answer, dict) else None
            if isinstance(option, str):
                self._child(self.approvals, self.choice_label(option)).inc()
