"""The relay under test: `aep-bridge relay` as a real process on a real nats-server, and
small clients (SSE over aiohttp, WebSocket over aiohttp) that read it as any AEP consumer."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from contextlib import suppress
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import nats

from bridge.core.lanes import lane_token
from bridge.nats.subjects import events_subject
from tests.support.cli import free_port

OPERATOR = "op-token-0123456789abcdef"
CONSUMER = "consumer-token-0123456789ab"
META_CONSUMER = "meta-consumer-token-0123456"
EMITTER = "emitter-token-0123456789abcd"
ALL = "all-rights-token-0123456789ab"
ALICE = "alice-operator-token-012345"  # an operator whose identity is alice-ciso
HERMES_EMITTER = "hermes-emitter-token-0123456"  # an emitter granted one Hermes instance's identity

TOKENS = {"tokens": [
    # the agents the tests' commands carry (respond(): operator; the SDK's ControlClient: sdk-operator;
    # build_command: relay-test, idle-test, console-*)
    {"name": "oncall", "token": OPERATOR, "role": "operator",
     "agents": ["operator", "sdk-operator", "op", "relay-test", "idle-test", "console-*"]},
    {"name": "alice", "token": ALICE, "role": "operator", "agents": ["alice-ciso"]},
    {"name": "dash", "token": CONSUMER, "role": "consumer"},
    {"name": "meta", "token": META_CONSUMER, "role": "consumer", "max_capture": "metadata"},
    {"name": "ci", "token": EMITTER, "role": "emitter"},
    {"name": "gw-b", "token": HERMES_EMITTER, "role": "emitter", "agents": ["hermes"],
     "sources": ["aep://gw-b/agent/hermes/*"]},
]}


class RelayProcess:
    def __init__(self, nats_url: str, workdir: Path, *, tokens: bool = True, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}/socket"
        self.log = workdir / f"relay-{self.port}.log"
        self.env = dict(os.environ)
        self.env.update({"AEP_BRIDGE_NATS_URL": nats_url, "AEP_BRIDGE_RELAY_LISTEN": f"127.0.0.1:{self.port}",
                         "AEP_BRIDGE_LOG_FORMAT": "json", "AEP_BRIDGE_RELAY_HEARTBEAT_S": "1"})
        if tokens:
            path = workdir / "tokens.json"
            path.write_text(json.dumps(TOKENS))
            self.env["AEP_BRIDGE_RELAY_TOKENS_FILE"] = str(path)
            self.env["AEP_BRIDGE_RELAY_TOKEN"] = ALL
        self.env.update(env or {})
        self.proc: subprocess.Popen | None = None

    def start(self) -> "RelayProcess":
        exe = Path(sys.executable).with_name("aep-bridge")
        self._out = open(self.log, "ab")
        self.proc = subprocess.Popen([str(exe), "relay"], env=self.env, stdout=self._out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"relay exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            with suppress(OSError):
                with urllib.request.urlopen(self.url + "/healthz", timeout=1) as r:
                    if r.status == 200:
                        return self
            time.sleep(0.1)
        raise RuntimeError("relay did not answer /healthz")

    def stop(self, kill: bool = False) -> None:
        if self.proc and self.proc.poll() is None:
            (self.proc.kill if kill else self.proc.terminate)()
            self.proc.wait(10)
        with suppress(Exception):
            self._out.close()

    def logs(self) -> str:
        return self.log.read_text(errors="replace")


def event(session: str, seq: int, type_: str = "tool.called", *, capture: str | None = "metadata",
          severity: str | None = None, data: dict[str, Any] | None = None, epoch: int | None = None) -> dict[str, Any]:
    ev: dict[str, Any] = {"aep": "0.1", "id": f"{session}-{seq}", "type": type_, "time": "2026-12-01T10:00:00.000Z",
                          "source": "urn:test:relay", "agent": "relay-test", "session": session, "seq": seq}
    if epoch is not None:
        ev["epoch"] = epoch
    if severity:
        ev["severity"] = severity
    if capture:
        ev["capture"] = capture
    ev["data"] = data if data is not None else {"tool": {"name": "terminal", "call_id": f"c{seq}"}}
    return ev


def encode(ev: dict[str, Any]) -> bytes:
    return msgspec.json.encode(ev)


async def publish(nats_url: str, events: list[dict[str, Any]]) -> list[bytes]:
    """Publish onto AEP_EVENTS as pairing does; returns the exact bytes stored."""
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        out = []
        for ev in events:
            raw = encode(ev)
            await js.publish(events_subject(lane_token(ev["session"]), ev["type"]), raw)
            out.append(raw)
        return out
    finally:
        await nc.close()


def auth(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


async def read_sse(session: aiohttp.ClientSession, url: str, *, want: int | None = None, timeout: float = 15.0,
                   headers: dict[str, str] | None = None, params: dict[str, str] | None = None) -> dict[str, Any]:
    """Read an SSE stream: {"status", "events": [{event, id, data(bytes)}], "comments": [...]}
    until ``want`` events arrived or the stream ended (or ``timeout``)."""
    out: dict[str, Any] = {"events": [], "comments": []}
    async with session.get(url, headers=headers, params=params, timeout=aiohttp.ClientTimeout(total=None)) as resp:
        out["status"] = resp.status
        if resp.status != 200:
            out["body"] = await resp.text()
            return out
        cur: dict[str, Any] = {}

        async def pump() -> None:
            nonlocal cur
            async for raw in resp.content:
                line = raw.rstrip(b"\n").rstrip(b"\r")
                if not line:
                    if cur:
                        out["events"].append(cur)
                        cur = {}
                        if want is not None and len(out["events"]) >= want:
                            return
                    continue
                if line.startswith(b":"):
                    out["comments"].append(line[1:].strip().decode())
                    continue
                name, _, value = line.partition(b":")
                value = value[1:] if value.startswith(b" ") else value
                cur[name.decode()] = value if name == b"data" else value.decode()

        with suppress(asyncio.TimeoutError):
            await asyncio.wait_for(pump(), timeout)
    return out
