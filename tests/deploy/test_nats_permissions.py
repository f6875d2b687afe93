"""The per-role NATS permissions, enforced by a real nats-server.

Two server configurations are checked with the same rules:

* ``deploy/nats/nats.conf``, the sample for an existing server, and
* the users and permissions this chart hands the bundled NATS server
  (``nats.config.merge`` in ``deploy/helm/aep-bridge/values.yaml``), written
  into a nats.conf by this test (:func:`values_nats_conf`: the block as JSON,
  each ``<< $VAR >>`` as the bare variable ``$VAR``). The official NATS chart,
  which does that rendering in a cluster, is not available here; what it adds
  around the block (listen ports, JetStream store, cluster) is not checked.

Each role connects with its own user and does what the bridge does with
nats-py (create streams and buckets, pull and ack, publish with an ack, KV
get/put/update/watch, object store put/get, ordered consumers); then tries
what it must not do (publish into another stage's stream, read upstream data,
write a bucket it only reads) and must be refused. The opt-in control plane's roles too: the
gate (``aep-bridge gate``'s own start-up as the ``aep-gate`` user, then its
durables, events, buckets, requests to a shim's inbox, the hello and
instruction-pull services), an operator's terminal (``aep-operator``: commands,
acks, the held calls read-only, hello) and the control-enabled shim's two
control moments (``hermes-shim-control``: the instruction pull; confirming the
gate's requests via ``allow_responses``), while the observe-only shim users
(``hermes-shim``, ``hermes-gateway-0``) may neither pull instructions nor
answer a request they overhear. The streams and buckets are created, as the
bootstrap user, by the bridge's own ``bridge.nats.bootstrap``, and the mapper
creates its durable from ``bridge.nats.streams.mapper_consumer_config``.
:func:`test_sample_and_values_grant_the_same_permissions` compares the two
configurations rule by rule.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import nats
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import DeliverPolicy

from bridge.nats.bootstrap import bootstrap as bridge_bootstrap
from bridge.nats.connection import ordered_subscribe
from bridge.nats.streams import mapper_consumer_config
from bridge.services.gate import Gate, GateConfig
from bridge.services.pairing import Partition, PairingService
from bridge.shim import hook
from tests.support.nats_roles import (
    Client,
    DENY_WAIT,
    PASSWORDS,
    SAMPLE_CONF,
    USERS,
    configured_server,
    ensure_streams,
    expect_api_refused,
    expect_publish_refused,
    role_settings,
    sample_nats_conf,
    values_merge,
    values_nats_conf,
)


@pytest.fixture(scope="module", params=["sample", "values"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp(f"nats-{request.param}")
    text = sample_nats_conf(tmp / "js") if request.param == "sample" else values_nats_conf(tmp / "js")
    with configured_server(tmp, text) as url:
        yield {"url": url, "kind": request.param, "log": tmp / "server.log"}


async def bootstrap(url: str) -> None:
    c = await Client.connect(url, "bootstrap")
    try:
        for _ in range(2):  # idempotent: created, then unchanged
            await bridge_bootstrap(c.js, replicas=1)
        await c.js.account_info()
        # bootstrap administers; it does not produce or consume events.
        await expect_publish_refused(c, "hermes.raw.gw.pre_tool_call")
        await expect_api_refused(c, c.js.delete_stream("AEP_EVENTS"), "$JS.API.STREAM.DELETE.AEP_EVENTS")
        await expect_api_refused(
            c, c.js.pull_subscribe("aep.hermes.>", durable="peek", stream="AEP_EVENTS"), "AEP_EVENTS"
        )
    finally:
        await c.close()


class _Snapshot:
    """A stand-in pairing state whose snapshot is a fixed blob."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def snapshot(self) -> bytes:
        return self.data


async def pairing_checkpoints(url: str) -> None:
    """The pairing service's own checkpoint write and read as aep-pairing: object p.3 of
    aep_checkpoints in several chunks, written twice (the second put purges the first's
    chunks), then read back the way a restore reads it (an ordered consumer)."""
    import zlib

    service = PairingService(role_settings(url, "pairing"), replica="permissions")
    await service.connect()
    try:
        snapshot = os.urandom(300_000)  # incompressible: three 128 KiB chunks
        # A lease confirmed just now: an owner whose lease may have lapsed is fenced and writes nothing.
        part = Partition(number=3, state=_Snapshot(snapshot), confirmed=time.monotonic())
        for position in (1, 2):
            part.position = position
            await service.checkpoint(part)
        info = await service.checkpoints.get_info("p.3")
        assert info.chunks >= 3, info
        assert zlib.decompress(await service.read_checkpoint(3)) == snapshot
        assert service.metrics.checkpoints._value.get() == 2
    finally:
        await service.close()


async def pairing_reader(url: str) -> None:
    """The pairing service's own reader consumer as aep-pairing: one consumer for several
    partitions (filter_subjects: created through $JS.API.CONSUMER.CREATE.BRIDGE_MAPPED.<name>,
    no filter token), pulled, then deleted (not left to its inactive threshold)."""
    from bridge.services.pairing import Feed

    service = PairingService(role_settings(url, "pairing"), replica="permissions")
    await service.connect()
    try:
        sub = await service.reader_consumer({3: Feed(0), 5: Feed(0)})
        (msg,) = await sub.fetch(1, timeout=2)
        assert msg.subject == "bridge.mapped.3.s1"
        await sub.unsubscribe()
        assert await service.js.delete_consumer("BRIDGE_MAPPED", sub._consumer)
    finally:
        await service.close()


