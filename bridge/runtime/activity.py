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

The figures are plain numbers in dicts, turned into metric families only when scraped
(`collect`): a model call touches eight series; as prometheus-client counters and a
histogram that cost 18.6 us an `x.hermes.api.call`, as this 7.5 us (timeit, 200,000 calls,
a shared 2-core machine, 2026-12-07; 0.1 us for a type not counted, most of the stream).
A scrape (the metrics port's thread) reads copies made under the GIL.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

from bridge.core.aep import API_CALL_TYPE as API_CALL, API_ERROR_TYPE as API_ERROR
from bridge.runtime.labels import BoundedLabel

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
_BOUNDS = (*(float(b) for b in DURATION_BUCKETS), float("inf"))

#: name, help, labels of each counter (`_total` is added on the wire).
COUNTERS = {
    "tokens": ("aep_bridge_model_tokens", "Tokens the model calls reported, by model and kind "
               "(input, output, cache_read, cache_write, reasoning)", ("model", "kind")),
    "calls": ("aep_bridge_model_calls", "Model calls, by model and outcome (ok: x.hermes.api.call, "
              "error: x.hermes.api.error)", ("model", "outcome")),
    "cost": ("aep_bridge_model_cost", "Cost of the model calls the bridge computed from the operator's price table, "
             "by model and currency", ("model", "currency")),
    "tools": ("aep_bridge_tool_calls", "Tool calls ended, by outcome (completed, failed, denied)", ("outcome",)),
    "approvals": ("aep_bridge_approvals", "Approvals answered, by choice (once, session, always, deny)", ("choice",)),
    "runs": ("aep_bridge_runs", "Runs ended, by outcome (finished, cancelled, failed)", ("outcome",)),
}
DURATION = ("aep_bridge_model_call_duration_seconds", "Duration of the model calls that answered "
            "(x.hermes.api.call duration_ms)", ("model",))


def _count(value: Any) -> bool:
    """A number the metrics may add: an int or float >= 0 (never a bool), finite."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 2**53


class _Duration:
    __slots__ = ("buckets", "sum")

    def __init__(self) -> None:
        self.buckets = [0] * len(_BOUNDS)  # per bucket, not cumulative
        self.sum = 0.0


class ActivityMetrics:
    """Registered on ``registry`` as a collector; `seen` is the one entry point."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.values: dict[str, dict[tuple[str, ...], float]] = {name: {} for name in COUNTERS}
        self.durations: dict[str, _Duration] = {}
        #: model label -> the series keys of a call of it: (calls ok, ((member, tokens key), ...))
        self._call_keys: dict[str, tuple[tuple[str, str], tuple[tuple[str, tuple[str, str]], ...]]] = {}
        self.model_label = BoundedLabel(known=("unknown",), cap=MAX_MODELS, shape=MODEL_SHAPE)
        self.currency_label = BoundedLabel(cap=8, shape=r"[A-Z]{3}")
        self.choice_label = BoundedLabel(known=APPROVAL_CHOICES)
        if registry is not None:
            registry.register(self)

    # ------------------------------------------------------------ counting (the event loop)

    def model(self, data: dict[str, Any]) -> str:
        name = data.get("gen_ai.request.model")
        if not isinstance(name, str) or not name:
            name = data.get("gen_ai.response.model")
        if not isinstance(name, str) or not name:
            return "unknown"
        return self.model_label(name[:MODEL_LABEL_LEN])

    @staticmethod
    def _add(series: dict[tuple[str, ...], float], key: tuple[str, ...], n: float = 1) -> None:
        series[key] = series.get(key, 0) + n

    def seen(self, event: Any) -> None:
        """Count one published event (a `bridge.core.aep.Event`); most types cost one set look-up."""
        etype = event.type
        if etype not in WATCHED:
            return
        data = event.data if isinstance(event.data, dict) else {}
        add, values = self._add, self.values
        if etype == API_CALL:
            model = self.model(data)
            keys = self._call_keys.get(model)
            if keys is None:  # one entry per model label: bounded like the labels (MAX_MODELS + 2)
                keys = self._call_keys[model] = ((model, "ok"), tuple((m, (model, kind)) for m, kind in TOKEN_KINDS))
            ok, token_keys = keys
            calls = values["calls"]
            calls[ok] = calls.get(ok, 0) + 1
            tokens = values["tokens"]
            for member, key in token_keys:  # the label tuples made once per model, not per call
                n = data.get(member)
                if n and _count(n):
                    tokens[key] = tokens.get(key, 0) + n
            ms = data.get("duration_ms")
            if _count(ms):
                d = self.durations.get(model)
                if d is None:
                    d = self.durations[model] = _Duration()
                seconds = ms / 1000
                d.buckets[bisect_left(_BOUNDS, seconds)] += 1  # the first bound >= the value: prometheus-client's bucket
                d.sum += seconds
            cost = data.get("cost")
            if isinstance(cost, dict) and isinstance(cost.get("currency"), str) and _count(cost.get("total")):
                add(values["cost"], (model, self.currency_label(cost["currency"])), cost["total"])
        elif etype == API_ERROR:
            add(values["calls"], (self.model(data), "error"))
        elif etype in TOOL_OUTCOMES:
            add(values["tools"], (TOOL_OUTCOMES[etype],))
        elif etype in RUN_OUTCOMES:
            add(values["runs"], (RUN_OUTCOMES[etype],))
        else:  # attention.answered: an approval carries its option; a form's answer (values) is no approval
            answer = data.get("answer")
            option = answer.get("option") if isinstance(answer, dict) else None
            if isinstance(option, str):
                add(values["approvals"], (self.choice_label(option),))

    # ------------------------------------------------------------ the scrape (the metrics port's thread)

    def describe(self) -> Iterator[Metric]:
        for name, doc, labels in COUNTERS.values():
            yield CounterMetricFamily(name, doc, labels=labels)
        yield HistogramMetricFamily(DURATION[0], DURATION[1], labels=DURATION[2])

    def collect(self) -> Iterator[Metric]:
        for key, (name, doc, labels) in COUNTERS.items():
            family = CounterMetricFamily(name, doc, labels=labels)
            for label_values, value in dict(self.values[key]).items():  # a copy: dict() of a dict holds the GIL
                family.add_metric(list(label_values), value)
            yield family
        family = HistogramMetricFamily(DURATION[0], DURATION[1], labels=DURATION[2])
        for model, d in dict(self.durations).items():
            counts, total = list(d.buckets), d.sum
            cumulative, running = [], 0
            for bound, n in zip(_BOUNDS, counts):
                running += n
                cumulative.append(("+Inf" if bound == float("inf") else repr(bound), running))
            family.add_metric([model], cumulative, total)
        yield family
