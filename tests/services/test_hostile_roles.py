"""Hostile roles (issue 13, findings 5 and 6), against a real nats-server running the sample
``deploy/nats/nats.conf`` with its users.

* 6: no role may hear another role's inbox. What the mapper pulls from HERMES_RAW (raw tool
  input, secrets) arrives on the mapper's inbox; an observe-only user (a gateway, a SIEM
  consumer, an operator) subscribing to ``_INBOX.>`` is refused and receives nothing.
* 5: the gate sends nothing outside the inbox space of the role that published: a user that
  may only publish ``hermes.raw.>`` cannot make it write into AEP_EVENTS, a KV bucket,
  another role's inbox or another instance's (``Aep-Gate-Reply``, or the reply subject of an
  instruction pull or a hello); and a card can only release the call that opened it (a raw
  message that copies an overheard inbox cannot release that call).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.services import raw_records
from tests.support.shim import compiled_hook, dumps, envelope, shim_env
from tests.support.nats_roles import (
    USERS, Client, configured_server, ensure_streams, role_settings, sample_nats_conf,
)

ROOT = Path(__file__).resolve().parents[2]
CANARY = "AKIAHOSTILEROLES0001"


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("nats-hostile-roles")
    with configured_server(tmp, sample_nats_conf(tmp / "js")) as u:
        asyncio.run(ensure_streams(u))
        yield u


class Heard(list):
    """What an eavesdropper heard: (subject, data) pairs; ``subs``, its subscriptions."""

    subs: list


async def _eavesdrop(url: str, role: str, subjects: list[str]) -> tuple[Client, Heard]:
    c = await Client.connect(url, role)
    heard = Heard()
    heard.subs = []

    async def keep(m) -> None:  # type: ignore[no-untyped-def]
        heard.append((m.subject, bytes(m.data)))

    for s in subjects:
        heard.subs.append(await c.nc.subscribe(s, cb=keep))
    await c.nc.flush()
    return c, heard


async def _all_heard(c: Client, heard: Heard) -> None:
    """Everything the server routed to ``c`` so far is in ``heard``: a PING/PONG round trip (the
    server writes what it routed before the PONG), then its subscriptions' queues emptied."""
    await c.nc.flush()
    while any(s.pending_msgs for s in heard.subs):
        await asyncio.sleep(0.01)


def test_observe_only_roles_hear_nothing_of_what_the_mapper_pulls(url: str) -> None:
    """Finding 6. On the code before the fix every role could subscribe to ``_INBOX.>`` and
    received the mapper's pulled raw messages (secret included)."""
    from bridge.core.ceiling import CapturePolicy
    from bridge.services.mapper import Mapper

    async def main() -> None:
        spies = {role: await _eavesdrop(url, role, ["_INBOX.>", "_INBOX.aep-mapper.>"])
                 for role in ("gateway-0", "shim", "consumer", "operator")}
        shim = await Client.connect(url, "shim")
        env = envelope("pre_tool_call", session="s-hostile-6", tool_call_id="c1")
        env["tool_input"] = {"command": f"AWS_ACCESS_KEY_ID={CANARY} aws s3 ls"}
        (subject, body, rid), = raw_records([env], instance="gateway-3")
        await shim.js.publish(subject, body, headers={"Nats-Msg-Id": rid})
        await shim.close()
        mapper = Mapper(role_settings(url, "mapper"), CapturePolicy())
        await mapper.connect()
        try:
            sub = await mapper.bind()
            msgs = await sub.fetch(50, timeout=5)
            assert any(CANARY.encode() in m.data for m in msgs), "the mapper pulled the raw message"
            for m in msgs:
                await m.ack_sync()
        finally:
            await mapper.close()
        try:
            for role, (c, heard) in spies.items():
                await _all_heard(c, heard)  # the mapper had its messages: anything overheard is here now
                assert not [s for s, d in heard if CANARY.encode() in d], f"{role} heard the mapper's pull"
                assert not heard, f"{role} heard another role's inbox: {[s for s, _ in heard]}"
                assert await c.refused("_INBOX.>"), f"{role} may subscribe to _INBOX.>: {c.errors}"
        finally:
            for c, _ in spies.values():
                await c.close()

    asyncio.run(asyncio.wait_for(main(), 60))


_calls = iter(range(1, 1 << 30))


def _held_call(instance: str, session: str, call: str) -> tuple[str, bytes, str]:
    """A raw pre_tool_call as the shim wraps it, with an id of its own."""
    base = time.time_ns() + next(_calls) * 7_000_000
    (record,) = raw_records([envelope("pre_tool_call", session=session, tool_call_id=call)], instance=instance,
                            base_ts=base)
    return record