async def checkpoints_refused(c: "Client") -> None:
    """A role other than pairing may neither bind, read nor write the checkpoint objects."""
    from nats.js.object_store import ObjectStore

    await expect_api_refused(c, c.js.object_store("aep_checkpoints"), "$JS.API.STREAM.INFO.OBJ_aep_checkpoints")
    unbound = ObjectStore(name="aep_checkpoints", stream="OBJ_aep_checkpoints", js=c.js)  # straight to the meta
    await expect_api_refused(c, unbound.get("p.3"), "$JS.API.STREAM.MSG.GET.OBJ_aep_checkpoints")
    await expect_api_refused(
        c, c.js.subscribe("$O.aep_checkpoints.C.>", stream="OBJ_aep_checkpoints", ordered_consumer=True),
        "$JS.API.CONSUMER.CREATE.OBJ_aep_checkpoints",
    )
    await expect_publish_refused(c, "$O.aep_checkpoints.M.cC4z")


async def scenario(url: str, kind: str) -> None:
    await bootstrap(url)

    # --- the Hermes shim: publish its raw envelope, with an ack, nothing else
    # (the observe-only users not even the control plane's instruction pull).
    shim_roles = ["shim", "shim-control"] + (["gateway-0"] if kind == "sample" else [])
    for role in shim_roles:
        c = await Client.connect(url, role)
        try:
            ack = await c.js.publish("hermes.raw.gateway-0.pre_tool_call", b'{"v":1}',
                                     headers={"Nats-Msg-Id": f"raw-{role}"})
            assert ack.stream == "HERMES_RAW"
            await expect_publish_refused(c, "aep.hermes.s1.session.started")
            await expect_publish_refused(c, "bridge.mapped.0.s1")
            await c.nc.subscribe("hermes.raw.>")
            assert await c.refused("hermes.raw.>"), "a shim must not read the raw stream"
            if role != "shim-control":
                await c.nc.publish("aep.gate.instruct.x", b'{"session":"x"}')
                assert await c.refused("aep.gate.instruct.x"), f"{role} is observe-only: no instruction pull"
        finally:
            await c.close()
    if kind == "sample":  # the strict form: a gateway publishes only as itself
        c = await Client.connect(url, "gateway-0")
        try:
            await expect_publish_refused(c, "hermes.raw.gateway-1.pre_tool_call")
        finally:
            await c.close()

    # --- mapper: pull + ack raw, publish mapped and dead letters, aep_lanes read/write.
    c = await Client.connect(url, "mapper")
    try:
        info = await c.js.stream_info("HERMES_RAW")  # epoch = the stream's creation time
        assert info.config.name == "HERMES_RAW"
        await c.js.add_consumer("HERMES_RAW", config=mapper_consumer_config())
        sub = await c.js.pull_subscribe("hermes.raw.>", durable="mapper", stream="HERMES_RAW")
        msgs = await sub.fetch(len(shim_roles), timeout=2)
        assert len(msgs) == len(shim_roles)
        for msg in msgs:
            await msg.ack_sync()
        ack = await c.js.publish("bridge.mapped.3.s1", b"{}", headers={"Nats-Msg-Id": "ev-1"})
        assert ack.stream == "BRIDGE_MAPPED"
        assert (await c.js.publish("bridge.dlq.not_json", b"x")).stream == "BRIDGE_DLQ"
        lanes = await c.js.key_value("aep_lanes")
        await lanes.put("s.s1", b"1")
        assert (await lanes.get("s.s1")).value == b"1"
        facts = await c.js.key_value("aep_lane_facts")  # a look-up raw message's lane: created once, read
        await facts.create("r.gw-1.01M8VHZ6HWX38VDH034AXBGQ7G", b"=s1")
        assert (await facts.get("r.gw-1.01M8VHZ6HWX38VDH034AXBGQ7G")).value == b"=s1"
        await c.nc.subscribe("$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.HERMES_RAW.mapper")
        await expect_publish_refused(c, "aep.hermes.s1.session.started")  # only pairing writes AEP_EVENTS
        await expect_publish_refused(c, "$KV.aep_pairing.p.0")
        await expect_publish_refused(c, "$KV.aep_leases.p.0")
        await checkpoints_refused(c)
        await expect_api_refused(c, c.js.stream_info("AEP_EVENTS"), "$JS.API.STREAM.INFO.AEP_EVENTS")
        assert not [e for e in c.errors if "MAX_DELIVERIES" in e]
    finally:
        await c.close()

    # --- pairing: per-partition durable, replay, publish AEP events, leases and checkpoints.
    c = await Client.connect(url, "pairing")
    try:
        sub = await c.js.pull_subscribe("bridge.mapped.3.>", durable="pairing-3", stream="BRIDGE_MAPPED")
        (msg,) = await sub.fetch(1, timeout=2)
        await msg.ack_sync()
        replayed = await c.js.get_msg("BRIDGE_MAPPED", seq=1)
        assert replayed.subject == "bridge.mapped.3.s1"
        ordered = await c.js.subscribe("bridge.mapped.>", ordered_consumer=True)
        assert (await ordered.next_msg(timeout=2)).subject == "bridge.mapped.3.s1"
        await ordered.unsubscribe()
        # Its tick into a partition it owns (TTL orphan closure), and no other mapped subject.
        tick = await c.js.publish("bridge.mapped.3.__tick__", b'{"now":1}', headers={"Nats-Msg-Id": "tick:3:1"})
        assert tick.stream == "BRIDGE_MAPPED"
        await expect_publish_refused(c, "bridge.mapped.3.somesession")  # no forged mapped events
        ack = await c.js.publish("aep.hermes.s1.session.started", b"{}", headers={"Nats-Msg-Id": "aep-1"})
        assert ack.stream == "AEP_EVENTS"
        leases = await c.js.key_value("aep_leases")
        revision = await leases.create("p.3", b"pod-a")
        await leases.update("p.3", b"pod-a", last=revision)
        watcher = await leases.watch("p.>")
        entry = await watcher.updates(timeout=2)
        assert entry is not None and entry.key == "p.3"
        await watcher.stop()
        checkpoints = await c.js.key_value("aep_pairing")
        await checkpoints.put("p.3", b"42")
        assert (await checkpoints.get("p.3")).value == b"42"
        await (await checkpoints.watch("p.>")).stop()
        await pairing_checkpoints(url)
        await pairing_reader(url)
        lanes = await c.js.key_value("aep_lanes")
        assert (await lanes.get("s.s1")).value == b"1"
        await expect_publish_refused(c, "$KV.aep_lanes.s.s2")  # lanes are the mapper's to write
        await expect_publish_refused(c, "$KV.aep_lane_facts.r.gw-1.x")  # and so are the lane facts
        await expect_publish_refused(c, "hermes.raw.gateway-0.pre_tool_call")
        await expect_api_refused(
            c, c.js.pull_subscribe("hermes.raw.>", durable="steal", stream="HERMES_RAW"),
            "HERMES_RAW",
        )
        # the mapper's floor its ticks carry: the mapper durable's info and HERMES_RAW's epoch, no more
        assert (await c.js.consumer_info("HERMES_RAW", "mapper")).ack_floor is not None
        assert (await c.js.stream_info("HERMES_RAW")).created is not None
        await expect_api_refused(c, c.js.consumer_info("HERMES_RAW", "gate"), "HERMES_RAW.gate")
        await expect_api_refused(c, c.js.get_msg("HERMES_RAW", seq=1), "HERMES_RAW")
    finally:
        await c.close()

    # --- consumers of AEP_EVENTS (SIEM, tail): read AEP_EVENTS only, with ordered consumers
    # created by name (issue 44: no durable, pull or ack that could be another role's).
    c = await Client.connect(url, "consumer")
    try:
        tail = await ordered_subscribe(c.js, "aep.hermes.>", "AEP_EVENTS", deliver_policy=DeliverPolicy.ALL)
        assert (await tail.next_msg(timeout=2)).subject == "aep.hermes.s1.session.started"
        await tail.unsubscribe()
        # the nameless create (its body may name any durable), a durable, a pull, an ack
        await expect_api_refused(c, c.js.subscribe("aep.hermes.>", ordered_consumer=True),
                                 '"$js.api.consumer.create.aep_events"')
        await expect_api_refused(c, c.js.pull_subscribe("aep.hermes.>", durable="siem", stream="AEP_EVENTS"),
                                 "AEP_EVENTS.siem")
        await expect_publish_refused(c, "$JS.ACK.AEP_EVENTS.siem.1.1.1.1.0")
        await expect_publish_refused(c, "aep.hermes.s1.session.ended")  # no forged events
        await expect_api_refused(
            c, c.js.pull_subscribe("hermes.raw.>", durable="peek", stream="HERMES_RAW"), "HERMES_RAW",
        )
        await expect_api_refused(c, c.js.get_msg("BRIDGE_MAPPED", seq=1), "BRIDGE_MAPPED")
        await c.nc.subscribe("bridge.mapped.>")
        assert await c.refused("bridge.mapped.>")
        await checkpoints_refused(c)
    finally:
        await c.close()


