"""`aep-bridge usage` as a process, against a real nats-server whose AEP_EVENTS holds model-call
events of the issue-40 contract's shape (tests/support/api_calls.py): exact sums per model,
instance, session and day, `--json`, `--since`; and its failures (a dead server, a wrong URL,
a refused credential, a server never bootstrapped) as one line and an exit code, in seconds."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

import nats
import pytest

from tests.support.cli import free_port
from tests.natsfixture import JetStreamClient, make_server
from tests.support.api_calls import api_call, event, publish_events
from tests.support.auth_server import USER, AuthServer
from tests.support.up import cli

DAY1, DAY2 = "2026-12-05T09:30:00.000Z", "2026-12-06T23:59:59.999Z"


def usd(total: float) -> dict[str, Any]:
    return {"currency": "USD", "total": total}


def first_batch() -> list[dict[str, Any]]:
    a = {"instance": "gw-a", "session": "sess-a", "time": DAY1}
    b = {"instance": "gw-b", "session": "sess-b", "time": DAY2}
    return [
        event("run.started", **a, data={}),
        event("x.hermes.api.call", **a, data=api_call(duration_ms=100, cost=usd(0.25), input=1000, output=50,
                                                      cache_read=400, cache_write=100)),
        event("tool.completed", **a, data={"tool": {"name": "terminal", "call_id": "c1"}}),
        event("x.hermes.api.call", **a, data=api_call(duration_ms=300, cost=usd(0.5), input=2000, output=70, reasoning=30)),
        event("x.hermes.api.call", **a, data=api_call(duration_ms=200, cost={"currency": "EUR", "total": 0.125},
                                                      input=10, output=5)),
        event("x.hermes.api.error", **a, data={"gen_ai.request.model": "fake-model", "status_code": 429}),
        # the run's totals repeat the calls' tokens: not counted again
        event("run.finished", **a, data={"gen_ai.usage.input_tokens": 3010, "gen_ai.usage.output_tokens": 125,
                                         "model_calls": 3}),
        event("x.hermes.api.call", **b, data=api_call("other-model", duration_ms=1000, input=7, output=3)),
        event("x.hermes.api.call", **b, data=api_call("other-model", duration_ms=3000, input=5, output=2, reasoning=9)),
        event("x.hermes.api.call", **b, data=api_call(None, response_model="served", duration_ms=50, input=1)),
        # bad members are left out, the call still counts
        event("x.hermes.api.call", **b, data=api_call(duration_ms="12", input=-5, output=4)),  # type: ignore[arg-type]
        event("x.hermes.api.retry", **b, data={"gen_ai.usage.input_tokens": 999}),  # another api.* type: ignored
    ]


def second_batch() -> list[dict[str, Any]]:
    return [event("x.hermes.api.call", instance="gw-a", session="sess-c", time=DAY2,
                  data=api_call(duration_ms=400, cost=usd(0.125), input=100, output=10))]


class Stream:
    url: str
    since: str  # an RFC 3339 time between the two batches (as the server stored them)


@pytest.fixture(scope="module")
def stream(nats_backend: str) -> Iterator[Stream]:
    if nats_backend == "external":
        pytest.skip("the sums need a stream of their own")
    server = make_server(backend=nats_backend)
    client = JetStreamClient(server.url)
    try:
        client.bootstrap()

        async def fill() -> str:
            nc = await nats.connect(server.url)
            try:
                js = nc.jetstream()
                await publish_events(js, first_batch())
                await asyncio.sleep(0.3)
                between = datetime.now(timezone.utc).isoformat()
                await asyncio.sleep(0.3)
                await publish_events(js, second_batch())
                return between
            finally:
                await nc.close()

        s = Stream()
        s.url, s.since = server.url, asyncio.run(fill())
        yield s
    finally:
        client.close()
        server.close()


def env() -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith("AEP_BRIDGE_")}
    out["XDG_STATE_HOME"] = "/nonexistent-usage-test"  # no `up` state to pick a server from
    return out


def usage(*args: str, timeout: float = 60) -> Any:
    return cli("usage", *args, env=env(), timeout=timeout)


def groups(stream: Stream, *args: str) -> dict[str, Any]:
    done = usage("--nats", stream.url, "--json", *args)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    return doc


def row(group: str, calls: int, errors: int = 0, *, input: int = 0, output: int = 0, cache_read: int = 0,
        cache_write: int = 0, reasoning: int = 0, p50: int | None = None, p99: int | None = None,
        cost: dict[str, float] | None = None, unpriced: int = 0) -> dict[str, Any]:
    return {"group": group, "calls": calls, "errors": errors, "input_tokens": input, "output_tokens": output,
            "cache_read_tokens": cache_read, "cache_write_tokens": cache_write, "reasoning_tokens": reasoning,
            "p50_ms": p50, "p99_ms": p99, "cost": cost or {}, "unpriced_calls": unpriced}


FAKE = row("fake-model", 5, 1, input=3110, output=139, cache_read=400, cache_write=100, reasoning=30, p50=200, p99=400,
           cost={"EUR": 0.125, "USD": 0.875}, unpriced=1)
OTHER = row("other-model", 2, input=12, output=5, reasoning=9, p50=1000, p99=3000, unpriced=2)
SERVED = row("served", 1, input=1, p50=50, p99=50, unpriced=1)


def test_by_model_sums_exactly(stream: Stream) -> None:
    doc = groups(stream, "--since", "all")
    assert doc["by"] == "model" and doc["since"] is None
    assert doc["events"] == 9  # 8 calls and an error; run.finished and x.hermes.api.retry are not model calls
    assert doc["groups"] == [FAKE, OTHER, SERVED]
    assert doc["total"] == row("total", 8, 1, input=3123, output=144, cache_read=400, cache_write=100, reasoning=39,
                               p50=300, p99=3000, cost={"EUR": 0.125, "USD": 0.875}, unpriced=4)


@pytest.mark.parametrize(("by", "expected"), [
    ("instance", [("gw-a", 4, 1, 3110, 0.875), ("gw-b", 4, 0, 13, None)]),
    ("session", [("sess-b", 4, 0, 13, None), ("sess-a", 3, 1, 3010, 0.75), ("sess-c", 1, 0, 100, 0.125)]),
    ("day", [("2026-12-05", 3, 1, 3010, 0.75), ("2026-12-06", 5, 0, 113, 0.125)]),
])
def test_by_instance_session_day(stream: Stream, by: str, expected: list[tuple[Any, ...]]) -> None:
    doc = groups(stream, "--since", "all", "--by", by)
    got = [(r["group"], r["calls"], r["errors"], r["input_tokens"], r["cost"].get("USD")) for r in doc["groups"]]
    assert got == expected
    assert doc["total"]["calls"] == 8 and doc["total"]["input_tokens"] == 3123


def test_since_reads_only_what_the_stream_stored_after(stream: Stream) -> None:
    doc = groups(stream, "--since", stream.since)
    assert doc["groups"] == [row("fake-model", 1, input=100, output=10, p50=400, p99=400, cost={"USD": 0.125})]
    # the default is the last 24 h: every event here
    assert groups(stream)["total"]["calls"] == 8


def test_the_table(stream: Stream) -> None:
    done = usage("--nats", stream.url, "--since", "all")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["model", "calls", "errors", "input", "output", "cache_read", "cache_write",
                                "reasoning", "p50_ms", "p99_ms", "cost"]
    assert lines[1].split() == ["fake-model", "5", "1", "3110", "139", "400", "100", "30", "200", "400",
                                "0.125", "EUR,", "0.875", "USD", "(+1", "unpriced)"]
    assert lines[2].split() == ["other-model", "2", "0", "12", "5", "0", "0", "9", "1000", "3000"]  # no cost: blank
    assert lines[4].split()[:2] == ["total", "8"]
    assert len(lines) == 5
    assert done.stderr == ""  # a short read says nothing on stderr


def test_an_empty_window_says_so(stream: Stream) -> None:
    later = datetime.now(timezone.utc).replace(year=2100).isoformat()
    done = usage("--nats", stream.url, "--since", later)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("no model calls on the stream")


def one_line_failure(done: Any, code: int, *words: str) -> str:
    assert done.returncode == code, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("aep-bridge usage: "), lines
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert done.stdout == ""
    return lines[0]


def test_failures_are_one_line_within_seconds(tmp_path: Path) -> None:
    dead = f"nats://127.0.0.1:{free_port()}"
    one_line_failure(usage("--nats", dead, timeout=20), 1, "cannot connect to NATS", dead)
    line = one_line_failure(usage("--nats", "nats://user:s3cret@127.0.0.1:notaport", timeout=20), 1,
                            "cannot connect to NATS")
    assert "s3cret" not in line
    one_line_failure(usage("--nats", dead, "--since", "yesterday", timeout=20), 2, "--since")

    server = AuthServer(tmp_path, "right").start()  # JetStream on, never bootstrapped
    try:
        port = server.url.rsplit(":", 1)[1]
        one_line_failure(usage("--nats", f"nats://{USER}:wrong@127.0.0.1:{port}", timeout=20), 1,
                         "refused the credentials")
        one_line_failure(usage("--nats", f"nats://{USER}:right@127.0.0.1:{port}", timeout=20), 1,
                         "AEP_EVENTS", "bootstrap")
    finally:
        server.stop()


def test_a_long_read_shows_progress_on_stderr(stream: Stream) -> None:
    """The reader's progress lines (every second in the command; here every read)."""
    from io import StringIO

    from bridge.core.usage import Usage
    from bridge.stack.usage import read_usage

    async def read() -> tuple[int, str, Usage]:
        nc = await nats.connect(stream.url)
        out, u = StringIO(), Usage("model")
        try:
            n = await read_usage(nc, u, progress=out, progress_s=0.0)
        finally:
            await nc.close()
        return n, out.getvalue(), u

    n, progress, u = asyncio.run(read())
    assert n == 10  # every x.hermes.api.* message up to the last sequence at start
    assert u.rows()[0] == FAKE
    assert "aep-bridge usage: read " in progress and "of ~10 model-call events" in progress



