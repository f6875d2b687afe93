"""Issue 44 item 6b: a NATS URL's credential never reaches stderr. Hermes logs a hook's stderr,
so the shim's connect errors, and `aep-bridge spool drain`'s, print the server as
`aep-bridge config` shows it (``user:*****@host``, ``*****@host``). Checked at process
level against a real nats-server running the sample deploy/nats/nats.conf: a wrong password
(the server's own refusal) and a port nobody listens on."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bridge.shim import hook
from tests.support.cli import free_port
from tests.support.nats_roles import configured_server, sample_nats_conf

ROOT = Path(__file__).resolve().parents[2]
SECRET = "s3cret-Pw-44"
TOKEN = "t0ken-44-xyz"


@pytest.fixture(scope="module")
def sample_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("nats-sample-6b")
    with configured_server(tmp, sample_nats_conf(tmp / "js")) as url:
        yield url


def urls(server: str) -> str:
    host = server.removeprefix("nats://")
    closed = f"127.0.0.1:{free_port()}"
    # a user with the wrong password on the real server, a token on a closed port
    return f"nats://hermes-shim:{SECRET}@{host},nats://{TOKEN}@{closed}"


def env_for(server: str, spool: Path) -> dict[str, str]:
    return {**os.environ, "AEP_BRIDGE_NATS_URL": urls(server), "AEP_BRIDGE_SPOOL_DIR": str(spool),
            "AEP_BRIDGE_INSTANCE": "gw-6b", "AEP_BRIDGE_DEADLINE_MS": "1500",
            "AEP_BRIDGE_CONFIG": str(spool / "no-such-file")}


def test_the_shim_and_spool_drain_mask_url_credentials(sample_server: str, tmp_path: Path) -> None:
    env = env_for(sample_server, tmp_path)
    shim = subprocess.run([sys.executable, "-I", "-S", hook.__file__], env=env, capture_output=True, timeout=30,
                          input=b'{"hook_event_name": "pre_tool_call", "session_id": "s1", "extra": {}}')
    assert (shim.returncode, shim.stdout.strip()) == (0, b"{}"), shim.stderr
    drain = subprocess.run([sys.executable, "-m", "bridge.cli", "spool", "drain"], env=env, capture_output=True,
                           timeout=60, cwd=ROOT)
    assert drain.returncode == 1, drain
    assert "nats://*****@127.0.0.1" in shim.stderr.decode()  # it tried both servers
    for what, err in (("shim", shim.stderr.decode()), ("spool drain", drain.stderr.decode())):
        print(what, err)
        assert "spool" in err or "NATS" in err, err  # it did say what failed
        assert SECRET not in err and TOKEN not in err, f"{what} printed a credential: {err}"
        assert "nats://hermes-shim:*****@127.0.0.1" in err, err
        assert "uthorization" in err, err  # the server's refusal is still reported


def test_masked_url_forms() -> None:
    assert hook.masked_url("nats://u:p@h:1") == "nats://u:*****@h:1"
    assert hook.masked_url("tls://tok@h") == "tls://*****@h"
    assert hook.masked_url("u:p@h") == "u:*****@h"
    assert hook.masked_url("nats://h:4222") == "nats://h:4222"
    assert hook.masked_url("nats://u:p%40x@h/path@x") == "nats://u:*****@h/path@x"
