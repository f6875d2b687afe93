"""One settings table (bridge/config.py): every command reads flags, then the environment, then
the AEP_BRIDGE_CONFIG file; the shim and the services resolve the keys they share alike; a bad
value is named; `aep-bridge config` shows what is in effect, secrets masked."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from bridge import cli
from bridge import config as bridge_config
from bridge.shim import hook
from tests.support.cli import cli as support_cli

ROOT = Path(__file__).resolve().parents[1]


def settings_file(tmp_path: Path, **values: str) -> Path:
    path = tmp_path / "aep-bridge.env"
    path.write_text("".join(f"{k}={v}\n" for k, v in values.items()))
    return path


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):  # type: ignore[no-untyped-def]
    """No AEP_* variable of the developer's shell, HOME in tmp (no ~/.config/aep-bridge/env)."""
    for name in list(os.environ):
        if name.startswith(("AEP_", "XDG_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return monkeypatch


# ---------------------------------------------------------------- the file is honoured by every command


def test_the_relay_reads_its_listen_address_from_the_config_file(tmp_path: Path) -> None:
    from bridge.services.relay.config import from_env

    path = settings_file(tmp_path, AEP_BRIDGE_RELAY_LISTEN="127.0.0.1:9999", AEP_BRIDGE_RELAY_QUEUE="77")
    cfg = from_env({"AEP_BRIDGE_CONFIG": str(path), "HOME": str(tmp_path)})
    assert (cfg.host, cfg.port, cfg.queue) == ("127.0.0.1", 9999, 77)
    # the environment still wins over the file
    cfg = from_env({"AEP_BRIDGE_CONFIG": str(path), "AEP_BRIDGE_RELAY_LISTEN": "127.0.0.1:9000"})
    assert cfg.port == 9000


def test_the_exporter_reads_its_sinks_file_from_the_config_file(clean_env, tmp_path: Path, capsys) -> None:
    sinks = tmp_path / "sinks.yaml"
    sinks.write_text("sinks:\n  - {name: s1, url: 'bogus://nowhere'}\n")
    clean_env.setenv("AEP_BRIDGE_CONFIG", str(settings_file(tmp_path, AEP_BRIDGE_EXPORT_CONFIG=str(sinks))))
    assert cli.main(["exporter"]) == 2
    err = capsys.readouterr().err
    assert "bogus://nowhere" in err and "no sinks" not in err  # the file named there was read


def test_the_exporter_takes_the_sasl_password_from_the_config_file(clean_env, tmp_path: Path) -> None:
    import argparse

    from bridge.commands.services import exporter_sinks

    clean_env.setenv("AEP_BRIDGE_CONFIG", str(settings_file(tmp_path, AEP_BRIDGE_KAFKA_SASL_PASSWORD="from-file")))
    args = argparse.Namespace(sink=["kafka://k:9092/t"], config=None)
    assert exporter_sinks(args)[0].kafka["sasl.password"] == "from-file"
    clean_env.setenv("AEP_BRIDGE_KAFKA_SASL_PASSWORD", "from-env")
    assert exporter_sinks(args)[0].kafka["sasl.password"] == "from-env"


def test_the_profiler_reads_tracemalloc_from_the_config_file(clean_env, tmp_path: Path) -> None:
    from bridge.runtime import profiling

    snaps = tmp_path / "snaps"
    clean_env.setenv("AEP_BRIDGE_CONFIG", str(settings_file(
        tmp_path, AEP_BRIDGE_TRACEMALLOC=str(snaps), AEP_BRIDGE_TRACEMALLOC_EVERY_S="3600", AEP_BRIDGE_TRACEMALLOC_FRAMES="0")))
    profiler = profiling.start_allocation_profiler("cfgtest")
    try:
        assert profiler is not None and profiler.dir == str(snaps) and profiler.frames == 0
    finally:
        profiling.stop_allocation_profiler()


# ---------------------------------------------------------------- the shim and the services agree

SHARED_CASES = [
    {},
    {"XDG_STATE_HOME": "/tmp/xs"},
    {"XDG_STATE_HOME": "~/xs"},
    {"AEP_BRIDGE_SPOOL_DIR": "~/sp"},
    {"AEP_BRIDGE_SPOOL_DIR": "", "XDG_STATE_HOME": ""},
    {"AEP_BRIDGE_SPOOL_DIR": "/abs/sp", "XDG_STATE_HOME": "/ignored"},
    {"AEP_BRIDGE_DEADLINE_MS": "0"},
    {"AEP_BRIDGE_DEADLINE_MS": "abc"},
    {"AEP_BRIDGE_DEADLINE_MS": ""},
    {"AEP_BRIDGE_DEADLINE_MS": " 300 "},
    {"AEP_BRIDGE_DEADLINE_MS": "60001"},
    {"AEP_BRIDGE_DEADLINE_MS": "1e3"},
    {"AEP_BRIDGE_DEADLINE_MS": "9" * 50},
    {"AEP_BRIDGE_MAX_FIELD_BYTES": "1023", "AEP_BRIDGE_SPOOL_MAX_BYTES": "-1"},
    {"AEP_BRIDGE_MAX_FIELD_BYTES": "2048", "AEP_BRIDGE_SPOOL_MAX_BYTES": "0"},
    {"AEP_BRIDGE_NATS_URL": ""},
    {"AEP_BRIDGE_NATS_URL": "nats://a:1, nats://b:2 ,"},
    {"AEP_BRIDGE_INSTANCE": "gw-1", "TMPDIR": "/tmp/t/"},
    {"AEP_BRIDGE_INSTANCE": "", "TMPDIR": ""},
    {"AEP_HERMES_CONTROL": " TRUE ", "AEP_HERMES_HOLD_MS": "0", "AEP_INSTRUCT": "yes"},
    {"AEP_HERMES_CONTROL": "maybe", "AEP_INSTRUCT": "no"},
    {"AEP_HERMES_CONTROL": "1", "AEP_HERMES_HOLD_MS": "1000"},
    {"AEP_HERMES_CONTROL": "on", "AEP_HERMES_HOLD_MS": "x"},
]


def shim_and_bridge(env: dict[str, str]) -> tuple[dict, dict]:  # type: ignore[type-arg]
    cfg = hook.Config(env)
    s = bridge_config.Settings.from_env(env)
    shim = {"servers": cfg.servers, "instance": cfg.instance, "spool_dir": cfg.spool_dir, "deadline_ms": cfg.deadline_ms,
            "max_field_bytes": cfg.max_field_bytes, "spool_max_bytes": cfg.spool_max_bytes,
            "fallback_dir": cfg.fallback_dir, "control": cfg.control, "instruct": cfg.instruct}
    ours = {"servers": s.servers, "instance": s.instance, "spool_dir": str(s.spool_dir), "deadline_ms": s.deadline_ms,
            "max_field_bytes": s.max_field_bytes, "spool_max_bytes": s.spool_max_bytes,
            "fallback_dir": getattr(s, "fallback_dir", None)}
    from bridge.services.gate.config import GateConfig

    gate = GateConfig.from_env(env)
    ours.update(control=gate.control, instruct=gate.instruct)
    if cfg.control:
        shim["hold_ms"] = cfg.hold_ms
        ours["hold_ms"] = bridge_config.setting("AEP_HERMES_HOLD_MS", env)
    return shim, ours


@pytest.mark.parametrize("case", SHARED_CASES, ids=lambda c: ",".join(f"{k}={v!r}" for k, v in c.items()) or "defaults")
def test_the_shim_and_the_bridge_resolve_shared_settings_alike(case: dict[str, str], tmp_path: Path) -> None:
    home = str(tmp_path / "u")
    env = {"AEP_BRIDGE_CONFIG": "/nonexistent", "HOME": home, **case}
    shim, ours = shim_and_bridge(env)
    assert shim == ours
    # the same values from the settings file give the same answers too
    path = settings_file(tmp_path, **case)
    shim, ours = shim_and_bridge({"AEP_BRIDGE_CONFIG": str(path), "HOME": home})
    assert shim == ours


def test_the_issue_example_agrees(tmp_path: Path) -> None:
    env = {"AEP_BRIDGE_CONFIG": os.devnull, "HOME": "/root", "XDG_STATE_HOME": "/tmp/xs",
           "AEP_BRIDGE_DEADLINE_MS": "0", "AEP_BRIDGE_SPOOL_DIR": "~/sp"}
    s = bridge_config.Settings.from_env(env)
    assert (str(s.spool_dir), s.deadline_ms) == ("/root/sp", 250)
    assert str(bridge_config.Settings.from_env({**env, "AEP_BRIDGE_SPOOL_DIR": ""}).spool_dir) == "/tmp/xs/aep-bridge/spool"


def test_a_settings_file_named_with_a_tilde_is_found_by_both(tmp_path: Path) -> None:
    settings_file(tmp_path, AEP_BRIDGE_DEADLINE_MS="321", AEP_BRIDGE_NATS_URL="nats://f:1")
    env = {"AEP_BRIDGE_CONFIG": "~/aep-bridge.env", "HOME": str(tmp_path)}
    shim, ours = shim_and_bridge(env)
    assert shim == ours and ours["deadline_ms"] == 321 and ours["servers"] == ["nats://f:1"]


# ---------------------------------------------------------------- a bad value is named


@pytest.mark.parametrize(("name", "raw", "message"), [
    ("AEP_BRIDGE_METRICS_PORT", "abc", "AEP_BRIDGE_METRICS_PORT must be an integer in 0-65535, got 'abc'"),
    ("AEP_BRIDGE_METRICS_PORT", "70000", "AEP_BRIDGE_METRICS_PORT must be an integer in 0-65535, got '70000'"),
    ("AEP_BRIDGE_PARTITIONS", "0", "AEP_BRIDGE_PARTITIONS must be an integer in 1-65536, got '0'"),
    ("AEP_BRIDGE_LANE_WAIT_MS", "soon", "AEP_BRIDGE_LANE_WAIT_MS must be an integer in 0-3600000, got 'soon'"),
    ("AEP_BRIDGE_TICK_S", "0", "AEP_BRIDGE_TICK_S must be a number > 0, got '0'"),
    ("AEP_BRIDGE_TICK_S", "nan", "AEP_BRIDGE_TICK_S must be a number > 0, got 'nan'"),
    ("AEP_BRIDGE_LOG_FORMAT", "xml", "AEP_BRIDGE_LOG_FORMAT must be one of json, console, got 'xml'"),
    ("AEP_BRIDGE_CAPTURE", "most", "AEP_BRIDGE_CAPTURE must be one of none, metadata, redacted, full, got 'most'"),
])
def test_a_bad_value_names_its_variable_and_range(name: str, raw: str, message: str) -> None:
    with pytest.raises(bridge_config.SettingError) as exc:
        bridge_config.Settings.from_env({"AEP_BRIDGE_CONFIG": os.devnull, name: raw})
    assert str(exc.value) == message


@pytest.mark.parametrize(("role", "name", "raw", "message"), [
    ("relay", "AEP_BRIDGE_RELAY_QUEUE", "many", "AEP_BRIDGE_RELAY_QUEUE must be an integer in 1-10000000, got 'many'"),
    ("relay", "AEP_BRIDGE_RELAY_LISTEN", "nowhere", "AEP_BRIDGE_RELAY_LISTEN must be HOST:PORT with a port in 0-65535, got 'nowhere'"),
    ("relay", "AEP_BRIDGE_RELAY_INSECURE", "perhaps", "AEP_BRIDGE_RELAY_INSECURE must be one of 1, true, yes, on, 0, false, no, off, got 'perhaps'"),
    ("gate", "AEP_GATE_PROBE_MS", "fast", "AEP_GATE_PROBE_MS must be an integer in 1-3600000, got 'fast'"),
    ("mapper", "AEP_BRIDGE_TRACEMALLOC_FRAMES", "all", "AEP_BRIDGE_TRACEMALLOC_FRAMES must be an integer in 0-100, got 'all'"),
    ("mapper", "AEP_BRIDGE_TRACEMALLOC_EVERY_S", "0.5", "AEP_BRIDGE_TRACEMALLOC_EVERY_S must be a number in 1-86400, got '0.5'"),
])
def test_every_role_names_a_bad_value(role: str, name: str, raw: str, message: str) -> None:
    with pytest.raises(bridge_config.SettingError) as exc:
        bridge_config.resolve(role, {"AEP_BRIDGE_CONFIG": os.devnull, name: raw})
    assert str(exc.value) == message


def test_a_secret_bad_value_is_not_echoed() -> None:
    f = bridge_config.Field("AEP_X_TOKEN", "int", None, frozenset({"relay"}), "", secret=True)
    assert "s3cret" not in str(f.error("s3cret"))


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT), "AEP_BRIDGE_CONFIG": os.devnull,
            "HOME": os.environ.get("HOME", "/tmp"), **env}
    return support_cli(*args, env=full, inherit=False)


