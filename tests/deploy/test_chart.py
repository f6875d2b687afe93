"""The Helm chart (deploy/helm/aep-bridge): lint, render, validate, and what the manifests say.

Everything runs offline through the Helm SDK library (``helm_python``, no helm
CLI) and ``kubernetes-validate --strict``. The chart is rendered with each
values file in ``deploy/helm/aep-bridge/ci/`` as checked out: no ``charts/``
directory, the NATS dependency declared but absent (as in a source checkout
before ``helm dependency build``). The official NATS chart cannot be
downloaded on the machines that run these tests and no copy of it is
committed, so the bundled-NATS path is checked only up to the values this
chart hands the ``nats`` subchart and the names its own templates derive from
them (see deploy/README.md, "What is not validated here").

ServiceMonitor and PrometheusRule (no schema in kubernetes-validate) are
checked against small JSON Schemas written for this project
(:data:`SERVICEMONITOR_SCHEMA`, :data:`PROMETHEUSRULE_SCHEMA`): the fields the
chart sets, unknown fields rejected.

The helpers (render, validate, a container's environment) are in tests/support/chart.py. The
check of our production values against the official NATS chart itself needs that chart on the
machine, so it is not a test of this suite: deploy/check_nats_chart.py, run by hand
(deploy/README.md, "What is not validated here").
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

# The `deploy` extra (pyproject.toml) provides helm_python and kubernetes_validate;
# `make venv` installs it. A missing package is a collection error, not a skip.
import helm_python as helm
import pytest
import yaml

from bridge.config import GATE_METRICS_PORT as GATE_PORT
from tests.support.chart import (
    ALL_SERVICES,
    ARCHITECTURE,
    CHART_DIR,
    CI_VALUES,
    DEFAULT_PORTS,
    DEPLOY_README,
    MAPPER_PORT,
    NAMESPACE,
    PRODUCTION_VALUES,
    RELEASE,
    REQUIRED_CI_VALUES,
    any_secrets,
    chart_max_file_store,
    ci_values,
    documented_variables,
    env_entries,
    lint_messages,
    load_values,
    merged,
    one,
    ours,
    pod_spec,
    production_with_everything,
    render_chart,
    render_manifests,
    select,
    validate_manifest,
    workload,
    workload_env,
)

# --------------------------------------------------------------------------- fixtures


def _id(path: Path) -> str:
    return "production" if path == PRODUCTION_VALUES else path.name.removesuffix("-values.yaml")


@pytest.fixture(scope="module", params=CI_VALUES, ids=_id)
def ci_case(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any], list[dict[str, Any]]]:
    values = load_values(request.param)
    return _id(request.param), values, render_manifests(values)


# --------------------------------------------------------------------------- lint


def test_ci_values_files_cover_the_required_cases() -> None:
    assert REQUIRED_CI_VALUES <= {_id(p) for p in CI_VALUES}


@pytest.mark.parametrize("values_file", CI_VALUES, ids=_id)
def test_lint_as_checked_out(values_file: Path) -> None:
    """Without charts/ the only warning is the absent (declared) NATS dependency."""
    report = lint_messages(CHART_DIR, load_values(values_file))
    assert report["errors"] == [], report
    warnings = [m for m in report["messages"] if m["severity"] >= 2]
    assert [m["error"] for m in warnings] == ["chart directory is missing these dependencies: nats"], report


def test_dependency_is_the_official_nats_chart_behind_a_condition() -> None:
    """The NATS chart is declared, installed only when nats.enabled, and not committed:
    a checkout needs `helm dependency build` before `helm install` (deploy/README.md)."""
    with helm.Chart.load(CHART_DIR) as chart:
        (dep,) = chart.metadata["dependencies"]
    assert dep["name"] == "nats" and dep["condition"] == "nats.enabled"
    assert dep["repository"] == "https://nats-io.github.io/k8s/helm/charts/"
    assert re.fullmatch(r"\d+\.\d+\.\d+", dep["version"]), "an exact version, not a range"
    assert [d["status"] for d in helm.dependency_list(CHART_DIR)] == ["missing"]
    assert not (CHART_DIR / "charts").exists(), "charts/ is made by `helm dependency build`, never committed"


# --------------------------------------------------------------------------- validate


def test_every_manifest_is_valid(ci_case: tuple[str, dict[str, Any], list[dict[str, Any]]]) -> None:
    name, _, manifests = ci_case
    assert manifests, name
    problems = [p for m in manifests for p in validate_manifest(m)]
    assert problems == [], "\n".join(problems)


def test_the_validator_does_reject_unknown_fields() -> None:
    """Guard against a validator that silently accepts everything."""
    manifests = render_manifests(ci_values("monitoring"))
    deployment = copy.deepcopy(workload(manifests, "mapper"))
    pod_spec(deployment)["containers"][0]["livenessProbe"]["httpGet"]["pth"] = "/healthz"
    assert validate_manifest(deployment)
    monitor = one(manifests, "ServiceMonitor")
    rule = one(manifests, "PrometheusRule")
    assert validate_manifest(monitor) == [] and validate_manifest(rule) == []
    bad = copy.deepcopy(monitor)
    bad["spec"]["endpoints"][0]["intervall"] = "30s"
    assert any("intervall" in p for p in validate_manifest(bad))
    bad = copy.deepcopy(monitor)
    bad["spec"]["endpoints"][0]["interval"] = "30 seconds"
    assert validate_manifest(bad)
    bad = copy.deepcopy(rule)
    bad["spec"]["groups"][0]["rules"][0]["expresion"] = "up == 0"
    assert any("expresion" in p for p in validate_manifest(bad))
    bad = copy.deepcopy(rule)
    bad["spec"]["groups"][0]["rules"][0]["labels"]["severity"] = 3
    assert validate_manifest(bad)


# --------------------------------------------------------------------------- what the manifests say


def test_probes_point_at_the_services_endpoints_and_ports(ci_case) -> None:
    name, values, manifests = ci_case
    for component, port in DEFAULT_PORTS.items():
        deployment = workload(manifests, component)
        (container,) = pod_spec(deployment)["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports == {"metrics": port}, (name, component)
        env = env_entries(deployment, component)
        assert env["AEP_BRIDGE_METRICS_PORT"]["value"] == str(port)
        for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz"), ("startupProbe", "/healthz")):
            get = container[probe]["httpGet"]
            assert get["path"] == path, (component, probe)
            assert ports.get(get["port"], get["port"]) == port, (component, probe)
        service = one(manifests, "Service", component)
        (sport,) = service["spec"]["ports"]
        assert (sport["name"], sport["port"], sport["targetPort"]) == ("metrics", port, "metrics")
        assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
        # Graceful drain: the services finish the batch in hand on SIGTERM (~30 s).
        assert pod_spec(deployment)["terminationGracePeriodSeconds"] >= 30


def test_commands_and_shared_settings(ci_case) -> None:
    name, values, manifests = ci_case
    partitions = str(values.get("config", {}).get("partitions", 8))
    assert workload_env("mapper", manifests=manifests, secrets=any_secrets()).args == ["mapper"]
    assert workload_env("bootstrap", manifests=manifests, secrets=any_secrets()).args == ["bootstrap"]
    assert workload_env("pairing", manifests=manifests, secrets=any_secrets()).args == [
        "pairing", "--partitions", partitions,
    ]
    for component in ("bootstrap", "mapper", "pairing"):
        env = env_entries(workload(manifests, component), component)
        assert env["AEP_BRIDGE_PARTITIONS"]["value"] == partitions, (name, component)
        assert set(env) <= documented_variables(), set(env) - documented_variables()




def test_security_context_is_set(ci_case) -> None:
    name, values, manifests = ci_case
    for component in ("bootstrap", "mapper", "pairing"):
        spec = pod_spec(workload(manifests, component))
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] > 0, (name, component)
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}
        assert spec["automountServiceAccountToken"] is False
        assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC")
        for container in spec["containers"] + spec.get("initContainers", []):
            sc = container["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, (component, container["name"])
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"] == {"drop": ["ALL"]}
            assert sc.get("privileged", False) is False
            assert sc["runAsNonRoot"] is True
            resources = container["resources"]
            assert resources["requests"].keys() >= {"cpu", "memory"}
            assert resources["limits"].keys() >= {"cpu", "memory"}
            # The root filesystem is read-only: /tmp is a size-limited emptyDir.
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            volumes = {v["name"]: v for v in spec["volumes"]}
            assert volumes[mounts["/tmp"]]["emptyDir"]["sizeLimit"]
            for mount in container["volumeMounts"]:
                if "secret" in volumes[mount["name"]]:
                    assert mount["readOnly"] is True
    (sa,) = select(manifests, "ServiceAccount")
    assert sa["automountServiceAccountToken"] is False


def test_no_secret_in_the_defaults() -> None:
    """values.yaml holds no credential; the chart renders no Secret and no literal credential."""
    defaults = load_values(CHART_DIR / "values.yaml")

    def walk(node: Any, path: str = "") -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{path}.{key}" if path else str(key))
            return
        if isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{path}[{i}]")
            return
        leaf = path.rsplit(".", 1)[-1].lower()
        if isinstance(node, str) and re.search(r"password|passwd|token|seed|creds|privatekey|apikey", leaf):
            # Allowed: empty, or a variable that nats-server reads from its environment.
            assert node in (None, "") or re.fullmatch(r"<< \$[A-Z0-9_]+ >>", str(node)), (path, node)
        if isinstance(node, str):
            assert not re.search(r"-----BEGIN|SUAC|SUAM|eyJ[a-zA-Z0-9_-]{10,}", node), path

    walk(defaults)
    for values_file in CI_VALUES:
        values = load_values(values_file)
        walk(values)
        manifests = render_manifests(values)
        assert [m for m in manifests if m["kind"] == "Secret"] == []
        for m in manifests:
            if m["kind"] in ("Deployment", "Job"):
                component = m["metadata"]["labels"]["app.kubernetes.io/component"]
                for var, entry in env_entries(m, component).items():
                    if re.search(r"PASSWORD|TOKEN", var) and not var.endswith("_FILE"):
                        assert "secretKeyRef" in entry.get("valueFrom", {}), (values_file.name, var)
                    if re.search(r"CREDS|SEED|TLS_KEY|TOKENS_FILE", var):  # files mounted from Secrets
                        assert entry["value"].startswith("/etc/aep-bridge/"), (values_file.name, var)


@pytest.mark.parametrize(
    ("values_name", "expected"),
    [
        ("defaults", {"AEP_BRIDGE_NATS_USER", "AEP_BRIDGE_NATS_PASSWORD"}),
        ("external-nats", {"AEP_BRIDGE_NATS_USER", "AEP_BRIDGE_NATS_PASSWORD"}),
        ("creds-auth", {"AEP_BRIDGE_NATS_CREDS", "AEP_BRIDGE_TLS_CA", "AEP_BRIDGE_TLS_CERT", "AEP_BRIDGE_TLS_KEY"}),
        ("monitoring", {"AEP_BRIDGE_NATS_NKEY_SEED"}),
        ("token", {"AEP_BRIDGE_NATS_TOKEN", "AEP_BRIDGE_TLS_CA"}),
    ],
)
def test_credentials_per_auth_type(values_name: str, expected: set[str], tmp_path: Path) -> None:
    values = ci_values(values_name)
    manifests = render_manifests(values)
    credential_vars = {
        "AEP_BRIDGE_NATS_USER", "AEP_BRIDGE_NATS_PASSWORD", "AEP_BRIDGE_NATS_TOKEN",
        "AEP_BRIDGE_NATS_CREDS", "AEP_BRIDGE_NATS_NKEY_SEED",
        "AEP_BRIDGE_TLS_CA", "AEP_BRIDGE_TLS_CERT", "AEP_BRIDGE_TLS_KEY",
    }
    for component in ("bootstrap", "mapper", "pairing"):
        w = workload_env(component, manifests=manifests, secrets=any_secrets(), mount_root=tmp_path / component)
        assert set(w.env) & credential_vars == expected, (values_name, component)
        # Every file the environment names is a mounted Secret item (materialised here).
        for var in expected & {"AEP_BRIDGE_NATS_CREDS", "AEP_BRIDGE_NATS_NKEY_SEED",
                               "AEP_BRIDGE_TLS_CA", "AEP_BRIDGE_TLS_CERT", "AEP_BRIDGE_TLS_KEY"}:
            local = Path(w.env[var])
            assert local.is_file() and local.read_text().startswith("<"), (component, var)
        if "AEP_BRIDGE_NATS_PASSWORD" in expected:
            # Each role has its own user and its own key in the Secret.
            role_secret = values.get("auth", {}).get(component, {}).get("existingSecret") or values.get(
                "auth", {}
            ).get("existingSecret", "aep-bridge-nats-auth")
            assert w.env["AEP_BRIDGE_NATS_PASSWORD"] == f"<{role_secret}/{component}-password>"
    external = values.get("nats", {}).get("enabled") is False
    url = workload_env("mapper", manifests=manifests, secrets=any_secrets()).env["AEP_BRIDGE_NATS_URL"]
    assert url == (values["nats"]["url"] if external else f"nats://{RELEASE}-nats.{NAMESPACE}.svc:4222")
    assert "@" not in url, "credentials never travel in the URL"


def test_workload_env_resolves_secrets_and_files(tmp_path: Path) -> None:
    """The helper a service test uses: real values in, a runnable environment out."""
    values = {"nats": {"enabled": False, "url": "nats://127.0.0.1:4222"}, "auth": {"type": "creds"}}
    secrets = {"aep-bridge-nats-auth": {"mapper.creds": "-----creds-----"}}
    w = workload_env("mapper", values, secrets=secrets, mount_root=tmp_path)
    assert w.args == ["mapper"]
    assert w.env["AEP_BRIDGE_NATS_URL"] == "nats://127.0.0.1:4222"
    assert Path(w.env["AEP_BRIDGE_NATS_CREDS"]).read_text() == "-----creds-----"
    assert w.env["AEP_BRIDGE_METRICS_PORT"] == str(MAPPER_PORT)
    with pytest.raises(KeyError, match="pairing.creds"):
        workload_env("pairing", values, secrets=secrets, mount_root=tmp_path)
    w = workload_env("pairing", {"nats": {"enabled": False, "url": "nats://127.0.0.1:4222"}},
                     secrets={"aep-bridge-nats-auth": {"pairing-password": "pw"}})
    assert (w.env["AEP_BRIDGE_NATS_USER"], w.env["AEP_BRIDGE_NATS_PASSWORD"]) == ("aep-pairing", "pw")


def test_mapper_autoscaling() -> None:
    default = render_manifests()
    assert select(default, "HorizontalPodAutoscaler") == []
    assert workload(default, "mapper")["spec"]["replicas"] == 2
    values = ci_values("autoscaling")
    manifests = render_manifests(values)
    hpa = one(manifests, "HorizontalPodAutoscaler", "mapper")
    deployment = workload(manifests, "mapper")
    assert "replicas" not in deployment["spec"], "the HPA owns the replica count"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1", "kind": "Deployment", "name": deployment["metadata"]["name"],
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 12)
    bootstrap_env = workload_env("bootstrap", manifests=manifests, secrets=any_secrets()).env
    assert bootstrap_env["AEP_BRIDGE_STREAM_REPLICAS"] == "3"
    assert "AEP_BRIDGE_STREAM_REPLICAS" not in workload_env("bootstrap", manifests=default, secrets=any_secrets()).env
    types = [m["type"] for m in hpa["spec"]["metrics"]]
    assert types == ["Resource", "Resource", "External"]
    assert select(manifests, "HorizontalPodAutoscaler", "pairing") == []
    assert workload(manifests, "pairing")["spec"]["replicas"] == 3


def test_pod_disruption_budgets_match_the_pods(ci_case) -> None:
    name, values, manifests = ci_case
    for component in ("mapper", "pairing"):
        pdb = one(manifests, "PodDisruptionBudget", component)
        labels = workload(manifests, component)["spec"]["template"]["metadata"]["labels"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert ("minAvailable" in pdb["spec"]) != ("maxUnavailable" in pdb["spec"])
    pairing = workload(manifests, "pairing")
    assert pairing["spec"]["replicas"] >= 2, "pairing keeps a standby"
    assert pairing["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_network_policies(ci_case) -> None:
    name, values, manifests = ci_case
    policies = select(manifests, "NetworkPolicy")
    for component in ("bootstrap", "mapper", "pairing"):
        labels = workload(manifests, component)["spec"]["template"]["metadata"]["labels"]
        (policy,) = [p for p in policies if p["spec"]["podSelector"]["matchLabels"].items() <= labels.items()]
        spec = policy["spec"]
        assert spec["policyTypes"] == ["Ingress", "Egress"]
        ingress_ports = [p["port"] for rule in spec["ingress"] for p in rule["ports"]]
        assert ingress_ports == ([] if component == "bootstrap" else ["metrics"])
        nats_rules = [r for r in spec["egress"] if {"port": 4222, "protocol": "TCP"} in r["ports"]]
        assert len(nats_rules) == 1
        if values.get("nats", {}).get("enabled", True):
            assert nats_rules[0]["to"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == RELEASE
        else:  # an external server: networkPolicy.natsTo, or any destination on the NATS ports
            nats_to = values.get("networkPolicy", {}).get("natsTo")
            assert nats_rules[0].get("to") == (nats_to or None), name
        metrics_from = values.get("networkPolicy", {}).get("metricsFrom")
        if metrics_from and component != "bootstrap":
            assert spec["ingress"][0]["from"] == metrics_from


# The bundled NATS server. The official NATS chart is not available here (see the
# module docstring), so these tests stop at what this chart controls: the values it
# hands the `nats` subchart (values.yaml `nats:`) and the Service name, port and pod
# labels its own templates derive to reach that server. That the NATS chart names
# its Service and labels its pods this way is not checked here.

NATS_ROLES = {  # user in nats.config.merge -> role (Secret key "<role>-password")
    "aep-bootstrap": "bootstrap",
    "aep-mapper": "mapper",
    "aep-pairing": "pairing",
    "hermes-shim": "shim",  # observe-only
    "aep-consumer": "consumer",
    "aep-gate": "gate",  # the opt-in control plane: present whether or not gate.enabled
    "aep-operator": "operator",
    "hermes-shim-control": "shim-control",  # a shim of a fleet that runs the control plane
    "aep-exporter": "exporter",  # present whether or not exporter.enabled
    "aep-relay": "relay",  # present whether or not relay.enabled
}


def test_values_handed_to_the_nats_subchart_are_self_consistent() -> None:
    """values.yaml `nats:`: JetStream with room for every stream, nats-box off, one
    account whose users are the services' users, and every password a variable the
    server gets from the same Secret key the services read."""
    defaults = load_values(CHART_DIR / "values.yaml")
    nats_values = defaults["nats"]
    assert nats_values["enabled"] is True and nats_values["url"] == ""
    assert nats_values["natsBox"]["enabled"] is False, "nats-box would connect without credentials"
    jetstream = nats_values["config"]["jetstream"]
    assert jetstream["enabled"] is True
    from bridge.nats.streams import reserved_bytes  # the gate's buckets and AEP_EXPORT included

    assert chart_max_file_store(defaults) >= reserved_bytes(), "JetStream reserves max_bytes up front"

    (account,) = nats_values["config"]["merge"]["accounts"].values()
    assert account["jetstream"] == "enabled"
    users = {u["user"]: u for u in account["users"]}
    assert users.keys() == NATS_ROLES.keys()
    for role in ("bootstrap", "mapper", "pairing", "gate"):
        assert defaults["auth"][role]["username"] in users, role
    container_env = nats_values["container"]["env"]
    referenced = set()
    for user, entry in users.items():
        role = NATS_ROLES[user]
        (var,) = re.fullmatch(r"<< \$([A-Z0-9_]+) >>", entry["password"]).groups()
        assert var == f"AEP_{role.upper().replace('-', '_')}_PASSWORD", user
        referenced.add(var)
        ref = container_env[var]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": defaults["auth"]["existingSecret"], "key": f"{role}-password"}, user
        permissions = entry["permissions"]
        # allow_responses: only the control-enabled shim (it confirms the gate's requests) and
        # the relay (it answers the commands its other replicas forward); the observe-only
        # hermes-shim has no control right.
        assert permissions.keys() == {"publish", "subscribe"} | (
            {"allow_responses"} if role in ("shim-control", "relay") else set()), user
        # its own inbox prefix only (bridge.nats.connection.ROLE_INBOX), never _INBOX.>
        inbox = "_INBOX.hermes.>" if user.startswith("hermes-") else f"_INBOX.{user}.>"
        assert inbox in permissions["subscribe"]["allow"] and "_INBOX.>" not in permissions["subscribe"]["allow"], user
        assert permissions["publish"]["allow"], user
    assert referenced == container_env.keys(), "no unused or missing password variable"
    assert users["hermes-shim"]["permissions"]["publish"]["allow"] == ["hermes.raw.>"], "observe-only"
    assert users["hermes-shim-control"]["permissions"]["allow_responses"] is True


@pytest.mark.parametrize(
    ("values", "release", "url", "name_label", "port"),
    [
        ({}, "demo", "nats://demo-nats.bridge.svc:4222", "nats", 4222),
        ({"nats": {"nameOverride": "queue"}}, "demo", "nats://demo-queue.bridge.svc:4222", "queue", 4222),
        ({"nats": {"fullnameOverride": "msg"}}, "demo", "nats://msg.bridge.svc:4222", "nats", 4222),
        ({}, "nats-prod", "nats://nats-prod.bridge.svc:4222", "nats", 4222),
        ({"nats": {"service": {"name": "bus"}}}, "demo", "nats://bus.bridge.svc:4222", "nats", 4222),
        ({"nats": {"config": {"nats": {"port": 4333}}}}, "demo", "nats://demo-nats.bridge.svc:4333", "nats", 4333),
        ({"tls": {"enabled": True, "existingSecret": "nats-ca"}}, "demo", "tls://demo-nats.bridge.svc:4222", "nats", 4222),
    ],
    ids=["defaults", "nameOverride", "fullnameOverride", "release-contains-nats", "service-name", "port", "tls"],
)
def test_bundled_nats_url_and_network_policy_agree(
    values: dict[str, Any], release: str, url: str, name_label: str, port: int
) -> None:
    """The URL every service gets and the NetworkPolicy NATS rule name the same server:
    the Service name follows the usual Helm fullname rule from nats.nameOverride /
    fullnameOverride, the port is nats.config.nats.port, and the rule allows that port
    to the pods labelled with the subchart's name, the release and component nats."""
    manifests = render_manifests(values, name=release)
    for component in ("bootstrap", "mapper", "pairing"):
        env = workload_env(component, manifests=manifests, secrets=any_secrets()).env
        assert env["AEP_BRIDGE_NATS_URL"] == url, component
    policies = select(manifests, "NetworkPolicy")
    assert len(policies) == 3
    for policy in policies:
        (rule,) = [r for r in policy["spec"]["egress"] if "to" in r]
        assert {"port": port, "protocol": "TCP"} in rule["ports"]
        assert rule["to"] == [{"podSelector": {"matchLabels": {
            "app.kubernetes.io/name": name_label,
            "app.kubernetes.io/instance": release,
            "app.kubernetes.io/component": "nats",
        }}}]


