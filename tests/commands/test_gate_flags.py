"""`aep-bridge gate` takes its flags through the one resolver (issue 38): flag > environment >
settings file > default, each checked against the field's range. Before, the command built its
settings from the environment and set --metrics-port, --log-format and --probe-ms by hand:
`--probe-ms -5` passed the range check and `--probe-ms 0` was silently dropped (the gate then
probed every 1000 ms), and a bad AEP_GATE_PROBE_MS stopped the gate even with a good flag."""

from __future__ import annotations

import os
import subprocess

import pytest

from bridge.cli import build_parser
from tests.support.cli import cli, free_port


@pytest.mark.parametrize("value", ["-5", "0"])
def test_a_probe_interval_out_of_range_is_refused_at_start(value: str, clean_env: dict[str, str]) -> None:
    url = f"nats://127.0.0.1:{free_port()}"  # nobody listens: a gate that starts would retry until killed
    try:
        proc = cli("gate", "--probe-ms", value, "--nats", url, "--metrics-port", "0",
                   env={**clean_env, "AEP_BRIDGE_CONFIG": os.devnull}, inherit=False, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"--probe-ms {value} was taken: the gate started instead of refusing it")
    assert proc.returncode == 2, proc.stderr
    assert "AEP_GATE_PROBE_MS" in proc.stderr and "--probe-ms" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_gate_flags_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from bridge.commands.services import gate_settings

    monkeypatch.setenv("AEP_BRIDGE_CONFIG", os.devnull)
    monkeypatch.setenv("AEP_GATE_PROBE_MS", "not a number")  # the flag is what counts
    monkeypatch.setenv("AEP_BRIDGE_METRICS_PORT", "7001")
    monkeypatch.setenv("AEP_BRIDGE_LOG_FORMAT", "json")
    args = build_parser().parse_args(["gate", "--probe-ms", "250", "--metrics-port", "7002", "--log-format", "console",
                                      "--nats", "nats://127.0.0.1:4999"])
    settings, config = gate_settings(args)
    assert (config.probe_ms, settings.metrics_port, settings.log_format) == (250, 7002, "console")
    assert settings.nats_url == "nats://127.0.0.1:4999"
    monkeypatch.setenv("AEP_GATE_PROBE_MS", "300")
    settings, config = gate_settings(build_parser().parse_args(["gate"]))
    assert (config.probe_ms, settings.metrics_port, settings.log_format) == (300, 7001, "json")
