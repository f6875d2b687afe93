"""Check our production values against the official NATS chart itself (deploy/README.md,
"What is not validated here"). Not a test of the suite: the NATS chart cannot be fetched on the
machines that run it and no copy is committed, so this runs by hand where the chart is::

    helm pull nats --repo https://nats-io.github.io/k8s/helm/charts/ --version 2.14.2
    .venv/bin/python deploy/check_nats_chart.py nats-2.14.2.tgz     # or the chart's directory

It copies deploy/helm/aep-bridge with the NATS chart as its `charts/nats` (the version must be
the one Chart.yaml depends on), renders `values-production.yaml` plus the gate, relay and
exporter ci values, and checks: every object valid (kubernetes-validate --strict), a
StatefulSet of 3 with the required anti-affinity selecting its own pods, its PDB at
`maxUnavailable: 1`, routes between the same three pod names the services are given, our
`sync_interval` in its jetstream block, the deny lines of each exporter sink's durable
(rendered by its `$tplYamlSpread` from `global.aepBridge.exporterSinks`); and, with the default values, one server whose client
Service URL the services are given. Exit 0 when all hold, 1 with the first that does not.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tarfile
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import helm_python as helm  # noqa: E402 - after the checkout is on the path
import yaml  # noqa: E402

from tests.support.chart import (  # noqa: E402
    ALL_SERVICES, CHART_DIR, NAMESPACE, RELEASE, any_secrets, ours, production_with_everything, validate_manifest,
    workload_env,
)


class Failed(Exception):
    """A check that does not hold: what was expected and what the chart made."""


def require(ok: Any, what: str) -> None:
    if not ok:
        raise Failed(what)


def chart_with_nats(source: Path, work: Path) -> Path:
    """A copy of our chart with the NATS chart (a directory or a .tgz) as its dependency."""
    root = work / "aep-bridge"
    shutil.copytree(CHART_DIR, root)
    charts = root / "charts"
    charts.mkdir()
    if source.is_dir():
        shutil.copytree(source, charts / "nats")
    else:
        with tarfile.open(source) as tgz:
            tgz.extractall(charts, filter="data")
    with helm.Chart.load(CHART_DIR) as chart:
        (dep,) = chart.metadata["dependencies"]
    version = yaml.safe_load((charts / "nats" / "Chart.yaml").read_text())["version"]
    require(version == dep["version"], f"the NATS chart is {version}; Chart.yaml depends on {dep['version']}")
    return root


def render_with_nats(chart: Path, values: Mapping[str, Any]) -> list[dict[str, Any]]:
    with helm.Chart.load(chart) as loaded:
        rendered = loaded.render(dict(values), name=RELEASE, namespace=NAMESPACE, is_install=True)
    docs = []
    for path, text in sorted(rendered.items()):
        if path.endswith("NOTES.txt") or "/tests/" in path:
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def nats_objects(manifests: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [m for m in manifests if m["kind"] == kind
            and m["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "nats"]


def only(objects: list[dict[str, Any]], what: str) -> dict[str, Any]:
    require(len(objects) == 1, f"expected one {what}, the chart made {len(objects)}")
    return objects[0]


def check(chart: Path) -> list[str]:
    """Every check above on a chart with NATS; what held, one line each (Failed: the first not)."""
    held = []
    manifests = render_with_nats(chart, production_with_everything())
    problems = [p for m in manifests for p in validate_manifest(m)]
    require(problems == [], "invalid objects:\n" + "\n".join(problems))
    held.append(f"{len(manifests)} objects valid (kubernetes-validate --strict)")

    sts = only(nats_objects(manifests, "StatefulSet"), "NATS StatefulSet")
    require(sts["spec"]["replicas"] == 3, f"StatefulSet replicas {sts['spec']['replicas']}, not 3")
    pod = sts["spec"]["template"]
    labels = pod["metadata"]["labels"]
    terms = pod["spec"].get("affinity", {}).get("podAntiAffinity", {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution", [])
    term = only(terms, "required anti-affinity term")
    require(term["topologyKey"] == "kubernetes.io/hostname", f"anti-affinity topologyKey {term['topologyKey']}")
    match = term["labelSelector"].get("matchLabels") or {}
    require(match and match.items() <= labels.items(), f"anti-affinity selects {match}, not its own pods {labels}")
    require(match.get("app.kubernetes.io/instance") == RELEASE, f"anti-affinity not scoped to the release: {match}")
    held.append("a StatefulSet of 3, one server per node (required anti-affinity on its own pods)")

    pdb = only(nats_objects(manifests, "PodDisruptionBudget"), "NATS PodDisruptionBudget")
    require(pdb["spec"] == {"maxUnavailable": 1, "selector": pdb["spec"]["selector"]}, f"PDB spec {pdb['spec']}")
    require(pdb["spec"]["selector"]["matchLabels"].items() <= labels.items(), "the PDB does not select the servers")
    held.append("its PodDisruptionBudget: maxUnavailable 1")

    headless = only([s for s in nats_objects(manifests, "Service") if s["spec"].get("clusterIP") == "None"],
                    "headless NATS Service")
    require(sts["spec"]["serviceName"] == headless["metadata"]["name"], "the StatefulSet's serviceName is not the headless Service")
    pods = [f"{sts['metadata']['name']}-{i}.{headless['metadata']['name']}" for i in range(3)]
    expected = ",".join(f"nats://{p}.{NAMESPACE}.svc:4222" for p in pods)
    for component in ALL_SERVICES:
        url = workload_env(component, manifests=ours(manifests), secrets=any_secrets()).env["AEP_BRIDGE_NATS_URL"]
        require(url == expected, f"{component} is given {url}, not {expected}")
    held.append(f"every service given the three servers: {expected}")

    conf = only(nats_objects(manifests, "ConfigMap"), "NATS ConfigMap")["data"]["nats.conf"]
    for p in pods:
        require(f"nats://{p}:6222" in conf, f"no route to {p} in nats.conf")
    require(re.search(r'"jetstream": \{[^}]*"sync_interval": "always"', conf), "our sync_interval is not in the jetstream block")
    held.append("routes between the same three pods; sync_interval always in the jetstream block")
    # each exporter sink's durable denied to the readers, rendered from global.aepBridge.exporterSinks
    for sink in ("siem", "otel"):
        line = f'"$JS.API.CONSUMER.*.AEP_EVENTS.export-{sink}"'
        require(conf.count(line) == 2, f"{line} is not in aep-consumer's and aep-relay's deny lists of nats.conf")
    held.append("each exporter sink's durable denied to aep-consumer and aep-relay")

    single = render_with_nats(chart, {})
    replicas = [s["spec"]["replicas"] for s in nats_objects(single, "StatefulSet")]
    require(replicas == [1], f"the default values make NATS StatefulSets of {replicas}, not one server")
    client = only([s for s in nats_objects(single, "Service") if s["spec"].get("clusterIP") != "None"], "client NATS Service")
    url = workload_env("mapper", manifests=ours(single), secrets=any_secrets()).env["AEP_BRIDGE_NATS_URL"]
    want = f"nats://{client['metadata']['name']}.{NAMESPACE}.svc:4222"
    require(url == want, f"the default install gives the mapper {url}, not {want}")
    held.append(f"the default values: one server, the services given {want}")
    return held


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("chart", type=Path, help="the official NATS chart: its directory or the .tgz `helm pull` fetches")
    args = parser.parse_args(argv)
    if not args.chart.exists():
        parser.error(f"{args.chart}: no such file or directory")
    with tempfile.TemporaryDirectory(prefix="aep-bridge-nats-chart-") as work:
        try:
            held = check(chart_with_nats(args.chart, Path(work)))
        except Failed as exc:
            print(f"FAIL {exc}", file=sys.stderr)
            return 1
    for line in held:
        print(f"ok   {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