def test_monitoring_is_off_by_default_and_complete_when_on() -> None:
    default = render_manifests()
    assert not [m for m in ours(default) if m["kind"] in ("ServiceMonitor", "PrometheusRule")]
    assert not [m for m in ours(default) if m["kind"] == "ConfigMap"]

    values = ci_values("monitoring")
    manifests = render_manifests(values)
    monitor = one(manifests, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    selector = monitor["spec"]["selector"]
    services = select(manifests, "Service")
    assert len(services) == 2
    for service in services:
        labels = service["metadata"]["labels"]
        assert selector["matchLabels"].items() <= labels.items()
        (expr,) = selector["matchExpressions"]
        assert labels[expr["key"]] in expr["values"]
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"

    rule = one(manifests, "PrometheusRule")
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert {
        "AepBridgeConsumerLagGrowing", "AepBridgeDeadLetters", "AepBridgeDriftSentinel",
        "AepBridgeHermesInstanceSilent", "AepBridgePairingPartitionsUnowned", "AepBridgeMapperOutageRetries",
    } <= alerts.keys()
    assert "aep_bridge_mapper_outage_retries_total" in alerts["AepBridgeMapperOutageRetries"]["expr"]
    service_names = {s["metadata"]["name"] for s in services}
    for alert in alerts.values():
        assert alert["labels"]["severity"] in ("warning", "critical")
        assert alert["labels"]["team"] == "agents"
        assert alert["annotations"]["summary"]
        for job in re.findall(r'job="([^"]+)"', alert["expr"]):
            assert job in service_names, (alert["alert"], job)
        for job in re.findall(r'job=~"([^"]+)"', alert["expr"]):
            assert all(re.fullmatch(job, s) for s in service_names)
        assert f'namespace="{NAMESPACE}"' in alert["expr"]
        assert alert["expr"].count("(") == alert["expr"].count(")")
    assert "> 1200" in alerts["AepBridgeHermesInstanceSilent"]["expr"]  # 20 minutes

    (dashboard_cm,) = [m for m in ours(manifests) if m["kind"] == "ConfigMap"]
    assert dashboard_cm["metadata"]["namespace"] == "monitoring"
    assert dashboard_cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(dashboard_cm["data"]["aep-bridge.json"])
    assert dashboard["uid"] == "aep-bridge"


def _metric_names(expr: str) -> set[str]:
    names = set(re.findall(r"\b(aep_bridge_[a-z_]+?)(?:_bucket)?(?=[{\[(\s])", expr + " "))
    return names


def test_dashboard_and_alerts_read_only_documented_metrics() -> None:
    """The metric names the dashboard and the alerts read are the contract listed in deploy/README.md."""
    readme = DEPLOY_README.read_text(encoding="utf-8")
    documented = set(re.findall(r"^\| `(aep_bridge_[a-z_]+)`", readme, flags=re.M))
    assert documented, "deploy/README.md lists the metrics"
    dashboard = json.loads((CHART_DIR / "files" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    manifests = render_manifests(ci_values("monitoring"))
    rule = one(manifests, "PrometheusRule")
    exprs += [r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]]
    used = set().union(*(_metric_names(e) for e in exprs))
    assert used and used <= documented, used - documented
    # The dashboard shows what the issue asks for.
    titles = " | ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("events in", "events out", "lag", "dead letters", "unknown lane", "drift",
                  "latency", "open pairs", "orphans", "partitions"):
        assert topic in titles, topic
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}"
            assert panel["targets"]


