"""`aep-bridge mapper`, `pairing`, `exporter` and `relay`: the long-running services (the gate: bridge/commands/control.py)."""

from __future__ import annotations

import argparse
import asyncio
import sys


def _common(p: argparse.ArgumentParser, default_port: int) -> None:
    p.add_argument("--nats", default=None, metavar="URL", help="NATS server URL(s), comma-separated (default: AEP_BRIDGE_NATS_URL)")
    p.add_argument("--partitions", type=int, default=None, help="partitions of BRIDGE_MAPPED (default: AEP_BRIDGE_PARTITIONS or 8)")
    p.add_argument("--metrics-port", type=int, default=None, help=f"HTTP port for /metrics, /healthz, /readyz (default: AEP_BRIDGE_METRICS_PORT or {default_port})")
    p.add_argument("--log-format", choices=["json", "console"], default=None, help="log format (default: AEP_BRIDGE_LOG_FORMAT or json)")


def register(sub: argparse._SubParsersAction) -> None:
    from bridge.commands.mapping import add_capture_args
    from bridge.config import EXPORTER_METRICS_PORT, MAPPER_METRICS_PORT, PAIRING_METRICS_PORT

    m = sub.add_parser("mapper", help="run the stateless mapper: HERMES_RAW -> BRIDGE_MAPPED")
    _common(m, MAPPER_METRICS_PORT)
    add_capture_args(m)
    m.add_argument("--batch", type=int, default=256, help="raw messages per fetch (default 256)")
    m.set_defaults(func=cmd_mapper)

    p = sub.add_parser("pairing", help="run the pairing service: BRIDGE_MAPPED -> AEP_EVENTS")
    _common(p, PAIRING_METRICS_PORT)
    p.add_argument("--replica", default=None, help="this replica's name (default: host name + pid)")
    p.add_argument("--tick-s", type=float, default=None,
                   help="seconds between ticks (the clock of TTL closure and held follow-ups; AEP_BRIDGE_TICK_S, default 15)")
    p.set_defaults(func=cmd_pairing)

    e = sub.add_parser(
        "exporter",
        help="run the exporter: AEP_EVENTS -> Kafka / OTLP/HTTP sinks in AEP-0005 forms",
        description="One durable consumer on AEP_EVENTS per sink. A sink is a URL "
        "(kafka://HOST:PORT/TOPIC?format=cloudevents|otlp|ocsf&max_capture=metadata&mode=structured|binary&filter=JSON, "
        "otlp+http://HOST:PORT/v1/logs) or an entry of the AEP_BRIDGE_EXPORT_CONFIG file (YAML or JSON, "
        "{sinks: [{name, url, format, max_capture, filter, kafka: {librdkafka settings}, headers}]}).",
    )
    _common(e, EXPORTER_METRICS_PORT)
    e.add_argument("--sink", action="append", default=[], metavar="URL", help="a sink (repeatable)")
    e.add_argument("--config", default=None, metavar="FILE",
                   help="sinks file, YAML or JSON (default: AEP_BRIDGE_EXPORT_CONFIG)")
    e.set_defaults(func=cmd_exporter)

    r = sub.add_parser(
        "relay",
        help="run the AEP door: AEP-0003 discovery, SSE and WebSocket over AEP_EVENTS",
        description="Serve AEP_EVENTS to any AEP consumer: GET /events and /.well-known/aep (discovery), "
        "GET /stream (SSE), /socket (WebSocket), /healthz, /metrics. Settings: AEP_BRIDGE_RELAY_LISTEN "
        "(default 127.0.0.1:8787), AEP_BRIDGE_RELAY_TOKEN, AEP_BRIDGE_RELAY_TOKENS_FILE, "
        "AEP_BRIDGE_RELAY_TLS_CERT/_KEY, AEP_BRIDGE_RELAY_REPLAY_BUFFER (see bridge/services/relay/config.py).",
    )
    r.add_argument("--nats", default=None, metavar="URL", help="NATS server URL(s) (default: AEP_BRIDGE_NATS_URL)")
    r.add_argument("--listen", default=None, metavar="HOST:PORT", help="overrides AEP_BRIDGE_RELAY_LISTEN")
    r.add_argument("--log-format", choices=["json", "console"], default=None)
    r.set_defaults(func=cmd_relay)


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


