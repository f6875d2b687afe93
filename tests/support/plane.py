"""A control plane under test: a real nats-server, the gate (and by default the mapper and
pairing) as processes, the real shim held the way Hermes runs it, commands sent the way any
sender sends them. Shared by the gate, relay and Hermes control tests."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from bridge.commands.control import build_command, send_command
from bridge.config import Settings
from bridge.core import control as C
from bridge.core.lanes import lane_token
from bridge.nats.streams import CONTROL_BUCKET
from bridge.nats.subjects import HELLO_SUBJECT
from tests.natsfixture import JetStreamClient, NatsServer, make_server
from tests.support.services import Service, wait_for
from tests.support.shim import compiled_hook, dumps, envelope, run_hook, shim_env


@dataclass
class Plane:
    server: NatsServer
    client: JetStreamClient
    gate: Service
    tmp: Path
    instance: str

    @property
    def url(self) -> str:
        return self.server.url

    # -- commands

    def send(self, event: Any, timeout: float = C.ACK_WINDOW_MS / 1000) -> tuple[str, dict[str, Any] | None, bytes | None]:
        """Publish a command; its ack within the declared ack window (else "timeout")."""
        settings = Settings()
        settings.nats_url = self.url
        kind, data = self.client.run(send_command(settings, event, timeout))
        return kind, (json.loads(data) if data else None), data

    def respond(self, session: str, request: str, answer: dict[str, Any], **kw: Any) -> tuple[str, dict[str, Any] | None, bytes | None]:
        return self.send(build_command(C.RESPOND, session, {"answer": answer}, sender=kw.pop("sender", "test-console"),
                                       subject=request, **kw))

    def instruct(self, session: str, text: Any, **kw: Any) -> tuple[str, dict[str, Any] | None, bytes | None]:
        return self.send(build_command(C.INSTRUCT, session, {"text": text}, sender=kw.pop("sender", "test-console"), **kw))

    @contextlib.contextmanager
    def gate_paused(self) -> Iterator[None]:
        """The gate process stopped (SIGSTOP) for the block: it takes nothing, its NATS
        subscriptions stay."""
        self.gate.proc.send_signal(signal.SIGSTOP)
        try:
            yield
        finally:
            self.gate.proc.send_signal(signal.SIGCONT)

    def gate_knows(self, session: str) -> bool:
        """The gate has a `sess.<lane token>` record of ``session`` (it handled a raw event of it)."""
        import nats.js.errors

        async def get() -> bool:
            kv = await self.client.js.key_value(CONTROL_BUCKET.bucket)
            try:
                await kv.get(f"sess.{lane_token(session)}")
                return True
            except nats.js.errors.KeyNotFoundError:
                return False

        return self.client.run(get())

    # -- the shim

    def env(self, **extra: str) -> dict[str, str]:
        env = shim_env(self.url, self.tmp / "spool", self.instance, DEADLINE_MS="2000")
        env.update(extra)
        return env

    def hook(self, data: dict[str, Any], **extra: str) -> bytes:
        r = run_hook(dumps(data), self.env(**extra))
        assert r.returncode == 0, r.stderr
        return r.stdout

    def held(self, session: str, call: str, hold_ms: int = 10_000, tool: str = "terminal") -> subprocess.Popen[bytes]:
        env = envelope("pre_tool_call", session=session, turn_id=f"{session}:t:1", tool_call_id=call)
        env["tool_name"] = tool
        proc = subprocess.Popen([sys.executable, "-I", "-S", str(compiled_hook())], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=self.env(AEP_HERMES_CONTROL="1", AEP_HERMES_HOLD_MS=str(hold_ms)))
        assert proc.stdin is not None
        proc.stdin.write(dumps(env))
        proc.stdin.close()
        proc.stdin = None  # communicate() must not flush it again
        return proc

    # -- the stream

    def events(self, session: str) -> list[dict[str, Any]]:
        return [m.json() for m in self.client.fetch(f"aep.hermes.{lane_token(session)}.>", stream="AEP_EVENTS")]

    def wait(self, session: str, predicate: Any, what: str, timeout: float = 10.0) -> list[dict[str, Any]]:
        found: list[list[dict[str, Any]]] = []

        def check() -> bool:
            evs = self.events(session)
            if predicate(evs):
                found.append(evs)
                return True
            return False

        wait_for(check, timeout, interval=0.05, what=what)
        return found[0]

    def request_of(self, session: str, call: str) -> dict[str, Any]:
        evs = self.wait(session, lambda e: any(x["type"] == "attention.requested" and x["subject"] == "terminal"
                                               and _call(e, x) == call for x in e), f"attention.requested for {call}")
        return next(x for x in evs if x["type"] == "attention.requested" and _call(evs, x) == call)


def _call(evs: list[dict[str, Any]], request: dict[str, Any]) -> str:
    """The tool_call_id of the tool.requested a gate request is caused by (the mapper may lag)."""
    cause = next((x for x in evs if x["id"] == request["cause"]), None)
    return ((cause or {}).get("data") or {}).get("tool", {}).get("call_id", "") if cause else request.get("_call", "?")


def types(evs: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in evs]


def ready(url: str) -> bool:
    import asyncio

    import nats

    async def ask() -> bool:
        nc = await nats.connect(url)
        try:
            await nc.request(HELLO_SUBJECT, b"", timeout=0.5)
            return True
        except Exception:
            return False
        finally:
            await nc.close()

    return asyncio.run(ask())


def start_plane(backend: str, tmp: Path, gate_env: dict[str, str], with_pipeline: bool = True,
                mapper_env: dict[str, str] | None = None) -> tuple[Plane, list[Service]]:
    server = make_server(backend=backend)
    client = JetStreamClient(server.url)
    client.bootstrap()
    services = [Service("gate", server.url, tmp, "--probe-ms", "300", env=gate_env).start()]
    if with_pipeline:
        services += [Service("mapper", server.url, tmp, env=mapper_env).start(), Service("pairing", server.url, tmp).start()]
    wait_for(lambda: ready(server.url), 20, interval=0.1, what="the gate's hello")
    return Plane(server, client, services[0], tmp, f"ctl-{uuid.uuid4().hex[:6]}"), services


def stop_plane(plane: Plane, services: list[Service]) -> None:
    for s in services:  # all at once: each drains for a moment
        if s.alive():
            s.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    for s in services:
        s.terminate()
    plane.client.close()
    plane.server.close()


def new_session() -> str:
    return f"s-{uuid.uuid4().hex[:10]}"


def start_session(plane: Plane, session: str) -> None:
    """What a Hermes session's first turn sends before any tool call; returns once the gate
    knows the session (its raw consumer and its command consumer run side by side: a command
    sent at once could overtake the raw events and be refused as for an unknown session)."""
    plane.hook(envelope("on_session_start", session=session))
    plane.hook(envelope("pre_llm_call", session=session, turn_id=f"{session}:t:1"))
    wait_for(lambda: plane.gate_knows(session), 10, interval=0.05, what=f"the gate to learn {session}")
