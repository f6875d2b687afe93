"""Helpers of the Helm chart tests (deploy/helm/aep-bridge), shared by tests/deploy/ and
deploy/check_nats_chart.py: render the chart offline (``helm_python``, no helm CLI), validate an
object (``kubernetes-validate --strict``, and small JSON Schemas written for this project for
the monitoring custom resources), and read what the manifests say.

* :func:`render_chart` / :func:`render_manifests`: render with values.
* :func:`workload_env`: the environment (and arguments) of a rendered container,
  with ``secretKeyRef`` values resolved from a dict and secret volumes
  materialised in a local directory, so a test can start the real services with
  exactly the environment the chart gives them (see its docstring).
* :func:`validate_manifest`: the problems of one rendered object.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The chart tests need the Helm SDK library and the validators (the [dev] extra;
# `make venv` installs it). A missing package is a collection error, not a skip.
import helm_python as helm
import jsonschema
import kubernetes_validate.utils as kv_utils
import yaml

from bridge.config import MAPPER_METRICS_PORT, PAIRING_METRICS_PORT

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "deploy" / "helm" / "aep-bridge"
CI_DIR = CHART_DIR / "ci"
ARCHITECTURE = REPO / "docs" / "ARCHITECTURE.md"
DEPLOY_README = REPO / "deploy" / "README.md"

RELEASE = "demo"
NAMESPACE = "bridge"
# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest
# kubernetes-validate knows: every manifest must be valid for both.
KUBE_VERSIONS = ("1.27", kv_utils.latest_version())

# The services' default HTTP ports (docs/ARCHITECTURE.md: AEP_BRIDGE_METRICS_PORT).
MAPPER_PORT, PAIRING_PORT = MAPPER_METRICS_PORT, PAIRING_METRICS_PORT
DEFAULT_PORTS = {"mapper": MAPPER_PORT, "pairing": PAIRING_PORT}

# The documented production values (a three-node NATS cluster, streams at R3: issue 23),
# rendered and checked like every ci/ file.
PRODUCTION_VALUES = CHART_DIR / "values-production.yaml"
CI_VALUES = sorted(CI_DIR.glob("*-values.yaml")) + [PRODUCTION_VALUES]
REQUIRED_CI_VALUES = {"defaults", "external-nats", "creds-auth", "autoscaling", "monitoring", "gate", "exporter"}


# --------------------------------------------------------------------------- helpers


def quantity(text: str) -> int:
    """A Kubernetes binary quantity ("50Gi") in bytes."""
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", str(text))
    if match is None:
        raise ValueError(f"not a binary quantity: {text!r}")
    number, unit = match.groups()
    return int(number) * {None: 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}[unit]


def chart_max_file_store(values: Mapping[str, Any] | None = None) -> int:
    """The max_file_store the NATS chart renders from ``values`` (values.yaml by default):
    ``nats.config.jetstream.fileStore.maxSize``, else the PVC's size, in bytes."""
    values = load_values(CHART_DIR / "values.yaml") if values is None else values
    file_store = values["nats"]["config"]["jetstream"]["fileStore"]
    return quantity(file_store.get("maxSize") or file_store["pvc"]["size"])


def load_values(path: Path | str) -> dict[str, Any]:
    """A values file as a dict (an empty file or `{}` gives {})."""
    return yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}


def ci_values(name: str) -> dict[str, Any]:
    """The values of ``deploy/helm/aep-bridge/ci/<name>-values.yaml``."""
    return load_values(CI_DIR / f"{name}-values.yaml")


def render_chart(
    values: Mapping[str, Any] | None = None,
    *,
    name: str = RELEASE,
    namespace: str = NAMESPACE,
) -> dict[str, str]:
    """Render the chart offline: {template path: rendered text} (NOTES.txt included).

    Only this chart's own templates render: the NATS dependency is not in charts/.
    """
    with helm.Chart.load(CHART_DIR) as chart:
        return chart.render(
            dict(values) if values else None, name=name, namespace=namespace, is_install=True
        )