def test_bootstrap_job_name_is_stable_and_follows_its_template() -> None:
    first = workload(render_manifests(), "bootstrap")["metadata"]["name"]
    assert first == workload(render_manifests(), "bootstrap")["metadata"]["name"]
    changed = workload(render_manifests({"image": {"tag": "0.2.0"}}), "bootstrap")["metadata"]["name"]
    assert changed != first and len(changed) <= 63
    assert select(render_manifests({"bootstrap": {"enabled": False}}), "Job") == []


def test_image_reference() -> None:
    manifests = render_manifests(ci_values("creds-auth"))
    image = pod_spec(workload(manifests, "mapper"))["containers"][0]["image"]
    assert image == "registry.example.internal/aep-bridge@sha256:" + "0123456789abcdef" * 4
    default = pod_spec(workload(render_manifests(), "pairing"))["containers"][0]["image"]
    with helm.Chart.load(CHART_DIR) as chart:
        assert default == f"aep-bridge:{chart.metadata['appVersion']}"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"nats": {"enabled": False}}, "nats.url is required"),
        ({"auth": {"type": "password"}}, "auth.type must be one of"),
        ({"tls": {"enabled": True}}, "tls.existingSecret is required"),
        ({"mapper": {"autoscaling": {"enabled": True, "targetCPUUtilizationPercentage": None}}},
         "mapper.autoscaling needs a target"),
        ({"auth": {"existingSecret": ""}}, "is required when auth.type is userPassword"),
    ],
)
def test_misconfiguration_fails_with_a_clear_message(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmError) as err:
        render_chart(values)
    assert message in str(err.value)


