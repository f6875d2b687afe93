"""`aep-bridge hermes install | uninstall | doctor` against a temporary HERMES_HOME."""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from bridge.hermes import install as inst
from tests.natsfixture import JetStreamClient, NatsServer
from tests.support.cli import free_port
from tests.support.shim import dumps, envelope
from tests.support.cli import cli

ROOT = Path(__file__).resolve().parents[2]

ORIGINAL = """\
# Hermes configuration (hand-written)
model:
    default: fake-model      # keep this comment
    provider: custom

toolsets:
    - terminal   # the shell
    - file

# my own hook stays
hooks:
    pre_tool_call:
        - command: "/usr/local/bin/audit.sh"
          matcher: "terminal"
          timeout: 5

hooks_auto_accept: false
"""

SETTINGS = {"AEP_BRIDGE_NATS_URL": "nats://127.0.0.1:1", "AEP_BRIDGE_INSTANCE": "inst-test", "AEP_BRIDGE_DEADLINE_MS": "250"}


def home_with(tmp_path: Path, text: str | None = ORIGINAL) -> Path:
    home = tmp_path / "hermes"
    home.mkdir()
    if text is not None:
        (home / "config.yaml").write_text(text)
    return home


def plain_config(home: Path) -> dict:
    from ruamel.yaml import YAML

    return json.loads(json.dumps(YAML(typ="safe").load((home / "config.yaml").read_text())))


def test_round_trip_keeps_the_file_and_its_comments(tmp_path: Path) -> None:
    home = home_with(tmp_path)
    res = inst.install(home, events=["pre_tool_call", "post_tool_call", "on_session_end"], settings=SETTINGS)
    text = (home / "config.yaml").read_text()
    for line in ORIGINAL.splitlines():
        if line.strip().startswith("#") or "comment" in line or "# the shell" in line:
            assert line in text, f"lost: {line!r}"
    cfg = plain_config(home)
    assert cfg["model"] == {"default": "fake-model", "provider": "custom"}
    pre = cfg["hooks"]["pre_tool_call"]
    assert pre[0] == {"command": "/usr/local/bin/audit.sh", "matcher": "terminal", "timeout": 5}
    assert pre[1] == {"command": res.command, "timeout": 3}
    assert cfg["hooks"]["post_tool_call"] == [{"command": res.command, "timeout": 3}]
    assert sorted(res.added) == ["on_session_end", "post_tool_call", "pre_tool_call"]
    # the command Hermes will shlex.split: absolute interpreter, -I -S, the compiled shim, the env file
    argv = shlex.split(res.command)
    assert argv[0] == sys.executable and os.path.isabs(argv[0]) and argv[1:3] == ["-I", "-S"]
    assert argv[3].endswith(".pyc") and inst.pyc_is_current(Path(argv[3]))[0]
    assert argv[4:] == ["--config", str(home / "aep-bridge.env")]
    done = inst.uninstall(home)
    assert (home / "config.yaml").read_text() == ORIGINAL  # byte for byte
    assert any("revoked 3 approval" in line for line in done)
    assert sorted(p.name for p in home.iterdir()) == ["config.yaml"]


STYLES = [
    "# two, dash at the parent's column\nmodel:\n  default: m\ntoolsets:\n- terminal\n- file\nhooks:\n  on_session_end:\n  - command: /bin/true\n",
    "model:\n  default: m  # c\ntoolsets:\n  - terminal\nhooks: {}\n",
    "toolsets: [terminal, file]   # flow style\nplatforms:\n    cli:\n        enabled: true\n",
    "hooks:\n",
    "",
]


@pytest.mark.parametrize("text", STYLES)
def test_round_trip_in_several_styles(tmp_path: Path, text: str) -> None:
    home = home_with(tmp_path, text)
    res = inst.install(home, events=["pre_tool_call", "on_session_end"], settings=SETTINGS)
    cfg = plain_config(home)
    assert {"command": res.command, "timeout": 3} in cfg["hooks"]["pre_tool_call"]
    assert {"command": res.command, "timeout": 3} in cfg["hooks"]["on_session_end"]
    inst.uninstall(home)
    assert (home / "config.yaml").read_text() == text