def render_manifests(values: Mapping[str, Any] | None = None, **kw: Any) -> list[dict[str, Any]]:
    """Every Kubernetes object the chart renders, parsed (NOTES.txt and empty documents left out)."""
    out = []
    for path, text in sorted(render_chart(values, **kw).items()):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                doc.setdefault("metadata", {}).setdefault("annotations", None)
                if doc["metadata"]["annotations"] is None:
                    del doc["metadata"]["annotations"]
                out.append(doc)
    return out


def ours(manifests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The objects of this chart (every object carries app.kubernetes.io/part-of: aep-bridge)."""
    return [
        m
        for m in manifests
        if m["metadata"].get("labels", {}).get("app.kubernetes.io/part-of") == "aep-bridge"
    ]


def select(manifests: list[dict[str, Any]], kind: str, component: str | None = None) -> list[dict[str, Any]]:
    found = [m for m in ours(manifests) if m["kind"] == kind]
    if component is not None:
        found = [
            m for m in found if m["metadata"]["labels"].get("app.kubernetes.io/component") == component
        ]
    return found


def one(manifests: list[dict[str, Any]], kind: str, component: str | None = None) -> dict[str, Any]:
    found = select(manifests, kind, component)
    assert len(found) == 1, f"expected one {kind} {component or ''}, found {len(found)}"
    return found[0]


def workload(manifests: list[dict[str, Any]], component: str) -> dict[str, Any]:
    """The Deployment (mapper, pairing, gate) or Job (bootstrap) of a component."""
    kind = "Job" if component == "bootstrap" else "Deployment"
    return one(manifests, kind, component)


def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["template"]["spec"]


@dataclass
class WorkloadEnv:
    """What a rendered container would run with: ``args`` (after the `aep-bridge`
    entrypoint) and ``env`` (name -> value, secrets resolved, file paths local)."""

    component: str
    args: list[str]
    env: dict[str, str]
    files: dict[str, Path] = field(default_factory=dict)  # container path -> local file


def workload_env(
    component: str,
    values: Mapping[str, Any] | None = None,
    *,
    secrets: Mapping[str, Mapping[str, str]] | None = None,
    mount_root: Path | None = None,
    manifests: list[dict[str, Any]] | None = None,
) -> WorkloadEnv:
    """The environment the chart gives the ``mapper``, ``pairing``, ``bootstrap`` or ``gate`` container.

    ``secrets`` is ``{secret name: {key: value}}``: every ``valueFrom.secretKeyRef``
    is resolved from it (a missing Secret or key raises ``KeyError`` naming it, as
    the kubelet would refuse to start the pod). Secret volumes (the ``.creds`` /
    nkey seed file, the TLS files) are written under ``mount_root`` from the same
    dict, and every variable whose value is a path inside such a mount is
    rewritten to the local file, so the values can be given to a local process::

        w = workload_env("mapper", {"nats": {"enabled": False, "url": url}},
                         secrets={"aep-bridge-nats-auth": {"mapper-password": pw}})
        subprocess.Popen([aep_bridge, *w.args], env={**os.environ, **w.env})

    ``values`` should point ``nats.url`` at the local server (``nats.enabled: false``).
    """
    manifests = manifests if manifests is not None else render_manifests(values)
    spec = pod_spec(workload(manifests, component))
    (container,) = [c for c in spec["containers"] if c["name"] == component]
    secrets = {} if secrets is None else secrets

    def secret_value(name: str, key: str) -> str:
        if name not in secrets:
            raise KeyError(f"Secret {name!r} (needed by the {component} container) was not given")
        if key not in secrets[name]:
            raise KeyError(f"key {key!r} of Secret {name!r} (needed by the {component} container) was not given")
        return secrets[name][key]

    # Materialise the secret volumes: container path -> local path.
    files: dict[str, Path] = {}
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        if "secret" not in volume:
            continue
        secret_name = volume["secret"]["secretName"]
        for item in volume["secret"].get("items", []):
            container_path = f"{mount['mountPath'].rstrip('/')}/{item['path']}"
            if mount_root is None:
                files[container_path] = Path(container_path)
                continue
            local = Path(mount_root) / container_path.lstrip("/")
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_text(secret_value(secret_name, item["key"]), encoding="utf-8")
            local.chmod(0o400)
            files[container_path] = local

    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            value = str(var["value"])
            env[var["name"]] = str(files.get(value, value))
        elif "secretKeyRef" in var.get("valueFrom", {}):
            ref = var["valueFrom"]["secretKeyRef"]
            env[var["name"]] = secret_value(ref["name"], ref["key"])
        else:
            raise AssertionError(f"unexpected env source in {component}: {var}")
    return WorkloadEnv(component, list(container.get("args", [])), env, files)


def env_entries(obj: dict[str, Any], component: str) -> dict[str, dict[str, Any]]:
    """The raw env entries (name -> EnvVar) of a workload's main container."""
    (container,) = [c for c in pod_spec(obj)["containers"] if c["name"] == component]
    return {e["name"]: e for e in container.get("env", [])}


def documented_variables() -> set[str]:
    """Every `AEP_BRIDGE_*` name in docs/ARCHITECTURE.md or read by the bridge's code."""
    names = set(re.findall(r"`(AEP_BRIDGE_[A-Z_]+)`", ARCHITECTURE.read_text(encoding="utf-8")))
    for source in (REPO / "bridge").rglob("*.py"):
        names |= set(re.findall(r"\b(AEP_BRIDGE_[A-Z_]+)\b", source.read_text(encoding="utf-8")))
    return names


# ServiceMonitor / PrometheusRule (monitoring.coreos.com/v1): kubernetes-validate has
# no schema for these custom resources, so they are checked against the schemas
# below, written for this project. They cover exactly the fields the chart sets
# (templates/servicemonitor.yaml, templates/prometheusrule.yaml), with their types
# and formats, and reject any other field wherever the chart controls the shape
# (like kubernetes-validate --strict). They are deliberately narrower than the
# Prometheus Operator's CRDs: a field the chart starts to use must be added here.

# A Prometheus duration ("30s", "1h30m", "0"): units in descending order.
_DURATION = {
    "type": "string",
    "minLength": 1,
    "pattern": "^(0|" + "".join(f"([0-9]+{unit})?" for unit in ("y", "w", "d", "h", "m", "s", "ms")) + ")$",
}
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_OBJECT_META = {
    "type": "object",
    "required": ["name", "namespace"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "maxLength": 253, "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"},
        "namespace": {"type": "string", "maxLength": 63, "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
        "labels": _STRING_MAP,
        "annotations": _STRING_MAP,
    },
}
_LABEL_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": _STRING_MAP,
        "matchExpressions": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["key", "operator"],
                "additionalProperties": False,
                "properties": {
                    "key": {"type": "string", "minLength": 1},
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
    },
}