def test_readme_examples_parse_and_the_chart_values_render() -> None:
    """Every ```yaml block of deploy/README.md is valid YAML; the chart-values ones render."""
    blocks = re.findall(r"```yaml\n(.*?)```", DEPLOY_README.read_text(encoding="utf-8"), flags=re.S)
    assert len(blocks) >= 2
    rendered = 0
    for block in blocks:
        doc = yaml.safe_load(block)
        assert isinstance(doc, dict), block[:80]
        if "nats" in doc or "networkPolicy" in doc or "gate" in doc:  # a values snippet of this chart
            manifests = render_manifests(doc)
            assert [p for m in manifests for p in validate_manifest(m)] == []
            rendered += 1
    assert rendered >= 1


# --------------------------------------------------------------------------- the control plane (gate)

# The variables the gate reads beyond AEP_BRIDGE_* (docs/ARCHITECTURE.md, "Control plane" / Configuration).
GATE_VARIABLES = {"AEP_HERMES_CONTROL", "AEP_INSTRUCT", "AEP_CONTROL_SENDERS", "AEP_GATE_PROBE_MS"}


def gate_objects(manifests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m for m in ours(manifests) if m["metadata"]["labels"].get("app.kubernetes.io/component") == "gate"]


@pytest.mark.parametrize("values_file", [p for p in CI_VALUES if _id(p) != "gate"], ids=_id)
def test_gate_is_off_by_default(values_file: Path) -> None:
    """The control plane is opt-in: without gate.enabled no gate object, no gate in the
    ServiceMonitor, NOTES.txt silent about it."""
    values = load_values(values_file)
    assert not values.get("gate", {}).get("enabled")
    rendered = render_chart(values)
    manifests = render_manifests(values)
    assert gate_objects(manifests) == []
    assert not any("gate" in m["metadata"]["name"] for m in ours(manifests))
    for monitor in select(manifests, "ServiceMonitor"):
        assert "gate" not in monitor["spec"]["selector"]["matchExpressions"][0]["values"]
    notes = next(text for path, text in rendered.items() if path.endswith("NOTES.txt"))
    assert "Control plane" not in notes
    assert load_values(CHART_DIR / "values.yaml")["gate"]["enabled"] is False


