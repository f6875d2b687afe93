"""`aep-bridge map` and `aep-bridge schemas`: the pure core, from a terminal."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "map",
        help="map Hermes envelopes (JSON Lines) to AEP events (JSON Lines), the mapping stage only",
        description=(
            "Read Hermes hook envelopes as JSON Lines (bare envelopes, corpus records with an "
            "'envelope' key, or raw messages as the shim publishes them) and write one AEP event "
            "per line. Lanes are learned from the sessions seen earlier in the same input; the raw "
            "sequence is the line number. A line that cannot be mapped (not JSON, nested too deep, "
            "no hook, a value out of range) is reported on stderr as 'line N: <reason>: <detail>' "
            "and skipped, and the run goes on; the exit status is then 1 (0: every line mapped; "
            "2: bad arguments or settings)."
        ),
    )
    p.add_argument("input", nargs="?", default="-", help="input file (default: stdin)")
    add_capture_args(p)
    p.add_argument("--instance", default=None, help="instance name for bare envelopes (default: AEP_BRIDGE_INSTANCE or the host name)")
    p.add_argument("--epoch", type=int, default=0, help="AEP epoch to stamp (default 0)")
    p.add_argument(
        "--base-time-ms",
        type=int,
        default=0,
        help="receive time of bare envelopes: this Unix time in ms plus the line number (default 0)",
    )
    p.add_argument("--progress", action="store_true", help="report progress on stderr (default: when stderr is a terminal)")
    p.set_defaults(func=cmd_map)

    s = sub.add_parser("schemas", help="write the JSON Schemas generated from the bridge's types")
    s.add_argument("--out", default="schemas", help="output directory (default: schemas/)")
    s.add_argument("--check", action="store_true", help="do not write; exit 1 if the directory differs")
    s.set_defaults(func=cmd_schemas)


def add_capture_args(p: argparse.ArgumentParser, ceiling: bool = True) -> None:
    """--capture (with ``ceiling``; a service's comes from the settings table) and --capture-override."""
    if ceiling:
        p.add_argument(
            "--capture",
            default=None,
            choices=["none", "metadata", "redacted", "full"],
            help="capture ceiling: no event carries more (default: AEP_BRIDGE_CAPTURE, or unset: metadata with attention at redacted)",
        )
    p.add_argument(
        "--capture-override",
        action="append",
        default=None,
        metavar="CATEGORY=LEVEL",
        help="per-category level, repeatable, applied over AEP_BRIDGE_CAPTURE_OVERRIDES (default attention=redacted); at most the ceiling (clamped, with a warning)",
    )


def policy_from_args(args: argparse.Namespace, settings=None):  # type: ignore[no-untyped-def]
    """The capture policy of the flags and settings; warnings (an override clamped to the
    ceiling) go to stderr once, at start."""
    from bridge.config import Settings
    from bridge.core.ceiling import configure
    from bridge.core.redaction import Redactor

    settings = settings or Settings.from_env()
    redactor = Redactor(secret_values=settings.secret_values(), home=os.path.expanduser("~"))
    policy, warnings = configure(getattr(args, "capture", None) or settings.capture, settings.capture_overrides,
                                 getattr(args, "capture_override", None) or (), redactor)
    for warning in warnings:
        print(f"aep-bridge: warning: {warning}", file=sys.stderr)
    return policy


def line_error(exc: BaseException) -> str:
    """`<reason>: <detail>` for a line `map` could not map: the EnvelopeError reason, `not_json`,
    `too_deep` (nesting past the decoder's or the mapping's recursion limit), else
    `unmappable` with the exception's type (a value the mapping cannot represent, such as a
    receive time past year 9999)."""
    import msgspec

    from bridge.core.envelope import EnvelopeError

    if isinstance(exc, EnvelopeError):
        return f"{exc.reason}: {exc.detail}"
    if isinstance(exc, RecursionError):
        return "too_deep: nested deeper than the decoder or the mapping can follow"
    if isinstance(exc, msgspec.DecodeError):
        return f"not_json: {exc}"
    return f"unmappable: {type(exc).__name__}: {str(exc)[:200]}"


def cmd_map(args: argparse.Namespace) -> int:
    import msgspec

    from bridge.config import Settings, load_price_table
    from bridge.core.aep import encode_event
    from bridge.core.lanes import MemoryLanes
    from bridge.core.pipeline import map_record, record_from_line

    settings = Settings.from_env()
    try:
        policy = policy_from_args(args, settings)
        # the mapper's price table (AEP_BRIDGE_PRICE_TABLE), so `map` costs calls as the mapper does
        prices = load_price_table(settings.price_table) if settings.price_table else None
    except ValueError as exc:  # SettingError too
        print(f"aep-bridge map: {exc}", file=sys.stderr)
        return 2
    instance = args.instance or settings.instance
    lanes = MemoryLanes()
    decoder = msgspec.json.Decoder()
    out = sys.stdout.buffer
    stream = sys.stdin.buffer if args.input == "-" else open(args.input, "rb")
    progress = args.progress or sys.stderr.isatty()
    total = os.path.getsize(args.input) if args.input != "-" and progress else None
    failures = events = 0
    read_bytes = 0
    last_report = time.monotonic()
    with stream:
        for line_no, line in enumerate(stream, start=1):
            read_bytes += len(line)
            if not line.strip():
                continue
            try:
                obj = decoder.decode(line)
                record = record_from_line(obj, line_no, instance, args.base_time_ms * 1_000_000)
                result = map_record(record, line_no, args.epoch, lanes, policy, prices)
            except Exception as exc:  # one line's problem, never the run's: report it, go on
                failures += 1
                print(f"aep-bridge map: line {line_no}: {line_error(exc)}", file=sys.stderr)
                continue
            lanes.learn(result.learned)
            for event in result.events:
                out.write(encode_event(event))
                out.write(b"\n")
                events += 1
            if progress and time.monotonic() - last_report > 0.5:
                last_report = time.monotonic()
                pct = f" ({100 * read_bytes // total}%)" if total else ""
                print(f"\raep-bridge map: {line_no} lines{pct}, {events} events, {failures} errors", end="", file=sys.stderr)
    out.flush()
    if progress:
        print(f"\raep-bridge map: done, {events} events, {failures} errors" + " " * 10, file=sys.stderr)
    if failures:
        print(f"aep-bridge map: {failures} line(s) could not be mapped", file=sys.stderr)
        return 1
    return 0


def cmd_schemas(args: argparse.Namespace) -> int:
    from bridge.core.schemas import generate, render

    out = Path(args.out)
    files = {name: render(doc) for name, doc in generate().items()}
    if args.check:
        stale = [n for n, body in files.items() if not (out / n).is_file() or (out / n).read_bytes() != body]
        extra = [
            str(p.relative_to(out)) for p in out.rglob("*.json") if str(p.relative_to(out)) not in files
        ] if out.is_dir() else []
        for name in stale + extra:
            print(f"aep-bridge schemas: {out / name} is out of date", file=sys.stderr)
        return 1 if stale or extra else 0
    for name, body in files.items():
        path = out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(body)
    print(f"aep-bridge schemas: wrote {len(files)} files to {out}/")
    return 0
