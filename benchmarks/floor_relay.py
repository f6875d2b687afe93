#!/usr/bin/env python3
"""The fair floor of benchmarks/cost.py (issue 43): a nats-py process in the mapper's or
pairing's place that does what the service does on the wire and nothing else.

    .venv/bin/python benchmarks/floor_relay.py --nats URL --role mapper
    .venv/bin/python benchmarks/floor_relay.py --nats URL --role pairing

``mapper``: the mapper's durable consumer on HERMES_RAW (`bridge.nats.streams.MAPPER_CONSUMER`,
bound as `Mapper.bind` binds it), its fetch (`bridge.nats.pull.Puller` with ``burst``, a batch of
256 as `aep-bridge mapper`'s default) and its pause after a small batch
(`bridge.runtime.lifecycle.Linger` with the mapper's ``LINGER_TARGET`` and the settings'
AEP_BRIDGE_LINGER_MS / AEP_BRIDGE_LINGER_MAX_MS). Each batch: every message's bytes published to
``bridge.mapped.<partition>.<instance>.<hook>`` (its ``Nats-Msg-Id`` kept) with nats-py's public
``publish_async``, one wait for all their acks, then the raw messages' acks.

``pairing``: pairing's reader (`PairingService.reader_consumer`: an ephemeral consumer of
``bridge.mapped.>`` without acks) read with pairing's gather (`Puller` with pairing's
``GATHER_S`` / ``GATHER_MAX_S``, a batch of ``FETCH_BATCH``, waits of ``POLL_S``). Each burst:
every message published to ``aep.hermes.<instance>.<hook>`` the same way, one wait for all the
acks (pairing's consumer takes no acks).

``--publish bridge``: the services' own `bridge.nats.publish.AckPublisher` instead of nats-py's
``publish_async`` (what the floor would cost on the pipeline's publish path).

No mapping, no state, no metrics, no logs, no health. Runs on the services' event loop
(`bridge.runtime.lifecycle.event_loop_factory`: uvloop when installed) unless ``--loop asyncio``;
prints ``floor <role> ready on <loop>`` once bound. Runs until SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import zlib

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bridge.config import Settings  # noqa: E402
from bridge.nats import streams as S  # noqa: E402
from bridge.nats import subjects as subj  # noqa: E402
from bridge.nats.pull import Puller  # noqa: E402
from bridge.runtime.lifecycle import Linger, event_loop_factory  # noqa: E402
from bridge.services import mapper as mapper_service  # noqa: E402
from bridge.services import pairing as pairing_service  # noqa: E402

MAPPER_BATCH = 256  # `aep-bridge mapper --batch`'s default
_ID = "Nats-Msg-Id"


def loop_name(loop: asyncio.AbstractEventLoop) -> str:
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


async def wait_acks(futures: list[asyncio.Future]) -> None:
    """One wait for every publish of a batch (the mapper's `flush_pending`), then their results read."""
    if futures:
        await asyncio.wait(futures, timeout=10)
        for f in futures:
            if not f.done():
                f.cancel()
            elif not f.cancelled() and f.exception() is not None:
                print(f"floor: publish failed: {f.exception()!r}", file=sys.stderr, flush=True)


async def run(a: argparse.Namespace) -> None:
    import nats
    import nats.errors
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    settings = Settings.from_env()
    nc = await nats.connect(a.nats, name=f"floor-{a.role}")
    js = nc.jetstream(publish_async_max_pending=4096)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    if a.publish == "bridge":  # the services' own publish path (one future per publish, bridge.nats.publish)
        from bridge.nats.publish import AckPublisher

        publisher = await AckPublisher(nc).start()
        publish = publisher.publish
    else:
        publish = js.publish_async
    if a.role == "mapper":
        config = S.mapper_consumer_config(S.MAPPER_DURABLE, settings.mapper_ack_wait_s)
        sub = await js.pull_subscribe(S.RAW_SUBJECTS, durable=S.MAPPER_DURABLE, stream=S.HERMES_RAW, config=config)
        puller = Puller(sub, burst=True)
        linger = Linger(settings.linger_ms / 1000, settings.linger_max_ms / 1000, target=mapper_service.LINGER_TARGET)
        partitions = settings.partitions
        prefix = subj.MAPPED_PREFIX + "."
        print(f"floor mapper ready on {loop_name(asyncio.get_running_loop())}", flush=True)
        while not stop.is_set():
            try:
                msgs = await puller.fetch(MAPPER_BATCH, timeout=1.0)
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                continue
            futures = []
            for m in msgs:
                rest = m.subject.split(".", 2)[2]  # hermes.raw.<instance>.<hook>
                part = zlib.crc32(rest.split(".", 1)[0].encode()) % partitions
                futures.append(await publish(f"{prefix}{part}.{rest}", m.data, headers={_ID: (m.headers or {}).get(_ID, "")}))
            await wait_acks(futures)
            for m in msgs:
                await m.ack()
            await linger.after(len(msgs), len(msgs) < MAPPER_BATCH // 4)
    else:
        # PairingService.reader_consumer's configuration for a replica that reads every partition.
        config = ConsumerConfig(deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE, inactive_threshold=30.0,
                                filter_subject=f"{subj.MAPPED_PREFIX}.>", max_ack_pending=-1)
        sub = await js.pull_subscribe(config.filter_subject, stream=S.BRIDGE_MAPPED, config=config)
        puller = Puller(sub, gather_s=pairing_service.GATHER_S, gather_max_s=pairing_service.GATHER_MAX_S)
        prefix = subj.EVENTS_PREFIX + "."
        cut = subj.MAPPED_PREFIX.count(".") + 2  # bridge.mapped.<n>.<rest>
        last = 0  # the last BRIDGE_MAPPED sequence read
        print(f"floor pairing ready on {loop_name(asyncio.get_running_loop())}", flush=True)
        while not stop.is_set():
            try:
                msgs = await puller.fetch(pairing_service.FETCH_BATCH, timeout=pairing_service.POLL_S)
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                continue
            except nats.errors.Error as exc:
                # Its ephemeral consumer is gone: past its inactive threshold while this process was
                # stopped (cost.py --max-rate stops one system while the other runs). A new one from
                # the next message, as pairing's reader makes one (before, this process ended here,
                # and the floor's --max-rate steps ran without a pairing).
                print(f"floor pairing: {type(exc).__name__}: {exc}; a new consumer from {last + 1}", file=sys.stderr, flush=True)
                try:
                    await sub.unsubscribe()
                except Exception:
                    pass
                config.deliver_policy, config.opt_start_seq = DeliverPolicy.BY_START_SEQUENCE, last + 1
                try:
                    sub = await js.pull_subscribe(config.filter_subject, stream=S.BRIDGE_MAPPED, config=config)
                except Exception as again:
                    print(f"floor pairing: {type(again).__name__}: {again}", file=sys.stderr, flush=True)
                    await asyncio.sleep(0.5)
                    continue
                puller = Puller(sub, gather_s=pairing_service.GATHER_S, gather_max_s=pairing_service.GATHER_MAX_S)
                continue
            if msgs:
                last = msgs[-1].metadata.sequence.stream
            futures = [await publish(prefix + m.subject.split(".", cut)[cut], m.data, headers={_ID: (m.headers or {}).get(_ID, "")})
                       for m in msgs]
            await wait_acks(futures)
    await nc.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nats", required=True)
    p.add_argument("--role", choices=("mapper", "pairing"), required=True)
    p.add_argument("--loop", choices=("service", "asyncio"), default="service",
                   help="the services' loop (uvloop when installed; default) or asyncio's")
    p.add_argument("--publish", choices=("public", "bridge"), default="public",
                   help="nats-py's public publish_async (default) or the services' AckPublisher")
    a = p.parse_args()
    with asyncio.Runner(loop_factory=event_loop_factory() if a.loop == "service" else None) as runner:
        runner.run(run(a))
