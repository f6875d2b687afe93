"""A mapped message a partition's consumer delivered but pairing never received (issue 23).

Pairing reads each partition with an ephemeral consumer that takes no acks: the server moves
on as soon as it has sent a message. A delivery lost on the way (the connection or a route
torn down by a node's restart) is therefore never sent again. In the rolling-restart scenario
(local clean-clone run, 2026-12-04) partition 5's consumer lost BRIDGE_MAPPED 1679 (a
`tool.requested`), pairing folded 1688 after it, its checkpoint said 1688, and the event
never reached AEP_EVENTS ("mapped, not paired: 1"). The consumer sequence numbers each
delivery (1, 2, 3, ... without acks, never a redelivery): a jump is a lost delivery, and the
partition must read again from the last message it folded."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from bridge.nats import streams as S
from bridge.sim.sessions import realistic_envelopes
from tests.natsfixture import JetStreamClient
from tests.support.services import Service, publish_all, raw_records
from tests.support.streams import quiet, stored_ids


def test_a_delivery_lost_on_the_way_is_read_again_not_skipped(nats_server_fn, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from prometheus_client import CollectorRegistry

    from bridge.config import Settings
    from bridge.services import pairing as P

    client = JetStreamClient(nats_server_fn.url)
    client.bootstrap()
    client.run(publish_all(client.js, raw_records(realistic_envelopes(300, seed=5), instance="gaps")))
    mapper = Service("mapper", nats_server_fn.url, tmp_path).start()
    try:
        quiet(client, "BRIDGE_MAPPED")
    finally:
        mapper.terminate()
    mapped = client.fetch("bridge.mapped.>", stream=S.BRIDGE_MAPPED)
    victims = [m for m in mapped if m.subject.startswith("bridge.mapped.0.")]
    assert len(victims) > 4
    lost_seq = victims[len(victims) // 2].seq  # mid-partition: later messages reveal the gap
    dropped: list[int] = []

    class LossyPuller(P.Puller):
        """What a torn-down route does: one delivery never arrives (the first time)."""

        async def fetch(self, batch: int, timeout: float) -> list[Any]:
            msgs = await super().fetch(batch, timeout)
            if not dropped and any(m.metadata.sequence.stream == lost_seq for m in msgs):
                dropped.append(lost_seq)
                msgs = [m for m in msgs if m.metadata.sequence.stream != lost_seq]
            return msgs

    monkeypatch.setattr(P, "Puller", LossyPuller)

    async def run() -> tuple[float, set[str]]:
        pairing = P.PairingService(Settings(nats_url=nats_server_fn.url, instance="p"), replica="lossy",
                                   registry=CollectorRegistry(), tick_s=3600)
        await pairing.connect()
        maintain = asyncio.create_task(pairing.maintain_loop())
        try:
            want, got = {json.loads(m.data)["id"] for m in mapped}, set()
            for _ in range(30):
                await asyncio.sleep(1.0)
                got |= {i for _, i in await stored_ids(client.js, S.AEP_EVENTS, ">")}
                if want <= got:
                    break
            gaps = getattr(pairing.metrics, "consumer_gaps", None)  # (absent before the fix)
            return (gaps._value.get() if gaps is not None else -1.0), got
        finally:
            pairing.stopper.trigger()
            await maintain
            await pairing.stop()
            await pairing.nc.close()

    try:
        gaps, on_events = client.run(run())
        assert dropped == [lost_seq], "the test did not drop the delivery it meant to"
        lost_id = json.loads(next(m for m in mapped if m.seq == lost_seq).data)["id"]
        assert lost_id in on_events, "the lost delivery was skipped: its event never reached AEP_EVENTS"
        assert {json.loads(m.data)["id"] for m in mapped} <= on_events
        assert gaps == 1
    finally:
        client.close()