@pytest.mark.parametrize("command", [["mapper"], ["pairing"], ["exporter", "--sink", "kafka://k:9092/t"]])
def test_a_command_with_a_bad_value_exits_2_with_the_message(command: list[str]) -> None:
    proc = run_cli(*command, env={"AEP_BRIDGE_METRICS_PORT": "abc", "AEP_BRIDGE_NATS_URL": "nats://127.0.0.1:1"})
    assert proc.returncode == 2, proc.stderr
    assert "AEP_BRIDGE_METRICS_PORT must be an integer in 0-65535, got 'abc'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_relay_with_a_bad_file_value_exits_2(tmp_path: Path) -> None:
    path = settings_file(tmp_path, AEP_BRIDGE_RELAY_HEARTBEAT_S="99")
    proc = run_cli("relay", env={"AEP_BRIDGE_CONFIG": str(path), "AEP_BRIDGE_NATS_URL": "nats://127.0.0.1:1"})
    assert proc.returncode == 2, proc.stderr
    assert "AEP_BRIDGE_RELAY_HEARTBEAT_S must be an integer in 1-30, got '99'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_bad_flag_names_the_flag(clean_env, capsys) -> None:
    assert cli.main(["config", "--role", "relay", "--listen", "nowhere"]) == 2
    assert "--listen (AEP_BRIDGE_RELAY_LISTEN) must be HOST:PORT with a port in 0-65535, got 'nowhere'" in capsys.readouterr().err


