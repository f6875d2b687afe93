"""The exporter service: AEP_EVENTS -> Kafka topics and OTLP/HTTP endpoints, in AEP-0005 forms.

Theory of operation
-------------------
* One `SinkWorker` per configured sink (`bridge.core.sinks`), each with its own durable pull
  consumer ``export-<sink>`` on AEP_EVENTS (`streams.exporter_consumer_config`): a slow or
  unreachable sink holds back its own consumer only.
* A worker fetches a batch, and for each event: the sink's attr-match filter (no match: acked,
  counted ``filtered``), the projection after the sink's ``max_capture`` (no record in this
  format, e.g. OCSF for a heartbeat: acked, counted ``no_record``; an event the projection
  refuses: dead-lettered to ``bridge.dlq.export_<reason>``, then acked).
* The batch goes to the sink; a message is acked only once the sink confirmed it (Kafka's
  delivery report; the OTLP endpoint's 2xx). A sink that fails transiently (Kafka down,
  OTLP 429/502/503/504, a connection refused) is retried for as long as it takes, with the
  server's Retry-After or exponential backoff (1 s doubling to 30 s), while the worker tells
  JetStream the messages are in progress: nothing is acked and nothing fetched meanwhile
  (backpressure), nothing is lost, and delivery resumes where it stopped. A permanent refusal
  (OTLP 400, a Kafka record too large) dead-letters the batch's events with the reason.
* An ack lost with a NATS node (the consumer's leader killed, a leader change) redelivers
  an event the sink already has: the worker remembers the AEP_EVENTS sequences it delivered
  (the last `DELIVERED_MEMORY`) and acks such a redelivery without sending it again (counted
  ``skipped{reason="redelivered"}``), so node faults put no event twice in the sink.
* A crash between delivery and ack redelivers: the sink sees the same event again, with the
  same id (Kafka header ``aep-id``, CloudEvents ``id``, OCSF ``metadata.uid``,
  OTLP ``aep.event_id``), so consumers dedupe on it.
* Metrics per sink (label ``sink``): delivered, filtered / no_record, retries, errors,
  dead letters, last success time, lag (the consumer's pending + unacknowledged).
  /readyz: NATS connected, every sink's consumer bound, and (``replicas`` > 1) no lease
  unsure (`partitions.PartitionedSink.unsure`).
* A sink whose client library is missing (the `export` extra) fails the start, with the
  command that installs it (`sinks.require_clients`).
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections import OrderedDict
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.js.api import DeliverPolicy
from prometheus_client import CollectorRegistry, Counter, Gauge

from bridge.core import deadletter
from bridge.core.bridges import BridgeError, project
from bridge.core.ceiling import LEVELS, CapturePolicy, configure
from bridge.core.redaction import Redactor
from bridge.services.exporter.delivery import kafka_record
from bridge.services.exporter.partitions import PartitionedSink, bind_or_wait
from bridge.core.sinks import PROJECTION, SinkConfig, check_unique, sink_from_url, sinks_from_document
from bridge.services.exporter.sinks import Outcome, make_sink, require_clients
from bridge.runtime import Health, Loop, Service, Settings, Stopper, connect_service, follow, server_list
from bridge.runtime import streams as S
from bridge.runtime import subjects as subj

log = structlog.get_logger("aep_bridge.exporter")

BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
DELIVERED_MEMORY = 65536  # AEP_EVENTS sequences a worker remembers having delivered (lost acks)
PROGRESS_EVERY = 1 / 3  # of the ack wait (AEP_BRIDGE_EXPORT_ACK_WAIT_S): +WPI this often while a sink holds a batch


class ExporterMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        p = "aep_bridge_export_"
        self.delivered = Counter(p + "delivered", "events the sink confirmed", ["sink"], registry=registry)
        self.skipped = Counter(p + "skipped", "events acked without a record: filtered (the sink's filter) "
                               "or no_record (the format has none for the type)", ["sink", "reason"], registry=registry)
        self.retries = Counter(p + "retries", "deliveries retried (per event)", ["sink"], registry=registry)
        self.errors = Counter(p + "errors", "failed deliveries by reason", ["sink", "reason"], registry=registry)
        self.dead_letters = Counter(p + "dead_letters", "events dead-lettered", ["sink", "reason"], registry=registry)
        self.last_success = Gauge(p + "last_success_timestamp_seconds", "time of the last confirmed delivery",
                                  ["sink"], registry=registry)
        self.lag = Gauge(p + "lag", "events of AEP_EVENTS the sink has not confirmed (pending + unacked; "
                         "a sink with replicas > 1: of this replica's partitions)", ["sink"], registry=registry)
        self.partitions = Gauge(p + "partitions_owned", "partitions of the sink this replica owns (replicas > 1)",
                                ["sink"], registry=registry)
        self.recreated = Counter(p + "consumers_recreated", "a sink's (or partition's) durable found gone and "
                                 "created again", ["sink"], registry=registry)
        self.fenced = Counter(p + "fenced", "partitions dropped because their lease may have lapsed (replicas > 1): "
                              "nothing more fetched or sent", ["sink"], registry=registry)


class Item:
    """One fetched message and what the sink gets for it."""

    __slots__ = ("msg", "event", "record")

    def __init__(self, msg: Any, event: dict[str, Any], record: Any) -> None:
        self.msg, self.event, self.record = msg, event, record


class SinkWorker:
    """One sink's consumer, or (``partition`` given: a sink with replicas > 1) one partition's
    consumer on the sink's partitioned stream, sharing the sink's transport with the others
    this replica owns (`partitions.PartitionedSink`)."""

    def __init__(self, service: "Exporter", cfg: SinkConfig, sink: Any = None, partition: int | None = None) -> None:
        self.service = service
        self.cfg = cfg
        self.sink = make_sink(cfg) if sink is None else sink
        self.partition = partition
        self.released = False  # a partition given back: finish the batch in hand, fetch no more
        # A partition's lease check (`PartitionedSink.fenced`): True once the lease may have
        # lapsed; then nothing more is fetched or sent (what is in hand stays unacked).
        self.fence: Any = None
        self.metrics = service.metrics
        for metric in (self.metrics.delivered, self.metrics.retries, self.metrics.last_success):
            metric.labels(sink=cfg.name)  # every sink's series exists from the start, at 0
        self.sub: Any = None
        self.bound = False
        self.state = "starting"
        self._decode = msgspec.json.Decoder().decode
        self.delivered: OrderedDict[int, None] = OrderedDict()  # AEP_EVENTS sequences the sink confirmed
        self.server_floor = 0  # the durable's ack floor (stream seq) as `watch` last read it
        self.start_after = 0  # a durable found gone: created again after this sequence (`gone`)
        self.replay_upto = 0  # ... and the sequences up to this one it delivers again are checked against `delivered`
        self.stream_created: Any = None  # AEP_EVENTS's creation time at the last bind
        self.consumer_created: Any = None  # the bound durable's creation time (`gone`)

    def unsure(self) -> str | None:
        """Why readiness waits on a lease: never for a sink's one durable (a partition's worker is
        fenced by its `PartitionedSink`, whose ``unsure`` says it)."""
        return None

    # ------------------------------------------------------------ setup

    async def bind(self) -> None:
        if self.partition is not None:
            # Just acquired: recreate the consumer, so that what the previous owner held unacked
            # (a replica killed mid-batch) comes first, in stream order, and not after ack_wait
            # behind newer events. The work-queue stream holds only unacked messages, so a new
            # consumer from the start is exactly "from the ack floor"; redeliveries are same-id.
            stream, durable = S.EXPORT_STREAM, self.cfg.partition_durable(self.partition)
            try:
                await self.service.js.delete_consumer(stream, durable)
            except nats.js.errors.NotFoundError:
                pass
            info = await self.service.js.add_consumer(stream, S.export_partition_consumer_config(
                durable, self.cfg.name, self.partition, f"aep-bridge exporter sink {self.cfg.name} partition {self.partition}",
                ack_wait=self.service.settings.export_ack_wait_s))
            self.consumer_created = getattr(info, "created", None)
            self.sub = await self.service.js.pull_subscribe_bind(durable=durable, stream=stream)
            self.bound = True
            return
        # Create the durable, or update one an earlier release made for aep.hermes.> alone
        # (it then takes aep.ingest.> from its position on), then bind to it.
        config = S.exporter_consumer_config(self.cfg.durable, f"aep-bridge exporter sink {self.cfg.name}",
                                            ack_wait=self.service.settings.export_ack_wait_s)
        created = (await self.service.js.stream_info(S.AEP_EVENTS)).created
        if created != self.stream_created:  # a new stream (or the first bind): its sequences start again
            self.start_after = self.replay_upto = self.server_floor = 0
        self.stream_created = created
        if self.start_after:  # it disappeared: from the ack floor on, not from the stream's start
            config.deliver_policy, config.opt_start_seq = DeliverPolicy.BY_START_SEQUENCE, self.start_after + 1
        self.consumer_created = getattr(await self.service.js.add_consumer(S.AEP_EVENTS, config), "created", None)
        if self.start_after:
            self.start_after, self.state = 0, "delivering"
            log.warning("consumer_recreated", sink=self.cfg.name, durable=self.cfg.durable)
        self.sub = await self.service.js.pull_subscribe_bind(durable=self.cfg.durable, stream=S.AEP_EVENTS)
        self.bound = True

    # ------------------------------------------------------------ one batch

    def origin(self, msg: Any) -> tuple[int, str]:
        """The message's AEP_EVENTS sequence and subject (a partitioned stream's message is
        ``export.<sink>.<n>.<subject>``, its source sequence in the Nats-Stream-Source header)."""
        if self.partition is None:
            return msg.metadata.sequence.stream, msg.subject
        subject = msg.subject.split(".", 3)[-1]
        source = (msg.headers or {}).get("Nats-Stream-Source", "").split(" ")
        seq = int(source[1]) if len(source) > 1 and source[1].isdigit() else msg.metadata.sequence.stream
        return seq, subject

    def prepare(self, msg: Any) -> tuple[Item | None, str | None]:
        """(item to deliver, None) or (None, why it is acked without delivery / dead-lettered)."""
        event = self._decode(msg.data)
        if not isinstance(event, dict):
            raise BridgeError("not_object", "an AEP event is a JSON object")
        if not self.cfg.filter.matches(event):
            return None, "filtered"
        if self.cfg.kind == "kafka":
            subject = msg.subject if self.partition is None else self.origin(msg)[1]
            lane = subject.split(".")[2] if subject.count(".") >= 3 else str(event.get("session", "_"))
            record = kafka_record(self.cfg.format, event, lane, self.cfg.max_capture, self.cfg.ce_mode)
        else:
            record = project(PROJECTION[self.cfg.format], event, self.cfg.max_capture)
        if record is None:
            return None, "no_record"
        return Item(msg, event, record), None

    async def handle(self, msgs: list[Any]) -> None:
        items: list[Item] = []
        for msg in msgs:
            seq = msg.metadata.sequence.stream
            if ((getattr(msg.metadata, "num_delivered", 1) or 1) > 1 or seq <= self.replay_upto) and seq in self.delivered:
                self.metrics.skipped.labels(sink=self.cfg.name, reason="redelivered").inc()
                await self.ack([msg])  # its first ack was lost: the sink has it already
                continue
            try:
                item, why = self.prepare(msg)
            except (BridgeError, msgspec.DecodeError, UnicodeDecodeError) as exc:
                reason = getattr(exc, "reason", "not_json")
                await self.dead_letter([msg], f"export_{reason}", f"{type(exc).__name__}: {exc}")
                continue
            except Exception as exc:  # an event no projection foresaw must not stop the sink
                log.error("export_unprojectable", sink=self.cfg.name, error=type(exc).__name__)
                await self.dead_letter([msg], "export_unprojectable", f"{type(exc).__name__}: {exc}")
                continue
            if item is None:
                self.metrics.skipped.labels(sink=self.cfg.name, reason=why).inc()
                await self.ack([msg])
            else:
                items.append(item)
        if items and not self.fenced():
            await self.deliver(items)

    def fenced(self) -> bool:
        return self.fence is not None and self.fence()

    async def deliver(self, items: list[Item]) -> None:
        """Until every item is confirmed or dead-lettered (or the service stops: then the rest
        stays unacked and comes back)."""
        attempt = 0
        keepalive = asyncio.create_task(self._keep_in_progress(items))
        try:
            while items:
                if self.fenced():  # the lease may have lapsed: the next owner delivers them
                    return
                outcomes = await self.until_stopped(self.send(items))
                if outcomes is None:
                    return  # stopping: unacked, redelivered (a dead broker held this for 30 s)
                delivered = [i for i, o in zip(items, outcomes) if o.ok]
                permanent = [(i, o) for i, o in zip(items, outcomes) if not o.ok and not o.retry]
                retry = [(i, o) for i, o in zip(items, outcomes) if not o.ok and o.retry]
                if delivered:
                    self.remember(delivered)
                    await self.ack([i.msg for i in delivered])
                    self.metrics.delivered.labels(sink=self.cfg.name).inc(len(delivered))
                    self.metrics.last_success.labels(sink=self.cfg.name).set(time.time())
                    if self.state != "delivering":
                        log.info("sink_delivering", sink=self.cfg.name, after_attempts=attempt)
                    self.state, attempt = "delivering", 0
                for item, outcome in permanent:
                    self.metrics.errors.labels(sink=self.cfg.name, reason=outcome.reason).inc()
                    await self.dead_letter([item.msg], f"export_{outcome.reason}", outcome.detail)
                items = [i for i, _ in retry]
                if not items:
                    return
                attempt += 1
                reason = retry[0][1].reason
                self.metrics.errors.labels(sink=self.cfg.name, reason=reason).inc(len(items))
                self.metrics.retries.labels(sink=self.cfg.name).inc(len(items))
                delay = max((o.retry_after_s for _, o in retry if o.retry_after_s is not None), default=None)
                if delay is None:
                    delay = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (attempt - 1)) * random.uniform(0.8, 1.0)
                if self.state != "retrying" or attempt % 10 == 1:
                    log.warning("sink_retry", sink=self.cfg.name, events=len(items), attempt=attempt,
                                reason=reason, detail=retry[0][1].detail[:300], wait_s=round(delay, 2))
                self.state = "retrying"
                if await self.service.stopper.sleep(delay) or self.released:
                    return  # unacked: redelivered to the next exporter (or the partition's next owner)
        finally:
            keepalive.cancel()

    async def until_stopped(self, call: Any) -> Any:
        """``await call``, or None (``call`` cancelled) once the service is stopping."""
        task = asyncio.ensure_future(call)
        stopped = asyncio.ensure_future(self.service.stopper.event.wait())
        try:
            await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        return None if task.cancelled() else task.result()

    def remember(self, items: list[Item]) -> None:
        for item in items:
            self.delivered[item.msg.metadata.sequence.stream] = None
        while len(self.delivered) > DELIVERED_MEMORY:
            self.delivered.popitem(last=False)

    async def send(self, items: list[Item]) -> list[Outcome]:
        """The sink's outcomes for ``items``. A batch the sink cannot even frame (a record its
        encoder refuses) is sent again one record at a time, so that only the record that
        cannot be sent is dead-lettered and the rest go on."""
        try:
            return await self.sink.send([i.record for i in items])
        except Exception as exc:
            if len(items) == 1:
                log.error("export_unsendable", sink=self.cfg.name, error=type(exc).__name__)
                return [Outcome(False, retry=False, reason="unsendable", detail=f"{type(exc).__name__}: {exc}")]
        outcomes: list[Outcome] = []
        for item in items:
            outcomes += await self.send([item])
        return outcomes

    async def _keep_in_progress(self, items: list[Item]) -> None:
        """While a batch waits for its sink: +WPI, so JetStream does not redeliver it meanwhile."""
        while True:
            await asyncio.sleep(self.service.settings.export_ack_wait_s * PROGRESS_EVERY)
            self.service.health.beat()
            for item in items:
                try:
                    await item.msg.in_progress()
                except Exception:
                    pass

    async def ack(self, msgs: list[Any]) -> None:
        for msg in msgs:
            try:
                await msg.ack()
            except Exception as exc:  # redelivered later: a same-id duplicate at the sink
                log.warning("ack_failed", sink=self.cfg.name, error=f"{type(exc).__name__}: {exc}")

    async def dead_letter(self, msgs: list[Any], reason: str, error: str) -> None:
        """Dead-letter events the sink refuses for good (`bridge.core.deadletter`, within the
        sink's own ceiling: its `max_capture`), then ack them."""
        bridge = self.service.dlq_policy  # a dead letter never holds more than the bridge's lowest ceiling
        level = min(self.cfg.max_capture, bridge.lowest())
        policy = CapturePolicy(default=LEVELS[level], overrides={}, redactor=bridge.redactor)
        for msg in msgs:
            seq, subject = self.origin(msg)
            original = deadletter.Original(S.AEP_EVENTS, seq, subject, msg.data)
            letter = deadletter.build(f"exporter:{self.cfg.name}", reason, reason, error, original, policy)
            # one letter per sink and event (another sink may refuse the same event)
            headers = {**letter.headers, "Nats-Msg-Id": f"dlq:{S.AEP_EVENTS}:{self.cfg.name}:{seq}"}
            self.metrics.dead_letters.labels(sink=self.cfg.name, reason=reason).inc()
            # the error as the letter holds it (its detail only where the ceiling lets it through)
            log.warning("dead_letter", sink=self.cfg.name, reason=reason, events_seq=seq,
                        error=headers["Bridge-Dlq-Error"][:200], bytes=len(msg.data),
                        delivered=getattr(msg.metadata, "num_delivered", None))
            try:
                await self.service.js.publish(subj.dlq_subject(reason), letter.body, headers=headers)
            except Exception as exc:  # not acked: it comes back and is tried again
                log.error("dead_letter_failed", sink=self.cfg.name, error=f"{type(exc).__name__}: {exc}")
                continue
            await self.ack([msg])

    # ------------------------------------------------------------ the loop

    async def run(self) -> None:
        stopper = self.service.stopper
        while not stopper.stopping and not self.released and not self.fenced():
            if not self.bound and not await bind_or_wait(self, self.bind):
                continue
            self.service.health.beat()
            if self.fenced():  # checked before every fetch: past it the consumer may be the next owner's
                return
            try:
                msgs = await self.sub.fetch(self.cfg.batch, timeout=1.0)
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                continue
            except Exception as exc:  # connection trouble, consumer gone: bind again
                log.warning("fetch_failed", sink=self.cfg.name, error=f"{type(exc).__name__}: {exc}")
                if await self.gone():
                    self.bound = False
                await stopper.sleep(1.0)
                continue
            await self.handle(msgs)

    async def gone(self) -> bool:
        """After a failed fetch: must the worker bind again? Not while its durable answers and
        is the one bound (its creation time), nor while nothing answers (an election, a node cut
        off: the next fetch tells): it pulls from the same durable again, with no request to the
        meta group (a bind creates the durable, which waits for a meta leader: after a
        partition's heal, seconds after the durable's own leader is back; issue 42). A durable of
        that name made since (a new AEP_EVENTS, another replica's): bound again. Gone (deleted by
        hand, or by a role that should not have been able to: issue 44): created again by the
        next bind (not ready meanwhile: /readyz 503), a sink's after its ack floor as last read,
        the events between that and what the sink confirmed checked against `delivered` (not
        sent twice); a partition's from its work queue's first unacked message, as at every
        acquisition."""
        stream, durable = (S.EXPORT_STREAM, self.cfg.partition_durable(self.partition)) if self.partition is not None \
            else (S.AEP_EVENTS, self.cfg.durable)
        try:
            info = await self.service.js.consumer_info(stream, durable)
            return self.consumer_created is None or info.created != self.consumer_created
        except nats.js.errors.NotFoundError:
            pass
        except Exception:  # cannot tell: the same durable, pulled again
            return False
        self.metrics.recreated.labels(sink=self.cfg.name).inc()
        self.state = f"consumer {durable} gone: recreating it"
        log.error("consumer_gone", sink=self.cfg.name, stream=stream, durable=durable, after_seq=self.server_floor)
        if self.partition is None:
            self.start_after = self.server_floor
            self.replay_upto = max(self.delivered, default=0)
        return True

    async def lag(self) -> int:
        info = await self.sub.consumer_info()
        self.server_floor = max(self.server_floor, int(getattr(info.ack_floor, "stream_seq", 0) or 0))
        return int((info.num_pending or 0) + (info.num_ack_pending or 0))

    async def watch(self) -> None:
        while not self.service.stopper.stopping:
            if self.sub is not None:
                try:
                    self.metrics.lag.labels(sink=self.cfg.name).set(await self.lag())
                except Exception:
                    pass
            if await self.service.stopper.sleep(5.0):
                return


class Exporter(Service):
    name = "exporter"
    grace_s = 15.0

    def __init__(self, settings: Settings, sinks: list[SinkConfig], registry: CollectorRegistry | None = None) -> None:
        if not sinks:
            raise ValueError("no sinks configured: --sink URL or AEP_BRIDGE_EXPORT_CONFIG")
        self.settings = settings
        # Only for dead letters: the bridge's ceiling and redaction (AEP_BRIDGE_CAPTURE*, REDACT_NAMES).
        self.dlq_policy = configure(settings.capture, settings.capture_overrides, (), Redactor(
            secret_values=settings.secret_values(), home=os.path.expanduser("~")))[0]
        self.registry = registry or CollectorRegistry()
        self.metrics = ExporterMetrics(self.registry)
        self.health = Health("exporter")
        self.stopper = Stopper()
        self.nc: Any = None
        self.js: Any = None
        self.workers: list[Any] = [PartitionedSink(self, cfg, worker=SinkWorker) if cfg.partitioned else SinkWorker(self, cfg)
                                   for cfg in sinks]

    async def connect(self) -> None:
        self.nc = await connect_service(self.settings, name=f"aep-bridge-exporter-{self.settings.instance}", role="exporter")
        if (follower := follow.of(self.nc)) is not None:
            # the stream it reads: a server that cannot reach its leader is left (bridge.nats.follow)
            follower.lead(S.EXPORT_STREAM if all(isinstance(w, PartitionedSink) for w in self.workers) else S.AEP_EVENTS)
        self.js = self.nc.jetstream()

    def _readiness(self) -> None:
        bound = all(w.bound for w in self.workers)
        connected = self.nc is not None and self.nc.is_connected
        unsure = [f"{w.cfg.name}: {why}" for w in self.workers if (why := w.unsure())]
        ready = bound and connected and not unsure
        self.health.set_ready(ready, "" if ready else ("NATS disconnected" if not connected else "binding sink consumers"
                                                       if not bound else f"lease unsure: {'; '.join(unsure)}"[:300]))
        failing = {w.cfg.name: why for w in self.workers if (why := sink_failing(w))}
        self.health.info["sinks"] = {w.cfg.name: "failing" if w.cfg.name in failing else w.state for w in self.workers}
        if failing:  # why, on /healthz: not only in a log file
            self.health.info["sink_errors"] = failing
        else:
            self.health.info.pop("sink_errors", None)

    def starting(self) -> dict[str, Any]:
        return {"nats": server_list(self.settings).urls, "sinks": [w.cfg.describe() for w in self.workers]}

    async def start(self) -> list[Loop]:
        require_clients([w.cfg for w in self.workers])
        await self.connect()
        for worker in self.workers:
            await worker.sink.start()
        return [w.run() for w in self.workers] + [w.watch() for w in self.workers] + [self.readiness_loop()]

    async def readiness_loop(self) -> None:
        while not self.stopper.stopping:
            self._readiness()
            if await self.stopper.sleep(0.5):
                return

    async def stop(self) -> None:
        for worker in self.workers:
            try:
                await worker.sink.close()
            except Exception:
                pass


def sink_failing(worker: Any) -> str | None:
    """Why the worker's sink client fails now (a Kafka broker that does not answer), else None."""
    failing = getattr(getattr(worker, "sink", None), "failing", None)
    return failing() if callable(failing) else None


def load_sinks(urls: list[str], config_path: str | None, environ: dict[str, str] | None = None) -> list[SinkConfig]:
    """The sinks of ``--sink`` URLs plus those of the config file (YAML or JSON)."""
    environ = dict(os.environ) if environ is None else environ
    sinks = [sink_from_url(u, environ) for u in urls]
    if config_path:
        from ruamel.yaml import YAML

        with open(config_path) as f:
            doc = YAML(typ="safe").load(f)
        sinks += sinks_from_document(doc, environ)
    check_unique(sinks)
    return sinks


__all__ = ["Exporter", "ExporterMetrics", "Outcome", "SinkWorker", "load_sinks"]