def test_gate_when_enabled_is_one_recreated_pod_like_the_other_services(tmp_path: Path) -> None:
    values = ci_values("gate")
    manifests = render_manifests(values)
    assert [p for m in gate_objects(manifests) for p in validate_manifest(m)] == []
    assert sorted(m["kind"] for m in gate_objects(manifests)) == ["Deployment", "NetworkPolicy", "Service"]

    deployment = workload(manifests, "gate")
    # One replica, never two at once: only the replica that opened a card sweeps it.
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert select(manifests, "HorizontalPodAutoscaler", "gate") == []
    assert select(manifests, "PodDisruptionBudget", "gate") == []
    # replicas is not a knob
    forced = workload(render_manifests({**values, "gate": {**values["gate"], "replicaCount": 3}}), "gate")
    assert forced["spec"]["replicas"] == 1

    spec = pod_spec(deployment)
    (container,) = spec["containers"]
    assert container["name"] == "gate"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"metrics": GATE_PORT}
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz"), ("startupProbe", "/healthz")):
        assert container[probe]["httpGet"] == {"path": path, "port": "metrics"}, probe
    assert spec["terminationGracePeriodSeconds"] >= 30

    # The same pod conventions as the mapper's: security contexts, service account, /tmp, resources.
    mapper_spec = pod_spec(workload(manifests, "mapper"))
    assert spec["securityContext"] == mapper_spec["securityContext"]
    assert container["securityContext"] == mapper_spec["containers"][0]["securityContext"]
    for key in ("serviceAccountName", "automountServiceAccountToken", "enableServiceLinks", "volumes"):
        assert spec[key] == mapper_spec[key], key
    assert spec["automountServiceAccountToken"] is False
    assert container["volumeMounts"] == mapper_spec["containers"][0]["volumeMounts"]
    assert container["resources"]["requests"].keys() >= {"cpu", "memory"}
    assert container["resources"]["limits"].keys() >= {"cpu", "memory"}

    # Command and environment: its own NATS user, the password only from the Secret.
    w = workload_env("gate", manifests=manifests, secrets=any_secrets(), mount_root=tmp_path)
    assert w.args == ["gate"]
    assert w.env["AEP_BRIDGE_NATS_USER"] == "aep-gate"
    assert w.env["AEP_BRIDGE_NATS_PASSWORD"] == "<aep-bridge-nats-auth/gate-password>"
    assert env_entries(deployment, "gate")["AEP_BRIDGE_NATS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "aep-bridge-nats-auth", "key": "gate-password"}
    assert w.env["AEP_BRIDGE_METRICS_PORT"] == str(GATE_PORT)
    assert (w.env["AEP_HERMES_CONTROL"], w.env["AEP_INSTRUCT"]) == ("1", "1")
    assert w.env["AEP_CONTROL_SENDERS"] == "aep-bridge-control,oncall-console"
    assert w.env["AEP_GATE_PROBE_MS"] == "500"
    assert w.env["AEP_BRIDGE_NATS_URL"] == f"nats://{RELEASE}-nats.{NAMESPACE}.svc:4222"
    architecture = ARCHITECTURE.read_text(encoding="utf-8")
    for var in w.env:
        assert var in documented_variables() or (var in GATE_VARIABLES and f"`{var}`" in architecture), var

    # Metrics Service, NetworkPolicy and ServiceMonitor as for mapper and pairing.
    service = one(manifests, "Service", "gate")
    (sport,) = service["spec"]["ports"]
    assert (sport["name"], sport["port"], sport["targetPort"]) == ("metrics", GATE_PORT, "metrics")
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    policy = one(manifests, "NetworkPolicy", "gate")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    mapper_policy = one(manifests, "NetworkPolicy", "mapper")
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert policy["spec"]["ingress"] == mapper_policy["spec"]["ingress"]  # the metrics port only
    assert policy["spec"]["egress"] == mapper_policy["spec"]["egress"]  # DNS and NATS only
    assert [p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]] == ["metrics"]
    monitor = one(manifests, "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchExpressions"][0]["values"] == ["mapper", "pairing", "gate"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]

    notes = next(text for path, text in render_chart(values).items() if path.endswith("NOTES.txt"))
    assert "Control plane" in notes and "AEP_HERMES_CONTROL=1" in notes and "gate: aep-bridge-nats-auth" in notes