@pytest.mark.slow
def test_the_reader_holds_a_bounded_part_of_a_long_stream(nats_backend: str) -> None:
    """While the fold does not take messages, the read's subscription holds a bounded part of
    the stream (flow control stops the server), not all of it: with a callback, nats-py
    answered flow control on arrival and the callback's queue took everything (400k events,
    390 MB). Then the read still gets every message."""
    if nats_backend == "external":
        pytest.skip("needs a stream of its own")
    from nats.js.api import DeliverPolicy

    import bridge.stack.usage as su
    from bridge.core.usage import Usage
    from tests.support.api_calls import subject

    n = 8000
    server = make_server(backend=nats_backend)
    client = JetStreamClient(server.url)
    try:
        client.bootstrap()

        async def run() -> tuple[int, int, int]:
            nc = await nats.connect(server.url)
            try:
                for _ in range(n):  # ~0.9 KB each, ~7 MB
                    ev = event("x.hermes.api.call", data=api_call(duration_ms=5, input=1, cost=usd(0.5)))
                    ev["data"]["x-pad"] = "p" * 600
                    await nc.publish(subject(ev), json.dumps(ev).encode())
                await nc.flush()
                while (await nc.jetstream().stream_info("AEP_EVENTS")).state.messages < n:
                    await asyncio.sleep(0.05)
                sub, _ = await su.subscribe(nc, deliver_policy=DeliverPolicy.ALL)
                held = 0
                for _ in range(20):  # nothing taken for 2 s: what the client holds stops growing
                    await asyncio.sleep(0.1)
                    held = max(held, sub.pending_msgs)
                await sub.unsubscribe()
                u = Usage("model")
                return held, await su.read_usage(nc, u), u.rows()[0]["calls"]
            finally:
                await nc.close()

        held, read, calls = asyncio.run(run())
        assert 0 < held < n // 2
        assert read == calls == n
    finally:
        client.close()
        server.close()