# ---------------------------------------------------------------- aep-bridge config

SECRETS = {
    "AEP_BRIDGE_NATS_PASSWORD": "pw-nats-1",
    "AEP_BRIDGE_NATS_TOKEN": "tok-nats-2",
    "AEP_BRIDGE_NATS_NKEY_SEED": "/run/seed-3.nk",
    "AEP_BRIDGE_RELAY_TOKEN": "relay-token-4-abcdefgh",
    "AEP_BRIDGE_KAFKA_SASL_PASSWORD": "sasl-5",
}
FILE_SECRETS = {
    "AEP_BRIDGE_NATS_URL": "nats://alice:url-pass-6@h1:4222,nats://url-token-7@h2:4222",
    "AEP_BRIDGE_KAFKA_SSL_KEY_PASSWORD": "keypw-8",
}


def config_json(clean_env, tmp_path: Path, capsys, *args: str) -> dict:  # type: ignore[type-arg]
    for k, v in SECRETS.items():
        clean_env.setenv(k, v)
    clean_env.setenv("AEP_BRIDGE_CONFIG", str(settings_file(
        tmp_path, **FILE_SECRETS, AEP_BRIDGE_RELAY_LISTEN="127.0.0.1:9999", AEP_BRIDGE_KAFKA_SASL_USERNAME="aep")))
    assert cli.main(["config", *args, "--json"]) == 0
    out = capsys.readouterr().out
    for secret in [*SECRETS.values(), "url-pass-6", "url-token-7", "keypw-8"]:
        assert secret not in out
    return json.loads(out)


