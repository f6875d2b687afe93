"""A service started while its cluster has no JetStream quorum waits for one instead of exiting
on nats-py's 5 s API timeout (`bridge.nats.connection.until_answered`): the cluster fault
suite's services start while a freshly (re)started cluster still elects. Real processes: a
three-node cluster with two nodes paused, the mapper and pairing as `aep-bridge` processes."""

from __future__ import annotations

import time

import pytest

from tests.clusterfixture import Cluster
from tests.support.services import Service, wait_for


@pytest.mark.slow
@pytest.mark.parametrize("role, ready", [("mapper", "mapper_ready"), ("pairing", "reader_started")])
def test_a_service_started_without_a_quorum_waits_for_one(nats_cluster: Cluster, tmp_path, role: str, ready: str) -> None:
    nats_cluster.bootstrap(replicas=3)
    first, *others = nats_cluster.nodes
    for node in others:
        node.pause()
    service = Service(role, first.url, tmp_path).start()
    try:
        wait_for(lambda: "jetstream_unanswered" in service.log(), 40, what=f"{role} waiting for JetStream")
        time.sleep(6.0)  # past nats-py's 5 s API timeout: before the fix the process had exited
        assert service.alive(), service.log()
        assert ready not in service.log()
        for node in others:
            node.resume()
        wait_for(lambda: ready in service.log(), 60, what=f"{role} bound once the quorum is back")
        assert service.alive(), service.log()
    finally:
        for node in others:
            node.resume()
        service.terminate()


class _Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict]] = []

    def warning(self, event: str, **kw) -> None:  # type: ignore[no-untyped-def]
        self.lines.append((event, kw))


def _calls(*outcomes):  # type: ignore[no-untyped-def]
    """An async callable that raises or returns each outcome in turn; counts its calls."""
    left = list(outcomes)
    made = []

    async def call():  # type: ignore[no-untyped-def]
        made.append(1)
        outcome = left.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    return call, made


def test_until_answered_waits_out_what_an_election_answers_and_nothing_else(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Unit: timeouts, no responders and a 503 are retried (with a log line each); anything else,
    a 503 'JetStream not enabled', or a request the server refused for permissions (nats-py
    only says so in ``last_error``) fails at once; past the deadline the last error stands."""
    import asyncio

    import nats.errors
    import nats.js.errors

    from bridge.nats import connection

    async def no_sleep(seconds: float) -> None:
        return None

    monkeypatch.setattr(connection.asyncio, "sleep", no_sleep)
    log = _Log()
    call, made = _calls(nats.errors.TimeoutError(), nats.errors.NoRespondersError(),
                        nats.js.errors.ServiceUnavailableError(), "bound")
    assert asyncio.run(connection.until_answered(call, what="bind", log=log)) == "bound"
    assert len(made) == 4 and [e for e, _ in log.lines] == ["jetstream_unanswered"] * 3

    call, made = _calls(nats.js.errors.NotFoundError(), "never")
    with pytest.raises(nats.js.errors.NotFoundError):
        asyncio.run(connection.until_answered(call, what="bind", log=_Log()))
    assert len(made) == 1, "a stream that does not exist is not waited for"

    call, made = _calls(nats.js.errors.ServiceUnavailableError(code=503, err_code=10039), "never")
    with pytest.raises(nats.js.errors.ServiceUnavailableError):
        asyncio.run(connection.until_answered(call, what="bind", log=_Log()))
    assert len(made) == 1, "JetStream not enabled is not waited for"

    class Refused:
        last_error = Exception("nats: permissions violation for publish to \"$JS.API.STREAM.INFO.HERMES_RAW\"")

    call, made = _calls(nats.errors.TimeoutError(), "never")
    with pytest.raises(nats.errors.TimeoutError):
        asyncio.run(connection.until_answered(call, what="bind", log=_Log(), nc=Refused()))
    assert len(made) == 1, "a refused request is not waited for"

    call, made = _calls(*[nats.errors.TimeoutError()] * 50)
    with pytest.raises(nats.errors.TimeoutError):
        asyncio.run(connection.until_answered(call, what="bind", log=_Log(), within_s=0.0))
    assert len(made) == 1, "past the deadline: the last error"
