"""`aep-bridge mapper`, `pairing`, `gate`, `exporter` and `relay`: the five long-running services,
one path for all (`cmd_service`).

A command's flags are the settings its role reads that have one (bridge/config.py FIELDS'
``flag``: `add_setting_flags`) plus its own few (`COMMANDS`: ``arguments``). `cmd_service`
resolves the settings (flag > environment > settings file > default, every one the role reads
checked: a bad one is a SettingError, exit 2), builds the service (``build``: a
`bridge.runtime.Service`; a setting it cannot use is a SettingError too) and runs it
(`bridge.runtime.run_service`: the log lines, the event loop, `serve`, the exit code)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable

#: the metavar of a setting's flag, by the field's type (a choice shows its choices)
METAVAR = {"int": "N", "float": "N", "listen": "HOST:PORT", "path": "FILE", "list": "A,B"}


@dataclass(frozen=True)
class Command:
    help: str
    build: Callable[[argparse.Namespace, Any], Any]  # (args, Settings) -> the Service
    arguments: Callable[[argparse.ArgumentParser], None] = lambda p: None  # its own flags, beyond the settings'
    description: str | None = None


def add_setting_flags(p: argparse.ArgumentParser, role: str) -> None:
    """A flag for every setting ``role`` reads that has one (FIELDS' ``flag``), with the table's
    help; its value is checked by the resolver, like the variable's (no type here: one check)."""
    from bridge.config import fields_for

    for f in fields_for(role):
        if not f.flag:
            continue
        default = f.default({}, role) if callable(f.default) else f.default
        shown = "" if default is None else f"; default {default:g}" if isinstance(default, float) else f"; default {default}"
        metavar = "URL" if f.name.endswith("_URL") else METAVAR.get(f.type, "VALUE")
        kw: dict[str, Any] = {"choices": list(f.choices)} if f.type == "choice" else {"metavar": metavar}
        p.add_argument(f.flag, default=None, help=f"{f.help} ({f.name}{shown})".replace("%", "%%"), **kw)


def register(sub: argparse._SubParsersAction) -> None:
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.help, description=command.description)
        add_setting_flags(p, name)
        command.arguments(p)
        p.set_defaults(func=cmd_service)


def cmd_service(args: argparse.Namespace) -> int:
    """Every service command: its settings, its service, its run."""
    from bridge.runtime import run_service

    settings = settings_from_args(args, args.command)
    return run_service(COMMANDS[args.command].build(args, settings))


def flag_values(args: argparse.Namespace) -> dict[str, object]:
    """The flags given on the command line, by the variable each overrides (bridge/config.py
    FIELDS' ``flag``: the one map)."""
    from bridge.config import flag_fields

    return {var: getattr(args, dest) for _, dest, var in flag_fields() if getattr(args, dest, None) is not None}


def settings_from_args(args: argparse.Namespace, role: str | None = None):  # type: ignore[no-untyped-def]
    """Flags over the environment over the AEP_BRIDGE_CONFIG file; with ``role``, every setting
    that role reads is checked first (a bad one: SettingError, the command exits 2)."""
    from bridge.config import Settings, role_settings

    flags = flag_values(args)
    return role_settings(role, flags=flags) if role else Settings.from_env(flags=flags)


# ---------------------------------------------------------------- each service's own part


def _capture_override(p: argparse.ArgumentParser) -> None:
    from bridge.commands.mapping import add_capture_args

    add_capture_args(p, ceiling=False)  # --capture: a setting (AEP_BRIDGE_CAPTURE)


def _mapper_arguments(p: argparse.ArgumentParser) -> None:
    _capture_override(p)
    p.add_argument("--batch", type=int, default=256, help="raw messages per fetch (default 256)")


def build_mapper(args: argparse.Namespace, settings: Any) -> Any:
    from bridge.commands.mapping import policy_from_args
    from bridge.services.mapper import Mapper

    return Mapper(settings, policy_from_args(args, settings), batch=args.batch)


def _pairing_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replica", default=None, help="this replica's name (default: host name + pid)")


def build_pairing(args: argparse.Namespace, settings: Any) -> Any:
    from bridge.services.pairing import PairingService

    return PairingService(settings, replica=args.replica)


def gate_config(args: argparse.Namespace, settings: Any) -> Any:
    """The gate's GateConfig, every flag through the one resolver (flag > environment > settings
    file > default), each checked: a bad one is a SettingError (exit 2)."""
    from bridge.commands.mapping import policy_from_args
    from bridge.services.gate import GateConfig

    return GateConfig.from_env(policy=policy_from_args(args, settings), flags=flag_values(args))


def gate_settings(args: argparse.Namespace) -> tuple[Any, Any]:
    """The gate's Settings and GateConfig, as `aep-bridge gate` resolves them."""
    settings = settings_from_args(args, "gate")
    return settings, gate_config(args, settings)