def _custom_resource(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "title": f"monitoring.coreos.com/v1 {kind}, as this chart renders it",
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": kind},
            "metadata": _OBJECT_META,
            "spec": spec,
        },
    }


SERVICEMONITOR_SCHEMA = _custom_resource("ServiceMonitor", {
    "type": "object",
    "required": ["selector", "endpoints"],
    "additionalProperties": False,
    "properties": {
        "selector": _LABEL_SELECTOR,
        "namespaceSelector": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "any": {"type": "boolean"},
                "matchNames": {"type": "array", "items": {"type": "string", "minLength": 1}},
            },
        },
        "endpoints": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["port"],
                "additionalProperties": False,
                "properties": {
                    "port": {"type": "string", "minLength": 1},  # the Service port's name
                    "path": {"type": "string", "pattern": "^/"},
                    "scheme": {"enum": ["http", "https"]},
                    "interval": _DURATION,
                    "scrapeTimeout": _DURATION,
                },
            },
        },
    },
})

PROMETHEUSRULE_SCHEMA = _custom_resource("PrometheusRule", {
    "type": "object",
    "required": ["groups"],
    "additionalProperties": False,
    "properties": {
        "groups": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["name", "rules"],
                "additionalProperties": False,
                "properties": {
                    "name": {"type": "string", "minLength": 1},
                    "rules": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "required": ["alert", "expr"],
                            "additionalProperties": False,
                            "properties": {
                                # An alert name is a Prometheus label value of alertname;
                                # keep it a metric-style identifier.
                                "alert": {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
                                "expr": {"type": "string", "minLength": 1},
                                "for": _DURATION,
                                "labels": _STRING_MAP,
                                "annotations": _STRING_MAP,
                            },
                        },
                    },
                },
            },
        },
    },
})

