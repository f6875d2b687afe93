"""`aep-bridge export`: the AEP-0005 projections (bridge/core/bridges), from a terminal."""

from __future__ import annotations

import argparse
import sys

FORMAT_CHOICES = ("cloudevents", "otlp-json", "ocsf")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="project AEP events (JSON Lines) to CloudEvents, OTLP LogRecords or OCSF records (JSON Lines)",
        description=(
            "Read AEP events as JSON Lines (what `aep-bridge map` or `tail --json` writes) and write "
            "one record per event in the chosen AEP-0005 form: cloudevents (CloudEvents 1.0, JSON "
            "structured mode), otlp-json (an OTLP LogRecord, JSON encoding of the OTLP data model) "
            "or ocsf (an OCSF 1.8.0 record; only session.started/ended, tool.* and attention.* "
            "have one, other events write nothing). Content above --max-capture is withheld before "
            "projecting. With --inverse (cloudevents only), read CloudEvents and write AEP events. "
            "A line that cannot be projected is reported on stderr and skipped; the exit code is then 1."
        ),
    )
    p.add_argument("input", nargs="?", default="-", help="input file (default: stdin)")
    p.add_argument("--format", required=True, choices=FORMAT_CHOICES, help="output form")
    p.add_argument(
        "--max-capture",
        default="metadata",
        choices=["none", "metadata", "redacted", "full"],
        help="the exporter's capture ceiling: an event above it keeps its envelope and loses its payload (default metadata)",
    )
    p.add_argument(
        "--inverse",
        action="store_true",
        help="cloudevents only: CloudEvents in, AEP events out (AEP-0005 §2)",
    )
    p.add_argument(
        "--otlp-request",
        action="store_true",
        help="otlp-json only: write each LogRecord as an OTLP/JSON ExportLogsServiceRequest "
        "(the OTLP/HTTP JSON body; what the Collector's otlpjsonfile receiver reads)",
    )
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    import msgspec

    from bridge.core.bridges import BridgeError, from_cloudevent, project
    from bridge.core.bridges.otlp import export_logs_request
    from bridge.core.ceiling import level_rank

    if args.inverse and args.format != "cloudevents":
        print("aep-bridge export: --inverse exists for --format cloudevents only", file=sys.stderr)
        return 2
    if args.otlp_request and args.format != "otlp-json":
        print("aep-bridge export: --otlp-request exists for --format otlp-json only", file=sys.stderr)
        return 2
    max_capture = level_rank(args.max_capture)
    encode = msgspec.json.Encoder().encode
    decode = msgspec.json.Decoder().decode
    out = sys.stdout.buffer
    failures = written = 0
    stream = sys.stdin.buffer if args.input == "-" else open(args.input, "rb")
    with stream:
        for line_no, line in enumerate(stream, start=1):
            if not line.strip():
                continue
            try:
                obj = decode(line)
                if args.inverse:
                    record, diagnostics = from_cloudevent(obj, max_capture)
                    for note in diagnostics:
                        print(f"aep-bridge export: line {line_no}: warning: {note}", file=sys.stderr)
                else:
                    record = project(args.format, obj, max_capture)
            except msgspec.DecodeError as exc:
                failures += 1
                print(f"aep-bridge export: line {line_no}: not_json: {exc}", file=sys.stderr)
                continue
            except BridgeError as exc:
                failures += 1
                print(f"aep-bridge export: line {line_no}: {exc.reason}: {exc}", file=sys.stderr)
                continue
            if record is None:
                continue
            if args.otlp_request:
                record = export_logs_request([record])
            out.write(encode(record))
            out.write(b"\n")
            written += 1
    out.flush()
    if failures:
        print(f"aep-bridge export: {failures} line(s) could not be exported ({written} written)", file=sys.stderr)
        return 1
    return 0