async def request_soon(nc, subject: str, data: bytes):  # type: ignore[no-untyped-def]
    """A request to a subscription another connection has just made: a freshly made
    subscription can still answer "no responders" for a few ms after its flush."""
    import nats.errors

    for _ in range(50):
        try:
            return await nc.request(subject, data, timeout=2)
        except nats.errors.NoRespondersError:
            await asyncio.sleep(0.02)
    return await nc.request(subject, data, timeout=2)


async def overheard_request_unanswered(requester, role: str, url: str) -> None:
    """An observe-only shim user hears (on _INBOX.>) a request meant for another shim's
    inbox and tries to answer it: without allow_responses the reply is refused and the
    requester hears nothing."""
    eaves = await Client.connect(url, role)
    try:
        victim = "_INBOX.hermes.gateway-0.victim-" + role  # inside the space it may hear
        replies: list[str] = []

        async def answer(m) -> None:  # type: ignore[no-untyped-def]
            replies.append(m.reply)
            await m.respond(b"ok")

        await eaves.nc.subscribe(victim + ".*", cb=answer)
        await eaves.nc.flush()
        for _ in range(50):  # a fresh subscription may answer "no responders" for a few ms
            try:
                await requester.request(victim + ".g", b'{"op":"release","decision":"allow"}', timeout=DENY_WAIT * 2)
            except nats.errors.NoRespondersError:
                await asyncio.sleep(0.02)
                continue
            except NatsTimeout:
                break
            pytest.fail(f"{role} answered a request it overheard")
        assert replies, f"{role} did not hear the request"
        assert await eaves.refused(replies[0]), eaves.errors
    finally:
        await eaves.close()


