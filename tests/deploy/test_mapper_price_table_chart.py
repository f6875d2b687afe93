"""The chart's price table (mapper.priceTable, issue 40): inline in the values, rendered into a
ConfigMap, mounted read-only into the mapper and named by AEP_BRIDGE_PRICE_TABLE, as the
exporter's sinks file is; the rendered file is one the mapper itself accepts, with the values'
prices exactly."""

from __future__ import annotations

import copy
from decimal import Decimal
from pathlib import Path

from bridge.config import load_price_table
from tests.support.chart import (
    ci_values,
    documented_variables,
    env_entries,
    pod_spec,
    render_manifests,
    select,
    validate_manifest,
    workload,
)

TABLE = {"currency": "EUR", "models": {
    "fake-model": {"input": 2.5, "output": 10, "cache_read": 1.25, "cache_write": 3.75, "reasoning": 10},
    "big-model": {"input": 1000000, "output": "0.000001"},  # a quoted price stays exactly as written
}}


def _prices_maps(manifests: list[dict]) -> list[dict]:
    return [m for m in select(manifests, "ConfigMap", "mapper")]


def test_no_price_table_by_default() -> None:
    manifests = render_manifests()
    assert "AEP_BRIDGE_PRICE_TABLE" not in env_entries(workload(manifests, "mapper"), "mapper")
    assert not _prices_maps(manifests)


def test_the_values_price_table_reaches_the_mapper_exactly(tmp_path: Path) -> None:
    values = copy.deepcopy(ci_values("monitoring"))
    values.setdefault("mapper", {})["priceTable"] = TABLE
    values["podAnnotations"] = {"team": "agents"}
    manifests = render_manifests(values)
    assert [p for m in manifests for p in validate_manifest(m)] == []

    deployment = workload(manifests, "mapper")
    spec = pod_spec(deployment)
    (container,) = spec["containers"]
    env = env_entries(deployment, "mapper")
    assert "AEP_BRIDGE_PRICE_TABLE" in documented_variables()
    path = Path(env["AEP_BRIDGE_PRICE_TABLE"]["value"])
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == str(path.parent)]
    assert mount["readOnly"] is True
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    (cm,) = _prices_maps(manifests)
    assert volume["configMap"]["name"] == cm["metadata"]["name"]
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["team"] == "agents" and annotations["checksum/prices"]  # a new table rolls the pods

    copied = tmp_path / path.name
    copied.write_text(cm["data"][path.name])
    table = load_price_table(str(copied))  # what the mapper reads at start
    assert table.currency == "EUR"
    fake, big = table.prices("fake-model"), table.prices("big-model")
    assert (fake.input, fake.output, fake.cache_read, fake.cache_write, fake.reasoning) == (
        Decimal("2.5"), Decimal(10), Decimal("1.25"), Decimal("3.75"), Decimal(10))
    assert big.input == Decimal(1000000) and big.output == Decimal("0.000001")

    other = copy.deepcopy(values)
    other["mapper"]["priceTable"]["models"]["fake-model"]["input"] = 3
    changed = workload(render_manifests(other), "mapper")["spec"]["template"]["metadata"]["annotations"]
    assert changed["checksum/prices"] != annotations["checksum/prices"]
