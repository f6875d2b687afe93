"""The chart's exporter (exporter.enabled): what it renders, and the real exporter started with
exactly the environment and sinks file the chart gives it, as user aep-exporter, on a
nats-server configured like the bundled one (values.yaml) and like deploy/nats/nats.conf."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bridge.config import EXPORTER_METRICS_PORT
from bridge.services.exporter import load_sinks
from tests.support.services import wait_for
from tests.support.aep_fixtures import golden
from tests.support.chart import (
    NAMESPACE,
    ci_values,
    documented_variables,
    env_entries,
    one,
    ours,
    pod_spec,
    render_chart,
    render_manifests,
    select,
    validate_manifest,
    workload,
    workload_env,
)
from tests.support.nats_roles import (
    PASSWORDS,
    Client,
    configured_server,
    ensure_streams,
    expect_api_refused,
    expect_publish_refused,
    sample_nats_conf,
    values_nats_conf,
)
from tests.support.otlp import Receiver, to_id

ROOT = Path(__file__).resolve().parents[2]


def component_of(obj: dict) -> str | None:
    return obj["metadata"].get("labels", {}).get("app.kubernetes.io/component")


def test_off_by_default_and_nothing_of_it_renders():
    manifests = render_manifests()
    assert not [m for m in ours(manifests) if component_of(m) == "exporter"]


def test_enabled_without_sinks_fails_with_a_clear_message():
    with pytest.raises(Exception, match="exporter.sinks must list at least one sink"):
        render_chart({"exporter": {"enabled": True}})


def test_what_the_exporter_values_render():
    values = ci_values("exporter")
    manifests = render_manifests(values)
    problems = [p for m in manifests for p in validate_manifest(m)]
    assert problems == [], problems

    deployment = workload(manifests, "exporter")
    spec = pod_spec(deployment)
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    (container,) = spec["containers"]
    assert container["args"] == ["exporter"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"metrics": EXPORTER_METRICS_PORT}
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    env = env_entries(deployment, "exporter")
    assert env["AEP_BRIDGE_NATS_USER"]["value"] == "aep-exporter"
    assert env["AEP_BRIDGE_NATS_PASSWORD"]["valueFrom"]["secretKeyRef"]["key"] == "exporter-password"
    assert env["AEP_BRIDGE_KAFKA_SASL_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "aep-bridge-kafka", "key": "kafka-sasl-password"}
    assert env["AEP_BRIDGE_METRICS_PORT"]["value"] == str(EXPORTER_METRICS_PORT)
    assert {n for n in env if n != "AEP_BRIDGE_KAFKA_SASL_PASSWORD"} <= documented_variables()
    mount = next(m for m in container["volumeMounts"] if m["name"] == "sinks")
    assert env["AEP_BRIDGE_EXPORT_CONFIG"]["value"] == mount["mountPath"] + "/sinks.yaml" and mount["readOnly"]
    assert spec["securityContext"]["runAsNonRoot"] is True

    # The ConfigMap is a sinks file the exporter itself accepts, with the values' sinks.
    (cm,) = [m for m in select(manifests, "ConfigMap") if component_of(m) == "exporter"]
    sinks_file = cm["data"]["sinks.yaml"]
    assert "password" not in sinks_file
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"sinks-{os.getpid()}.yaml"
    path.write_text(sinks_file)
    try:
        sinks = load_sinks([], str(path), environ={"AEP_BRIDGE_KAFKA_SASL_PASSWORD": "pw"})
    finally:
        path.unlink()
    assert [(s.name, s.kind, s.format) for s in sinks] == [("siem", "kafka", "ocsf"), ("otel", "otlp", "otlp")]
    assert sinks[0].kafka["sasl.password"] == "pw" and sinks[0].kafka["security.protocol"] == "SASL_SSL"
    assert deployment["spec"]["template"]["metadata"]["annotations"]["checksum/sinks"]

    service = one(manifests, "Service", "exporter")
    assert service["spec"]["ports"][0]["port"] == EXPORTER_METRICS_PORT
    monitor = one(manifests, "ServiceMonitor")
    assert "exporter" in monitor["spec"]["selector"]["matchExpressions"][0]["values"]
    (policy,) = [p for p in select(manifests, "NetworkPolicy") if component_of(p) == "exporter"]
    egress_ports = {p["port"] for rule in policy["spec"]["egress"] for p in rule["ports"]}
    assert {9092, 9093, 4318} <= egress_ports
    rule = one(manifests, "PrometheusRule")
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    lag = alerts["AepBridgeExportSinkLag"]["expr"]
    assert "aep_bridge_export_lag" in lag and f'job="{service["metadata"]["name"]}"' in lag
    assert f'namespace="{NAMESPACE}"' in lag
    # Without the exporter, no such alert.
    plain = render_manifests({"monitoring": {"prometheusRule": {"enabled": True}}})
    assert "AepBridgeExportSinkLag" not in json.dumps(one(plain, "PrometheusRule"))


def test_the_dashboard_has_the_exporter_row():
    dashboard = json.loads((ROOT / "deploy/helm/aep-bridge/files/grafana-dashboard.json").read_text())
    titles = [p["title"] for p in dashboard["panels"]]
    assert "Export: sink lag" in titles and "Export: events delivered per sink" in titles
    assert any(v["name"] == "exporter_job" for v in dashboard["templating"]["list"])


async def load_events(url: str) -> list[str]:
    """As pairing (the one role that publishes aep.hermes.>): golden events and one that is not
    JSON; as the relay (POST /events stores there): another emitter's event under aep.ingest.>."""
    c = await Client.connect(url, "pairing")
    ids = []
    try:
        for e in golden()[:20]:
            await c.js.publish(f"aep.hermes.lane1.{e['type']}", json.dumps(e).encode(), headers={"Nats-Msg-Id": e["id"]})
            ids.append(e["id"])
        await c.js.publish("aep.hermes.lane1.tool.requested", b"not json", headers={"Nats-Msg-Id": "bad-1"})
    finally:
        await c.close()
    c = await Client.connect(url, "relay")
    try:
        other = {**golden()[0], "id": "ingested-1", "source": "urn:ci:runner", "agent": "ci-bot", "session": "ci-1"}
        await c.js.publish(f"aep.ingest.ci-1.{other['type']}", json.dumps(other).encode(), headers={"Nats-Msg-Id": "ingested-1"})
        ids.append(other["id"])
    finally:
        await c.close()
    return ids