CUSTOM_RESOURCE_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICEMONITOR_SCHEMA,
    ("monitoring.coreos.com/v1", "PrometheusRule"): PROMETHEUSRULE_SCHEMA,
}


def _custom_resource_validator(obj: dict[str, Any]) -> jsonschema.Draft7Validator:
    schema = CUSTOM_RESOURCE_SCHEMAS[(obj["apiVersion"], obj["kind"])]
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def validate_manifest(obj: dict[str, Any]) -> list[str]:
    """Problems of one object: kubernetes-validate --strict for every KUBE_VERSIONS entry,
    or this project's schema (unknown fields rejected) for the monitoring custom resources."""
    problems = []
    if (obj.get("apiVersion"), obj.get("kind")) in CUSTOM_RESOURCE_SCHEMAS:
        for err in _custom_resource_validator(obj).iter_errors(obj):
            problems.append(f"{obj['kind']}/{obj['metadata']['name']}: {'.'.join(map(str, err.path))}: {err.message}")
        return problems
    for version in KUBE_VERSIONS:
        try:
            kv_utils.validate(obj, version, strict=True)
        except kv_utils.ValidationError as err:
            path = ".".join(str(p) for p in err.path)
            problems.append(f"{obj['kind']}/{obj['metadata']['name']} (k8s {version}): {path}: {err.message}")
        except kv_utils.SchemaNotFoundError as err:
            problems.append(f"{obj['kind']}/{obj['metadata']['name']}: {err.message}")
    return problems


def lint_messages(path: Path, values: Mapping[str, Any] | None, **kw: Any) -> dict[str, Any]:
    return helm.lint(path, dict(values) if values else None, kube_version=f"v{KUBE_VERSIONS[-1]}", **kw)


class _AnySecrets(dict):
    """A secrets mapping that answers every (name, key) with a placeholder."""

    def __contains__(self, key: object) -> bool:
        return True

    def __getitem__(self, key: str) -> Mapping[str, str]:
        return _AnyKeys(key)


class _AnyKeys(dict):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def __contains__(self, key: object) -> bool:
        return True

    def __getitem__(self, key: str) -> str:
        return f"<{self.name}/{key}>"


def any_secrets() -> Mapping[str, Mapping[str, str]]:
    return _AnySecrets()


ALL_SERVICES = ("bootstrap", "mapper", "pairing", "gate", "relay", "exporter")


def merged(*docs: Mapping[str, Any]) -> dict[str, Any]:
    """Values files combined as `helm -f a -f b` does: maps merged key by key, the last wins."""
    out: dict[str, Any] = {}
    for doc in docs:
        for key, value in doc.items():
            if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
                out[key] = merged(out[key], value)
            else:
                out[key] = copy.deepcopy(value)
    return out


def production_with_everything() -> dict[str, Any]:
    """The production values with the opt-in services on too (gate, relay, exporter)."""
    return merged(load_values(PRODUCTION_VALUES), ci_values("gate"), ci_values("relay"), ci_values("exporter"))