@pytest.mark.parametrize(("reply", "ok"), [
    ("_INBOX.hermes.gateway-3.0123456789abcdef012345.g", True),  # the shim's own form
    ("_INBOX.hermes.gateway-3.x.g", True),
    ("_INBOX.hermes.gateway-4.0123456789abcdef012345.g", False),  # another instance
    ("_INBOX.hermes.gateway-3.0123456789abcdef012345.i", False),  # not a decision's inbox
    ("_INBOX.hermes.gateway-3.*.g", False),  # a wildcard
    ("_INBOX.hermes.gateway-3..g", False),
    ("_INBOX.hermes.gateway-3.g", False),
    ("_INBOX.aep-operator.x.g", False),  # another role
    ("aep.hermes.victim.control.accepted", False),  # a stream
    ("$KV.aep_control.seq.victim", False),  # a bucket
    ("_INBOX.hermes.gateway-3." + "a" * 600 + ".g", False),
])
def test_a_held_calls_reply_must_be_an_inbox_of_its_own_instance(reply: str, ok: bool) -> None:
    from bridge.nats.subjects import shim_reply_ok

    assert shim_reply_ok(reply, "gateway-3", "g") is ok


def test_the_gate_replies_only_inside_the_publishers_inbox_space(url: str) -> None:
    """Finding 5. Before the fix the gate probed (and would release to) whatever subject a raw
    message's Aep-Gate-Reply named, with its own rights: a ping stored on AEP_EVENTS as
    ``aep.hermes.victim.control.accepted``, one written as the KV value ``seq.victim`` of
    aep_control (breaking that session's held calls), and it answered instruction pulls and
    hellos on any reply subject."""
    from nats.js.errors import KeyNotFoundError

    from bridge.services.gate import Gate, GateConfig

    targets = [
        "aep.hermes.victim.control.accepted",  # a forged event
        "$KV.aep_control.seq.victim",  # the gate's own state
        "_INBOX.aep-operator.stolen.g",  # another role's inbox
        "_INBOX.hermes.gateway-4.0123456789abcdef012345.g",  # another instance's inbox
    ]

    async def main() -> None:
        gate = Gate(role_settings(url, "gate"), GateConfig(control=True, instruct=True, probe_ms=50))
        raw, _commands = await gate.connect()
        op_spy, op_heard = await _eavesdrop(url, "operator", ["_INBOX.aep-operator.>"])
        shim_spy, shim_heard = await _eavesdrop(url, "shim", ["_INBOX.hermes.gateway-4.>"])
        attacker = await Client.connect(url, "shim")  # may publish hermes.raw.> and nothing else
        control = await Client.connect(url, "shim-control")
        op = await Client.connect(url, "operator")
        try:
            for i, target in enumerate(targets):
                subject, body, rid = _held_call("gateway-3", "s-hostile-5", f"c{i}")
                await attacker.js.publish(subject, body, headers={
                    "Nats-Msg-Id": rid, "Aep-Gate-Reply": target, "Aep-Gate-Hold-Ms": "30000"})
            msgs: list = []
            while len(msgs) < len(targets):
                msgs += await raw.fetch(len(targets) - len(msgs), timeout=5)
            for m in msgs:
                await gate.handle_raw(m)
                await m.ack_sync()
            for _ in range(3):  # the is-the-hook-still-there probe of every open card
                gate._last_probe = 0.0
                await gate.sweep()
            # The same through the gate's request services: a pull and a hello whose reply
            # subject is not an inbox of the requester's role.
            await control.nc.publish("aep.gate.instruct.s-hostile-5", b'{"session":"s-hostile-5"}',
                                     reply="$KV.aep_control.seq.victim2")
            await op.nc.publish("aep.gate.hello", b"", reply="aep.hermes.victim.control.rejected")
            await control.nc.flush()
            await op.nc.flush()
            await asyncio.sleep(0.5)

            reader = await Client.connect(url, "consumer")
            try:
                info = await reader.js.stream_info("AEP_EVENTS", subjects_filter="aep.hermes.victim.>")
                assert not info.state.subjects, f"the gate wrote into AEP_EVENTS: {info.state.subjects}"
            finally:
                await reader.close()
            for key in ("seq.victim", "seq.victim2"):
                with pytest.raises(KeyNotFoundError):
                    await gate.kv.get(key)
            assert not op_heard, f"the gate published into the operator's inbox space: {op_heard}"
            assert not shim_heard, f"the gate published into another instance's inbox: {shim_heard}"
        finally:
            for c in (op_spy, shim_spy, attacker, control, op):
                await c.close()
            await gate.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_card_releases_only_the_call_that_opened_it(url: str, tmp_path: Path) -> None:
    """Finding 5. A shared shim user overhears the gate's probe of a held call (its inbox),
    then publishes a raw pre_tool_call of its own naming that inbox. Before the fix the gate
    opened a second card on the victim's inbox, and the operator's deny of that card blocked
    the victim's call (a decision about another call)."""
    from bridge.services.gate import Gate, GateConfig

    async def main() -> None:
        gate = Gate(role_settings(url, "gate"), GateConfig(control=True, instruct=True, probe_ms=200))
        raw, commands = await gate.connect()
        loops = [asyncio.create_task(gate.consume(raw, gate.handle_raw, "raw")),
                 asyncio.create_task(gate.consume(commands, gate.handle_command, "commands")),
                 asyncio.create_task(gate.sweep_loop())]
        # (`_INBOX.*.g`: where a shim's inbox was before it named its instance; refused now)
        attacker, overheard = await _eavesdrop(url, "shim-control", ["_INBOX.hermes.gateway-5.*.g", "_INBOX.*.g"])
        user, password = USERS["shim-control"]
        env = {**shim_env(url, tmp_path / "spool", "gateway-5", DEADLINE_MS="3000", NATS_USER=user,
                          NATS_PASSWORD=password), "AEP_HERMES_CONTROL": "1", "AEP_HERMES_HOLD_MS": "30000"}
        victim = subprocess.Popen([sys.executable, "-I", "-S", str(compiled_hook())], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        victim.stdin.write(dumps(envelope("pre_tool_call", session="s-hostile-5b", tool_call_id="victim-call")))
        victim.stdin.close()
        victim.stdin = None
        op_env = {"PATH": "/usr/bin:/bin", "AEP_BRIDGE_CONFIG": "/dev/null", "AEP_BRIDGE_NATS_URL": url,
                  "AEP_BRIDGE_NATS_USER": USERS["operator"][0], "AEP_BRIDGE_NATS_PASSWORD": USERS["operator"][1]}

        async def answer(card_id: str, decision: str) -> str:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "bridge.cli", "control", "respond", card_id, decision, cwd=ROOT, env=op_env,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await proc.communicate()
            return (out + err).decode()

        async def cards() -> list[dict]:
            found = []
            for key in await gate.kv.keys():
                if key.startswith("card."):
                    found.append(json.loads((await gate.kv.get(key)).value))
            return found

        try:
            deadline = time.monotonic() + 20
            while not overheard and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert overheard, "the shared shim user overhears the gate's probe of the held call"
            stolen = overheard[0][0]
            (mine,) = [c for c in await cards() if c["call_id"] == "victim-call"]
            assert mine["inbox"] == stolen
            subject, body, rid = _held_call("gateway-5", "s-hostile-5b", "attacker-call")
            await attacker.js.publish(subject, body, headers={
                "Nats-Msg-Id": rid, "Aep-Gate-Reply": stolen, "Aep-Gate-Hold-Ms": "30000"})
            await asyncio.sleep(2.0)  # the gate handles it (opens a card, or refuses to)
            for card in await cards():
                if card["call_id"] == "attacker-call" and card["state"] == "open":
                    await answer(card["id"], "deny")
            await asyncio.sleep(1.0)
            assert victim.poll() is None, f"another card released the call: {victim.communicate()}"
            said = await answer(mine["id"], "allow")
            assert "accepted" in said, said
            out, err = await asyncio.to_thread(victim.communicate, timeout=30)
            assert out == b"{}\n", err
        finally:
            if victim.poll() is None:
                victim.kill()
            gate.stopper.trigger("test")
            await asyncio.wait(loops, timeout=10)
            await attacker.close()
            await gate.close()

    asyncio.run(asyncio.wait_for(main(), 90))


# ---------------------------------------------------------------- finding 17: `aep-bridge up`


def _listening(port: int) -> set[str]:
    """The local addresses a TCP socket listens on for ``port`` (from /proc/net/tcp{,6})."""
    import ipaddress

    found = set()
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            host, hexport = local.split(":")
            if state != "0A" or int(hexport, 16) != port:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(host)
            if width == 4:
                found.add(str(ipaddress.IPv4Address(raw[::-1])))
            else:  # four little-endian 32-bit words
                found.add(str(ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))))
    return found