async def control_plane(url: str, kind: str = "sample") -> None:
    """The gate, an operator and the shim's control moments (after :func:`scenario`)."""
    # The real service's start-up as aep-gate: it creates aep_control and aep_instruct,
    # its durables `gate` (HERMES_RAW) and `gate-commands` (AEP_EVENTS), subscribes the
    # hello and instruction-pull services and watches aep_control for open cards.
    gate = Gate(role_settings(url, "gate"), GateConfig(control=True, instruct=True))
    raw, commands = await gate.connect()
    shim = await Client.connect(url, "shim-control")
    op = await Client.connect(url, "operator")
    try:
        # A held pre_tool_call reaches the gate's durable; the gate acks it.
        inbox = shim.nc.new_inbox()
        ack = await shim.js.publish("hermes.raw.gateway-0.pre_tool_call", b'{"v":1}',
                                    headers={"Nats-Msg-Id": "held-1", "Aep-Gate-Reply": inbox + ".g"})
        assert ack.stream == "HERMES_RAW"
        (msg,) = await raw.fetch(1, timeout=2)
        assert msg.headers["Aep-Gate-Reply"] == inbox + ".g"
        await msg.ack_sync()

        # The gate's requests to the shim's inbox (probe, release) are confirmed by the
        # shim: allow_responses lets it reply to what it received, and only to that.
        async def confirm(m) -> None:  # type: ignore[no-untyped-def]
            await m.respond(b"ok")

        await shim.nc.subscribe(inbox + ".*", cb=confirm)
        await shim.nc.flush()
        assert (await request_soon(gate.nc, inbox + ".g", b'{"op":"ping"}')).data == b"ok"

        # An operator's command reaches the gate's other durable; its ack reaches the operator.
        acks = await op.nc.subscribe("aep.hermes.s1.control.accepted")
        sent = await op.js.publish("aep.hermes.s1.control.attention.respond", b'{"id":"c1"}')
        assert sent.stream == "AEP_EVENTS"
        assert (await op.js.publish("aep.hermes.s1.x.hermes.control.instruct", b'{"id":"c2"}')).stream == "AEP_EVENTS"
        cmds = await commands.fetch(2, timeout=2)
        assert [m.subject for m in cmds] == ["aep.hermes.s1.control.attention.respond",
                                             "aep.hermes.s1.x.hermes.control.instruct"]
        for m in cmds:
            await m.ack_sync()
        for etype in ("attention.requested", "attention.resolved", "control.accepted", "control.rejected",
                      "x.hermes.instruction.delivered", "x.hermes.instruction.dropped"):
            published = await gate.js.publish(f"aep.hermes.s1.{etype}", b"{}", headers={"Nats-Msg-Id": f"g-{etype}"})
            assert published.stream == "AEP_EVENTS", etype
        assert (await acks.next_msg(timeout=2)).subject == "aep.hermes.s1.control.accepted"

        # State: its two buckets (create, compare-and-set, get); aep_lanes read; the
        # session's start on AEP_EVENTS (a session the gate did not see begin).
        revision = await gate.kv.create("card.c1", b'{"state":"open"}')
        await gate.kv.update("card.c1", b'{"state":"open"}', last=revision)
        await gate.load_cards()  # what a restarted gate does: watch aep_control for the open cards
        await gate.queues.put("q.s1", b"[]")
        assert (await gate.queues.get("q.s1")).value == b"[]"
        assert (await gate.lanes.kv.get("s.s1")).value == b"1"
        assert (await gate.js.get_last_msg("AEP_EVENTS", "aep.hermes.s1.session.started")).data == b"{}"
        assert (await gate.js.stream_info("HERMES_RAW")).state.last_seq >= 1

        # The shim's instruction pull, answered by the gate's service (empty queue: {}).
        pulled = await request_soon(shim.nc, "aep.gate.instruct.s1", b'{"session":"s1"}')
        assert pulled.data == b"{}"

        # The operator: hello, the held calls (get and watch), and nothing else.
        hello = json.loads((await request_soon(op.nc, "aep.gate.hello", b"")).data)
        assert hello["capabilities"]["control"]["accepts"] == ["control.attention.respond", "x.hermes.control.instruct"]
        cards = await op.js.key_value("aep_control")
        assert (await cards.get("card.c1")).value == b'{"state":"open"}'
        watcher = await cards.watch("card.*")
        entry = await watcher.updates(timeout=2)
        assert entry is not None and entry.key == "card.c1"
        await watcher.stop()
        await expect_publish_refused(op, "$KV.aep_control.card.c1")  # cards are the gate's to write
        await expect_publish_refused(op, "aep.hermes.s1.control.accepted")  # no forged acks
        await expect_publish_refused(op, "aep.hermes.s1.attention.answered")
        await expect_publish_refused(op, "hermes.raw.gateway-0.pre_tool_call")
        await expect_api_refused(op, op.js.key_value("aep_instruct"), "KV_aep_instruct")
        await expect_api_refused(
            op, op.js.pull_subscribe("aep.hermes.>", durable="peek", stream="AEP_EVENTS"), "AEP_EVENTS",
        )
        await op.nc.subscribe("aep.gate.instruct.*")
        assert await op.refused("aep.gate.instruct.*"), "an operator must not pose as the gate"

        # The shim: no reply it was not asked for, no posing as the gate.
        await shim.nc.publish("_INBOX.someone-else.g", b'{"op":"release","decision":"allow"}')
        assert await shim.refused("_INBOX.someone-else.g"), "allow_responses only answers a request"
        await shim.nc.subscribe("aep.gate.hello")
        assert await shim.refused("aep.gate.hello")

        # The observe-only shim users: no instruction pull, no answer to what they overhear.
        for role in ["shim"] + (["gateway-0"] if kind == "sample" else []):
            await overheard_request_unanswered(gate.nc, role, url)
            eaves = await Client.connect(url, role)
            try:
                with pytest.raises((NatsTimeout, nats.errors.NoRespondersError)):
                    await eaves.nc.request("aep.gate.instruct.x", b'{"session":"x"}', timeout=DENY_WAIT)
                assert await eaves.refused("aep.gate.instruct.x"), f"{role} must not pull instructions"
            finally:
                await eaves.close()
    finally:
        await op.close()
        await shim.close()
        await gate.close()

    # What the gate must not do, on a connection of its own that records the refusals.
    c = await Client.connect(url, "gate")
    try:
        await expect_publish_refused(c, "hermes.raw.gateway-0.pre_tool_call")  # no forged raw events
        await expect_publish_refused(c, "aep.hermes.s1.control.attention.respond")  # nor commands
        await expect_publish_refused(c, "aep.hermes.s1.tool.requested")  # nor mapped or paired types
        await expect_publish_refused(c, "aep.hermes.s1.session.ended")
        await expect_publish_refused(c, "bridge.mapped.0.s1")
        await expect_publish_refused(c, "bridge.dlq.not_json")
        await expect_publish_refused(c, "$KV.aep_lanes.s.s2")  # lanes are the mapper's to write
        await expect_publish_refused(c, "$KV.aep_pairing.p.0")
        await expect_api_refused(c, c.js.key_value("aep_pairing"), "KV_aep_pairing")  # no pairing state
        await expect_api_refused(c, c.js.key_value("aep_leases"), "KV_aep_leases")
        await checkpoints_refused(c)
        await expect_api_refused(
            c, c.js.pull_subscribe("hermes.raw.>", durable="mapper", stream="HERMES_RAW"), "HERMES_RAW.mapper",
        )
        await expect_api_refused(c, c.js.get_msg("HERMES_RAW", seq=1), "HERMES_RAW")
        await expect_api_refused(c, c.js.delete_stream("AEP_EVENTS"), "$JS.API.STREAM.DELETE.AEP_EVENTS")
        await c.nc.subscribe("hermes.raw.>")
        assert await c.refused("hermes.raw.>")
    finally:
        await c.close()