ROLES = ["shim", "mapper", "pairing", "gate", "relay", "exporter", "bootstrap", "client"]


def test_the_roles_are_these() -> None:
    assert list(bridge_config.ROLES) == ROLES


@pytest.mark.parametrize("role", ROLES)
def test_config_shows_every_setting_of_a_role_with_its_source_and_secrets_masked(
        role: str, clean_env, tmp_path: Path, capsys) -> None:
    doc = config_json(clean_env, tmp_path, capsys, "--role", role)
    rows = {r["name"]: r for r in doc["settings"]}
    named = {f.name for f in bridge_config.fields_for(role) if not f.prefix}
    assert named <= set(rows) and all(role in r["roles"] for r in rows.values())
    assert doc["settings_file"].endswith("aep-bridge.env") and not doc["errors"]
    for name in named & set(SECRETS):
        assert rows[name] == {**rows[name], "value": bridge_config.MASK, "source": "env"}
    if "AEP_BRIDGE_NATS_URL" in rows:
        assert rows["AEP_BRIDGE_NATS_URL"]["value"] == "nats://alice:*****@h1:4222,nats://*****@h2:4222"
        assert rows["AEP_BRIDGE_NATS_URL"]["source"] == "file " + doc["settings_file"]
    if role == "relay":
        assert rows["AEP_BRIDGE_RELAY_LISTEN"]["value"] == "127.0.0.1:9999"
        assert rows["AEP_BRIDGE_RELAY_QUEUE"] == {**rows["AEP_BRIDGE_RELAY_QUEUE"], "value": "10000", "source": "default"}
    if role == "exporter":
        assert rows["AEP_BRIDGE_KAFKA_SSL_KEY_PASSWORD"]["value"] == bridge_config.MASK
        assert rows["AEP_BRIDGE_KAFKA_SASL_USERNAME"]["value"] == "aep"
    if role == "mapper":
        assert rows["AEP_BRIDGE_METRICS_PORT"]["value"] == "9464"
    if role == "shim":
        assert "AEP_BRIDGE_RELAY_LISTEN" not in rows and rows["AEP_BRIDGE_DEADLINE_MS"]["value"] == "250"