def test_up_listens_on_loopback_only_and_requires_its_generated_credential(tmp_path: Path) -> None:
    """Finding 17. Before the fix `up`'s NATS took any local client without credentials (read
    HERMES_RAW, delete streams, answer held calls) and its workers' HTTP ports listened on every
    interface."""
    import os
    import stat

    import nats

    from tests.support.shim import run_hook
    from tests.support.up import cli, running_up

    with running_up(tmp_path) as (proc, env, info, tmp):
        url = info["nats_url"]
        port = int(url.rsplit(":", 1)[1])

        async def anonymous() -> str:
            try:
                nc = await nats.connect(url, connect_timeout=2, allow_reconnect=False, max_reconnect_attempts=0)
            except Exception as exc:
                return f"{type(exc).__name__}: {exc}"
            await nc.close()
            return "connected"

        assert "authorization" in asyncio.run(anonymous()).lower(), "up's NATS takes clients without credentials"
        shim = info.get("shim_env") or {}
        assert shim.get("AEP_BRIDGE_NATS_USER") and len(shim.get("AEP_BRIDGE_NATS_PASSWORD", "")) >= 24, info
        state = tmp / "state" / "aep-bridge" / "up.json"
        assert stat.S_IMODE(state.stat().st_mode) == 0o600, "up.json holds the credential: owner only"
        deadline = time.monotonic() + 30
        while "Ctrl-C" not in (tmp / "up.out").read_text() and time.monotonic() < deadline:
            time.sleep(0.1)  # the banner comes right after up.json
        banner = (tmp / "up.out").read_text()
        assert shim["AEP_BRIDGE_NATS_PASSWORD"] in banner
        assert (f"AEP_BRIDGE_NATS_URL={url} AEP_BRIDGE_NATS_USER={shim['AEP_BRIDGE_NATS_USER']} "
                f"AEP_BRIDGE_NATS_PASSWORD={shim['AEP_BRIDGE_NATS_PASSWORD']} {Path(sys.executable).parent / 'aep-bridge'} "
                "hermes install") in banner  # the full path: works without the venv on PATH

        for name, metrics in info["metrics"].items():
            mport = int(metrics.split(":")[2].split("/")[0])
            wait_for_listen = time.monotonic() + 30
            while not _listening(mport) and time.monotonic() < wait_for_listen:
                time.sleep(0.1)
            assert _listening(mport) <= {"127.0.0.1", "::1"} and _listening(mport), (name, _listening(mport))
        assert _listening(port) == {"127.0.0.1"}, _listening(port)
        relay_port = int(info["relay"]["url"].rsplit(":", 1)[1])  # the AEP door: loopback too
        wait_for_listen = time.monotonic() + 30
        while not _listening(relay_port) and time.monotonic() < wait_for_listen:
            time.sleep(0.1)  # the relay starts with the other workers
        assert _listening(relay_port) == {"127.0.0.1"}, _listening(relay_port)

        # The shim configured as up says, then `tail` (which reads up.json) sees its event.
        r = run_hook(dumps(envelope("on_session_start", session="s-up-17")),
                     {**shim_env(url, tmp / "spool", "gw-17", DEADLINE_MS="3000"), **shim})
        assert r.answered_empty_object and r.stderr == b"", r.stderr
        clean = {k: v for k, v in env.items() if not k.startswith("AEP_BRIDGE_NATS_")}
        tail = cli("tail", "--all", "--json", "--session", "s-up-17", "--count", "1", "--idle-exit", "30", env=clean)
        assert tail.returncode == 0 and '"session.started"' in tail.stdout, tail.stdout + tail.stderr
        os.kill(proc.pid, 0)


def test_the_sample_nats_conf_serves_monitoring_on_loopback_only(url: str, tmp_path_factory) -> None:  # type: ignore[no-untyped-def]
    """Finding 17: `/connz`, `/subsz`, `/jsz` have no authentication; the sample bound them to
    every interface (http_port: 8222)."""
    from tests.support.nats_roles import SAMPLE_CONF

    text = "\n".join(line.split("#", 1)[0] for line in SAMPLE_CONF.read_text().splitlines())
    assert "http_port" not in text and "monitor_port" not in text
    assert 'http: "127.0.0.1:8222"' in text
    logs = list(tmp_path_factory.getbasetemp().glob("nats-hostile-roles*/server.log"))
    assert logs and "Starting http monitor on 127.0.0.1:" in logs[0].read_text()
