"""`aep-bridge status`: how the whole bridge is, on one screen (issue 38 item 7)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "status",
        help="one screen: every worker and sink with its health and reason, stream depths, consumer lags, "
             "held calls, the relay's clients",
        description="Reads the running `aep-bridge up` (up.json: its workers' /healthz, the relay) and NATS "
                    "(--nats, else up's, else AEP_BRIDGE_NATS_URL: every stream's depth and each consumer's lag, the "
                    "gate's open held calls). Exit 0 when every part answers healthy, 1 otherwise.",
    )
    p.add_argument("--nats", default=None, metavar="URL", help="NATS URL (default: the running `up`, else AEP_BRIDGE_NATS_URL)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_status)


def get_json(url: str, token: str | None = None, timeout: float = 2.0) -> tuple[int, Any]:
    """(HTTP status, the JSON body or the text) of a GET; (0, why) when nothing answers."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            status, body = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read()
    except (OSError, ValueError) as e:
        return 0, f"{type(e).__name__}: {getattr(e, 'reason', e)}"
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body.decode("utf-8", "replace")


def workers(state: dict[str, Any] | None) -> dict[str, Any]:
    """Each of up's workers: pid, /healthz status and body (the relay's on its own port)."""
    out: dict[str, Any] = {}
    if not state:
        return out
    pids = state.get("workers") or {}
    urls = {name: url.rsplit("/metrics", 1)[0] for name, url in (state.get("metrics") or {}).items()}
    relay = state.get("relay") or {}
    if relay.get("url"):
        urls["relay"] = relay["url"]
    for name in sorted(set(pids) | set(urls)):
        entry: dict[str, Any] = {"pid": pids.get(name)}
        if name in urls:
            code, body = get_json(urls[name] + "/healthz")
            entry.update(healthy=code == 200, healthz=body)
        if name == "relay" and relay.get("url"):
            code, text = get_json(relay["url"] + "/metrics", relay.get("token"))
            if code == 200 and isinstance(text, str):
                entry["clients"] = {line.split('binding="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                                    for line in text.splitlines() if line.startswith("aep_bridge_relay_connections{")}
        out[name] = entry
    return out


async def nats_view(settings: Any) -> dict[str, Any]:
    """Every stream's depth and each consumer's lag; the gate's open held calls."""
    import nats.js.errors

    from bridge.nats.connection import connect_client
    from bridge.nats.streams import CONTROL_BUCKET

    nc = await connect_client(settings, name="aep-bridge-status")
    try:
        js = nc.jetstream()
        streams: dict[str, Any] = {}
        for info in await js.streams_info():
            name = info.config.name
            if name.startswith("KV_") or name.startswith("OBJ_"):
                continue
            consumers = {c.name: {"pending": c.num_pending or 0, "ack_pending": c.num_ack_pending or 0}
                         for c in await js.consumers_info(name)}
            streams[name] = {"messages": info.state.messages, "bytes": info.state.bytes, "consumers": consumers}
        held: int | None
        try:
            kv = await js.key_value(CONTROL_BUCKET.bucket)
            held = 0
            watcher = await kv.watch("card.*", ignore_deletes=True)
            async for entry in watcher:
                if entry is None:
                    break
                held += json.loads(entry.value).get("state") == "open"
            await watcher.stop()
        except nats.js.errors.BucketNotFoundError:
            held = None  # no gate has run on this server
        return {"streams": streams, "held_calls": held}
    finally:
        await nc.close()


def render(out: dict[str, Any]) -> list[str]:
    lines = [f"NATS {out['nats_url']}" + (f"   (aep-bridge up, pid {out['up_pid']})" if out.get("up_pid") else "")]
    if not out["workers"]:
        lines.append("  workers        none known (no running `aep-bridge up` found)")
    for name, w in out["workers"].items():
        body = w.get("healthz")
        if isinstance(body, dict):
            why = body.get("error") or body.get("nats_error") or ""
            what = f"{body.get('status', '?')}, nats {body.get('nats', '?')}" + (f": {why}" if why else "")
            for sink, state in (body.get("sinks") or {}).items():
                reason = (body.get("sink_errors") or {}).get(sink)
                what += f"; sink {sink} {state}" + (f": {reason}" if reason else "")
            if body.get("unowned"):
                what += f"; unowned partitions {body['unowned']}"
        else:
            what = f"no answer ({body})" if body is not None else "-"
        clients = w.get("clients")
        if clients is not None:
            what += "; clients " + (", ".join(f"{k} {v:g}" for k, v in sorted(clients.items())) or "0")
        lines.append(f"  {name:<14} {'ok ' if w.get('healthy') else 'BAD'} pid {w.get('pid')}  {what}")
    if "error" in out:
        lines.append(f"  nats           BAD {out['error']}")
        return lines
    for name, s in sorted(out["streams"].items()):
        lags = ", ".join(f"{c} {v['pending']}+{v['ack_pending']}" for c, v in sorted(s["consumers"].items()))
        lines.append(f"  {name:<14} {s['messages']} messages, {s['bytes']} bytes" + (f"; lag (pending+unacked): {lags}" if lags else ""))
    held = out.get("held_calls")
    lines.append(f"  held calls     {'no gate has run' if held is None else held}")
    return lines


def cmd_status(args: argparse.Namespace) -> int:
    import asyncio

    from bridge.commands.stack import settings_for
    from bridge.nats.connection import NatsConnectError, server_list
    from bridge.stack.up import read_state

    settings = settings_for(args)
    state = read_state()
    out: dict[str, Any] = {"nats_url": ", ".join(server_list(settings).urls), "up_pid": (state or {}).get("pid"),
                           "workers": workers(state)}
    try:
        out.update(asyncio.run(nats_view(settings)))
    except NatsConnectError as exc:
        out["error"] = str(exc)
    healthy = "error" not in out and all(w.get("healthy", True) for w in out["workers"].values())
    out["healthy"] = healthy
    print(json.dumps(out, indent=2) if args.json else "\n".join(render(out)))
    if "error" in out and not args.json:
        print(f"aep-bridge status: {out['error']}", file=sys.stderr)
    return 0 if healthy else 1