async def exporter_cannot_do_more(url: str) -> None:
    c = await Client.connect(url, "exporter")
    try:
        await expect_publish_refused(c, "aep.hermes.lane1.tool.requested")
        await expect_api_refused(
            c, c.js.pull_subscribe("hermes.raw.>", durable="x", stream="HERMES_RAW"), "HERMES_RAW")
        await expect_api_refused(c, c.js.delete_stream("AEP_EVENTS"), "$JS.API.STREAM.DELETE.AEP_EVENTS")
    finally:
        await c.close()


async def dead_letters(url: str) -> int:
    """Messages in BRIDGE_DLQ (bootstrap may inspect streams; no role here reads dead letters)."""
    c = await Client.connect(url, "bootstrap")
    try:
        return (await c.js.stream_info("BRIDGE_DLQ")).state.messages
    finally:
        await c.close()


@pytest.mark.parametrize("kind", ["sample", "values"])
def test_the_real_exporter_runs_with_the_charts_environment_as_aep_exporter(kind, tmp_path):
    text = sample_nats_conf(tmp_path / "js") if kind == "sample" else values_nats_conf(tmp_path / "js")
    with configured_server(tmp_path, text) as url, Receiver() as rx:
        asyncio.run(ensure_streams(url))
        ids = asyncio.run(load_events(url))
        values = {
            "nats": {"enabled": False, "url": url},
            "exporter": {"enabled": True, "sinks": [{"name": "otel", "url": f"otlp+http://127.0.0.1:{rx.port}/v1/logs"}],
                         "kafkaSecret": {"existingSecret": "aep-bridge-kafka"}},
        }
        manifests = render_manifests(values)
        secrets = {"aep-bridge-nats-auth": {"exporter-password": PASSWORDS["AEP_EXPORTER_PASSWORD"]},
                   "aep-bridge-kafka": {"kafka-sasl-password": "kafka-pw"}}
        w = workload_env("exporter", manifests=manifests, secrets=secrets)
        (cm,) = [m for m in select(manifests, "ConfigMap") if component_of(m) == "exporter"]
        sinks = tmp_path / "sinks.yaml"
        sinks.write_text(cm["data"]["sinks.yaml"])
        env = {**os.environ, **w.env, "AEP_BRIDGE_EXPORT_CONFIG": str(sinks), "AEP_BRIDGE_METRICS_PORT": "0",
               "AEP_BRIDGE_CONFIG": os.devnull}
        assert w.env["AEP_BRIDGE_KAFKA_SASL_PASSWORD"] == "kafka-pw"
        log = open(tmp_path / "exporter.log", "wb")
        proc = subprocess.Popen([sys.executable, "-m", "bridge.cli", *w.args], env=env, stdout=log,
                                stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            wait_for(lambda: {to_id(r) for r in rx.records()} >= set(ids), 60, what="the events at the receiver")
            wait_for(lambda: asyncio.run(dead_letters(url)) == 1, 30, what="the dead letter")
            exporter_log = (tmp_path / "exporter.log").read_text()
            assert '"reason": "export_not_json"' in exporter_log and "dead_letter_failed" not in exporter_log
            assert proc.poll() is None
            asyncio.run(exporter_cannot_do_more(url))
        finally:
            proc.terminate()
            assert proc.wait(30) == 0, (tmp_path / "exporter.log").read_text()[-3000:]
            log.close()
        assert "permissions violation" not in (tmp_path / "exporter.log").read_text().lower()


def test_the_image_lock_carries_the_export_extra():
    """The chart's exporter runs the image: its lock pins the `export` extra's packages."""
    import re
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["export"]
    wanted = {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in extra}
    lock = (ROOT / "deploy" / "requirements.lock").read_text()
    pinned = {n.lower() for n in re.findall(r"^([A-Za-z0-9_.-]+)==\S+ \\$", lock, flags=re.M)}
    assert wanted and wanted <= pinned, wanted - pinned


def test_replicas_per_sink_and_otlp_headers_from_a_secret():
    values = ci_values("exporter")
    values["exporter"]["sinks"] = [
        {"name": "siem", "url": "kafka://kafka-0.kafka:9093/aep-ocsf", "format": "ocsf", "replicas": 3},
        {"name": "audit", "url": "kafka://kafka-0.kafka:9093/aep-audit"},
        {"name": "otel", "url": "otlp+http://otel-collector.observability:4318/v1/logs",
         "headersSecret": {"existingSecret": "otel-auth", "headers": [{"header": "authorization", "key": "token"}]}},
    ]
    values["global"]["aepBridge"]["exporterSinks"] = ["siem", "audit", "otel"]
    manifests = render_manifests(values)
    assert [p for m in manifests for p in validate_manifest(m)] == []
    deployments = {d["metadata"]["name"]: d for d in select(manifests, "Deployment") if component_of(d) == "exporter"}
    (single,) = [d for n, d in deployments.items() if not n.endswith("-siem")]
    (shared,) = [d for n, d in deployments.items() if n.endswith("-siem")]
    assert single["spec"]["replicas"] == 1 and single["spec"]["strategy"] == {"type": "Recreate"}
    assert shared["spec"]["replicas"] == 3 and shared["spec"]["strategy"]["type"] == "RollingUpdate"
    (cm,) = [m for m in select(manifests, "ConfigMap") if component_of(m) == "exporter"]
    assert "token" not in json.dumps(cm["data"]) and "otel-auth" not in json.dumps(cm["data"])

    def sinks_of(deployment: dict) -> list:
        env = {e["name"]: e for e in pod_spec(deployment)["containers"][0]["env"]}
        path = Path(os.environ.get("TMPDIR", "/tmp")) / f"sinks-{os.getpid()}.yaml"
        path.write_text(cm["data"][Path(env["AEP_BRIDGE_EXPORT_CONFIG"]["value"]).name])
        secrets = {n: "Bearer from-the-secret" for n, e in env.items()
                   if e.get("valueFrom", {}).get("secretKeyRef", {}).get("name") == "otel-auth"}
        try:
            return load_sinks([], str(path), environ={"AEP_BRIDGE_KAFKA_SASL_PASSWORD": "pw", **secrets})
        finally:
            path.unlink()

    # Each Deployment runs its own sinks: the shared one its sink (partitioned), the other the rest.
    assert [(s.name, s.replicas) for s in sinks_of(shared)] == [("siem", 3)]
    rest = sinks_of(single)
    assert [(s.name, s.replicas) for s in rest] == [("audit", 1), ("otel", 1)]
    assert rest[1].headers == {"authorization": "Bearer from-the-secret"}
    with pytest.raises(Exception, match="needs a name"):
        render_chart({"exporter": {"enabled": True, "sinks": [{"url": "kafka://k:9092/t", "replicas": 2}]}})
