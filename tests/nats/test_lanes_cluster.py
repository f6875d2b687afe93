"""Lane facts and session records on an R3 bucket (bridge/nats/lanes.py): two creates of one key
in flight together.

A clustered stream answers the second of two creates of one key with ``err_code`` 10164
("wrong last sequence", JSStreamWrongLastSequenceConstantErr) while the first is still being
replicated, not with 10071 as a single server does once the first is stored. nats-py's own KV
``create`` maps both to KeyWrongLastSequenceError; the mapper's creates (sent with
`AckPublisher`, issue 43) must read both as "another one is recorded, or about to be". Seen in
the cluster fault runs (2026-12-07): the mapper's `retry` with "err_code=10164 ... wrong last
sequence" on a message's first delivery, and a lane fact given up (`lane_fact_failed`) that was
only racing."""

from __future__ import annotations

import asyncio

import nats

from bridge.nats import streams as S
from bridge.nats.connection import outage
from bridge.nats.lanes import KvLanes, PinnedLane, lost_create
from bridge.nats.publish import AckPublisher
from tests.clusterfixture import Cluster

RACES = 30


def test_creates_racing_on_an_r3_bucket_agree_on_the_first(nats_cluster: Cluster) -> None:
    nats_cluster.bootstrap(3)
    nats_cluster.wait_leader(f"KV_{S.LANE_FACTS_BUCKET}")

    async def main() -> tuple[list[int | None], list[int | None]]:
        nc = await nats.connect(nats_cluster.urls, connect_timeout=5)
        try:
            js = nc.jetstream(timeout=10)
            kv, facts = await js.key_value(S.LANES_BUCKET), await js.key_value(S.LANE_FACTS_BUCKET)
            pub = await AckPublisher(nc).start()
            # two replicas of the mapper: a cache each
            first, second = KvLanes(kv, facts=facts), KvLanes(kv, facts=facts)
            owner_codes: list[int | None] = []
            fact_codes: list[int | None] = []
            for i in range(RACES):
                session = f"race-{i}"
                a = await first.send_owner(session, "inst-a", pub.publish)
                b = await second.send_owner(session, "inst-b", pub.publish)
                await asyncio.wait([a, b], timeout=10)
                assert a.exception() is None  # sent first: recorded
                error = b.exception()
                assert error is not None and lost_create(error), repr(error)
                # in flight: its fate is open, the message is retried without counting against it;
                # stored: a refusal, like any lost create on one server
                assert outage(error) == (getattr(error, "err_code", None) == 10164), repr(error)
                owner_codes.append(getattr(error, "err_code", None))
                # the loser reads the winner's record: both agree on the first instance
                assert await first.owner_answered(session, "inst-a", a) == "inst-a"
                assert await second.owner_answered(session, "inst-b", b) == "inst-a"

                key = f"fact-{i}"
                lane_a, lane_b = PinnedLane("s-a"), PinnedLane("s-b")
                fa = await first.send_lane(key, lane_a, pub.publish)
                fb = await second.send_lane(key, lane_b, pub.publish)
                await asyncio.wait([fa, fb], timeout=10)
                assert fa.exception() is None
                error = fb.exception()
                assert error is not None and lost_create(error), repr(error)
                fact_codes.append(getattr(error, "err_code", None))
                recorded = await second.recorded_lane(key)
                assert recorded is not None and recorded.session == "s-a"
            return owner_codes, fact_codes
        finally:
            await nc.close()

    owner_codes, fact_codes = asyncio.run(main())
    # the clustered answer was met (else this test proves nothing about it)
    assert 10164 in owner_codes + fact_codes, (owner_codes, fact_codes)
    assert not lost_create(RuntimeError("nats: timeout"))