def test_install_is_idempotent_and_uninstall_exact(tmp_path: Path) -> None:
    home = home_with(tmp_path)
    first = inst.install(home, events=["pre_tool_call"], settings=SETTINGS)
    # an approval the user had given before must survive our uninstall: pretend it pre-existed
    # by approving another event for the same command by hand
    with inst.locked_allowlist(home) as data:
        data["approvals"].append(inst.approval_entry("post_llm_call", first.command))
    again = inst.install(home, events=["pre_tool_call"], settings=SETTINGS)
    assert again.command == first.command and again.added == [] and again.already == ["pre_tool_call"]
    assert again.approved == []
    cfg = plain_config(home)
    assert [e["command"] for e in cfg["hooks"]["pre_tool_call"]].count(first.command) == 1
    approvals = inst.read_allowlist(home)["approvals"]
    assert sum(1 for a in approvals if a["event"] == "pre_tool_call") == 1
    inst.uninstall(home)
    assert (home / "config.yaml").read_text() == ORIGINAL
    left = inst.read_allowlist(home)["approvals"]
    assert [(a["event"], a["command"]) for a in left] == [("post_llm_call", first.command)]


def test_fresh_home_is_left_empty_after_uninstall(tmp_path: Path) -> None:
    home = home_with(tmp_path, None)
    res = inst.install(home, settings=SETTINGS)
    assert sorted(res.added) == sorted(inst.ALL_EVENTS)
    cfg = plain_config(home)
    assert set(cfg["hooks"]) == set(inst.ALL_EVENTS)
    env_file = home / "aep-bridge.env"
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    text = env_file.read_text()
    assert "AEP_BRIDGE_NATS_URL=nats://127.0.0.1:1" in text and "AEP_BRIDGE_INSTANCE=inst-test" in text
    inst.uninstall(home)
    assert list(home.iterdir()) == []


def test_reinstall_with_another_command_replaces_the_old_one(tmp_path: Path) -> None:
    home = home_with(tmp_path)
    compiled = inst.install(home, events=["pre_tool_call"], settings=SETTINGS)
    source = inst.install(home, events=["pre_tool_call"], mode="source", settings=SETTINGS)
    assert shlex.split(source.command)[3] == str(inst.HOOK_SOURCE)
    cmds = [e["command"] for e in plain_config(home)["hooks"]["pre_tool_call"]]
    assert compiled.command not in cmds and source.command in cmds
    assert {a["command"] for a in inst.read_allowlist(home)["approvals"]} == {source.command}
    inst.uninstall(home)
    assert (home / "config.yaml").read_text() == ORIGINAL


def test_bad_arguments(tmp_path: Path) -> None:
    home = home_with(tmp_path)
    with pytest.raises(inst.InstallError, match="unknown Hermes hook"):
        inst.install(home, events=["pre_tool_cal"], settings=SETTINGS)
    with pytest.raises(inst.InstallError, match="absolute"):
        inst.install(home, python="python3", settings=SETTINGS)
    with pytest.raises(inst.InstallError, match="above"):
        inst.install(home, timeout=1, settings={**SETTINGS, "AEP_BRIDGE_DEADLINE_MS": "1500"})
    with pytest.raises(inst.InstallError, match="nothing to uninstall"):
        inst.uninstall(home)
    assert (home / "config.yaml").read_text() == ORIGINAL