def test_each_role_can_do_its_job_and_nothing_else(server: dict) -> None:
    try:
        asyncio.run(asyncio.wait_for(scenario(server["url"], server["kind"]), 60))
        asyncio.run(asyncio.wait_for(control_plane(server["url"], server["kind"]), 60))
    except BaseException:
        print(server["log"].read_text()[-4000:])
        raise


def test_wrong_password_is_refused(server: dict) -> None:
    async def attempt() -> str:
        with pytest.raises(Exception) as err:
            await Client.connect(server["url"], "mapper", password="wrong")
        return str(err.value)

    message = asyncio.run(attempt())
    assert re.search(r"authorization violation", message, re.I), message


def _allowed(text: str, direction: str) -> frozenset[str]:
    """The quoted subjects of `<direction>: { allow: [...] }` in a piece of nats.conf."""
    match = re.search(direction + r":\s*\{\s*allow:\s*\[(.*?)\]", text, flags=re.S)
    return frozenset(re.findall(r'"([^"]+)"', match.group(1))) if match else frozenset()


def sample_denies() -> dict[str, frozenset[str]]:
    """{user: publish deny} of deploy/nats/nats.conf (the only deny lists are on publish)."""
    text = re.sub(r"#[^\n]*", "", SAMPLE_CONF.read_text())
    named = dict(re.findall(r"^(\w+_PERMISSIONS) = \{(.*?)^\}", text, flags=re.M | re.S))
    out = {}
    for entry in re.split(r"(?=\buser:)", text[text.index("accounts {"):])[1:]:
        user = re.match(r"user: ([\w-]+)", entry).group(1)
        ref = re.search(r"permissions: \$(\w+)", entry)
        body = named[ref.group(1)] if ref else entry
        match = re.search(r"deny:\s*\[(.*?)\]", body, flags=re.S)
        out[user] = frozenset(re.findall(r'"([^"]+)"', match.group(1))) if match else frozenset()
    return out


def values_denies() -> dict[str, frozenset[str]]:
    (account,) = values_merge()["accounts"].values()
    return {u["user"]: frozenset(u["permissions"]["publish"].get("deny") or ()) for u in account["users"]}


def test_sample_and_values_deny_the_same() -> None:
    """The deny lists (other roles' durables, issue 44) are the same in both configurations."""
    sample, values = sample_denies(), values_denies()
    assert sample == {**values, "hermes-gateway-0": frozenset()}
    assert {u for u, d in sample.items() if d} == {"aep-mapper", "aep-consumer", "aep-exporter", "aep-relay"}


def sample_users() -> dict[str, tuple[str, frozenset[str], frozenset[str], bool]]:
    """{user: (password variable, publish allow, subscribe allow, allow_responses)} of deploy/nats/nats.conf."""
    text = re.sub(r"#[^\n]*", "", SAMPLE_CONF.read_text())
    named = dict(re.findall(r"^(\w+_PERMISSIONS) = \{(.*?)^\}", text, flags=re.M | re.S))
    users = {}
    for entry in re.split(r"(?=\buser:)", text[text.index("accounts {"):])[1:]:
        user = re.match(r"user: ([\w-]+)", entry).group(1)
        password = re.search(r"password: \$(\w+)", entry).group(1)
        ref = re.search(r"permissions: \$(\w+)", entry)
        body = named[ref.group(1)] if ref else entry
        responses = re.search(r"allow_responses:\s*(\w+)", body)
        users[user] = (password, _allowed(body, "publish"), _allowed(body, "subscribe"),
                       bool(responses) and responses.group(1) == "true")
    return users


