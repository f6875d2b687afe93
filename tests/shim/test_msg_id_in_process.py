"""JetStream's 409 "duplicate message id is in process" (err_code 10158) is not a rejection
(issue 42): the first publish with that Nats-Msg-Id is still being proposed, and that proposal
can be lost with its leader. The partition test (tests/cluster/test_partitions.py) lost 19
events of one instance this way: spooled at a link's cut, answered 10158 on replay, set aside
in ``.rejected`` and never replayed. The shim keeps such a record (transient), the services
retry it (an outage)."""

from __future__ import annotations

import json

from nats.js.errors import APIError

from bridge.nats.connection import outage
from bridge.shim import hook


def answer(code: int, err_code: int, description: str) -> bytes:
    return json.dumps({"error": {"code": code, "err_code": err_code, "description": description}}).encode()


def test_in_process_is_transient_for_the_shim():
    assert hook._ack_outcome(None, answer(409, 10158, "duplicate message id is in process")) is False
    # a real rejection stays one (set aside), an ack stays an ack
    assert isinstance(hook._ack_outcome(None, answer(400, 10054, "maximum message size exceeded")), str)
    assert hook._ack_outcome(None, b'{"stream":"HERMES_RAW","seq":7,"duplicate":true}') is True


def test_in_process_is_an_outage_for_the_services():
    assert outage(APIError(code=409, err_code=10158, description="duplicate message id is in process"))
    assert not outage(APIError(code=400, err_code=10054, description="maximum message size exceeded"))
