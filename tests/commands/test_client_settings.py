"""The operator's commands (tail, demo, simulate, usage, status, control) find NATS one way
(issue 38: the rule was written twice, in commands/stack.py and commands/control.py):
--nats > AEP_BRIDGE_NATS_URL > the running `up` (up.json, with its generated credential) >
the settings file > the default."""

from __future__ import annotations

import os

from bridge.commands.control import _settings
from bridge.commands.stack import settings_for
from bridge.config import DEFAULT_NATS_URL
from bridge.stack.up import client_settings

UP = {"nats_url": "nats://127.0.0.1:4333", "client_env": {"AEP_BRIDGE_NATS_USER": "operator", "AEP_BRIDGE_NATS_PASSWORD": "pw"}}
BASE = {"AEP_BRIDGE_CONFIG": os.devnull}


def test_the_flag_then_the_environment_then_up_then_the_default() -> None:
    env = {**BASE, "AEP_BRIDGE_NATS_URL": "nats://10.0.0.1:4222"}
    flag = client_settings("nats://127.0.0.1:5000", environ=env, state=UP)
    assert flag.nats_url == "nats://127.0.0.1:5000" and flag.nats_user is None
    from_env = client_settings(None, environ=env, state=UP)
    assert from_env.nats_url == "nats://10.0.0.1:4222" and from_env.nats_user is None
    from_up = client_settings(None, environ=BASE, state=UP)
    assert (from_up.nats_url, from_up.nats_user, from_up.nats_password) == (UP["nats_url"], "operator", "pw")
    assert client_settings(None, environ=BASE, use_up=False).nats_url == DEFAULT_NATS_URL


def test_both_command_groups_use_it(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))  # no running `up`
    monkeypatch.setenv("AEP_BRIDGE_CONFIG", os.devnull)
    monkeypatch.setenv("AEP_BRIDGE_NATS_URL", "nats://10.0.0.2:4222")

    class Args:
        nats = None

    assert settings_for(Args()).nats_url == _settings(Args()).nats_url == "nats://10.0.0.2:4222"
    Args.nats = "nats://10.0.0.3:4222"
    assert settings_for(Args()).nats_url == _settings(Args()).nats_url == "nats://10.0.0.3:4222"
