"""`hermes doctor` with a shim's own user (issue 44 item 4: `up` now hands the shims `aep-shim`,
with the rights of deploy/nats/nats.conf's `hermes-shim`, which may only publish). Before, doctor
failed ("HERMES_RAW missing ... run bootstrap") for every such user, though the shim delivers;
now it says the stream is not visible to this user, as a warning, and passes. Against a real
nats-server with the sample nats.conf."""

from __future__ import annotations

import os
from pathlib import Path

from tests.support.nats_roles import USERS, configured_server, ensure_streams, sample_nats_conf
from tests.support.cli import cli

ROOT = Path(__file__).resolve().parents[2]


def test_doctor_with_a_shim_user_that_may_only_publish(tmp_path: Path) -> None:
    import asyncio

    home = tmp_path / "hermes"
    home.mkdir()
    (home / "config.yaml").write_text("model: x\n")
    with configured_server(tmp_path, sample_nats_conf(tmp_path / "js")) as url:
        asyncio.run(ensure_streams(url))
        user, password = USERS["shim"]
        env = {"AEP_BRIDGE_CONFIG": os.devnull, "AEP_BRIDGE_NATS_URL": url, "AEP_BRIDGE_NATS_USER": user,
               "AEP_BRIDGE_NATS_PASSWORD": password, "AEP_BRIDGE_INSTANCE": "doc",
               "AEP_BRIDGE_SPOOL_DIR": str(tmp_path / "spool"), "HERMES_HOME": str(home)}
        out = cli("hermes", "install", "--events", "pre_tool_call", env=env)
        assert out.returncode == 0, out.stdout + out.stderr
        doc = cli("hermes", "doctor", "--timeout", "1", env=env)
    assert doc.returncode == 0, doc.stdout + doc.stderr
    assert "NATS answers" in doc.stdout and "HERMES_RAW not visible to this user" in doc.stdout, doc.stdout
    assert "run `aep-bridge bootstrap`" not in doc.stdout
