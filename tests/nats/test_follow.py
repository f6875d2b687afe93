"""A service leaves a server that cannot serve JetStream, and a fleet spreads over the servers
(bridge/nats/follow.py, issue 42). The cluster partition itself: tests/cluster/test_partitions.py."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections import Counter
from urllib.parse import urlparse

import pytest
from prometheus_client import CollectorRegistry

from bridge.config import Settings
from bridge.nats import follow
from bridge.nats.connection import connect_options, connect_service
from bridge.runtime.health import Health, HttpServer
from tests.natsfixture import free_port, nats_server_binary

URLS = ["nats://n1:4222", "nats://n2:4222", "nats://n3:4222"]


def test_first_server_is_a_stable_hash_of_the_identity_and_the_fleet_spreads():
    names = [f"aep-bridge-{kind}-{i}" for kind in ("mapper", "pairing", "gate", "exporter", "relay") for i in range(6)]
    firsts = Counter(follow.first_server_order(URLS, follow.identity(n))[0] for n in names)
    assert set(firsts) == set(URLS), firsts  # every server takes some of the fleet
    assert max(firsts.values()) <= len(names) * 0.6, firsts  # none takes (nearly) all
    for n in names[:5]:
        order = follow.first_server_order(URLS, follow.identity(n))
        assert order == follow.first_server_order(URLS, follow.identity(n)), "stable"
        k = URLS.index(order[0])
        assert order == URLS[k:] + URLS[:k], "the rest keeps the list's order (the next server on a move)"
    assert follow.first_server_order(URLS[:1], "x") == URLS[:1]


def test_connect_options_start_each_service_on_its_own_server(monkeypatch):
    monkeypatch.setenv("HOSTNAME", "pod-a")
    settings = Settings(nats_url=",".join(URLS))
    firsts = {connect_options(settings, name=f"aep-bridge-pairing-p{i}")["servers"][0] for i in range(12)}
    assert len(firsts) >= 2, "not every service on the first URL"
    opts = connect_options(settings, name="aep-bridge-gate-x")
    assert opts["dont_randomize"] is True and sorted(opts["servers"]) == sorted(URLS)
    monkeypatch.setenv("HOSTNAME", "pod-b")
    pods = {connect_options(settings, name="aep-bridge-gate-x")["servers"][0] for _ in range(2)}
    assert len(pods) == 1, "one pod: one stable choice"


def start_plain_server() -> tuple[str, subprocess.Popen]:
    """A nats-server without JetStream: it accepts, answers PINGs and takes publishes; every
    JetStream request finds no responders (what a client sees of a node that cannot serve)."""
    import socket

    port = free_port()
    proc = subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            time.sleep(0.05)
    return f"nats://127.0.0.1:{port}", proc


@pytest.fixture
def plain_server():
    url, proc = start_plain_server()
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def test_no_move_when_no_other_server_serves_jetstream(plain_server):
    """Every server fails JetStream (a whole cluster electing, e.g. at a heal): moving gains
    nothing, so the service stays where it is and says so once."""
    other, proc = start_plain_server()
    try:
        async def run() -> tuple[int, bool, str | None]:
            settings = Settings(nats_url=f"{plain_server},{other}", nats_leave_after_s=0.5)
            nc = await connect_service(settings, name="aep-bridge-stay-put", wait_s=10)
            try:
                f = follow.of(nc)
                first = f.server()
                await asyncio.sleep(3.0)
                return f.moves, f.waiting, first == f.server()
            finally:
                await nc.close()

        moves, waiting, same = asyncio.run(run())
    finally:
        proc.terminate()
        proc.wait(10)
    assert moves == 0 and waiting and same


def test_a_lone_answering_server_among_three_is_not_followed(plain_server, nats_server):
    """Three servers take connections and only one answers the probe: what a meta leader cut off
    from its peers looks like while the other two have not elected one yet (it answers
    $JS.API.INFO for ~10 s more, the healthy two answer nothing). Moving there would put the
    service on the cut node: in a partition run (2026-12-07) three services on a healthy node
    moved to the cut meta leader. The service stays until a majority of the servers that take
    connections answer."""
    other, proc = start_plain_server()
    urls = [plain_server, other, nats_server.url]
    name = next(n for n in (f"aep-bridge-lone-{i}" for i in range(200))
                if follow.first_server_order(urls, follow.identity(n))[0] == plain_server)
    try:
        async def run() -> tuple[int, bool, str | None]:
            settings = Settings(nats_url=",".join(urls), nats_leave_after_s=0.5)
            nc = await connect_service(settings, name=name, wait_s=10)
            try:
                f = follow.of(nc)
                await asyncio.sleep(3.0)
                return f.moves, f.waiting, f.server()
            finally:
                await nc.close()

        moves, waiting, server = asyncio.run(run())
    finally:
        proc.terminate()
        proc.wait(10)
    assert moves == 0 and waiting and server == urlparse(plain_server).netloc


def test_a_service_leaves_a_server_that_cannot_serve_jetstream(plain_server, nats_server):
    """Listed first (its name's hash picks it), the server without JetStream takes the
    connection; within a few seconds of failed JetStream requests the service moves to the
    next server, counts and logs the move, and /healthz and /metrics show it."""
    good = urlparse(nats_server.url).netloc
    bad = urlparse(plain_server).netloc
    urls = [plain_server, nats_server.url]
    name = next(n for n in (f"aep-bridge-test-{i}" for i in range(200))
                if follow.first_server_order(urls, follow.identity(n))[0] == plain_server)

    async def run() -> tuple[str | None, str | None, int, dict, float | None]:
        settings = Settings(nats_url=",".join(urls), nats_leave_after_s=1.0)
        nc = await connect_service(settings, name=name, wait_s=10)
        try:
            first = nc.connected_url.netloc
            f = follow.of(nc)
            assert f is not None
            js = nc.jetstream(timeout=0.5)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and f.server() != good:
                try:
                    await js.account_info()  # the service's own requests fail meanwhile
                except Exception:
                    pass
                await asyncio.sleep(0.1)
            await js.account_info()  # answered where it is now
            health = Health("test")
            health.connection = nc
            registry = CollectorRegistry()
            HttpServer(health, registry, host="127.0.0.1", port=0)._server.server_close()
            moves = registry.get_sample_value("aep_bridge_nats_server_moves_total")
            return first, f.server(), f.moves, health.healthz()[1], moves
        finally:
            await nc.close()

    first, now, moves, healthz, metric = asyncio.run(run())
    assert first == bad, "the name's hash started it on the server without JetStream"
    assert now == good and moves == 1
    assert healthz["nats_server"] == good and healthz["nats_server_moves"] == 1 and healthz["nats_server_left"] == bad
    assert metric == 1


def test_a_service_on_a_server_that_serves_jetstream_stays(nats_server):
    """Its JetStream answers: no move, however long it runs (the probe's answers are successes)."""
    async def run() -> tuple[int, str | None]:
        settings = Settings(nats_url=f"{nats_server.url},nats://127.0.0.1:{free_port()}", nats_leave_after_s=0.5)
        name = next(n for n in (f"aep-bridge-stay-{i}" for i in range(200))
                    if follow.first_server_order(follow_urls(settings), follow.identity(n))[0].endswith(
                        str(urlparse(nats_server.url).port)))
        nc = await connect_service(settings, name=name, wait_s=10)
        try:
            f = follow.of(nc)
            await asyncio.sleep(2.5)
            return f.moves, f.server()
        finally:
            await nc.close()

    moves, server = asyncio.run(run())
    assert moves == 0 and server == urlparse(nats_server.url).netloc


def follow_urls(settings: Settings) -> list[str]:
    from bridge.nats.connection import server_list

    return server_list(settings).urls


def test_a_one_shot_command_skips_a_server_that_cannot_serve_jetstream(plain_server, nats_server):
    """`quick_connect` (bootstrap, control) from a name whose hash starts it on the server
    without JetStream ends on the one that answers."""
    from bridge.nats.connection import quick_connect

    urls = [plain_server, nats_server.url]
    name = next(n for n in (f"aep-bridge-control-{i}" for i in range(200))
                if follow.first_server_order(urls, follow.identity(n))[0] == plain_server)

    async def run() -> str:
        nc = await quick_connect(Settings(nats_url=",".join(urls)), name=name, role="operator")
        try:
            return nc.connected_url.netloc
        finally:
            await nc.close()

    assert asyncio.run(run()) == urlparse(nats_server.url).netloc


def test_answers_count_a_503_as_a_failure_and_an_answer_as_a_success():
    """What a JetStream request was answered counts: a node cut off from its peers without a
    meta leader answers every JetStream request 503 10008 "JetStream system temporarily
    unavailable" (nats-py raises it only after the request returned), an error answer about
    what was asked says nothing, a plain answer is a success that ends the failure. From
    302162b the answers were not looked at (the branch sat below the direct gets' `return`):
    both mappers stayed 25 s on such a node (a partition run, 2026-12-07), and one timeout
    started a clock no answer reset."""
    from types import SimpleNamespace

    from nats.aio.msg import Msg

    now = [100.0]
    f = follow.Follower(SimpleNamespace(is_connected=True), after_s=5.0, clock=lambda: now[0])

    def answer(data: bytes) -> Msg:
        return Msg(_client=None, subject="_INBOX.x", reply="", data=data, headers=None)

    info = "$JS.API.CONSUMER.INFO.HERMES_RAW.mapper"
    unavailable = b'{"type":"io.nats.jetstream.api.v1.consumer_info_response","error":{"code":503,"err_code":10008,' \
                  b'"description":"JetStream system temporarily unavailable"}}'
    f.observe(info, None, answer(unavailable))
    assert f.failing_since() == 100.0, "a 503 answer is a failure"
    now[0] = 101.0
    f.observe(info, None, answer(b'{"error":{"code":400,"err_code":10071,"description":"wrong last sequence: 1"}}'))
    assert f.failing_since() == 100.0, "an error about what was asked says nothing either way"
    f.observe(f"{follow.DIRECT_GET}KV_aep_lanes", None, answer(b"1"))
    assert f.failing_since() == 100.0, "a direct get's answer says nothing (any replica answers)"
    f.observe(info, None, answer(b'{"type":"io.nats.jetstream.api.v1.consumer_info_response","num_pending":0}'))
    assert f.failing_since() is None, "an answer ends the failure"
    f.observe(follow.PROBE_SUBJECT, None, answer(unavailable))
    assert f.failing_since() == 101.0, "the probe's 503 counts too"
    f.observe(follow.PROBE_SUBJECT, None, answer(b'{"memory":0,"storage":0}'))
    assert f.failing_since() is None


def test_a_request_sent_before_a_move_says_nothing_of_the_server_joined():
    """A request sent to the server left, unanswered, fails after the move: the new server's
    failure clock does not start at its send (it made both mappers leave a healthy node 5 s
    after joining it, "failing for 8.1 s", in a partition run, 2026-12-07)."""
    from types import SimpleNamespace

    now = [100.0]
    f = follow.Follower(SimpleNamespace(is_connected=True), after_s=5.0, clock=lambda: now[0])
    f.last_move = 100.0  # (as `move` leaves it)
    f.observe("$JS.API.CONSUMER.INFO.HERMES_RAW.mapper", asyncio.TimeoutError(), sent=97.0)
    assert f.failing_since() is None
    f.observe("$JS.API.CONSUMER.INFO.HERMES_RAW.mapper", asyncio.TimeoutError(), sent=100.5)
    assert f.failing_since() == 100.5


def test_a_reconnect_by_nats_py_itself_clears_what_was_sent_before_it():
    """nats-py reconnects by itself too (a server restarted, PINGs unanswered): a request sent
    before, timing out after, says nothing of the server joined, and the publishers' clocks
    start again; the connect's own reconnected callback still runs."""
    from types import SimpleNamespace

    called = []

    async def user_cb() -> None:
        called.append(True)

    class Publisher:
        forgot = 0


        def unacked_since(self):  # type: ignore[no-untyped-def]
            return None

        def forget_unacked(self) -> None:
            self.forgot += 1

        def waiting(self) -> list:
            return []

    async def main() -> follow.Follower:
        nc = SimpleNamespace(is_connected=True, is_closed=True, _reconnected_cb=user_cb,
                             request=lambda *a, **k: None)
        f = follow.start(nc, after_s=5.0)
        now = [100.0]
        f.clock = lambda: now[0]
        publisher = Publisher()
        f.publishers.append(publisher)
        f.observe("$JS.API.CONSUMER.INFO.HERMES_RAW.mapper", asyncio.TimeoutError(), sent=97.0)
        assert f.failing_since() == 97.0
        await nc._reconnected_cb()
        assert called == [True] and publisher.forgot == 1
        assert f.failing_since() is None
        f.observe("$JS.API.CONSUMER.INFO.HERMES_RAW.mapper", asyncio.TimeoutError(), sent=99.0)
        assert f.failing_since() is None, "sent before the reconnect"
        f.observe("$JS.API.CONSUMER.INFO.HERMES_RAW.mapper", asyncio.TimeoutError(), sent=100.5)
        assert f.failing_since() == 100.5
        await f.task
        return f

    asyncio.run(main())


def test_publishes_sent_to_the_server_a_move_left_fail_at_once_and_late_answers_still_come(plain_server):
    """A move leaves a server that answers nothing (a node cut off from its peers takes what is
    sent and never acks it): the acked publishes still waiting when the move began fail as
    unanswered once the connection is back (`SentBefore`), and their callers send them again
    through the server joined, not after their timeout (in a partition run, 2026-12-07 cut 1,
    both mappers moved 5-6 s after the cut and their publishes sent before it failed 15-19 s
    later; AEP_EVENTS flat 18.6 s). What was sent once the move began is not failed, nor is
    anything after nats-py's own reconnect: an answer routed to the inbox reaches the
    connection through the server joined (review of issue 42)."""
    import nats as nats_py
    import nats.errors

    from bridge.nats.publish import Ack, AckPublisher

    async def run() -> dict[str, object]:
        nc = await nats_py.connect(plain_server, reconnect_time_wait=0.1)
        other = await nats_py.connect(plain_server)
        out: dict[str, object] = {}
        try:
            f = follow.start(nc, after_s=60.0)

            async def mute(_msg: object) -> None:  # takes them, answers nothing
                pass

            async def late(msg: object) -> None:  # answers after the reconnect
                await asyncio.sleep(0.6)
                await other.publish(msg.reply, b'{"stream":"S","seq":7}')  # type: ignore[attr-defined]

            await other.subscribe("mute.>", cb=mute)
            await other.subscribe("late.>", cb=late)
            await other.flush()
            publisher = await AckPublisher(nc).start()
            await nc.flush()

            # nats-py's own reconnect (no move): a late answer still comes
            answered = await publisher.publish("late.a", b"x", headers={"Nats-Msg-Id": "a"})
            requested = asyncio.ensure_future(nc.request("late.b", b"", timeout=5))
            await nc.flush()
            await nc.force_reconnect()
            out["late_ack"] = await asyncio.wait_for(answered, 5)
            out["late_reply"] = (await asyncio.wait_for(requested, 5)).data

            # a move: what waited when it began fails at once; what came after waits on
            left = await publisher.publish("mute.a", b"x", headers={"Nats-Msg-Id": "m"})
            await nc.flush()
            f.leaving()
            after = await publisher.publish("mute.c", b"y", headers={"Nats-Msg-Id": "c"})
            t0 = time.monotonic()
            await nc.force_reconnect()
            try:
                await asyncio.wait_for(asyncio.shield(left), 10)
                out["left"] = None
            except asyncio.TimeoutError as exc:
                out["left"] = exc
            out["left_s"] = time.monotonic() - t0
            await asyncio.sleep(0.3)
            out["after_waits"] = not after.done()
            return out
        finally:
            await nc.close()
            await other.close()

    out = asyncio.run(run())
    assert out["late_ack"] == Ack("S", 7, False) and out["late_reply"] == b'{"stream":"S","seq":7}', out
    assert isinstance(out["left"], follow.SentBefore) and out["left_s"] < 5, out
    assert isinstance(out["left"], nats.errors.TimeoutError), "an outage to its callers (`outage`, UNANSWERED)"
    assert out["after_waits"], "a publish sent once the move began still waits for its ack"


def test_a_bucket_read_a_replica_never_answers_is_asked_of_the_leader(nats_server):
    """A direct get goes to any replica in the bucket's queue group, and during a partition the
    cut node stays in it while its routes are up: the get is lost there and nats-py waits its
    5 s. `follow.kv` asks the stream's leader once a direct get has not answered within
    DIRECT_GET_S. In a partition run (2026-12-07 18:16) the mappers' and the gate's direct
    gets on aep_lane_facts, aep_lanes and aep_instruct timed out one after the other, 5 s
    each, for the whole cut."""
    import nats as nats_py
    import nats.errors
    from nats.js.api import KeyValueConfig
    from nats.js.errors import KeyNotFoundError

    async def run() -> tuple[bytes, float, bool, float, int, float]:
        nc = await nats_py.connect(nats_server.url)
        try:
            js = nc.jetstream(timeout=1.5)
            # no server-side direct gets: what answers DIRECT.GET below is a replica that never does
            await js.create_key_value(KeyValueConfig(bucket="hedged", direct=False))
            await (await js.key_value("hedged")).put("k", b"v")

            asked: list[str] = []

            async def mute(msg: object) -> None:
                asked.append(msg.subject)  # type: ignore[attr-defined]

            await nc.subscribe("$JS.API.DIRECT.GET.KV_hedged.>", cb=mute)
            kv = await follow.kv(js, "hedged", leader=True)
            kv._direct = True  # (the bucket's allow_direct, as every bridge bucket has)
            t0 = time.monotonic()
            value = (await kv.get("k")).value
            took = time.monotonic() - t0
            t0 = time.monotonic()
            try:
                await kv.get("missing")
                missing = False
            except KeyNotFoundError:
                missing = True
            took_missing = time.monotonic() - t0
            # A role without the leader's get (its direct gets limited to some keys): direct gets
            # again, the last with nats-py's own timeout, then nats-py's timeout error.
            direct_only = await follow.kv(js, "hedged")
            direct_only._direct = True
            asked.clear()
            t0 = time.monotonic()
            with pytest.raises(nats.errors.TimeoutError):
                await direct_only.get("k")
            return value, took, missing, took_missing, len(asked), time.monotonic() - t0
        finally:
            await nc.close()

    value, took, missing, took_missing, tries, took_direct = asyncio.run(run())
    assert tries == 3 and took_direct < 2 * follow.DIRECT_GET_S + 1.5 + 1.0, (tries, took_direct)
    assert value == b"v" and took < follow.DIRECT_GET_S + 2.0, took
    assert missing and took_missing < follow.DIRECT_GET_S + 2.0, took_missing


def test_the_stream_probe_counts_a_leader_cut_off_from_its_group_apart_from_the_meta_probe():
    """`Follower.lead`: each probe also asks for the service's stream's info, which its leader
    answers with when it last heard from each member of its group. Unanswered, 503, no leader,
    or a leader that heard from no majority of its group for STALE_PEERS_S is a failure of its
    own, whatever the meta probe says (a node cut off from its peers that still leads the meta
    group, the durable or the stream answers from its stale view: both mappers sat 17 s on such
    a node, partition runs 2026-12-07 18:24 and 18:36); a leader that hears its group, or an
    answer with no cluster (one server), ends it. A refused subject stops the stream probe."""
    import json
    from types import SimpleNamespace

    now = [100.0]
    answers: list = []

    def info(leader: str, *active_s: float) -> bytes:
        return json.dumps({"type": "io.nats.jetstream.api.v1.stream_info_response", "config": {"name": "HERMES_RAW"},
                           "cluster": {"name": "c", "leader": leader,
                                       "replicas": [{"name": f"n{i}", "current": True, "active": int(a * 1e9)}
                                                    for i, a in enumerate(active_s, 2)]}}).encode()

    async def request(subject: str, payload: bytes = b"", timeout: float = 0.5, **_k: object) -> object:
        assert subject == "$JS.API.STREAM.INFO.HERMES_RAW"
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return SimpleNamespace(data=answer, headers=None)

    nc = SimpleNamespace(is_connected=True, last_error=None)
    f = follow.Follower(nc, after_s=5.0, clock=lambda: now[0])
    f.raw_request = request
    f.lead("HERMES_RAW")

    async def main() -> None:
        answers.append(asyncio.TimeoutError())
        await f.probe_stream()
        assert f.failing_since() == 100.0, "the leader's silence is a failure"
        f.success(probe=True)  # the meta probe answering does not end it
        assert f.failing_since() == 100.0
        now[0] = 101.0
        for stale in (info("n1", 6.0, 6.5), info("", 0.2, 0.3),
                      b'{"type":"io.nats.jetstream.api.v1.stream_info_response","error":{"code":503,"err_code":10008}}'):
            answers.append(stale)
            await f.probe_stream()
            assert f.failing_since() == 100.0, ("a stale leader, no leader or a 503 goes on failing", stale[:120])
        answers.append(info("n1", 0.4, 7.0))  # one of two peers heard: with itself, a majority of three
        await f.probe_stream()
        assert f.failing_since() is None, "a leader that hears a majority of its group answers"
        answers.append(info("n1", 6.0, 7.0))
        await f.probe_stream()
        assert f.failing_since() == 101.0
        answers.append(b'{"type":"io.nats.jetstream.api.v1.stream_info_response","config":{"name":"HERMES_RAW"},"state":{}}')
        await f.probe_stream()
        assert f.failing_since() is None, "one server: no cluster to judge"
        nc.last_error = "nats: permissions violation for publish to \"$JS.API.STREAM.INFO.HERMES_RAW\""
        answers.append(asyncio.TimeoutError())
        await f.probe_stream()
        assert f.stream is None and f.failing_since() is None, "refused: no more stream probes, no failure"

    asyncio.run(main())


def test_a_recorded_fact_a_lagging_replica_misses_is_read_from_the_leader(nats_server):
    """A create refused as "already recorded" (wrong last sequence) and then a direct get that
    answers "not found" (a replica behind the leader that refused the create): the mapper's
    lane-fact reads (`KvLanes`' read of a recorded fact, `follow.kv` with ``leader``) ask the
    leader before calling it missing. Before, the raw message was retried as its own fault
    (`retry`, counted toward max deliver; partition run 2026-12-07 18:33)."""
    import nats as nats_py
    from nats.js.api import KeyValueConfig
    from nats.js.errors import KeyNotFoundError

    from bridge.nats.lanes import KvLanes

    async def run() -> tuple[bool, str, bool]:
        nc = await nats_py.connect(nats_server.url)
        try:
            js = nc.jetstream(timeout=2)
            await js.create_key_value(KeyValueConfig(bucket="lagging", direct=False))
            await (await js.key_value("lagging")).put("o.sess", b"instance-a")

            async def behind(msg: object) -> None:  # a replica that has not got the key yet
                await nc.publish(msg.reply, b"", headers={"Status": "404", "Description": "Message Not Found"})  # type: ignore[attr-defined]

            await nc.subscribe("$JS.API.DIRECT.GET.KV_lagging.>", cb=behind)
            facts = await follow.kv(js, "lagging", leader=True)
            facts._direct = True
            try:
                await facts.get("o.sess")
                replica_missed = False
            except KeyNotFoundError:
                replica_missed = True
            lanes = KvLanes(kv=None, facts=facts)
            owner = (await lanes._read_recorded("o.sess")).value.decode()
            direct_only = await follow.kv(js, "lagging")
            direct_only._direct = True
            try:
                await KvLanes(kv=None, facts=direct_only)._read_recorded("o.sess")
                still_missed = False
            except KeyNotFoundError:
                still_missed = True
            return replica_missed, owner, still_missed
        finally:
            await nc.close()

    replica_missed, owner, still_missed = asyncio.run(run())
    assert replica_missed, "the replica's copy misses the key (the test's premise)"
    assert owner == "instance-a", "read from the leader"
    assert still_missed, "a bucket that may not ask the leader keeps the replica's answer"