def test_sample_and_values_grant_the_same_permissions() -> None:
    """deploy/nats/nats.conf and values.yaml's nats.config.merge: the same users, each
    with the same password variable, the same publish/subscribe allow lists and the same
    allow_responses (the sample adds the per-instance shim user hermes-gateway-0)."""
    sample = sample_users()
    (account,) = values_merge()["accounts"].values()
    values = {
        u["user"]: (
            re.fullmatch(r"<< \$(\w+) >>", u["password"]).group(1),
            frozenset(u["permissions"]["publish"]["allow"]),
            frozenset(u["permissions"]["subscribe"]["allow"]),
            u["permissions"].get("allow_responses") is True,
        )
        for u in account["users"]
    }
    assert values.keys() == {"aep-bootstrap", "aep-mapper", "aep-pairing", "hermes-shim", "aep-consumer",
                             "aep-gate", "aep-operator", "hermes-shim-control", "aep-exporter", "aep-relay"}
    assert sample.keys() == values.keys() | {"hermes-gateway-0"}
    for user, rules in values.items():
        assert sample[user] == rules, user
    # The shim users: observe-only, except hermes-shim-control (fleets that run the gate).
    assert sample["hermes-gateway-0"][1:] == ({"hermes.raw.gateway-0.>"}, {"_INBOX.hermes.gateway-0.>"}, False)
    assert sample["hermes-shim"][1:] == ({"hermes.raw.>"}, {"_INBOX.hermes.>"}, False)
    assert sample["hermes-shim-control"] == (
        "AEP_SHIM_CONTROL_PASSWORD", {"hermes.raw.>", "aep.gate.instruct.*"}, {"_INBOX.hermes.>"}, True)
    # Each role hears its own inbox prefix only: nobody may subscribe to _INBOX.> (what the
    # mapper pulls is the raw stream); only the gate publishes into inboxes (the shims' and
    # the operators' hello answers).
    for user, (_, publish, subscribe, _) in sample.items():
        assert not {"_INBOX.>", ">", "_INBOX.*"} & (publish | subscribe), user
        assert {s for s in subscribe if s.startswith("_INBOX.")} == (
            {"_INBOX.hermes.gateway-0.>"} if user == "hermes-gateway-0"
            else {"_INBOX.hermes.>"} if user.startswith("hermes-") else {f"_INBOX.{user}.>"}), user
    assert {user for user, rules in sample.items() if any(p.startswith("_INBOX.") for p in rules[1])} == {"aep-gate"}
    assert {p for p in sample["aep-gate"][1] if p.startswith("_INBOX.")} == {"_INBOX.hermes.>", "_INBOX.aep-operator.>"}
    # Only the control-enabled shim answers requests (the gate's) and pulls instructions; the
    # relay answers the commands its other replicas forward to it.
    assert {user for user, rules in sample.items() if rules[3]} == {"hermes-shim-control", "aep-relay"}
    # Only the relay uses its replicas' bucket and subjects.
    assert {user for user, rules in sample.items() if any("aep_relay" in s or s.startswith("aep.relay.")
                                                          for s in rules[1])} == {"aep-relay", "aep-bootstrap"}
    assert {s for s in sample["aep-bootstrap"][1] if "aep_relay" in s} == {
        "$JS.API.STREAM.CREATE.KV_aep_relay", "$JS.API.STREAM.UPDATE.KV_aep_relay", "$JS.API.STREAM.INFO.KV_aep_relay"}
    assert {user for user, rules in sample.items() if "aep.gate.instruct.*" in rules[1]} == {"hermes-shim-control"}
    # Only the mapper publishes mapped events; pairing only its ticks.
    assert {user for user, rules in sample.items() if "bridge.mapped.>" in rules[1]} == {"aep-mapper"}
    assert {user for user, rules in sample.items() if any(s.startswith("bridge.mapped.") for s in rules[1])} == {
        "aep-mapper", "aep-pairing"}
    assert {s for s in sample["aep-pairing"][1] if s.startswith("bridge.mapped.")} == {"bridge.mapped.*.__tick__"}
    # Only the gate publishes its events and acks; only the operator (and pairing's
    # aep.hermes.>) and the relay (for operator tokens) may publish commands; nobody else
    # touches the control buckets, and the relay only reads the held calls (roster).
    assert {user for user, rules in sample.items() if "aep.hermes.*.control.accepted" in rules[1]} == {"aep-gate"}
    assert {user for user, rules in sample.items() if "$KV.aep_control.>" in rules[1]} == {"aep-gate"}
    assert {user for user, rules in sample.items() if any("aep_control" in s for s in rules[1])} == {
        "aep-gate", "aep-operator", "aep-relay"}
    assert {user for user, rules in sample.items() if "aep.hermes.*.control.attention.respond" in rules[1]} == {
        "aep-operator", "aep-relay"}
    for password_var, *_ in sample.values():
        assert password_var in PASSWORDS
    assert sample.keys() == {name for name, _ in USERS.values()}, "the scenario connects as every user"


SHIM = Path(hook.__file__)