def test_it_reads_with_the_consumer_roles_rights_only(tmp_path: Path) -> None:
    """As aep-consumer (deploy/nats/nats.conf: create an ordered consumer BY NAME, stream info,
    flow control; no consumer info): the read asked $JS.API.CONSUMER.INFO for the number of
    events to expect, which the role may not, and failed with a timeout. The count now comes
    from the creation's answer; an empty window still ends at once."""
    from tests.support.nats_roles import Client, configured_server, ensure_streams, sample_nats_conf
    from tests.support.api_calls import subject

    from bridge.core.usage import Usage
    from bridge.stack.usage import read_usage

    with configured_server(tmp_path, sample_nats_conf(tmp_path / "js")) as url:
        async def main() -> tuple[int, list[dict[str, Any]], int, list[str]]:
            await ensure_streams(url)
            writer = await Client.connect(url, "pairing")
            try:
                for ev in first_batch():
                    await writer.js.publish(subject(ev), json.dumps(ev).encode())
            finally:
                await writer.close()
            reader = await Client.connect(url, "consumer")
            try:
                u = Usage("model")
                n = await asyncio.wait_for(read_usage(reader.nc, u, stall_s=5), 30)
                later = datetime.now(timezone.utc)
                empty = await asyncio.wait_for(read_usage(reader.nc, Usage("model"), since=later, stall_s=5), 30)
                return n, u.rows(), empty, reader.errors
            finally:
                await reader.close()

        n, rows, empty, errors = asyncio.run(main())
    assert n == 9 and rows[0]["group"] == "fake-model" and rows[0]["calls"] == 4
    assert empty == 0
    assert not [e for e in errors if "permissions violation" in e.lower()], errors
