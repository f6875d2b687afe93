"""What the mapper's first look at a raw message makes of hostile bytes (issue 13, the hostile mix).

`decode_raw` is the gate: anything it cannot decode is ``bad_raw``, dead-lettered at once,
never an exception the mapper retries until ``max_deliver`` (which hides the cause and costs
the backoff of every redelivery)."""

from __future__ import annotations

import pytest

from bridge.core.envelope import EnvelopeError, check_raw, decode_raw

ULID = "01J9ZQ0000000000000000000A"


def test_100k_deep_json_in_a_raw_message_is_bad_raw():
    deep = b'{"v":1,"id":"%s","instance":"gen","ts":1,"hook":"x","envelope":' % ULID.encode()
    deep += b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(EnvelopeError) as err:
        decode_raw(deep)
    assert err.value.reason == "bad_raw"


@pytest.mark.parametrize("body", [
    b'{"v":1,"id":"%s","instance":"gen","ts":-1,"hook":"x","envelope":{}}' % ULID.encode(),
    b'{"v":1,"id":"%s","instance":"gen","ts":1208925819614629174706176,"hook":"x","envelope":{}}' % ULID.encode(),
    b'{"v":1,"id":"not-a-ulid","instance":"gen","ts":1,"hook":"x","envelope":{}}',
    b'{"v":2,"id":"%s","instance":"gen","ts":1,"hook":"x","envelope":{}}' % ULID.encode(),
], ids=["ts=-1", "ts=2**80", "id not a ULID", "v=2"])
def test_raw_fields_the_shim_cannot_write_are_bad_raw(body):
    with pytest.raises(EnvelopeError) as err:
        check_raw(decode_raw(body))
    assert err.value.reason == "bad_raw"
