"""`aep-bridge control ...`: an operator's terminal on the control plane (the gate, its service, is
run by `aep-bridge gate`: bridge/commands/services.py).

`control respond|instruct` send one AEP command the way any sender does
(docs/ARCHITECTURE.md "Control plane"): published to
``aep.hermes.<lane token>.<command type>`` (so it is stored in the session's history on
AEP_EVENTS), then the ack is awaited on ``aep.hermes.<lane token>.control.accepted |
control.rejected`` (``cause`` = the command id) for the ack window. Exit codes: 0
accepted, 1 rejected, 3 no ack in the window (a sender treats that as a ``timeout``
nack, AEP-0004 §3), 2 usage or connection errors. ``--id`` resends a command under
the same id: the gate then re-sends its recorded ack, byte for byte.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import os
import socket
import sys
import time
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("control", help="answer a held tool call or steer a session from a terminal")
    csub = c.add_subparsers(dest="control_command", metavar="ACTION")

    r = csub.add_parser("respond", help="allow or deny a held tool call (control.attention.respond)",
                        description="Answer the attention.requested REQUEST_ID: allow, deny [--reason], or --text "
                                    "(AEP-0008: the words allow/deny are those options; other text denies with it as the reason).")
    r.add_argument("request", metavar="REQUEST_ID", help="the id of the gate's attention.requested (see `control pending`)")
    r.add_argument("decision", nargs="?", choices=["allow", "deny"], help="the option")
    r.add_argument("--reason", default=None, help="with deny: the message Hermes gives the model")
    r.add_argument("--text", default=None, help="a free-text answer instead of an option")
    _common(r)
    r.set_defaults(func=cmd_respond)

    i = csub.add_parser("instruct", help="queue an instruction for the session's next turn (x.hermes.control.instruct)")
    i.add_argument("text", help="the instruction (at most 4000 characters)")
    _common(i, session_required=True)
    i.set_defaults(func=cmd_instruct)

    h = csub.add_parser("hello", help="print the gate's hello/capabilities document (control.accepts, ack_window_ms)")
    h.add_argument("--nats", default=None, metavar="URL")
    h.add_argument("--timeout", type=float, default=2.0)
    h.set_defaults(func=cmd_hello)

    p = csub.add_parser("pending", help="list the held tool calls waiting for an answer")
    p.add_argument("--nats", default=None, metavar="URL")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_pending)
    c.set_defaults(func=lambda a: (c.print_help(sys.stderr), 2)[1])


def _common(p: argparse.ArgumentParser, session_required: bool = False) -> None:
    p.add_argument("--session", required=session_required, default=None,
                   help="the target session" + ("" if session_required else " (default: looked up from the request)"))
    p.add_argument("--id", default=None, help="the command id (default: a new ULID); reuse it to retry")
    p.add_argument("--as", dest="sender", default="aep-bridge-control", help="the sender's name (the command's agent)")
    p.add_argument("--nats", default=None, metavar="URL", help="NATS server URL(s) (default: AEP_BRIDGE_NATS_URL)")
    p.add_argument("--timeout", type=float, default=None, help="seconds to wait for the ack (default: the ack window, 10)")
    p.add_argument("--json", action="store_true", help="print the ack event")


def _settings(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """--nats, else the environment, else the running `aep-bridge up` (bridge/stack/up.py client_settings)."""
    from bridge.stack.up import client_settings

    return client_settings(getattr(args, "nats", None))


# ---------------------------------------------------------------- sending commands


def build_command(command_type: str, session: str, data: dict[str, Any], *, sender: str, command_id: str | None = None,
                  subject: str | None = None) -> Any:
    """An AEP command event (no seq: AEP-0004 §2)."""
    from msgspec import UNSET

    from bridge.core.aep import Event
    from bridge.core.identity import rfc3339, ulid_from

    now = time.time_ns()
    cid = command_id or ulid_from(now // 1_000_000, os.urandom(10))
    user = _user()
    return Event(
        aep="0.1", id=cid, type=command_type, time=rfc3339(now),
        source=f"aep://{socket.gethostname() or 'localhost'}/agent/{sender}/user/{user}",
        agent=sender, session=session, subject=subject or UNSET, cause=subject or UNSET, data=data,
    )


def _user() -> str:
    try:
        return getpass.getuser() or "operator"
    except Exception:
        return "operator"


async def send_command(settings: Any, event: Any, timeout: float) -> tuple[str, bytes | None]:
    """Publish a command and wait for its ack: ("accepted" | "rejected" | "timeout", ack bytes)."""
    from bridge.core import control as C
    from bridge.core.aep import encode_event
    from bridge.core.lanes import lane_token
    from bridge.nats import subjects as subj
    from bridge.nats.connection import quick_connect

    token = lane_token(event.session)
    nc = await quick_connect(settings, name="aep-bridge-control", role="operator")
    try:
        got: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

        async def on_ack(msg: Any) -> None:
            try:
                ack = json.loads(msg.data)
            except Exception:
                return
            # `cause` is the id alone: another source's command may use it too, the ack's id tells
            if (isinstance(ack, dict) and ack.get("cause") == event.id
                    and C.is_ack_of(ack.get("id"), event.source, event.id) and not got.done()):
                got.set_result(msg.data)

        for subject in subj.ack_subjects(token):
            await nc.subscribe(subject, cb=on_ack)
        await nc.flush()
        # No Nats-Msg-Id: a retry under the same id must reach the gate (it re-sends the recorded ack)
        await nc.jetstream().publish(subj.command_subject(token, event.type), encode_event(event), timeout=timeout)
        try:
            data = await asyncio.wait_for(got, timeout=timeout)
        except asyncio.TimeoutError:
            return "timeout", None
        return ("accepted" if json.loads(data)["type"] == C.ACCEPTED else "rejected"), data
    finally:
        await nc.close()


def _report(kind: str, data: bytes | None, event: Any, args: argparse.Namespace, window_s: float) -> int:
    if args.json and data is not None:
        print(data.decode())
    elif kind == "accepted":
        print(f"accepted: {event.type} {event.id}")
    elif kind == "rejected" and data is not None:
        ack = json.loads(data)
        detail = (ack.get("data") or {}).get("detail")
        print(f"rejected ({ack['data']['reason']}): {event.type} {event.id}" + (f": {detail}" if detail else ""))
    if kind == "timeout":
        print(f"no ack within {window_s:g} s for {event.id} (a timeout nack; is `aep-bridge gate` running?)", file=sys.stderr)
        return 3
    return 0 if kind == "accepted" else 1


async def _lookup_session(settings: Any, request_id: str) -> str | None:
    """The session of a held call, from the gate's card (KV aep_control)."""
    from bridge.nats.connection import quick_connect
    from bridge.nats.streams import CONTROL_BUCKET

    nc = await quick_connect(settings, name="aep-bridge-control", role="operator")
    try:
        kv = await nc.jetstream().key_value(CONTROL_BUCKET.bucket)
        entry = await kv.get(f"card.{request_id}")
        return json.loads(entry.value).get("session")
    except Exception:
        return None
    finally:
        await nc.close()


