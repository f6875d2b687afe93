"""The documented commands on default settings: no settings file, nothing in the environment."""

from __future__ import annotations

import json
import subprocess
import sys

from bridge.stack.server import terminate
from tests.support.cli import free_port
from tests.support.up import ROOT, cli


def test_config_prints_the_default_settings(clean_env: dict[str, str]) -> None:
    done = cli("config", env=clean_env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert any(line.split()[:2] == ["AEP_BRIDGE_RELAY_LISTEN", "127.0.0.1:8787"] for line in done.stdout.splitlines()), done.stdout


def test_config_json_prints_the_default_listen_address(clean_env: dict[str, str]) -> None:
    done = cli("config", "--json", env=clean_env, timeout=60)
    assert done.returncode == 0, done.stderr
    rows = {r["name"]: r for r in json.loads(done.stdout)["settings"]}
    assert rows["AEP_BRIDGE_RELAY_LISTEN"]["value"] == "127.0.0.1:8787"
    assert rows["AEP_BRIDGE_RELAY_LISTEN"]["source"] == "default"


def test_config_names_a_settings_file_that_does_not_exist(clean_env: dict[str, str], tmp_path) -> None:  # type: ignore[no-untyped-def]
    missing = tmp_path / "nonexistent"
    done = cli("config", "--config", str(missing), env=clean_env, timeout=60)
    assert done.returncode == 2
    assert str(missing) in done.stderr and "Traceback" not in done.stderr


def test_relay_starts_on_the_default_listen_address(clean_env: dict[str, str], tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`aep-bridge relay` as the README writes it: the default HOST:PORT is parsed (NATS points at
    a dead port so the test is the same whoever listens on 4222; SIGTERM ends it)."""
    env = {**clean_env, "AEP_BRIDGE_NATS_URL": f"nats://127.0.0.1:{free_port()}"}
    out = open(tmp_path / "relay.out", "w")
    proc = subprocess.Popen([sys.executable, "-m", "bridge.cli", "relay"], env=env, stdout=out,
                            stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        proc.wait(4)  # the crash came within a second; a relay that runs is still running
    except subprocess.TimeoutExpired:
        pass
    terminate(proc, 15)
    out.close()
    text = (tmp_path / "relay.out").read_text()
    assert "Traceback" not in text and "ValueError" not in text, text
    assert "8787" in text, text  # where it listens (or that the port is taken)


def test_exporter_names_a_sinks_file_that_is_not_yaml_in_one_line(clean_env: dict[str, str], tmp_path) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "sinks.yaml"
    bad.write_text("sinks:\n  - name: a\n    url: [unclosed\n")
    done = cli("exporter", "--config", str(bad), "--nats", f"nats://127.0.0.1:{free_port()}", env=clean_env, timeout=60)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "sinks.yaml" in lines[0] and "line 3" in lines[0], lines
