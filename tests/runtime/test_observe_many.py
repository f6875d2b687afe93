"""`observe_many`: a batch's values into a histogram at once give the samples that many
`observe` calls give (bucket edges included); a histogram laid out otherwise gets `observe`."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram

from bridge.runtime import observe_many

BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3, 0.025)


def samples(h: Histogram) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for m in h.collect() for s in m.samples
            if not s.name.endswith("_created")}


def test_observe_many_is_observe_per_value_edges_and_overflow_included():
    rng = random.Random(7)
    values = [rng.choice([0.0, *BUCKETS, 0.03, 7.0]) for _ in range(200)] + [rng.random() / 100 for _ in range(300)]
    one, many = (Histogram(name, "h", buckets=BUCKETS, registry=CollectorRegistry()) for name in ("one", "many"))
    for v in values:
        one.observe(v)
    observe_many(many, values[:250])
    observe_many(many, values[250:])
    observe_many(many, [])
    a = {(k[0].replace("one", ""), k[1]): v for k, v in samples(one).items()}
    b = {(k[0].replace("many", ""), k[1]): v for k, v in samples(many).items()}
    assert a.pop(("_sum", ())) == pytest.approx(b.pop(("_sum", ())), rel=1e-12)  # (summed in another order)
    assert a == b
    assert len(b) == len(BUCKETS) + 2 and b[("_count", ())] == len(values) and b[("_bucket", (("le", "1e-05"),))] == values.count(0.0) + values.count(1e-5) \
        + sum(1 for v in values[200:] if v <= 1e-5)


def test_a_histogram_laid_out_otherwise_gets_observe_per_value():
    class Plain:
        def __init__(self) -> None:
            self.seen: list[float] = []

        def observe(self, v: float) -> None:
            self.seen.append(v)

    h = Plain()
    observe_many(h, [0.1, 0.2, 0.1])
    assert h.seen == [0.1, 0.2, 0.1]