def test_config_flags_win_and_are_masked(clean_env, tmp_path: Path, capsys) -> None:
    doc = config_json(clean_env, tmp_path, capsys, "--role", "relay", "--nats", "nats://bob:flag-pw-9@h3",
                      "--listen", "127.0.0.1:7000")
    rows = {r["name"]: r for r in doc["settings"]}
    assert "flag-pw-9" not in json.dumps(doc)
    assert (rows["AEP_BRIDGE_NATS_URL"]["value"], rows["AEP_BRIDGE_NATS_URL"]["source"]) == ("nats://bob:*****@h3", "flag --nats")
    assert (rows["AEP_BRIDGE_RELAY_LISTEN"]["value"], rows["AEP_BRIDGE_RELAY_LISTEN"]["source"]) == ("127.0.0.1:7000", "flag --listen")


def test_config_text_output_and_shim_notes(clean_env, tmp_path: Path, capsys) -> None:
    clean_env.setenv("AEP_BRIDGE_DEADLINE_MS", "0")
    clean_env.setenv("AEP_BRIDGE_NATS_PASSWORD", "pw-text-10")
    clean_env.setenv("AEP_BRIDGE_CONFIG", os.devnull)
    assert cli.main(["config", "--role", "shim"]) == 0
    out = capsys.readouterr().out
    assert "pw-text-10" not in out
    line = next(x for x in out.splitlines() if x.startswith("AEP_BRIDGE_DEADLINE_MS"))
    assert "250" in line and "(default)" in line and "'0' is not an integer in [1, 60000]" in line
    assert next(x for x in out.splitlines() if x.startswith("AEP_BRIDGE_NATS_PASSWORD")).split()[1] == bridge_config.MASK


def test_config_reports_every_bad_value_and_exits_2(clean_env, capsys) -> None:
    clean_env.setenv("AEP_BRIDGE_CONFIG", os.devnull)
    clean_env.setenv("AEP_BRIDGE_METRICS_PORT", "abc")
    clean_env.setenv("AEP_BRIDGE_PARTITIONS", "-3")
    assert cli.main(["config", "--role", "mapper"]) == 2
    err = capsys.readouterr().err
    assert "AEP_BRIDGE_METRICS_PORT must be an integer in 0-65535, got 'abc'" in err
    assert "AEP_BRIDGE_PARTITIONS must be an integer in 1-65536, got '-3'" in err


def test_every_field_is_documented_in_the_readme() -> None:
    readme = (ROOT / "README.md").read_text()
    missing = [f.name for f in bridge_config.FIELDS if f"`{f.name}" not in readme and f.name not in readme]
    assert not missing


def test_hermes_doctor_looks_at_the_spool_the_shim_uses(tmp_path: Path) -> None:
    """The shim expands `~` in AEP_BRIDGE_SPOOL_DIR (from its settings file); `hermes doctor` must
    count the record it spooled there (it looked at a literal `~/sp`)."""
    import shlex

    from bridge.hermes import install as inst
    from tests.support.shim import dumps, envelope

    home = tmp_path / "hermes"
    home.mkdir()
    (home / "config.yaml").write_text("model: x\n")
    settings = {"AEP_BRIDGE_NATS_URL": "nats://127.0.0.1:1", "AEP_BRIDGE_INSTANCE": "doc-spool",
                "AEP_BRIDGE_SPOOL_DIR": "~/sp", "AEP_BRIDGE_DEADLINE_MS": "250"}
    res = inst.install(home, events=["pre_tool_call"], settings=settings)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "TMPDIR": str(tmp_path)}
    proc = subprocess.run(shlex.split(res.command), input=dumps(envelope()), capture_output=True, env=env, timeout=10)
    assert proc.returncode == 0 and (tmp_path / "sp" / "doc-spool.spool").exists(), proc.stderr
    doc = run_cli("hermes", "doctor", "--timeout", "1", env={**env, "HERMES_HOME": str(home)})
    assert "1 pending" in doc.stdout and str(tmp_path / "sp") in doc.stdout, doc.stdout + doc.stderr
