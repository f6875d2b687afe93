"""Follow the healthy majority (issue 42): where a service connects first, and when it leaves a
server that cannot serve JetStream.

The services' side of one rule the shim keeps too (docs/ARCHITECTURE.md "A server that
cannot serve JetStream"): *a server that takes requests and gives no JetStream answer is left
for the next one*. The shim gives each server's ack a share of its deadline and goes on to the
next (bridge/shim/hook.py); a service, which holds one connection for hours, leaves its server
after ``AEP_BRIDGE_NATS_LEAVE_AFTER_S`` seconds of JetStream failures with no answer between
them. A node cut off from its peers looks exactly like that to a client: it still answers
PINGs and accepts publishes, so nats-py's own reconnect (after failed PINGs) never comes.

* `first_server_order`: a service instance's server list, rotated by a stable hash of its
  identity (its connection name, which carries its replica or instance, and the pod's or
  host's name), so the instances of a fleet spread over the servers and one node's trouble
  reaches a fraction of them (before: ``dont_randomize`` and the list's order put every
  service on the first URL). The rest of the list keeps its order: a reconnect takes the
  next one.
* `Follower`: one task per service connection (`start`, called by
  ``bridge.nats.connection.connect_service``). It watches

  - the connection's JetStream requests: nats-py sends publish acks of ``js.publish``, every
    KV operation and every JetStream API call through ``Client.request``, which `watch`
    wraps; a ``$JS.``, ``$KV.`` or ``$O.`` request that times out, finds no responders or
    answers 503 is a failure (so is one its caller cancelled after a second unanswered), an
    answer without an error a success (other error answers count neither way: a leader cut off
    from its peers still refuses what it can check alone; direct gets count neither way: any
    replica answers one, and one routed to the cut node is lost from any server);
  - a probe of its own every `PROBE_S`: ``$JS.API.INFO``, which in a cluster only the meta
    leader answers (a node cut off from its peers has none: 503 "JetStream system
    temporarily unavailable", or nothing), so an idle service notices too;
  - with `Follower.lead`, the info of the service's own stream each probe, which its leader
    answers with when it last heard from each member of its group (`probe_stream`): a cut node
    that still leads the meta group, the service's durable or the stream answers the two above
    from its stale view for ~10 s.

  - the acked publishes of an `AckPublisher` on the connection (the mapper's and pairing's
    hot path, which does not go through ``request``): a publish sent after the last ack came
    and still not acked is a failure since it was sent.

  The four are judged apart (a meta leader cut off from its peers answers the probe for
  ~10 s more, lostQuorumInterval, while no publish of the service is acked). When one of them
  has failed for ``after_s`` with no success of its own since, while the connection is up, it
  checks the servers of the list with side connections and the probe, and reconnects to the
  first other one that answers, provided a majority of those that take a connection answer
  (three or more: a meta leader cut off from its peers answers the probe alone for ~10 s) (nats-py's ``force_reconnect()`` with that server first in the
  pool; subscriptions and pull consumers are subscribed again there). None answers (the whole
  cluster electing, as at a partition's heal): it stays (``nats_server_no_better``, once).
  Moves come at most once per ``after_s``, twice as far apart after each move that brought
  no answer, up to `MAX_SPACING_S`. Each is counted (``aep_bridge_nats_server_moves_total``)
  and logged (``nats_server_left``: the server left, the one joined, for how long, why);
  `/healthz` shows the server it is on (``nats_server``) and its moves. With one server in
  the list there is nowhere to go: it only watches. When a move's connection is up, the acked
  publishes sent to the server left and still unanswered fail at once (`SentBefore`) and their
  callers send them again through the server joined.
* `kv`: the services' KV buckets, a read no replica answered within `DIRECT_GET_S` asked again
  (the stream's leader, or another direct get): a direct get routed to a cut node is lost.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import time
from typing import Any, Iterable

import nats
import nats.errors
import msgspec
import nats.js.errors
import structlog

log = structlog.get_logger("aep_bridge.nats")

#: seconds between two probes (``$JS.API.INFO``)
PROBE_S = 1.0
#: the longest spacing of moves that found no answer between them
MAX_SPACING_S = 40.0
#: the probe: account info, which only the meta leader answers in a cluster
PROBE_SUBJECT = "$JS.API.INFO"
#: direct gets count neither way: any replica answers one (a node cut off from its peers too), and
#: during a partition the cut node stays in the replicas' queue group (its routes are not torn down
#: for minutes), so a direct get sent from a healthy node can be lost there: moving would not help
DIRECT_GET = "$JS.API.DIRECT.GET."
#: a request its caller cancelled after this long unanswered counts as a failure
CANCELLED_UNANSWERED_S = 1.0
#: the subjects whose requests speak for the server's JetStream
WATCHED_PREFIXES = ("$JS.", "$KV.", "$O.")
#: the attribute of a nats-py Client that holds its `Follower`
ATTR = "_aep_follower"
#: a stream leader that has heard from no majority of its group for this long is cut off from it
#: (its followers answer each heartbeat, 1 s; nats-server steps it down only after 10 s)
STALE_PEERS_S = 3.0


class _Peer(msgspec.Struct):
    active: int = 0  # ns since the leader last heard from it
    offline: bool = False


class _Cluster(msgspec.Struct):
    leader: str = ""
    replicas: list[_Peer] = []


class _StreamInfo(msgspec.Struct):
    cluster: _Cluster | None = None
    error: dict | None = None


def _stream_probe(stream: str) -> str:
    return f"$JS.API.STREAM.INFO.{stream}"


def leader_fresh(reply: Any) -> tuple[bool, str]:
    """Does a stream info answer come from a leader that reaches its group? (answered, why
    not). A 503, no leader (a member that sees none answers from its own copy), or a leader
    that heard from no majority of its group for `STALE_PEERS_S`: no. An answer without a
    cluster (one server) or another error (about what was asked): yes."""
    data = getattr(reply, "data", b"") or b""
    if b'"code":503' in data[:300] or (getattr(reply, "headers", None) or {}).get("Status") == "503":
        return False, "503"
    try:
        info = msgspec.json.decode(data, type=_StreamInfo)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return True, ""
    cluster = info.cluster
    if info.error is not None or cluster is None:
        return True, ""
    if not cluster.leader:
        return False, "no leader"
    if not cluster.replicas:
        return True, ""
    heard = 1 + sum(1 for p in cluster.replicas if not p.offline and 0 < p.active < STALE_PEERS_S * 1e9)
    if heard < (len(cluster.replicas) + 1) // 2 + 1:
        return False, f"its leader {cluster.leader[:40]} heard from {heard - 1} of {len(cluster.replicas)} peers within {STALE_PEERS_S:g} s"
    return True, ""


def identity(name: str | None) -> str:
    """What a service instance is: its connection name (which carries its replica or instance
    name) and its pod's (``HOSTNAME``) or host's name."""
    return f"{name or ''}|{os.environ.get('HOSTNAME') or socket.gethostname()}"


def first_server_order(urls: list[str], ident: str) -> list[str]:
    """``urls`` rotated to start at the one a stable hash of ``ident`` picks."""
    if len(urls) < 2:
        return list(urls)
    k = int.from_bytes(hashlib.sha256(ident.encode()).digest()[:8], "big") % len(urls)
    return urls[k:] + urls[:k]


def _failed(exc: BaseException) -> bool:
    """Does ``exc`` say the server could not serve JetStream (rather than what was asked)?"""
    if isinstance(exc, (nats.errors.TimeoutError, asyncio.TimeoutError, nats.errors.NoRespondersError,
                        nats.js.errors.ServiceUnavailableError, nats.js.errors.NoStreamResponseError)):
        return True
    return getattr(exc, "code", None) == 503


class Follower:
    """See the module docstring. ``clock``: monotonic seconds (tests)."""

    def __init__(self, nc: Any, *, after_s: float, probe_s: float = PROBE_S, name: str = "",
                 clock: Any = time.monotonic, options: dict[str, Any] | None = None) -> None:
        self.nc = nc
        #: what a side connection to a candidate server needs (credentials, TLS, inbox prefix)
        self.options = {k: v for k, v in (options or {}).items()
                        if k in ("user", "password", "token", "user_credentials", "nkeys_seed", "tls", "tls_hostname",
                                 "inbox_prefix")}
        self.after_s = after_s
        self.probe_s = probe_s
        self.name = name
        self.clock = clock
        self.bad_since: float | None = None  # the service's own requests: the first failure since the last success
        self.probe_bad_since: float | None = None  # the same for the probe
        self.publishers: list[Any] = []  # AckPublishers on the connection (`AckPublisher.start`)
        self.last_failure = ""
        self.moves = 0
        self.last_move: float | None = None
        self.joined: float | None = None  # when the connection last came back (`rejoined`)
        self.moved_from: str | None = None
        self.task: asyncio.Task | None = None
        self.probe_refused = False  # the probe's subject is not allowed: it stops
        self.waiting = False  # the last decision found no better server (logged once)
        self.spacing = after_s  # the least time between two moves (`move` doubles it while nothing answers)
        self.answered_since_move = True
        #: the stream whose leader the service needs (`lead`): its info asked each probe
        #: (`probe_stream`; None: not asked)
        self.stream: str | None = None
        self.stream_bad_since: float | None = None  # its leader unanswered, absent or cut off since
        self.raw_request: Any = None  # nc.request before `watch` wrapped it (the stream probe is judged apart)
        self.left_waiting: list[asyncio.Future] = []  # publishes waiting when a move began (`leaving`)

    # ------------------------------------------------------------ what the connection sees

    def failure(self, what: str, probe: bool = False, since: float | None = None) -> None:
        """A failure, which began at ``since`` (an unanswered request: when it was sent). A request
        sent before the last move was sent to the server left: it says nothing of this one (its
        timeout, landing after the move, made both mappers leave a healthy node 5 s after they
        had joined it, "failing for 8.1 s", in a partition run: 2026-12-07, run 19)."""
        if since is not None and ((self.last_move is not None and since < self.last_move)
                                  or (self.joined is not None and since < self.joined)):
            return
        if self.nc.is_connected:
            at = self.clock() if since is None else since
            if probe and self.probe_bad_since is None:
                self.probe_bad_since = at
            elif not probe and self.bad_since is None:
                self.bad_since = at
        self.last_failure = what

    def rejoined(self) -> None:
        """The connection came back, by a move or by nats-py's own reconnect (a server restarted,
        PINGs unanswered): what was sent before went to the connection left, and its failures
        say nothing of this one (a request timing out after a reconnect started the new
        server's clock at its send; review of issue 42's follower).

        After a move, the acked publishes that were waiting when the service left (`leaving`)
        and are still unanswered fail now as unanswered (`SentBefore`): their callers send them
        again through the server joined, as after a timeout (with the same ``Nats-Msg-Id``:
        JetStream keeps one copy). A server cut off from its peers takes what is sent and
        answers nothing: in a partition run (2026-12-07, cut 1) both mappers moved 5-6 s after
        the cut, the publishes they had sent before it failed 15-19 s later, and AEP_EVENTS
        stayed flat until then (18.6 s). Only those: an answer routed to the connection's inbox
        reaches it through the server joined too (a healthy server's, after nats-py's own
        reconnect), and what was sent after the move began went to the new server. Requests
        are left to their own timeouts (a KV write sent again would be refused as behind)."""
        self.joined = self.clock()
        self.bad_since = self.probe_bad_since = self.stream_bad_since = None
        left, self.left_waiting = self.left_waiting, []
        for publisher in self.publishers:
            publisher.forget_unacked()
        for future in left:
            if not future.done():
                future.set_exception(SentBefore())

    def leaving(self) -> None:
        """A move begins: the publishes waiting for their ack now went to the server left
        (`rejoined` fails those still waiting once the connection is back)."""
        self.left_waiting = [f for publisher in self.publishers for f in publisher.waiting()]

    def success(self, probe: bool = False) -> None:
        if probe:
            self.probe_bad_since = None
        else:
            self.bad_since = None
        self.answered_since_move = True

    def observe(self, subject: str, exc: BaseException | None, reply: Any = None, sent: float | None = None) -> None:
        if not subject.startswith(WATCHED_PREFIXES):
            return
        probe = subject == PROBE_SUBJECT
        if subject.startswith(DIRECT_GET):
            return  # any replica answers a direct get, a node cut off from its peers too
        if exc is None:
            # (an answer: nats-py's JetStream calls raise their error answers only after `request`
            # returned. From 302162b this branch sat below the direct gets' return, unreachable: a
            # 503 answer never counted, nor did any success. A node cut off from its peers without
            # a meta leader answers every JetStream request 503 10008, and both mappers stayed on
            # one for a whole 18 s cut in a partition run, 2026-12-07; one timeout started a clock
            # no answer reset)
            data = getattr(reply, "data", b"") or b""
            head = data[:200]
            if b'"code":503' in head or (getattr(reply, "headers", None) or {}).get("Status") == "503":
                self.failure(f"{subject}: 503", probe)
            elif b'"error"' not in head:
                self.success(probe)
            # (another error answer says nothing either way: a leader cut off from its peers still
            # refuses a lease create with "wrong last sequence", seen in the partition test)
        elif _failed(exc):
            unanswered = isinstance(exc, (nats.errors.TimeoutError, asyncio.TimeoutError))
            self.failure(f"{subject}: {type(exc).__name__}: {exc}", probe, sent if unanswered else None)

    def failing_since(self) -> float | None:
        """The earliest start of a failure that has had no success of its kind since."""
        starts = [t for t in (self.bad_since, self.probe_bad_since, self.stream_bad_since) if t is not None]
        for publisher in self.publishers:
            t = publisher.unacked_since()
            if t is not None:
                starts.append(t)
        return min(starts) if starts else None

    # ------------------------------------------------------------ the decision

    def server(self) -> str | None:
        url = getattr(self.nc, "connected_url", None)
        return url.netloc if url is not None else None

    def due(self) -> bool:
        now = self.clock()
        since = self.failing_since()
        if since is None:
            self.waiting = False
        if self.after_s <= 0 or since is None or not self.nc.is_connected:
            return False
        if len({s.netloc for s in getattr(self.nc, "servers", [])}) < 2:
            return False
        if now - since < self.after_s:
            return False
        return self.last_move is None or now - self.last_move >= self.spacing

    async def serves(self, url: str) -> bool | None:
        """Does the server at ``url`` answer the probe (its meta leader reachable)? A side
        connection of its own, closed at once. None: it took no connection."""
        try:
            nc = await nats.connect(servers=[url], name=f"{self.name}-probe", allow_reconnect=False,
                                    connect_timeout=1.0, max_reconnect_attempts=0, **self.options)
        except Exception:
            return None
        try:
            timeout = max(0.5, min(2.0, self.after_s / 3))
            reply = await nc.request(PROBE_SUBJECT, b"", timeout=timeout)
            if b'"error"' in (reply.data or b"")[:200]:
                return False
            if self.stream is not None:  # and the service's stream's leader, through it, not cut off from its group
                return leader_fresh(await nc.request(_stream_probe(self.stream), b"", timeout=timeout))[0]
            return True
        except Exception:
            return False
        finally:
            try:
                await nc.close()
            except Exception:
                pass

    async def candidate(self) -> Any:
        """The first other server of the list that serves JetStream, or None: when none does
        (the whole cluster electing a meta leader, e.g. at a partition's heal), a move would
        gain nothing and cost a reconnect.

        Every server of the list is asked at once (this one too), and with three or more that
        take a connection, a majority of those must answer: a meta leader cut off from its
        peers answers the probe for ~10 s more (lostQuorumInterval) while the healthy ones,
        not having elected yet, answer nothing. Followed, it drew services off a healthy node
        onto the cut one (a partition run, 2026-12-07). Servers that take no connection (the
        client's own network) do not count."""
        current = self.server()
        pool = list(getattr(self.nc, "_server_pool", []))
        answers = await asyncio.gather(*(self.serves(srv.uri.geturl()) for srv in pool))
        reachable = [a for a in answers if a is not None]
        answering = sum(1 for a in reachable if a)
        if len(reachable) >= 3 and answering < len(reachable) // 2 + 1:
            return None
        for srv, answered in zip(pool, answers):
            if srv.uri.netloc != current and answered:
                return srv
        return None

    async def move(self) -> None:
        target = await self.candidate()
        if target is None:
            if not self.waiting:
                log.warning("nats_server_no_better", connection=self.name, server=self.server(),
                            error=self.last_failure[:300], action="stay: no other server serves JetStream now")
            self.waiting = True
            return
        self.waiting = False
        pool = self.nc._server_pool  # the reconnect takes the pool's first server (nats-py 2.16)
        pool.remove(target)
        pool.insert(0, target)
        now = self.clock()
        left = self.server()
        failing = round(now - (self.failing_since() or now), 1)
        # Moves with no answer between them (what fails is a stream with no leader in the
        # majority yet, not the server) come twice as far apart each time, up to MAX_SPACING_S.
        self.spacing = self.after_s if self.answered_since_move or self.last_move is None else min(
            MAX_SPACING_S, max(self.after_s, 2 * self.spacing))
        self.answered_since_move = False
        self.moves += 1
        self.last_move = now
        self.moved_from = left
        self.bad_since = self.probe_bad_since = self.stream_bad_since = None
        for publisher in self.publishers:
            publisher.forget_unacked()
        if not self.last_failure:
            self.last_failure = "publishes not acked"
        log.warning("nats_server_left", connection=self.name, server=left, to=target.uri.netloc, failing_for_s=failing,
                    error=self.last_failure[:300], action="reconnect to a server that serves JetStream")
        self.leaving()
        await self.nc.force_reconnect()

    async def probe(self) -> None:
        """Ask the meta leader (its answer, or none, reaches `observe` through the wrapped
        request). A role whose user may not ask stops probing (its own requests still count)."""
        try:
            await self.nc.request(PROBE_SUBJECT, b"", timeout=max(0.2, min(2.0, self.after_s / 3)))
        except Exception:
            last = str(getattr(self.nc, "last_error", "") or "").lower()
            if "permissions violation" in last and "$js.api.info" in last:
                self.probe_refused = True
                self.success(probe=True)
                log.warning("nats_probe_refused", connection=self.name, error=last[:200],
                            action="JetStream failures of the service's own requests are still watched")

    def lead(self, stream: str) -> None:
        """Ask about ``stream``'s leader too, each probe (`probe_stream`): the stream the
        service cannot work without (the mapper's and the gate's HERMES_RAW, pairing's
        BRIDGE_MAPPED, the relay's AEP_EVENTS, the exporter's AEP_EVENTS or, every sink
        partitioned, AEP_EXPORT). Its role must be allowed
        ``$JS.API.STREAM.INFO.<stream>``."""
        self.stream = stream

    async def probe_stream(self) -> None:
        """The stream's info, which its leader answers with when it last heard from each member
        of its group (`leader_fresh`). A node cut off from its peers that still leads the meta
        group, the service's durable or the stream itself answers everything else from its stale
        view for ~10 s (nats-server's lostQuorumInterval), its fetches bringing nothing and
        failing nothing: both mappers sat 17 s on such a node in partition runs (2026-12-07
        18:24, 18:36). Unanswered (the leader on the other side), 503, no leader, or a leader
        that heard from no majority of its group for `STALE_PEERS_S`: a failure of its own."""
        assert self.stream is not None
        request = self.raw_request or self.nc.request
        sent = self.clock()
        subject = _stream_probe(self.stream)
        try:
            reply = await request(subject, b"", timeout=max(0.2, min(2.0, self.after_s / 3)))
        except Exception as exc:
            last = str(getattr(self.nc, "last_error", "") or "").lower()
            if "permissions violation" in last and subject.lower() in last:
                self.stream = None
                self.stream_bad_since = None
                log.warning("nats_stream_probe_refused", connection=self.name, error=last[:200],
                            action="the meta leader's probe and the service's own requests are still watched")
                return
            answered, why = False, f"{type(exc).__name__}: {exc}"
        else:
            answered, why = leader_fresh(reply)
        if answered:
            self.stream_bad_since = None
            self.answered_since_move = True
            return
        if (self.last_move is not None and sent < self.last_move) or (self.joined is not None and sent < self.joined):
            return
        if self.stream_bad_since is None and self.nc.is_connected:
            self.stream_bad_since = sent
        self.last_failure = f"{subject}: {why}"

    async def run(self) -> None:
        while not self.nc.is_closed:
            try:
                if self.nc.is_connected and not self.probe_refused:
                    await self.probe()
                if self.nc.is_connected and self.stream is not None:
                    await self.probe_stream()
                if self.due():
                    await self.move()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # never let the watch end the service
                log.warning("nats_follow_failed", connection=self.name, error=f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(self.probe_s)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"nats_server": self.server(), "nats_server_moves": self.moves}
        if self.moved_from:
            out["nats_server_left"] = self.moved_from
        since = self.failing_since()
        if since is not None:
            out["nats_jetstream_failing_s"] = round(self.clock() - since, 1)
        return out


class SentBefore(nats.errors.TimeoutError):
    """Unanswered: sent to the server a move left (`Follower.rejoined`)."""

    def __str__(self) -> str:
        return "nats: unanswered, sent to the server left (sent again)"


def watch(nc: Any, follower: Follower) -> None:
    """Wrap ``nc.request`` so every JetStream request's outcome reaches ``follower``."""
    inner = nc.request
    follower.raw_request = inner

    async def request(subject: str, payload: bytes = b"", timeout: float = 0.5, *args: Any, **kwargs: Any) -> Any:
        sent = time.monotonic()
        try:
            reply = await inner(subject, payload, timeout, *args, **kwargs)
        except asyncio.CancelledError:
            # The caller's own, shorter timeout (pairing's lease renewals): unanswered for a second
            # or more is a failure too; a cancel at once (a shutdown) says nothing.
            if time.monotonic() - sent >= CANCELLED_UNANSWERED_S:
                follower.observe(subject, asyncio.TimeoutError(f"cancelled after {time.monotonic() - sent:.1f} s"),
                                 sent=sent)
            raise
        except BaseException as exc:
            follower.observe(subject, exc, sent=sent)
            raise
        follower.observe(subject, None, reply)
        return reply

    nc.request = request


def start(nc: Any, *, after_s: float, name: str = "", probe_s: float = PROBE_S,
          options: dict[str, Any] | None = None) -> Follower:
    """A `Follower` for ``nc`` (a connected nats-py Client), its requests watched and its task
    running until the connection closes. ``options``: its connect options (for the side
    connections that check a server before a move)."""
    follower = Follower(nc, after_s=after_s, probe_s=probe_s, name=name, options=options)
    watch(nc, follower)
    prior = getattr(nc, "_reconnected_cb", None)  # (nats-py 2.16 keeps connect's reconnected_cb there)

    async def reconnected() -> None:
        try:
            follower.rejoined()
        except Exception as exc:  # never in nats-py's reconnect (its caller catches little)
            log.warning("nats_follow_failed", connection=follower.name, error=f"{type(exc).__name__}: {exc}")
        if prior is not None:
            await prior()

    nc._reconnected_cb = reconnected
    setattr(nc, ATTR, follower)
    follower.task = asyncio.get_running_loop().create_task(follower.run())
    return follower


async def answers(nc: Any, timeout: float = 1.0) -> bool:
    """Does the server ``nc`` is connected to answer the probe without an error?"""
    try:
        reply = await nc.request(PROBE_SUBJECT, b"", timeout=timeout)
    except Exception:
        return False
    return b'"error"' not in (reply.data or b"")[:200]


async def leader_kv(js: Any, bucket: str) -> Any:
    """The KV bucket ``bucket`` (checked to exist), its gets answered by the stream's leader
    (``STREAM.MSG.GET``) instead of any replica (``DIRECT.GET``). During a partition the cut
    node stays in the replicas' queue group while its routes are up (minutes), so a direct get
    from a healthy node can be routed there and lost: pairing's restores timed out one after
    the other for the whole partition (issue 42). For the reads a takeover waits on."""
    from nats.js.kv import KeyValue

    await js.key_value(bucket)
    return KeyValue(name=bucket, stream=f"KV_{bucket}", pre=f"$KV.{bucket}.", js=js, direct=False)


#: seconds a bucket's direct get may take before `kv`'s read tries again (a direct get answers
#: in milliseconds; nats-py would wait its JetStream timeout, 5 s)
DIRECT_GET_S = 1.0


def _hedged_kv_class() -> type:
    from nats.js.kv import KeyValue

    class HedgedKV(KeyValue):
        """nats-py's ``KeyValue``, a read that no replica answered within `DIRECT_GET_S` asked
        again: of the stream's leader (``STREAM.MSG.GET``) when ``leader`` (the role may send
        it), else by a second direct get (the queue group picks a member again) and a last one
        with nats-py's own timeout. Overrides nats-py's ``_get`` (nats-py 2.16, pinned): ``get``
        keeps its own checks and deleted-key rule."""

        def __init__(self, *args: Any, leader: bool = False, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._leader = KeyValue(name=self._name, stream=self._stream, pre=self._pre, js=self._js,
                                    direct=False) if leader else None

        async def _get(self, key: str, revision: int | None = None) -> Any:
            if not self._direct:
                return await super()._get(key, revision)
            for _ in range(1 if self._leader is not None else 2):
                try:
                    async with asyncio.timeout(DIRECT_GET_S):
                        return await super()._get(key, revision)
                except (TimeoutError, nats.errors.NoRespondersError):
                    pass  # lost on a replica cut off from its peers, or none subscribed (catching up)
            if self._leader is not None:
                return await self._leader._get(key, revision)
            return await super()._get(key, revision)

        async def get_recorded(self, key: str) -> Any:
            """``get``, and when a replica's copy has no such key, the leader's (``leader``
            only): a replica can lag behind a create the leader refused as already recorded."""
            try:
                return await self.get(key)
            except nats.js.errors.KeyNotFoundError:
                if self._leader is None:
                    raise
            return await self._leader.get(key)

    return HedgedKV


_HEDGED: type | None = None


async def kv(js: Any, bucket: str, *, leader: bool = False) -> Any:
    """The KV bucket ``bucket`` (checked to exist, as ``js.key_value`` does), a read that no
    replica answered within `DIRECT_GET_S` asked again: of the stream's leader when ``leader``
    (the role may send ``$JS.API.STREAM.MSG.GET.<stream>``, which names no key: a role whose
    direct gets are limited to some keys keeps ``leader`` off), else by direct gets again.
    During a partition the cut node stays in the replicas' queue group while its routes are
    up, and a direct get routed there is lost: in a partition run (2026-12-07 18:16) the
    mappers' and the gate's reads of aep_lane_facts, aep_lanes and aep_instruct waited 5 s
    each, one after the other, for the whole cut (issue 42)."""
    global _HEDGED
    if _HEDGED is None:
        _HEDGED = _hedged_kv_class()
    plain = await js.key_value(bucket)
    return _HEDGED(name=plain._name, stream=plain._stream, pre=plain._pre, js=js, direct=plain._direct, leader=leader)


def of(nc: Any) -> Follower | None:
    return getattr(nc, ATTR, None) if nc is not None else None


class MovesCollector:
    """``aep_bridge_nats_server_moves_total`` of the connection ``connection()`` returns (a
    prometheus collector for a service's registry)."""

    def __init__(self, connection: Any) -> None:
        self.connection = connection

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import CounterMetricFamily

        f = of(self.connection())
        family = CounterMetricFamily("aep_bridge_nats_server_moves",
                                     "Times this service left a NATS server that could not serve JetStream "
                                     "(AEP_BRIDGE_NATS_LEAVE_AFTER_S)")
        family.add_metric([], f.moves if f is not None else 0)
        yield family