async def raw_subjects(url: str) -> list[str]:
    c = await Client.connect(url, "mapper")
    try:
        info = await c.js.stream_info("HERMES_RAW", subjects_filter=">")
        return sorted((info.state.subjects or {}).keys())
    finally:
        await c.close()


def test_the_real_shim_publishes_with_its_user_and_only_as_its_instance(server: dict, tmp_path: Path) -> None:
    """The shim as Hermes runs it (`python -I -S hook.py`), with the shim users' rights."""
    asyncio.run(ensure_streams(server["url"]))
    cases = [("shim", "gateway-7", True), ("shim-control", "gateway-8", True)]
    if server["kind"] == "sample":
        cases += [("gateway-0", "gateway-0", True), ("gateway-0", "gateway-1", False)]
    for role, instance, allowed in cases:
        user, password = USERS[role]
        spool = tmp_path / f"spool-{role}-{instance}"
        env = {
            "AEP_BRIDGE_NATS_URL": server["url"], "AEP_BRIDGE_NATS_USER": user,
            "AEP_BRIDGE_NATS_PASSWORD": password, "AEP_BRIDGE_INSTANCE": instance,
            "AEP_BRIDGE_SPOOL_DIR": str(spool), "AEP_BRIDGE_DEADLINE_MS": "2000",
            "AEP_BRIDGE_CONFIG": str(tmp_path / "no-such-file"),
        }
        envelope = b'{"hook_event_name": "pre_tool_call", "session_id": "s1", "extra": {}}'
        proc = subprocess.run([sys.executable, "-I", "-S", str(SHIM)], input=envelope, env=env,
                              capture_output=True, timeout=30)
        assert (proc.returncode, proc.stdout.strip()) == (0, b"{}"), proc.stderr
        published = f"hermes.raw.{instance}.pre_tool_call" in asyncio.run(raw_subjects(server["url"]))
        spooled = any(p.stat().st_size for p in spool.glob("*.spool")) if spool.exists() else False
        assert (published, spooled) == (allowed, not allowed), (role, instance, proc.stderr)


def test_the_real_relay_does_its_job_as_its_user_and_nothing_else(server: dict, tmp_path: Path) -> None:
    """`aep-bridge relay` as user aep-relay: ingest, SSE replay, WebSocket, roster, with no
    permission error; the same user may not write the bridge's own subjects nor read upstream."""
    import aiohttp

    from tests.support.relay import EMITTER, OPERATOR, RelayProcess, auth, encode, event, read_sse

    asyncio.run(bootstrap(server["url"]))
    url = server["url"].replace("nats://", "nats://aep-relay:relay-pw@")
    relay = RelayProcess(url, tmp_path).start()
    other = RelayProcess(url, tmp_path).start()  # a second replica: claims and commands cross between them
    ev = event("perm-relay", 1)

    async def across() -> dict:
        """An emitter's claim on ``relay``, a command for it through ``other``, its ack back."""
        session = "perm-claim"
        async with aiohttp.ClientSession() as s:
            em = await s.ws_connect(relay.ws_url, headers=auth(EMITTER))
            await em.send_json({"type": "hello", "versions": ["0.1"], "role": "emitter", "identity": {"agent": "perm"},
                                "capabilities": {"control": {"accepts": ["control.attention.respond"]}}})
            await em.receive(timeout=5)
            await em.send_str(encode({**event(session, 0, "session.started", data={"client": {"name": "p"}})}).decode())
            op = await s.ws_connect(other.ws_url, headers=auth(OPERATOR))
            await op.send_json({"type": "hello", "versions": ["0.1"], "role": "consumer"})
            await op.receive(timeout=5)
            for _ in range(50):
                await op.send_json({"type": "roster", "id": "r"})
                if json.loads((await op.receive(timeout=10)).data)["entries"]:
                    break
                await asyncio.sleep(0.1)
            cmd = {"aep": "0.1", "id": "PERMCMD1", "type": "control.attention.respond", "time": "2026-12-01T10:00:00.000Z",
                   "source": "urn:test:perm", "agent": "op", "session": session, "data": {"answer": {"option": "allow"}}}
            await op.send_json(cmd)
            got = json.loads((await em.receive(timeout=10)).data)
            await em.send_str(encode({**event(session, 1, "control.accepted", data={}), "cause": got["id"],
                                      "id": "perm-ack"}).decode())
            ack = json.loads((await op.receive(timeout=10)).data)
            await em.close()
            await op.close()
            return ack

    async def use() -> tuple[int, dict, dict]:
        async with aiohttp.ClientSession() as s:
            async with s.post(relay.url + "/events", data=encode(ev),
                              headers={**auth(EMITTER), "AEP-Version": "0.1", "Content-Type": "application/json"}) as r:
                posted = r.status
            got = await read_sse(s, relay.url + "/stream", headers=auth(OPERATOR), params={"from": "all", "live": "0",
                                                                                      "filter": '{"session":"perm-relay"}'})
            ws = await s.ws_connect(relay.ws_url, headers=auth(OPERATOR))
            await ws.send_json({"type": "hello", "versions": ["0.1"], "role": "consumer"})
            await ws.receive(timeout=5)
            await ws.send_json({"type": "roster", "id": "r"})
            roster = json.loads((await ws.receive(timeout=10)).data)
            await ws.close()
            return posted, got, roster

    try:
        posted, got, roster = asyncio.run(use())
        ack = asyncio.run(across())
    finally:
        relay.stop()
        other.stop()
    assert ack["type"] == "control.accepted" and ack["cause"] == "PERMCMD1", ack
    assert "Permissions Violation" not in other.logs() and "Traceback" not in other.logs()
    assert posted == 202
    assert [{**json.loads(e["data"]), "seq": ev["seq"]} for e in got["events"]] == [ev]  # at the relay's position (issue 44)
    assert roster == {"type": "roster", "id": "r", "entries": []}
    assert "Permissions Violation" not in relay.logs() and "Traceback" not in relay.logs()

    async def refused() -> None:
        c = await Client.connect(server["url"], "relay")
        try:
            await expect_publish_refused(c, "aep.hermes.s1.session.started")  # the bridge's own events
            await expect_publish_refused(c, "aep.hermes.s1.control.accepted")  # acks are the gate's
            await expect_publish_refused(c, "hermes.raw.gw.pre_tool_call")
            await expect_publish_refused(c, "$KV.aep_lanes.s.x")  # of the KV buckets, aep_relay only
            await expect_publish_refused(c, "aep.relay.x.other")  # of its own subjects, command and reply only
            await expect_api_refused(c, c.js.pull_subscribe("hermes.raw.>", durable="x", stream="HERMES_RAW"), "HERMES_RAW")
            await expect_api_refused(c, c.js.delete_stream("AEP_EVENTS"), "$JS.API.STREAM.DELETE.AEP_EVENTS")
        finally:
            await c.close()

    asyncio.run(refused())


