"""`Puller` against a stand-in subscription (what the server sends is put on its queue by the
test): the order of messages and statuses a server can produce but a healthy run rarely
shows. A status behind messages: the messages first, then the error (nats-py's
``APIError.from_msg`` raises rather than returns). A burst whose ending status never comes
(a consumer leader gone, a message of an older request counted against it): returned after a
short grace, not held to the call's timeout. A quiet stream's first message with a backlog
behind it: the backlog asked for in the same call, not after a pause."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Callable

import nats.js.errors
import pytest

from bridge.nats.pull import Puller


class Msg:
    def __init__(self, data: bytes = b"", reply: str = "", headers: dict[str, str] | None = None) -> None:
        self.data, self.reply, self.headers, self._metadata = data, reply, headers, None

    @property
    def header(self) -> dict[str, str] | None:  # (nats-py's from_msg reads this name)
        return self.headers

    @property
    def metadata(self) -> Any:
        return self._metadata


def message(seq: int, pending: int = 0) -> Msg:
    return Msg(str(seq).encode(), f"$JS.ACK.S.c.1.{seq}.{seq}.1764543353000000000.{pending}")


def status(code: str, description: str = "") -> Msg:
    return Msg(headers={"Status": code, "Description": description})


class Stand:
    """nats-py's PullSubscription as far as `Puller` reads it; ``on_request(body)`` answers."""

    def __init__(self, on_request: Callable[[dict], None] | None = None) -> None:
        self._sub = self
        self._pending_queue: asyncio.Queue[Msg] = asyncio.Queue()
        self._pending_size = 0
        self._nc = self
        self._nms = "$JS.API.CONSUMER.MSG.NEXT.S.c"
        self._deliver = "_INBOX.x"
        self.is_closed = False
        self.requests: list[dict] = []
        self.on_request = on_request

    def put(self, *msgs: Msg) -> None:
        for m in msgs:
            self._pending_size += len(m.data)
            self._pending_queue.put_nowait(m)

    async def publish(self, subject: str, body: bytes, reply: str) -> None:
        self.requests.append(json.loads(body))
        if self.on_request is not None:
            self.on_request(self.requests[-1])


async def flowing() -> tuple[Stand, Puller, asyncio.AbstractEventLoop]:
    """A burst `Puller` past its first call: a quiet stream's one message (1) taken, so its
    next call asks with ``no_wait``."""
    stand = Stand()
    puller = Puller(stand, burst=True)
    loop = asyncio.get_running_loop()
    stand.on_request = lambda body: loop.call_later(0.01, stand.put, message(len(stand.requests)))
    assert [int(m.data) for m in await puller.fetch(16, timeout=1.0)] == [1]
    assert stand.requests == [{"batch": 1, "expires": stand.requests[0]["expires"]}], "quiet: one message asked"
    return stand, puller, loop


def test_a_status_behind_messages_comes_after_them() -> None:
    async def main() -> None:
        stand = Stand()
        puller = Puller(stand)
        stand.put(message(1), message(2), status("503"))
        got = await puller.fetch(16, timeout=1.0)
        assert [int(m.data) for m in got] == [1, 2]
        with pytest.raises(nats.js.errors.ServiceUnavailableError):
            await puller.fetch(16, timeout=1.0)

    asyncio.run(main())


def test_a_status_behind_a_burst_in_hand_comes_after_it() -> None:
    async def main() -> None:
        stand, puller, loop = await flowing()
        # flowing: a no_wait request; its burst comes in reads, then a status it ends with
        stand.on_request = lambda body: (loop.call_later(0.01, stand.put, message(2)),
                                         loop.call_later(0.02, stand.put, message(3)),
                                         loop.call_later(0.03, stand.put, status("503")))
        got = await puller.fetch(16, timeout=1.0)
        assert stand.requests[-1].get("no_wait") is True
        assert [int(m.data) for m in got] == [2, 3], "the messages in hand are not lost to the status"
        with pytest.raises(nats.js.errors.ServiceUnavailableError):
            await puller.fetch(16, timeout=1.0)

    asyncio.run(main())


def test_a_burst_whose_end_never_comes_is_returned_after_a_grace_not_the_timeout() -> None:
    async def main() -> None:
        stand, puller, loop = await flowing()
        stand.on_request = lambda body: loop.call_later(0.01, stand.put, message(2))  # and no 404/408
        started = time.monotonic()
        got = await puller.fetch(16, timeout=5.0)
        assert [int(m.data) for m in got] == [2]
        assert time.monotonic() - started < 2.0, "held to the call's timeout (5 s)"
        stand.on_request = None
        loop.call_later(0.01, stand.put, message(3))  # the same request's next message, later
        assert [int(m.data) for m in await puller.fetch(16, timeout=5.0)] == [3]

    asyncio.run(main())


def test_a_backlog_behind_a_quiet_streams_first_message_is_asked_for_at_once() -> None:
    async def main() -> None:
        stand = Stand()
        puller = Puller(stand, burst=True)
        loop = asyncio.get_running_loop()

        def answer(body: dict) -> None:
            if body.get("no_wait"):
                for seq in range(2, 2 + min(body["batch"], 5)):
                    loop.call_later(0.005, stand.put, message(seq, pending=6 - seq))
                loop.call_later(0.006, stand.put, status("408", "Request Timeout"))
            else:
                loop.call_later(0.005, stand.put, message(1, pending=5))  # one of six waiting

        stand.on_request = answer
        got = await puller.fetch(16, timeout=2.0)
        assert [int(m.data) for m in got] == [1, 2, 3, 4, 5, 6], "the five behind the first, in the same call"
        assert [r.get("no_wait", False) for r in stand.requests] == [False, True]
        assert stand.requests[0]["batch"] == 1 and stand.requests[1]["batch"] == 15

    asyncio.run(main())
