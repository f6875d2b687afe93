"""values-fleet.yaml (issue 41): the chart's fleet mode. The services take their roles' .creds,
and the bundled server's configuration these values hand the NATS chart (values.yaml's
``nats.config.merge`` with values-fleet.yaml's and the ``helm-values.yaml`` that `fleet init`
writes, plus its ``config.resolver``) starts a real nats-server that trusts the fleet: bootstrap
runs with its creds and an issued instance's shim publishes. (The NATS chart itself is not on
this machine: as in test_nats_permissions, the merged block is written into a nats.conf.)"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from bridge.nats.fleet import Fleet, push
from tests.support.chart import (ALL_SERVICES, CHART_DIR, any_secrets, ci_values, load_values, merged,
                                 render_manifests, validate_manifest, workload_env)
from tests.support.fleet import bootstrap, issue_env
from tests.support.nats_roles import configured_server
from tests.support.shim import dumps, envelope, run_hook

FLEET_VALUES = CHART_DIR / "values-fleet.yaml"


def without_nulls(d: Any) -> Any:
    """What helm does with a null in a later values file: the key is gone."""
    if isinstance(d, dict):
        return {k: without_nulls(v) for k, v in d.items() if v is not None}
    return d


def fleet_values(fleet: Fleet) -> dict[str, Any]:
    return without_nulls(merged(load_values(CHART_DIR / "values.yaml"), load_values(FLEET_VALUES),
                                fleet.helm_values()))


def test_services_take_their_role_creds(tmp_path: Path) -> None:
    fleet = Fleet.init(tmp_path / "keys")
    values = merged(load_values(FLEET_VALUES), fleet.helm_values(), ci_values("gate"), ci_values("relay"),
                    ci_values("exporter"))
    manifests = render_manifests(values)
    assert [p for m in manifests for p in validate_manifest(m)] == []
    for component in ALL_SERVICES:
        env = workload_env(component, manifests=manifests, secrets=any_secrets(), mount_root=tmp_path / component).env
        assert "AEP_BRIDGE_NATS_CREDS" in env and "AEP_BRIDGE_NATS_PASSWORD" not in env, component
    nats = fleet_values(fleet)["nats"]
    assert "accounts" not in nats["config"]["merge"], "operator mode: no static users"
    assert "env" not in nats["container"], "no password variables for the bundled server"
    assert nats["config"]["resolver"]["enabled"] is True and nats["config"]["resolver"]["merge"]["type"] == "full"


def test_the_bundled_server_config_trusts_the_fleet(tmp_path: Path) -> None:
    fleet = Fleet.init(tmp_path / "keys")
    config = fleet_values(fleet)["nats"]["config"]
    conf = {"server_name": "aep-test-fleet-values",
            "jetstream": {"store_dir": str(tmp_path / "js"), "max_file_store": 64 * 1024**3,
                          **config["jetstream"].get("merge", {})},
            "resolver": {"dir": str(tmp_path / "resolver"), **config["resolver"]["merge"]},
            **config["merge"]}
    with configured_server(tmp_path, json.dumps(conf, indent=1)) as url:
        asyncio.run(push(fleet, url, ("AEP", "FLEET")))  # the documented step after the first start
        asyncio.run(bootstrap(fleet, url))
        env = issue_env(fleet, "gw-chart", url, tmp_path / "spool")
        run = run_hook(dumps(envelope()), env)
        assert run.answered_empty_object and not run.stderr, run.stderr
