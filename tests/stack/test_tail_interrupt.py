"""Ctrl-C ends `aep-bridge tail` while events flow (clean-clone CI of 873249d: the gate banner's
`tail` did not exit within 30 s of its SIGINT).

asyncio.run turns Ctrl-C into a cancel of the command's task. tail polled its queue with
``asyncio.wait_for(queue.get(), 0.25)``, and Python 3.11's wait_for returns the item when the
get is done by the time the cancel lands (gh-86296): with events flowing, the cancel was
swallowed and tail went on until its stream ran dry, or for ever. The cancel here comes from
tail's own ``on_event``, with more events queued: the get of the next one is done before the
task sees its cancel, every time."""

from __future__ import annotations

import asyncio
import io
import json

import nats

from bridge.nats.bootstrap import bootstrap
from bridge.nats.subjects import event_lane_token, events_subject
from bridge.stack.tail import tail


def event(i: int) -> bytes:
    return json.dumps({"specversion": "1.0", "id": f"e{i}", "type": "run.started", "source": "aep://t/agent/x",
                       "time": "2026-12-07T00:00:00Z", "data": {}}).encode()


def test_a_cancel_ends_tail_while_events_flow(nats_server_fn) -> None:  # type: ignore[no-untyped-def]
    async def run() -> tuple[str, int]:
        nc = await nats.connect(nats_server_fn.url)
        js = nc.jetstream()
        await bootstrap(js, None, replicas=1)
        for i in range(300):
            await js.publish(events_subject(event_lane_token(f"s{i % 3}", False), "run.started"), event(i), headers={"Nats-Msg-Id": f"e{i}"})
        seen = 0
        task: asyncio.Task | None = None

        def on_event(_: dict) -> None:
            nonlocal seen
            seen += 1
            if seen == 20:  # Ctrl-C, the next events queued already
                assert task is not None
                task.cancel()

        task = asyncio.create_task(tail(nc, all_events=True, as_json=True, out=io.StringIO(), on_event=on_event,
                                        idle_exit=5))
        try:
            await task
            outcome = "ran on"
        except asyncio.CancelledError:
            outcome = "cancelled"
        await nc.close()
        return outcome, seen

    outcome, seen = asyncio.run(run())
    assert (outcome, seen) == ("cancelled", 20), (outcome, seen)
