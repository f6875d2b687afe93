"""Pairing's restore check (`PairingService.not_yet_published`) reads as far as the mapper's.

A partition restored later than AEP_EVENTS' duplicate window looks its replayed outputs up
on AEP_EVENTS. It used `find_msg_id`'s default of 64 probes, so an output the previous owner
published after 100 others on the same subject was not found and was published again
(issue 25 item 9). Real server, 2 s window; nothing is timed but the window.
"""

from __future__ import annotations

import asyncio

import msgspec
import nats
from prometheus_client import CollectorRegistry

from bridge.config import Settings
from bridge.core.aep import decode_event, encode_event
from bridge.core.ceiling import CapturePolicy
from bridge.nats import streams as S
from bridge.nats import subjects as subj
from bridge.nats.bootstrap import bootstrap
from bridge.services.mapper import Mapper
from bridge.services.pairing import PairingService
from tests.support.lanes import envelopes
from tests.support.services import publish_all, raw_records

WINDOW_S = 2.0


def test_a_restored_output_is_found_past_64_others_on_its_subject(nats_server_fn):
    async def run() -> list[str]:
        nc = await nats.connect(nats_server_fn.url)
        js = nc.jetstream()
        await bootstrap(js, None, replicas=1, duplicate_window_s=WINDOW_S)
        await publish_all(js, raw_records(envelopes("inner")[:1], instance="restore"))
        m = Mapper(Settings(nats_url=nats_server_fn.url, instance="m"), CapturePolicy(), registry=CollectorRegistry())
        await m.connect()
        sub = await m.bind()
        await m.process_batch(await sub.fetch(1, timeout=5))
        await m.close()
        # The replayed input (its stored time is where the look-up starts) and one of its outputs.
        mapped = await js.pull_subscribe("bridge.mapped.>", stream=S.BRIDGE_MAPPED)
        [replayed] = await mapped.fetch(1, timeout=5)
        event = decode_event(replayed.data)
        subject = subj.event_subject(event)
        for i in range(100):  # the previous owner's other outputs on the same subject, then this one
            other = msgspec.structs.replace(event, id=f"other-{i:03d}")
            await js.publish(subject, encode_event(other), headers={"Nats-Msg-Id": other.id})
        await js.publish(subject, encode_event(event), headers={"Nats-Msg-Id": event.id})
        await asyncio.sleep(WINDOW_S + 0.5)  # the restore comes later than the window

        pairing = PairingService(Settings(nats_url=nats_server_fn.url, instance="p"), replica="restorer",
                                 registry=CollectorRegistry())
        await pairing.connect()
        try:
            assert pairing.late_after_ns == int(WINDOW_S * 1e9) // 2
            missing = await pairing.not_yet_published(replayed, [event])
        finally:
            await pairing.nc.close()
            await nc.close()
        return [e.id for e in missing]

    assert asyncio.run(run()) == [], "the output published after 100 others is found, not published again"