def _send(args: argparse.Namespace, command_type: str, session: str, data: dict[str, Any], subject: str | None = None) -> int:
    from bridge.core.control import ACK_WINDOW_MS
    from bridge.nats.connection import NatsConnectError

    settings = _settings(args)
    window = args.timeout if args.timeout is not None else ACK_WINDOW_MS / 1000
    event = build_command(command_type, session, data, sender=args.sender, command_id=args.id, subject=subject)
    try:
        kind, ack = asyncio.run(send_command(settings, event, window))
    except NatsConnectError as exc:
        print(f"aep-bridge control: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # e.g. no AEP_EVENTS stream: bootstrap not run
        print(f"aep-bridge control: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    return _report(kind, ack, event, args, window)


def cmd_respond(args: argparse.Namespace) -> int:
    from bridge.core.control import RESPOND

    if args.text is not None:
        if args.decision or args.reason:
            print("aep-bridge control respond: --text replaces the decision and --reason", file=sys.stderr)
            return 2
        answer: dict[str, str] = {"text": args.text}
    elif args.decision:
        answer = {"option": args.decision}
        if args.reason:
            answer["text"] = args.reason
    else:
        print("aep-bridge control respond: say allow, deny [--reason TEXT] or --text TEXT", file=sys.stderr)
        return 2
    session = args.session
    if session is None:
        session = asyncio.run(_lookup_session(_settings(args), args.request))
        if session is None:
            print(f"aep-bridge control respond: no held call {args.request} known to the gate; pass --session", file=sys.stderr)
            return 2
    return _send(args, RESPOND, session, {"answer": answer}, subject=args.request)


def cmd_instruct(args: argparse.Namespace) -> int:
    from bridge.core.control import INSTRUCT

    return _send(args, INSTRUCT, args.session, {"text": args.text})


# ---------------------------------------------------------------- looking


def cmd_hello(args: argparse.Namespace) -> int:
    from bridge.nats.connection import NatsConnectError, quick_connect
    from bridge.nats.subjects import HELLO_SUBJECT

    async def ask() -> bytes | None:
        import nats.errors

        nc = await quick_connect(_settings(args), name="aep-bridge-control", role="operator")
        try:
            return (await nc.request(HELLO_SUBJECT, b"", timeout=args.timeout)).data
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            return None
        finally:
            await nc.close()

    try:
        data = asyncio.run(ask())
    except NatsConnectError as exc:
        print(f"aep-bridge control: {exc}", file=sys.stderr)
        return 2
    if data is None:
        print("no gate answers on aep.gate.hello: nothing accepts commands (read-only)", file=sys.stderr)
        return 1
    print(json.dumps(json.loads(data), indent=2))
    return 0


def cmd_pending(args: argparse.Namespace) -> int:
    from bridge.nats.connection import NatsConnectError, quick_connect, server_list
    from bridge.nats.streams import CONTROL_BUCKET

    async def cards() -> list[dict[str, Any]]:
        nc = await quick_connect(settings, name="aep-bridge-control", role="operator")
        out = []
        try:
            kv = await nc.jetstream().key_value(CONTROL_BUCKET.bucket)
            watcher = await kv.watch("card.*", ignore_deletes=True)
            async for entry in watcher:
                if entry is None:
                    break
                card = json.loads(entry.value)
                if card.get("state") == "open":
                    out.append(card)
            await watcher.stop()
        finally:
            await nc.close()
        return out

    import nats.js.errors

    settings = _settings(args)
    try:
        open_cards = asyncio.run(cards())
    except NatsConnectError as exc:
        print(f"aep-bridge control: {exc}", file=sys.stderr)
        return 2
    except nats.js.errors.BucketNotFoundError:  # the gate creates it
        print(f"aep-bridge control: no gate runs on NATS at {', '.join(server_list(settings).urls)} (its bucket "
              f"{CONTROL_BUCKET.bucket} does not exist): start one with `aep-bridge up --gate` or `aep-bridge gate`",
              file=sys.stderr)
        return 2
    except Exception as exc:
        print(f"aep-bridge control: {type(exc).__name__}: {exc} (is `aep-bridge gate` running?)", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(open_cards, indent=2))
        return 0
    now = time.time_ns()
    for card in sorted(open_cards, key=lambda c: c.get("expires", 0)):
        left = max(0, (card.get("expires", 0) - now) // 1_000_000_000)
        print(f"{card['id']}  session {card.get('session')}  tool {card.get('tool')}  {left} s left")
    if not open_cards:
        print("no held calls")
    return 0