async def exporter_partitions(url: str) -> None:
    """A sink with replicas > 1, as the exporter user: AEP_EXPORT and a sink's source in it,
    the leases and members in aep_leases, a partition consumer (recreated, fetched, acked);
    not pairing's leases, not another stream."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry

    from bridge.config import Settings
    from bridge.core.sinks import sink_from_url
    from bridge.runtime import Health, Stopper
    from bridge.services.exporter.partitions import PartitionedSink
    from bridge.services.exporter.service import ExporterMetrics, SinkWorker

    await bootstrap(url)
    p = await Client.connect(url, "pairing")
    try:
        ack = await p.js.publish("aep.hermes.lanex.session.started", b'{"id":"perm-e1"}', headers={"Nats-Msg-Id": "perm-e1"})
    finally:
        await p.close()
    c = await Client.connect(url, "exporter")
    try:
        svc = SimpleNamespace(js=c.js, metrics=ExporterMetrics(CollectorRegistry()), stopper=Stopper(),
                              health=Health("exporter"), settings=Settings())
        for name in ("perm-a", "perm-b"):  # the first creates AEP_EXPORT, the second adds its source
            part = PartitionedSink(svc, sink_from_url(f"kafka://127.0.0.1:9/t?name={name}&replicas=2"))
            await part.setup()
        await part.leases.put(part.member_key, b"m")
        assert await part.members() == 1
        revision = await part.leases.create(part.lease_key(0), b"me")
        await part.leases.update(part.lease_key(0), b"me", last=revision)
        subjects: dict[str, int] = {}
        for _ in range(50):
            subjects = (await c.js.stream_info("AEP_EXPORT", subjects_filter="export.perm-b.*.aep.hermes.lanex.>")).state.subjects or {}
            if subjects:
                break
            await asyncio.sleep(0.1)
        (subject,) = subjects
        worker = SinkWorker(svc, part.cfg, sink=part.sink, partition=int(subject.split(".")[2]))
        for _ in range(2):  # created, then (a takeover) deleted and created again
            await worker.bind()
        msgs = await worker.sub.fetch(100, timeout=5)  # the partition's events (earlier scenarios' too)
        assert (ack.seq, "aep.hermes.lanex.session.started") in [worker.origin(m) for m in msgs]
        for m in msgs:
            await m.ack_sync()
        await part.leases.delete(part.lease_key(0))
        assert not [e for e in c.errors if "permissions violation" in e.lower()], c.errors
        await expect_publish_refused(c, "$KV.aep_leases.p.0")  # pairing's leases are not the exporter's
        await expect_api_refused(c, c.js.get_msg("KV_aep_leases", subject="$KV.aep_leases.p.0", direct=True),
                                 "$KV.aep_leases.p.0")
        await expect_api_refused(c, c.js.delete_stream("AEP_EXPORT"), "$JS.API.STREAM.DELETE.AEP_EXPORT")
        await expect_api_refused(c, c.js.add_stream(name="STEAL", subjects=["hermes.raw.>"]), "STREAM.CREATE.STEAL")
    finally:
        await c.close()


def test_exporter_replicas_share_a_sink_within_the_exporters_permissions(server: dict) -> None:
    try:
        asyncio.run(asyncio.wait_for(exporter_partitions(server["url"]), 60))
    except BaseException:
        print(server["log"].read_text()[-4000:])
        raise


def test_the_values_server_has_the_file_store_the_chart_gives_it(tmp_path: Path) -> None:
    """The NATS chart renders max_file_store from fileStore.maxSize, else from the PVC's size;
    this test's server gets the same. Without it nats-server takes 75 % of the free disk, and
    whether the reservations (every stream's max_bytes, AEP_EXPORT's included) fit depended on
    the machine: CI, 2026-12-05, "insufficient storage resources available" creating AEP_EXPORT."""
    import urllib.request

    from tests.support.cli import free_port
    from tests.support.chart import chart_max_file_store

    port = free_port()
    with configured_server(tmp_path, values_nats_conf(tmp_path / "js"), monitor_port=port):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/varz", timeout=10) as resp:
            varz = json.loads(resp.read())
    assert varz["jetstream"]["config"]["max_storage"] == chart_max_file_store()