def run_service(coro, fast_loop: bool = False) -> int:  # type: ignore[no-untyped-def]
    """Run a service to its exit code; ``fast_loop``: on uvloop when installed (mapper, pairing)."""
    from bridge.config import SettingError
    from bridge.runtime.lifecycle import event_loop_factory

    try:
        with asyncio.Runner(loop_factory=event_loop_factory() if fast_loop else None) as runner:
            return runner.run(coro)
    except KeyboardInterrupt:
        return 0
    except SettingError as exc:  # e.g. a port taken: exit 2, which `aep-bridge up` does not restart
        print(f"aep-bridge: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a clear last line for operators; details are in the logs
        print(f"aep-bridge: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


def cmd_mapper(args: argparse.Namespace) -> int:
    from bridge.commands.mapping import policy_from_args
    from bridge.runtime import configure_logging
    from bridge.services.mapper import Mapper

    settings = settings_from_args(args, "mapper")
    configure_logging(settings.log_format, settings.log_level, component="mapper", replica=settings.instance)
    policy = policy_from_args(args, settings)
    return run_service(Mapper(settings, policy, batch=args.batch).run(), fast_loop=True)


def cmd_pairing(args: argparse.Namespace) -> int:
    from bridge.runtime import configure_logging
    from bridge.services.pairing import PairingService

    settings = settings_from_args(args, "pairing")  # --tick-s included
    service = PairingService(settings, replica=args.replica)
    configure_logging(settings.log_format, settings.log_level, component="pairing", replica=service.replica)
    return run_service(service.run(), fast_loop=True)


def exporter_sinks(args: argparse.Namespace, environ: dict[str, str] | None = None) -> list:  # type: ignore[type-arg]
    """The sinks of ``--sink`` and of the sinks file (``--config``, else AEP_BRIDGE_EXPORT_CONFIG);
    the file's path and the AEP_BRIDGE_KAFKA_* settings may come from the AEP_BRIDGE_CONFIG file."""
    from bridge.config import Layers, resolve
    from bridge.services.exporter import load_sinks

    layers = Layers.load(environ, {"AEP_BRIDGE_EXPORT_CONFIG": getattr(args, "config", None)})
    path = resolve("exporter", layers=layers)["AEP_BRIDGE_EXPORT_CONFIG"].value
    return load_sinks(args.sink, path, environ=layers.merged)


def cmd_exporter(args: argparse.Namespace) -> int:
    from bridge.core.sinks import SinkConfigError
    from bridge.runtime import configure_logging
    from bridge.services.exporter import ClientMissing, Exporter, require_clients

    from ruamel.yaml import YAMLError

    settings = settings_from_args(args, "exporter")
    try:
        sinks = exporter_sinks(args)
    except (SinkConfigError, OSError, ValueError) as exc:
        print(f"aep-bridge exporter: {exc}", file=sys.stderr)
        return 2
    except YAMLError as exc:  # the parser's message names the file, the line and the column
        print(f"aep-bridge exporter: the sinks file is not valid YAML or JSON: {' '.join(str(exc).split())}",
              file=sys.stderr)
        return 2
    if not sinks:
        print("aep-bridge exporter: no sinks: give --sink URL or AEP_BRIDGE_EXPORT_CONFIG", file=sys.stderr)
        return 2
    try:
        require_clients(sinks)
    except ClientMissing as exc:
        print(f"aep-bridge exporter: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_format, settings.log_level, component="exporter", replica=settings.instance)
    return run_service(Exporter(settings, sinks).run())


def cmd_relay(args: argparse.Namespace) -> int:
    from bridge.runtime import configure_logging
    from bridge.services.relay import RelayConfigError, from_env, run_relay

    settings = settings_from_args(args, "relay")
    try:
        cfg = from_env(flags=flag_values(args))
    except (RelayConfigError, OSError) as exc:
        print(f"aep-bridge relay: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_format, settings.log_level, component="relay", replica=settings.instance)
    return run_service(run_relay(settings, cfg))