def build_gate(args: argparse.Namespace, settings: Any) -> Any:
    from bridge.services.gate import Gate

    return Gate(settings, gate_config(args, settings))


def _exporter_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sink", action="append", default=[], metavar="URL", help="a sink (repeatable)")


def exporter_sinks(args: argparse.Namespace, environ: dict[str, str] | None = None) -> list:  # type: ignore[type-arg]
    """The sinks of ``--sink`` and of the sinks file (``--config``, else AEP_BRIDGE_EXPORT_CONFIG);
    the file's path and the AEP_BRIDGE_KAFKA_* settings may come from the AEP_BRIDGE_CONFIG file."""
    from bridge.config import Layers, resolve
    from bridge.services.exporter import load_sinks

    layers = Layers.load(environ, {"AEP_BRIDGE_EXPORT_CONFIG": getattr(args, "config", None)})
    path = resolve("exporter", layers=layers)["AEP_BRIDGE_EXPORT_CONFIG"].value
    return load_sinks(args.sink, path, environ=layers.merged)


def build_exporter(args: argparse.Namespace, settings: Any) -> Any:
    """The exporter of its sinks; a sink that cannot work (a bad URL or file, no sinks, a client
    library missing) is a SettingError: one line, exit 2."""
    from ruamel.yaml import YAMLError

    from bridge.config import SettingError
    from bridge.core.sinks import SinkConfigError
    from bridge.services.exporter import ClientMissing, Exporter, require_clients

    try:
        sinks = exporter_sinks(args)
    except (SinkConfigError, OSError, ValueError) as exc:
        raise SettingError(str(exc)) from None
    except YAMLError as exc:  # the parser's message names the file, the line and the column
        raise SettingError(f"the sinks file is not valid YAML or JSON: {' '.join(str(exc).split())}") from None
    if not sinks:
        raise SettingError("no sinks: give --sink URL or AEP_BRIDGE_EXPORT_CONFIG")
    try:
        require_clients(sinks)
    except ClientMissing as exc:
        raise SettingError(str(exc)) from None
    return Exporter(settings, sinks)


def build_relay(args: argparse.Namespace, settings: Any) -> Any:
    """The relay of its settings (RelayConfigError is a SettingError: exit 2); a tokens file that
    cannot be read, too."""
    from bridge.config import SettingError
    from bridge.services.relay import RelayService, from_env

    try:
        cfg = from_env(flags=flag_values(args))
    except OSError as exc:
        raise SettingError(str(exc)) from None
    return RelayService(settings, cfg)


COMMANDS: dict[str, Command] = {
    "mapper": Command("run the stateless mapper: HERMES_RAW -> BRIDGE_MAPPED", build_mapper, _mapper_arguments),
    "pairing": Command("run the pairing service: BRIDGE_MAPPED -> AEP_EVENTS", build_pairing, _pairing_arguments),
    "gate": Command(
        "run the opt-in control plane: the operator-deny gate and steering (AEP_HERMES_CONTROL, AEP_INSTRUCT)",
        build_gate, _capture_override,
        "Open a card for every pre_tool_call the shim holds, take control.attention.respond and "
        "x.hermes.control.instruct commands from AEP_EVENTS, answer the shim's holds and instruction "
        "pulls, and audit every step on AEP_EVENTS. What it accepts follows AEP_HERMES_CONTROL=1 and "
        "AEP_INSTRUCT=1; with neither it declares control.accepts [] and rejects every command. "
        "/healthz carries the hello document."),
    "exporter": Command(
        "run the exporter: AEP_EVENTS -> Kafka / OTLP/HTTP sinks in AEP-0005 forms", build_exporter, _exporter_arguments,
        "One durable consumer on AEP_EVENTS per sink. A sink is a URL "
        "(kafka://HOST:PORT/TOPIC?format=cloudevents|otlp|ocsf&max_capture=metadata&mode=structured|binary&filter=JSON, "
        "otlp+http://HOST:PORT/v1/logs) or an entry of the AEP_BRIDGE_EXPORT_CONFIG file (YAML or JSON, "
        "{sinks: [{name, url, format, max_capture, filter, kafka: {librdkafka settings}, headers}]})."),
    "relay": Command(
        "run the AEP door: AEP-0003 discovery, SSE and WebSocket over AEP_EVENTS", build_relay,
        description="Serve AEP_EVENTS to any AEP consumer: GET /events and /.well-known/aep (discovery), "
        "GET /stream (SSE), /socket (WebSocket), /healthz, /metrics. Settings: AEP_BRIDGE_RELAY_LISTEN "
        "(default 127.0.0.1:8787), AEP_BRIDGE_RELAY_TOKEN, AEP_BRIDGE_RELAY_TOKENS_FILE, "
        "AEP_BRIDGE_RELAY_TLS_CERT/_KEY, AEP_BRIDGE_RELAY_REPLAY_BUFFER (see bridge/services/relay/config.py)."),
}
