"""The chart's relay (relay.enabled): Deployment, Service, Ingress, NetworkPolicy, the token
Secret it reads, the alert; off by default; a clear failure without its token Secret."""

from __future__ import annotations

import pytest

from tests.support.chart import ci_values, env_entries, one, ours, pod_spec, render_chart, render_manifests, validate_manifest, workload


def component_of(obj: dict) -> str | None:
    return obj["metadata"].get("labels", {}).get("app.kubernetes.io/component")


def test_off_by_default_and_nothing_of_it_renders():
    assert not [m for m in ours(render_manifests()) if component_of(m) == "relay"]


def test_enabled_without_its_token_secret_fails_with_a_clear_message():
    with pytest.raises(Exception, match="relay.tokenSecret.existingSecret must name the Secret"):
        render_chart({"relay": {"enabled": True}})


def test_what_the_relay_values_render():
    manifests = render_manifests(ci_values("relay"))
    problems = [p for m in manifests for p in validate_manifest(m)]
    assert problems == [], problems

    deployment = workload(manifests, "relay")
    assert deployment["spec"]["replicas"] == 2  # stateless: several behind one Service
    (container,) = pod_spec(deployment)["containers"]
    assert container["args"] == ["relay"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"metrics": 8787}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    env = env_entries(deployment, "relay")
    assert env["AEP_BRIDGE_NATS_USER"]["value"] == "aep-relay"
    assert env["AEP_BRIDGE_NATS_PASSWORD"]["valueFrom"]["secretKeyRef"]["key"] == "relay-password"
    assert env["AEP_BRIDGE_RELAY_LISTEN"]["value"] == "0.0.0.0:8787"
    assert env["AEP_BRIDGE_RELAY_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "aep-bridge-relay-tokens", "key": "token"}
    assert env["AEP_BRIDGE_RELAY_TOKENS_FILE"]["value"] == "/etc/aep-bridge/relay-tokens/tokens.yaml"
    assert env["AEP_BRIDGE_RELAY_MAX_CONNECTIONS_PER_CLIENT"]["value"] == "4096"  # behind the Ingress: one address
    assert env["AEP_BRIDGE_RELAY_INSECURE"]["value"] == "1"  # TLS at the Ingress
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["relay-tokens"] == "/etc/aep-bridge/relay-tokens"
    volumes = {v["name"]: v for v in pod_spec(deployment)["volumes"]}
    assert volumes["relay-tokens"]["secret"]["secretName"] == "aep-bridge-relay-tokens"

    service = one(manifests, "Service", "relay")
    assert [(p["name"], p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [("metrics", 8787, "metrics")]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    ingress = one(manifests, "Ingress", "relay")
    (rule,) = ingress["spec"]["rules"]
    assert rule["host"] == "aep.example.com"
    assert rule["http"]["paths"][0]["backend"]["service"] == {"name": service["metadata"]["name"], "port": {"name": "metrics"}}
    assert ingress["spec"]["tls"] == [{"secretName": "aep-relay-tls", "hosts": ["aep.example.com"]}]

    policy = one(manifests, "NetworkPolicy", "relay")
    assert policy["spec"]["ingress"] == [{"ports": [{"port": "metrics", "protocol": "TCP"}]}]
    rule = one(manifests, "PrometheusRule")
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert "aep_bridge_relay_backpressure_disconnects_total" in alerts["AepBridgeRelaySlowConsumers"]["expr"]
    monitor = one(manifests, "ServiceMonitor")
    assert "relay" in str(monitor["spec"]["selector"])


def test_tls_on_the_pod():
    values = ci_values("relay")
    values["relay"]["tls"] = {"existingSecret": "relay-cert"}
    deployment = workload(render_manifests(values), "relay")
    env = env_entries(deployment, "relay")
    assert "AEP_BRIDGE_RELAY_INSECURE" not in env
    assert env["AEP_BRIDGE_RELAY_TLS_CERT"]["value"] == "/etc/aep-bridge/relay-tls/tls.crt"
    volumes = {v["name"]: v for v in pod_spec(deployment)["volumes"]}
    assert volumes["relay-tls"]["secret"]["secretName"] == "relay-cert"
