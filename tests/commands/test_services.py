"""The five services through one doorway (issue 38): one command path (`cmd_service`), one
`Service` shape that `serve` runs, and every flag a setting of the table (bridge/config.py
FIELDS) but for a command's own few. Before, each command had its own `cmd_*` (the gate's in
another module) calling its own `run()` with its own keywords, the relay was a function with
closures, and the flags were written by hand per command (the exporter took a --partitions
that no exporter setting reads)."""

from __future__ import annotations

import argparse
import os

import pytest

from bridge.cli import build_parser
from bridge.config import ROLE_METRICS_PORT, fields_for

NAMES = ("mapper", "pairing", "gate", "exporter", "relay")
#: the flags a service command takes beyond its role's settings
OWN = {"mapper": {"--capture-override", "--batch"}, "pairing": {"--replica"}, "gate": {"--capture-override"},
       "exporter": {"--sink"}, "relay": set()}
ARGS = {"exporter": ["--sink", "otlp+http://127.0.0.1:9/v1/logs"]}


def subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def test_every_service_command_resolves_to_the_one_path() -> None:
    from bridge.commands.services import cmd_service

    funcs = {name: build_parser().parse_args([name, *ARGS.get(name, [])]).func for name in NAMES}
    assert funcs == {name: cmd_service for name in NAMES}


@pytest.mark.parametrize("name", NAMES)
def test_a_service_commands_flags_are_its_roles_settings_and_its_own(name: str) -> None:
    flags = {s for a in subparser(name)._actions for s in a.option_strings if s.startswith("--") and s != "--help"}
    table = {f.flag for f in fields_for(name) if f.flag}
    assert flags == table | OWN[name], (sorted(flags - table - OWN[name]), sorted(table | OWN[name] - flags))


@pytest.mark.parametrize("name", NAMES)
def test_every_service_has_the_one_shape(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each command builds a `Service`: its name, settings, health, stopper, registry, the port
    of the table (none for the relay: its own), uvloop for the mapper and pairing, and no
    `close` or `run` of its own (the runtime's)."""
    from bridge.commands.services import COMMANDS, settings_from_args
    from bridge.runtime import Health, Service, Stopper

    monkeypatch.setenv("AEP_BRIDGE_CONFIG", os.devnull)
    args = build_parser().parse_args([name, "--nats", "nats://127.0.0.1:9", *ARGS.get(name, [])])
    service = COMMANDS[name].build(args, settings_from_args(args, name))
    assert isinstance(service, Service) and service.name == name
    assert isinstance(service.health, Health) and isinstance(service.stopper, Stopper)
    assert service.registry is not None and service.settings.nats_url == "nats://127.0.0.1:9"
    assert service.default_port == ROLE_METRICS_PORT.get(name)
    assert service.fast_loop == (name in ("mapper", "pairing"))
    assert type(service).close is Service.close and not hasattr(service, "run")
    assert service.connection() is None  # not connected yet


def test_every_service_logs_under_its_name_with_snake_case_events() -> None:
    """One logging shape: loggers ``aep_bridge.<service>``, event names in snake case (the relay
    had its own logger ``relay`` and spaced names such as ``relay listening``)."""
    import re
    from pathlib import Path

    import bridge.services

    root = Path(bridge.services.__file__).parent
    loggers, events = set(), []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        loggers.update(re.findall(r'get_logger\("([^"]*)"\)', text))
        events += [(path.name, e) for e in re.findall(r'\blog\.(?:debug|info|warning|error|exception)\(f?"([^"]*)"', text)]
    assert loggers == {f"aep_bridge.{name}" for name in NAMES}, loggers
    assert len(events) > 50 and [e for e in events if not re.fullmatch(r"[a-z0-9_{}.]+", e[1])] == [], events


def test_every_running_service_exits_0_within_5_s_of_sigterm(nats_server_fn, clean_env: dict[str, str], tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The five commands as processes on one server of their own (pairing takes every free
    partition), each ready (/readyz 200: connected and consuming), then SIGTERM: each exits 0
    within 5 s (issue 38; while connecting: tests/commands/test_nats_faults.py)."""
    import subprocess
    import sys
    import time

    from bridge.stack.server import terminate
    from tests.natsfixture import JetStreamClient
    from tests.support.cli import free_port
    from tests.support.services import http_json, wait_for
    from tests.support.up import ROOT

    client = JetStreamClient(nats_server_fn.url)
    try:
        client.bootstrap()
    finally:
        client.close()
    ports = {name: free_port() for name in NAMES}
    flags = {name: ["--listen", f"127.0.0.1:{ports[name]}"] if name == "relay" else ["--metrics-port", str(ports[name])]
             for name in NAMES}
    env = {**clean_env, "AEP_BRIDGE_CONFIG": os.devnull, "AEP_BRIDGE_METRICS_HOST": "127.0.0.1"}
    procs = {}
    for name in NAMES:
        with open(tmp_path / f"{name}.log", "w") as out:
            procs[name] = subprocess.Popen([sys.executable, "-m", "bridge.cli", name, "--nats", nats_server_fn.url,
                                            *flags[name], *ARGS.get(name, [])],
                                           env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        for name in NAMES:
            wait_for(lambda: http_json(f"http://127.0.0.1:{ports[name]}/readyz")[0] == 200 or procs[name].poll() is not None,
                     60, what=f"{name} ready")
            assert procs[name].poll() is None, (tmp_path / f"{name}.log").read_text()[-2000:]
        took = {}
        for name, proc in procs.items():
            started = time.monotonic()
            code = terminate(proc, 30)
            took[name] = (code, round(time.monotonic() - started, 2))
        print("SIGTERM -> exit (code, seconds):", took)
        assert all(code == 0 and s < 5 for code, s in took.values()), took
        for name in NAMES:
            assert f'"{name}_stopping"' in (tmp_path / f"{name}.log").read_text()
    finally:
        for proc in procs.values():
            terminate(proc, 5, 9)