def test_the_allowlist_is_what_hermes_reads(tmp_path: Path) -> None:
    shell_hooks = pytest.importorskip("agent.shell_hooks", reason="hermes-agent (the [hermes] extra) not installed")
    from hermes_constants import reset_hermes_home_override, set_hermes_home_override

    home = home_with(tmp_path)
    res = inst.install(home, events=["pre_tool_call", "subagent_stop"], settings=SETTINGS)
    token = set_hermes_home_override(home)
    try:
        specs = [s for s in shell_hooks.iter_configured_hooks(plain_config(home)) if s.command == res.command]
        assert sorted(s.event for s in specs) == ["pre_tool_call", "subagent_stop"]
        assert all(s.timeout * 1000 > 250 for s in specs)
        for s in specs:
            assert shell_hooks._is_allowlisted(s.event, s.command)
            entry = shell_hooks.allowlist_entry_for(s.event, s.command)
            assert entry["script_mtime_at_approval"] == shell_hooks.script_mtime_iso(s.command)
            assert entry["approved_at"].endswith("Z")
            assert shell_hooks.script_is_executable(s.command)
        # Hermes's own writer and ours agree on the file: it can add to it and we still read it
        shell_hooks._record_approval("on_session_end", "/bin/true")
        assert inst.is_approved(inst.read_allowlist(home), "on_session_end", "/bin/true")
    finally:
        reset_hermes_home_override(token)
    inst.uninstall(home)
    assert [a["command"] for a in inst.read_allowlist(home)["approvals"]] == ["/bin/true"]


def test_installed_command_runs_and_answers(tmp_path: Path) -> None:
    home = home_with(tmp_path)
    spool = tmp_path / "spool"
    res = inst.install(home, events=["pre_tool_call"], settings={**SETTINGS, "AEP_BRIDGE_SPOOL_DIR": str(spool)})
    proc = subprocess.run(shlex.split(res.command), input=dumps(envelope()), capture_output=True,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}, timeout=10)
    assert proc.returncode == 0 and proc.stdout.strip() == b"{}"
    assert (spool / "inst-test.spool").stat().st_size > 0  # NATS is unreachable in SETTINGS: spooled


# ---------------------------------------------------------------- the CLI, doctor included


def test_cli_install_doctor_uninstall(nats_server: NatsServer, jetstream: JetStreamClient, tmp_path: Path) -> None:
    home = home_with(tmp_path)
    env = {"AEP_BRIDGE_CONFIG": os.devnull, "AEP_BRIDGE_NATS_URL": nats_server.url, "AEP_BRIDGE_INSTANCE": "doc",
           "AEP_BRIDGE_SPOOL_DIR": str(tmp_path / "spool"), "HERMES_HOME": str(home)}
    out = cli("hermes", "install", "--events", "pre_tool_call,post_tool_call", "--events", "on_session_end", env=env)
    assert out.returncode == 0, out.stderr
    assert "added 3 event(s)" in out.stdout
    doc = cli("hermes", "doctor", env=env)
    assert doc.returncode == 0, doc.stdout + doc.stderr
    assert "registered for 3 event(s)" in doc.stdout and "NATS answers" in doc.stdout and "HERMES_RAW exists" in doc.stdout
    # NATS away: doctor says so and fails
    with open(home / "aep-bridge.env", "a") as fh:
        fh.write(f"AEP_BRIDGE_NATS_URL=nats://127.0.0.1:{free_port()}\n")
    down = cli("hermes", "doctor", "--timeout", "1", env={k: v for k, v in env.items() if k != "AEP_BRIDGE_NATS_URL"})
    assert down.returncode == 1 and "[FAIL] cannot connect to NATS" in down.stdout
    # consent revoked behind our back: doctor notices the hooks would not register
    with inst.locked_allowlist(home) as data:
        data["approvals"] = [a for a in data["approvals"] if a["event"] != "post_tool_call"]
    bad = cli("hermes", "doctor", env=env)
    assert bad.returncode == 1 and "not registered for: post_tool_call" in bad.stdout
    assert cli("hermes", "uninstall", env=env).returncode == 0
    assert (home / "config.yaml").read_text() == ORIGINAL
    gone = cli("hermes", "doctor", env=env)
    assert gone.returncode == 1 and "no aep-bridge install" in gone.stdout