def test_gate_switches_and_other_auth_types(tmp_path: Path) -> None:
    """gate.control / gate.instruct / gate.senders become the gate's variables; the gate
    authenticates like every role (here a .creds file from the Secret, mutual TLS)."""
    manifests = render_manifests({"gate": {"enabled": True, "control": False, "instruct": False}})
    env = workload_env("gate", manifests=manifests, secrets=any_secrets()).env
    assert (env["AEP_HERMES_CONTROL"], env["AEP_INSTRUCT"]) == ("0", "0")
    assert "AEP_CONTROL_SENDERS" not in env and env["AEP_GATE_PROBE_MS"] == "1000"

    values = {**ci_values("creds-auth"), "gate": {"enabled": True}}
    manifests = render_manifests(values)
    assert [p for m in gate_objects(manifests) for p in validate_manifest(m)] == []
    w = workload_env("gate", manifests=manifests,
                     secrets={"aep-bridge-nats-creds": {"gate.creds": "-----gate creds-----"},
                              "aep-bridge-nats-tls": {"ca.crt": "ca", "tls.crt": "crt", "tls.key": "key"}},
                     mount_root=tmp_path)
    assert Path(w.env["AEP_BRIDGE_NATS_CREDS"]).read_text() == "-----gate creds-----"
    assert {"AEP_BRIDGE_TLS_CA", "AEP_BRIDGE_TLS_CERT", "AEP_BRIDGE_TLS_KEY"} <= w.env.keys()
    assert "AEP_BRIDGE_NATS_PASSWORD" not in w.env
    with pytest.raises(KeyError, match="gate.creds"):  # its own key, not another role's
        workload_env("gate", manifests=manifests, secrets={"aep-bridge-nats-creds": {"mapper.creds": "x"},
                                                           "aep-bridge-nats-tls": {}}, mount_root=tmp_path / "x")
    own = render_manifests({"gate": {"enabled": True}, "auth": {"gate": {"existingSecret": "gate-nats"}}})
    ref = env_entries(workload(own, "gate"), "gate")["AEP_BRIDGE_NATS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "gate-nats", "key": "gate-password"}


# --------------------------------------------------------------------------- high availability (issue 23)

# values-production.yaml: a three-node NATS cluster through the official chart's own keys
# (config.cluster.enabled / replicas, podTemplate.merge for the anti-affinity, its
# podDisruptionBudget, whose template says maxUnavailable: 1), every stream at R3, and every
# service given the three servers. Without the NATS chart (see the module docstring) these
# tests check the values handed to it and the names our templates derive;
# deploy/check_nats_chart.py renders the chart itself, where it is on the machine, and checks
# what it makes of them.

def cluster_urls(*, release: str = RELEASE, statefulset: str | None = None, headless: str | None = None,
                 replicas: int = 3, port: int = 4222, scheme: str = "nats") -> str:
    """The client URLs of the NATS chart's StatefulSet pods, one per replica, by their stable
    names under its headless Service (`<statefulset>-<i>.<headless>.<namespace>.svc`)."""
    statefulset = statefulset or f"{release}-nats"
    headless = headless or f"{statefulset}-headless"
    return ",".join(f"{scheme}://{statefulset}-{i}.{headless}.{NAMESPACE}.svc:{port}" for i in range(replicas))


def test_production_values_ask_the_nats_chart_for_a_three_node_cluster() -> None:
    values = load_values(PRODUCTION_VALUES)
    nats = values["nats"]
    assert nats.get("enabled", True) is True, "the bundled NATS chart"
    cluster = nats["config"]["cluster"]
    assert cluster["enabled"] is True and cluster["replicas"] == 3
    # The NATS chart's PodDisruptionBudget (maxUnavailable: 1 in its template): a drain takes
    # one server at a time, so two of three (a JetStream quorum) stay up.
    assert nats["podDisruptionBudget"]["enabled"] is True
    # One server per node: required anti-affinity on the hostname against the NATS pods'
    # own selector labels (templated by the NATS chart: `$tplYaml`, its values mechanism).
    affinity = nats["podTemplate"]["merge"]["spec"]["affinity"]
    (term,) = affinity["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"] == {"matchLabels": {"$tplYaml": '{{ include "nats.selectorLabels" $ }}'}}
    assert values["bootstrap"]["streamReplicas"] == 3


def test_production_values_give_every_service_all_three_servers() -> None:
    manifests = render_manifests(production_with_everything())
    problems = [p for m in manifests for p in validate_manifest(m)]
    assert problems == [], "\n".join(problems)
    rendered = {m["metadata"]["labels"]["app.kubernetes.io/component"]
                for m in ours(manifests) if m["kind"] in ("Deployment", "Job")}
    assert rendered == set(ALL_SERVICES)
    for component in ALL_SERVICES:
        env = workload_env(component, manifests=manifests, secrets=any_secrets()).env
        assert env["AEP_BRIDGE_NATS_URL"] == cluster_urls(), component
        assert len(env["AEP_BRIDGE_NATS_URL"].split(",")) == 3
    bootstrap_env = workload_env("bootstrap", manifests=manifests, secrets=any_secrets()).env
    assert bootstrap_env["AEP_BRIDGE_STREAM_REPLICAS"] == "3", "every stream, bucket and object store at R3"
    # The gate creates its own buckets (aep_control, aep_instruct) at start: at R3 too.
    gate_env = workload_env("gate", manifests=manifests, secrets=any_secrets()).env
    assert gate_env["AEP_BRIDGE_STREAM_REPLICAS"] == "3"
    # The NetworkPolicies still reach exactly the bundled NATS pods (all three carry these labels).
    for policy in select(manifests, "NetworkPolicy"):
        nats_rules = [r for r in policy["spec"]["egress"] if {"port": 4222, "protocol": "TCP"} in r["ports"]]
        assert [r["to"] for r in nats_rules] == [[{"podSelector": {"matchLabels": {
            "app.kubernetes.io/name": "nats", "app.kubernetes.io/instance": RELEASE,
            "app.kubernetes.io/component": "nats"}}}]], policy["metadata"]["name"]


@pytest.mark.parametrize(
    ("nats", "release", "tls", "expected"),
    [
        ({}, RELEASE, False, cluster_urls()),
        ({"config": {"cluster": {"replicas": 5}}}, RELEASE, False, cluster_urls(replicas=5)),
        ({"fullnameOverride": "msg"}, RELEASE, False, cluster_urls(statefulset="msg")),
        ({"nameOverride": "queue"}, RELEASE, False, cluster_urls(statefulset="demo-queue")),
        ({}, "nats-prod", False, cluster_urls(release="nats-prod", statefulset="nats-prod")),
        ({"statefulSet": {"name": "bus"}, "headlessService": {"name": "bus-peers"}}, RELEASE, False,
         cluster_urls(statefulset="bus", headless="bus-peers")),
        ({"config": {"nats": {"port": 4333}}}, RELEASE, False, cluster_urls(port=4333)),
        ({}, RELEASE, True, cluster_urls(scheme="tls")),
    ],
    ids=["three", "five", "fullnameOverride", "nameOverride", "release-contains-nats", "names", "port", "tls"],
)
def test_cluster_urls_follow_the_nats_chart_names(nats: dict[str, Any], release: str, tls: bool, expected: str) -> None:
    """With config.cluster.enabled every service gets one URL per server, named as the NATS
    chart names its pods (StatefulSet `<fullname>`, headless Service `<fullname>-headless`,
    either overridable) and as many as config.cluster.replicas."""
    values = merged(load_values(PRODUCTION_VALUES), {"nats": nats})
    if tls:
        values["tls"] = {"enabled": True, "existingSecret": "nats-ca"}
    manifests = render_manifests(values, name=release)
    for component in ("bootstrap", "mapper", "pairing"):
        assert workload_env(component, manifests=manifests, secrets=any_secrets()).env["AEP_BRIDGE_NATS_URL"] == expected


def test_single_server_default_keeps_the_service_url() -> None:
    """Without config.cluster.enabled (the default install: one server) the URL stays the
    client Service's, and streams stay at the command's default."""
    manifests = render_manifests()
    env = workload_env("mapper", manifests=manifests, secrets=any_secrets()).env
    assert env["AEP_BRIDGE_NATS_URL"] == f"nats://{RELEASE}-nats.{NAMESPACE}.svc:4222"
    assert load_values(CHART_DIR / "values.yaml")["nats"]["config"].get("cluster", {}).get("enabled", False) is False


def test_jetstream_sync_interval_is_a_documented_value() -> None:
    """The JetStream fsync interval is a value (nats.config.jetstream.merge.sync_interval, into
    the server's jetstream block), never hard-coded in a template: `always` (chosen by measurement,
    tests/deploy/test_nats_fsync.py) or a quoted duration: nats-server reads an unquoted `2m` as
    the number 2,000,000 (seconds)."""
    defaults = load_values(CHART_DIR / "values.yaml")
    value = defaults["nats"]["config"]["jetstream"]["merge"]["sync_interval"]
    assert isinstance(value, str) and re.fullmatch(r"always|(\d+(ms|s|m|h))+", value), value
    assert "<<" not in value
    assert "sync_interval" in DEPLOY_README.read_text(encoding="utf-8")
    for template in (CHART_DIR / "templates").iterdir():
        assert "sync_interval" not in template.read_text(encoding="utf-8"), template.name


def test_the_nats_chart_check_refuses_a_chart_of_another_version(tmp_path: Path) -> None:
    """deploy/check_nats_chart.py (run by hand where the official NATS chart is) stays runnable:
    its imports resolve, and a chart other than the one Chart.yaml depends on is refused."""
    import subprocess
    import sys

    other = tmp_path / "nats"
    (other / "templates").mkdir(parents=True)
    (other / "Chart.yaml").write_text("apiVersion: v2\nname: nats\nversion: 0.0.1\n")
    out = subprocess.run([sys.executable, str(CHART_DIR.parents[1] / "check_nats_chart.py"), str(other)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "FAIL the NATS chart is 0.0.1; Chart.yaml depends on" in out.stderr, out.stderr
