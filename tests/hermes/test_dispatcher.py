"""The real hermes-agent 0.19.0 dispatcher runs the installed shim for every observed event.

`aep-bridge hermes install` writes the hooks and the consent into a temporary
HERMES_HOME; a fresh Python process then does what Hermes's CLI and gateway do at
start-up (``register_from_config(load_config())``, without any accept-hooks
override, so only the allowlist makes them register) and fires every envelope of
observed_envelopes.jsonl through ``hermes_cli.plugins.invoke_hook``, i.e. through
Hermes's own payload serialisation, subprocess spawning and response parsing.
Each event must then be on HERMES_RAW, in order, with the envelope Hermes sent.

Run alone with ``pytest -m hermes``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from bridge.shim import hook
from bridge.hermes import install as inst
from tests import corpus
from tests.natsfixture import JetStreamClient, NatsServer

pytestmark = pytest.mark.hermes

DRIVER = r"""
import json, os, sys
from hermes_cli.config import load_config
from agent.shell_hooks import register_from_config
from hermes_cli.plugins import invoke_hook

specs = register_from_config(load_config(), accept_hooks=False)
print(json.dumps(sorted({s.event for s in specs})), flush=True)
if sys.argv[1] == "register-only":
    sys.exit(0)
for line in open(sys.argv[1]):
    env = json.loads(line)["envelope"]
    kwargs = {k: v for k, v in env["extra"].items() if k != "telemetry_schema_version"}
    kwargs.update(tool_name=env["tool_name"], args=env["tool_input"], session_id=env["session_id"])
    results = invoke_hook(env["hook_event_name"], **kwargs)
    print(json.dumps(results, default=str), flush=True)
"""


def driver_env(home: Path, workdir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AEP_BRIDGE_", "HERMES_"))}
    env.update(HERMES_HOME=str(home), HOME=str(workdir), AEP_BRIDGE_CONFIG=os.devnull)
    return env


def test_hermes_dispatches_every_observed_event_to_hermes_raw(
    nats_server: NatsServer, jetstream: JetStreamClient, tmp_path: Path
) -> None:
    pytest.importorskip("agent.shell_hooks", reason="hermes-agent==0.19.0 (the [hermes] extra) is required")
    from importlib.metadata import version

    assert version("hermes-agent") == "0.19.0"
    records = corpus.records()
    events = sorted({r["envelope"]["hook_event_name"] for r in records})
    home = tmp_path / "hermes"
    home.mkdir()
    (home / "config.yaml").write_text("# test profile\nmodel:\n  default: fake-model\n")
    instance = f"hermes-{uuid.uuid4().hex[:8]}"
    settings = {
        "AEP_BRIDGE_NATS_URL": nats_server.url,
        "AEP_BRIDGE_INSTANCE": instance,
        "AEP_BRIDGE_SPOOL_DIR": str(tmp_path / "spool"),
    }
    res = inst.install(home, events=events, settings=settings)
    workdir = tmp_path / "work"
    workdir.mkdir()

    # Control: without the consent records Hermes registers nothing (non-interactive).
    bare = tmp_path / "bare"
    shutil.copytree(home, bare)
    (bare / inst.ALLOWLIST_FILENAME).unlink()
    probe = subprocess.run([sys.executable, "-c", DRIVER, "register-only"], env=driver_env(bare, workdir),
                           cwd=workdir, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert json.loads(probe.stdout.splitlines()[0]) == []

    corpus_file = tmp_path / "corpus.jsonl"
    corpus_file.write_text("".join(json.dumps(r) + "\n" for r in records))
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(corpus_file)], env=driver_env(home, workdir),
                          cwd=workdir, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert json.loads(lines[0]) == events, "Hermes did not register the shim for every event"
    # The shim answers {}: Hermes sees no directive, the agent's behaviour is unchanged.
    assert [json.loads(x) for x in lines[1:]] == [[] for _ in records]
    for trouble in ("shell hook failed", "shell hook timed out", "shell hook exited", "not allowlisted"):
        assert trouble not in proc.stderr, proc.stderr[-2000:]

    msgs = jetstream.fetch(f"hermes.raw.{instance}.>", expected=len(records), timeout=20)
    assert len(msgs) == len(records)
    assert not (tmp_path / "spool" / f"{instance}.spool").exists() or (tmp_path / "spool" / f"{instance}.spool").stat().st_size == 0
    for msg, rec in zip(msgs, records):
        original = rec["envelope"]
        body = msg.json()
        assert msg.subject == f"hermes.raw.{instance}.{hook.token(original['hook_event_name'])}"
        assert msg.headers["Nats-Msg-Id"] == body["id"] and body["instance"] == instance
        expected = json.loads(json.dumps(original))
        expected["cwd"] = str(workdir)  # Hermes puts its own working directory in
        expected["extra"] = {k: v for k, v in expected["extra"].items() if k not in hook.DROP_EXTRA}
        assert body["envelope"] == expected, (rec["scenario"], rec["seq"])
    assert res.command in (home / "config.yaml").read_text()