def test_doctor_counts_what_waits_in_the_fallback_spool(tmp_path: Path) -> None:
    """An unwritable spool dir sends the shim's records to its private fallback under $TMPDIR
    (issue 13, finding 12); `hermes doctor` must see them there too."""
    home = home_with(tmp_path)
    blocked = tmp_path / "a-file-not-a-dir"
    blocked.write_text("")
    settings = {**SETTINGS, "AEP_BRIDGE_SPOOL_DIR": str(blocked)}
    res = inst.install(home, events=["pre_tool_call"], settings=settings)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "TMPDIR": str(tmp)}
    proc = subprocess.run(shlex.split(res.command), input=dumps(envelope()), capture_output=True, env=env, timeout=10)
    assert proc.returncode == 0 and proc.stdout.strip() == b"{}"
    doc = cli("hermes", "doctor", "--timeout", "1",
              env={**settings, "AEP_BRIDGE_CONFIG": os.devnull, "HERMES_HOME": str(home), "TMPDIR": str(tmp)})
    assert "1 pending" in doc.stdout and str(tmp) in doc.stdout, doc.stdout + doc.stderr


def test_spool_commands_read_the_installed_shims_settings_file(tmp_path: Path) -> None:
    """Without --config or AEP_BRIDGE_CONFIG, `spool status` / `drain` read the file the installed
    hook is registered with ($HERMES_HOME/aep-bridge.env), not ~/.config/aep-bridge/env, and say so."""
    home = home_with(tmp_path)
    spool = tmp_path / "spool"
    res = inst.install(home, events=["pre_tool_call"], settings={**SETTINGS, "AEP_BRIDGE_SPOOL_DIR": str(spool)})
    clean = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run(shlex.split(res.command), input=dumps(envelope()), capture_output=True, env=clean, timeout=10)
    assert proc.returncode == 0 and (spool / "inst-test.spool").stat().st_size > 0

    def spool_cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "bridge.cli", "spool", *args], capture_output=True, text=True,
                              env={**clean, "HERMES_HOME": str(home), "PYTHONPATH": str(ROOT)}, timeout=60, cwd=ROOT)

    status = spool_cli("status", "--json")
    assert status.returncode == 0, status.stderr
    st = json.loads(status.stdout)
    assert st["pending_records"] == 1 and st["settings_file"] == str(home / inst.ENV_FILENAME)
    text = spool_cli("status")
    assert f"settings       {home / inst.ENV_FILENAME}" in text.stdout and str(spool / "inst-test.spool") in text.stdout
    drain = spool_cli("drain", "--timeout", "1")  # NATS is unreachable in SETTINGS: the shim's server is tried
    assert drain.returncode == 1 and "127.0.0.1:1" in drain.stderr, drain.stderr
    assert f"settings       {home / inst.ENV_FILENAME}" in drain.stderr


def test_doctor_finds_the_fallback_spool_named_in_the_settings_file(tmp_path: Path) -> None:
    """TMPDIR set only in the shim's settings file: the shim's fallback spool is under it (the
    merged settings), and so is doctor's (not fallback_spool_dir(os.environ))."""
    home = home_with(tmp_path)
    blocked = tmp_path / "a-file-not-a-dir"
    blocked.write_text("")
    tmp = tmp_path / "tmp-from-file"
    tmp.mkdir()
    res = inst.install(home, events=["pre_tool_call"], settings={**SETTINGS, "AEP_BRIDGE_SPOOL_DIR": str(blocked)})
    with open(home / inst.ENV_FILENAME, "a") as fh:
        fh.write(f"TMPDIR={tmp}\n")
    clean = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run(shlex.split(res.command), input=dumps(envelope()), capture_output=True, env=clean, timeout=10)
    assert proc.returncode == 0 and any(tmp.iterdir()), proc.stderr
    env = {**clean, "HERMES_HOME": str(home), "PYTHONPATH": str(ROOT)}
    doc = subprocess.run([sys.executable, "-m", "bridge.cli", "hermes", "doctor", "--timeout", "1"], env=env,
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert "1 pending" in doc.stdout and str(tmp) in doc.stdout, doc.stdout + doc.stderr
