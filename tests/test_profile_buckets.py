"""benchmarks/profile_buckets.py: issue 43's buckets of a service profile, from py-spy's raw
output and from benchmarks/cpu_sampler's, on stacks taken from real profiles of the mapper and
pairing (2,000 events/s, main 30b9f53)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from profile_buckets import bucket, frames_of, read, table  # noqa: E402

ROOT = "_run_module_as_main (<frozen runpy>:198);<module> (bridge/cli.py:92);Runner.run (asyncio/runners.py:118)"
MAPPER = ROOT + ";Mapper.consume (bridge/services/mapper.py:979);Mapper.process_batch (bridge/services/mapper.py:817)"
PAIRING = ROOT + ";PairingService.run_partition (bridge/services/pairing.py:1000)"

CASES = [
    # the pure mapping, through a dataclass __init__ (skipped to its caller)
    (MAPPER + ";Mapper.handle (bridge/services/mapper.py:458);Mapper.map_one (bridge/services/mapper.py:632);"
     "map_record (bridge/core/pipeline.py:60);map_envelope (bridge/core/mapping.py:637);__init__ (<string>:3)", "core"),
    # a held message's events published after its lane fact: the events' publish, not lane work
    (MAPPER + ";Mapper.flush_pending (bridge/services/mapper.py:833);Mapper.release_held (bridge/services/mapper.py:549);"
     "Mapper.publish_events (bridge/services/mapper.py:526);AckPublisher.publish (bridge/nats/publish.py:126);"
     "Client.publish (nats/aio/client.py:900);Client._send_publish (nats/aio/client.py:950)", "client"),
    # a lane learnt: its own publish is lane work
    (MAPPER + ";Mapper.handle (bridge/services/mapper.py:485);KvLanes.learn (bridge/nats/lanes.py:120);"
     "AckPublisher.publish (bridge/nats/publish.py:126);Client._send_publish (nats/aio/client.py:950)", "lanes"),
    (MAPPER + ";Mapper.handle (bridge/services/mapper.py:440);MapperMetrics.hook_in (bridge/services/mapper.py:262);"
     "MetricWrapperBase.labels (prometheus_client/metrics.py:180)", "metrics"),
    (MAPPER + ";Mapper.flush_pending (bridge/services/mapper.py:846);wait (asyncio/tasks.py:418)", "loop"),
    (MAPPER + ";Mapper.handle (bridge/services/mapper.py:430)", "service"),
    (ROOT, "loop"),  # uvloop's C loop, under Runner.run
    (ROOT + ";Client._flusher (nats/aio/client.py:2100);Queue.get (asyncio/queues.py:158)", "client"),
    (ROOT + ";Client._flusher (nats/aio/client.py:2110);StreamWriter.writelines (asyncio/streams.py:330)", "client"),
    (PAIRING + ";PairingService.checkpoint (bridge/services/pairing.py:566);PairingState.snapshot (bridge/core/pairing.py:900)",
     "timed"),
    ("Thread._bootstrap (threading.py:1002);_worker (concurrent/futures/thread.py:83);"
     "_WorkItem.run (concurrent/futures/thread.py:58)", "timed"),  # a checkpoint's zlib, in its thread
    (PAIRING + ";PairingService.handle_batch (bridge/services/pairing.py:760);PairingService.handle (bridge/services/pairing.py:700);"
     "decode_event (bridge/core/aep.py:300)", "core"),
    # cpu_sampler's frames: the file's last three path components, no line
    ("Runner.run (python3.11/asyncio/runners.py);Mapper.consume (bridge/services/mapper.py);"
     "Puller.fetch (bridge/nats/pull.py);Puller._take (bridge/nats/pull.py)", "client"),
    ("Runner.run (python3.11/asyncio/runners.py);PairingService.handle (bridge/services/pairing.py);"
     "ActivityMetrics.seen (bridge/runtime/activity.py)", "metrics"),
]


@pytest.mark.parametrize("stack,expected", CASES)
def test_a_stack_lands_in_its_bucket(stack: str, expected: str) -> None:
    assert bucket(frames_of(stack)) == expected


def test_the_table_turns_shares_into_microseconds_and_leaves_idle_threads_out(tmp_path: Path) -> None:
    profile = tmp_path / "mapper-2000.txt"
    profile.write_text("\n".join([
        CASES[0][0] + " 60",  # core
        CASES[1][0] + " 30",  # client
        CASES[6][0] + " 10",  # loop
        # the HTTP server's thread waiting in select: py-spy may count it, it costs no CPU
        "Thread._bootstrap (threading.py:1002);BaseServer.serve_forever (socketserver.py:233);"
        "_PollLikeSelector.select (selectors.py:415) 500",
        "not a stack line",
    ]) + "\n")
    per = read([profile])
    assert {b: sum(c.values()) for b, c in per.items() if c} == {"core": 60, "client": 30, "loop": 10}
    text = table(per, ms_per_event=0.2, title="mapper:")
    assert "100 samples; 200 µs of CPU per raw event" in text
    assert "core      60.0 %   120.0 µs" in text
    assert "client    30.0 %    60.0 µs" in text
