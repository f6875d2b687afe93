"""`aep-bridge bootstrap`: every stream and bucket with its limits, idempotent, converging;
connection options from the settings; clear errors."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from bridge.config import Settings
from bridge.nats import streams as S
from bridge.nats.bootstrap import bootstrap
from bridge.nats.connection import NatsConnectError, connect_options, quick_connect, server_list
from tests.natsfixture import JetStreamClient
from tests.support.cli import cli

ROOT = Path(__file__).resolve().parents[2]
ALL = ["HERMES_RAW", "BRIDGE_MAPPED", "BRIDGE_DLQ", "AEP_EVENTS", "KV_aep_lanes", "KV_aep_pairing", "KV_aep_leases",
       "KV_aep_relay", "KV_aep_lane_facts", "OBJ_aep_checkpoints"]


def bridge_cli(*args: str, url: str, **env: str) -> subprocess.CompletedProcess[str]:
    return cli(*args, env={"AEP_BRIDGE_CONFIG": os.devnull, "AEP_BRIDGE_NATS_URL": url, **env}, timeout=60)


def test_bootstrap_creates_everything_with_explicit_limits(nats_factory) -> None:  # type: ignore[no-untyped-def]
    server = nats_factory()
    first = bridge_cli("bootstrap", url=server.url)
    assert first.returncode == 0, first.stderr
    assert [line.split()[:2] for line in first.stdout.splitlines()] == [[name, "created"] for name in ALL]
    js = JetStreamClient(server.url)
    try:
        raw = js.stream_info("HERMES_RAW").config
        assert raw.subjects == ["hermes.raw.>"]
        assert raw.max_age == 7 * 24 * 3600 and raw.max_bytes == 10 * 1024**3 and raw.duplicate_window == 120
        assert getattr(raw.retention, "value", raw.retention) == "limits"
        assert getattr(raw.storage, "value", raw.storage) == "file"
        assert js.stream_info("AEP_EVENTS").config.subjects == ["aep.hermes.>", "aep.ingest.>"]  # the relay's POST /events
        assert js.stream_info("BRIDGE_MAPPED").config.subjects == ["bridge.mapped.>"]
        assert js.stream_info("BRIDGE_DLQ").config.max_age == 30 * 24 * 3600
        for spec in (*S.STREAMS, *S.BUCKETS, *S.OBJECT_STORES):
            cfg = js.stream_info(spec.config().name).config
            assert cfg.max_age and cfg.max_age > 0 or spec not in S.STREAMS, f"{cfg.name} has no max age"
            assert cfg.max_bytes and cfg.max_bytes > 0, f"{cfg.name} has no max bytes"
            assert cfg.duplicate_window and cfg.duplicate_window > 0
        # the buckets are real KV buckets for nats-py, with their TTLs
        lanes = js.run(js.js.key_value(S.LANES_BUCKET))
        js.run(lanes.put("s.abc", b"1"))
        assert js.run(lanes.get("s.abc")).value == b"1"
        assert js.stream_info("KV_aep_lanes").config.max_age == 7 * 24 * 3600
        assert js.stream_info("KV_aep_leases").config.max_age == S.LEASE_TTL_S
        leases = js.run(js.js.key_value(S.LEASES_BUCKET))
        js.run(leases.create("p.0", b"me"))
        # the relay replicas' bucket takes per-message TTLs (their claims' renewals)
        assert js.stream_info("KV_aep_relay").config.allow_msg_ttl is True
        # the checkpoint bucket is an object store for nats-py: its stream is the one nats-py
        # itself creates (ADR-20), and an object of several chunks goes in and out
        from nats.js.api import ObjectMeta, ObjectMetaOptions

        checkpoints = js.stream_info("OBJ_aep_checkpoints").config
        assert checkpoints.subjects == ["$O.aep_checkpoints.C.>", "$O.aep_checkpoints.M.>"]
        assert checkpoints.allow_rollup_hdrs and checkpoints.allow_direct and not checkpoints.deny_delete
        assert getattr(checkpoints.discard, "value", checkpoints.discard) == "new"
        assert checkpoints.max_bytes == 1024**3 and not checkpoints.max_age
        store = js.run(js.js.object_store(S.CHECKPOINTS_BUCKET))
        blob = os.urandom(300_000)
        meta = ObjectMeta(name="p.0", options=ObjectMetaOptions(max_chunk_size=128 * 1024))
        assert js.run(store.put("p.0", blob, meta=meta)).chunks == 3
        assert js.run(store.get("p.0")).data == blob
        # the mapper's consumer definition is accepted by the server
        sub = js.run(js.js.pull_subscribe(S.RAW_SUBJECTS, durable=S.MAPPER_DURABLE, stream=S.HERMES_RAW,
                                          config=S.mapper_consumer_config()))
        info = js.run(sub.consumer_info())
        assert info.config.max_deliver == S.MAPPER_MAX_DELIVER_BACKSTOP and info.config.ack_wait == S.MAPPER_ACK_WAIT_S
    finally:
        js.close()
    again = bridge_cli("bootstrap", url=server.url)
    assert again.returncode == 0
    assert [line.split()[:2] for line in again.stdout.splitlines()] == [[name, "unchanged"] for name in ALL]


def test_bootstrap_converges_a_drifted_stream(nats_server, jetstream: JetStreamClient) -> None:  # type: ignore[no-untyped-def]
    from nats.js.api import StreamConfig

    cfg: StreamConfig = jetstream.stream_info("BRIDGE_DLQ").config
    cfg.max_age = 3600.0
    cfg.max_bytes = 1024 * 1024
    jetstream.run(jetstream.js.update_stream(cfg))
    obj: StreamConfig = jetstream.stream_info("OBJ_aep_checkpoints").config
    obj.max_bytes = 1024 * 1024
    jetstream.run(jetstream.js.update_stream(obj))
    results = jetstream.run(bootstrap(jetstream.js, Settings.from_env({"AEP_BRIDGE_CONFIG": os.devnull})))
    assert results["BRIDGE_DLQ"] == "updated" and results["OBJ_aep_checkpoints"] == "updated"
    assert all(v == "unchanged" for k, v in results.items() if k not in ("BRIDGE_DLQ", "OBJ_aep_checkpoints"))
    fixed = jetstream.stream_info("BRIDGE_DLQ").config
    assert fixed.max_age == 30 * 24 * 3600 and fixed.max_bytes == 1024**3
    assert jetstream.stream_info("OBJ_aep_checkpoints").config.max_bytes == 1024**3


def test_bootstrap_keeps_messages(nats_server, jetstream: JetStreamClient) -> None:  # type: ignore[no-untyped-def]
    jetstream.run(jetstream.js.publish("hermes.raw.keep.pre_tool_call", b"{}", headers={"Nats-Msg-Id": "keep-1"}))
    before = jetstream.stream_info().state.messages
    jetstream.bootstrap()
    assert jetstream.stream_info().state.messages == before


def test_bootstrap_reports_auth_failure_clearly(nats_factory) -> None:  # type: ignore[no-untyped-def]
    server = nats_factory('authorization { user: bob, password: right }')
    out = bridge_cli("bootstrap", url=server.url_with("bob:wrong"))
    assert out.returncode == 1
    assert "Authorization Violation" in out.stderr and "AEP_BRIDGE_NATS_USER" in out.stderr
    assert "wrong" not in out.stderr  # never print the secret
    ok = bridge_cli("bootstrap", url=server.url, AEP_BRIDGE_NATS_USER="bob", AEP_BRIDGE_NATS_PASSWORD="right")
    assert ok.returncode == 0, ok.stderr


def test_bootstrap_unreachable_fails_fast() -> None:
    from tests.support.cli import free_port

    out = bridge_cli("bootstrap", "--timeout", "1", url=f"nats://127.0.0.1:{free_port()}")
    assert out.returncode == 1 and "cannot connect to NATS" in out.stderr


def test_replicas_setting(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from bridge.nats.bootstrap import BootstrapError, default_replicas

    assert all(c.num_replicas == 3 for c in S.all_stream_configs(3))
    assert default_replicas(None, {"AEP_BRIDGE_CONFIG": os.devnull}) == 1
    assert default_replicas(None, {"AEP_BRIDGE_CONFIG": os.devnull, "AEP_BRIDGE_STREAM_REPLICAS": "3"}) == 3
    with pytest.raises(BootstrapError):
        default_replicas(None, {"AEP_BRIDGE_CONFIG": os.devnull, "AEP_BRIDGE_STREAM_REPLICAS": "7"})


# ---------------------------------------------------------------- connection options


def settings(**env: str) -> Settings:
    return Settings.from_env({"AEP_BRIDGE_CONFIG": os.devnull, **{"AEP_BRIDGE_" + k: v for k, v in env.items()}})


def test_connect_options_take_credentials_out_of_urls() -> None:
    opts = connect_options(settings(NATS_URL="nats://al%40ice:p%3Ass@h1:4222,nats://h2"))
    assert sorted(opts["servers"]) == ["nats://h1:4222", "nats://h2:4222"]  # from the one its name picks
    assert (opts["user"], opts["password"]) == ("al@ice", "p:ss")
    opts = connect_options(settings(NATS_URL="nats://tok@h1", NATS_USER="u", NATS_PASSWORD="p"))
    assert (opts["user"], opts["password"]) == ("u", "p") and "token" not in opts
    opts = connect_options(settings(NATS_URL="nats://u:p@h1", NATS_TOKEN="t"))
    assert opts["token"] == "t" and "user" not in opts
    opts = connect_options(settings(NATS_CREDS="/x.creds", NATS_USER="u"))
    assert opts["user_credentials"] == "/x.creds" and "user" not in opts
    assert connect_options(settings(NATS_NKEY_SEED="/seed"))["nkeys_seed"] == "/seed"
    tls = connect_options(settings(NATS_URL="tls://h:4443"))
    assert tls["servers"] == ["tls://h:4443"] and tls["tls"] is not None
    assert "tls" not in connect_options(settings())
    assert server_list(settings(NATS_URL="nats://[::1]:5")).urls == ["nats://[::1]:5"]


def test_connect_with_settings(nats_factory) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    server = nats_factory('authorization { token: "abc" }')

    async def go(s: Settings) -> bool:
        nc = await quick_connect(s, timeout=2)
        ok = nc.is_connected
        await nc.close()
        return ok

    assert asyncio.run(go(settings(NATS_URL=server.url, NATS_TOKEN="abc")))
    with pytest.raises(NatsConnectError, match="refused the credentials"):
        asyncio.run(go(settings(NATS_URL=server.url, NATS_TOKEN="nope")))


class _Refusing:
    """A JetStream context whose stream creates are refused ``refusals`` times with what a
    cluster that just started answered in CI (error 10005, "peer offline"), then succeed."""

    def __init__(self, refusals: int, description: str = "no suitable peers for placement, peer offline") -> None:
        from nats.js.errors import APIError

        self.refusals, self.created, self.description, self.api_error = refusals, [], description, APIError

    async def stream_info(self, name: str) -> Any:
        from nats.js.errors import NotFoundError

        raise NotFoundError(code=404, err_code=10059, description="stream not found")

    async def add_stream(self, config: Any) -> None:
        if self.refusals > 0:
            self.refusals -= 1
            raise self.api_error(code=500, err_code=10005, description=self.description)
        self.created.append(config.name)


def test_bootstrap_waits_while_the_cluster_calls_a_server_offline(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """CI: bootstrap on a cluster that had just started (every node answered /healthz) was refused
    "no suitable peers for placement, peer offline" and exited 2. A cluster coming up, or a pod of
    a rolling restart, is that state for seconds: bootstrap tries again for up to offline_wait_s,
    tells once that it waits, and gives up after it with the same error."""
    import asyncio

    from bridge.nats import bootstrap as B

    monkeypatch.setattr(B, "OFFLINE_RETRY_S", 0.01)
    told: list[str] = []
    js = _Refusing(3)
    out = asyncio.run(B.bootstrap(js, None, replicas=3, offline_wait_s=5.0, waiting=lambda e: told.append(str(e))))
    assert js.created == [c.name for c in S.all_stream_configs(3)] and set(out.values()) == {"created"}
    assert len(told) == 1 and "offline" in told[0] and "HERMES_RAW" in told[0]
    with pytest.raises(B.ReplicasError, match="offline") as info:  # never comes back: the error, after the wait
        asyncio.run(B.bootstrap(_Refusing(10**6), None, replicas=3, offline_wait_s=0.2))
    assert info.value.offline
    too_small = _Refusing(10**6, "no suitable peers for placement")  # a cluster too small: at once, no wait
    with pytest.raises(B.ReplicasError) as info:
        asyncio.run(B.bootstrap(too_small, None, replicas=5, offline_wait_s=60.0))
    assert not info.value.offline and too_small.refusals == 10**6 - 1


class _Unanswered(_Refusing):
    """A JetStream context of a cluster still electing its meta leader: stream lookups answer
    503 (or time out) ``refusals`` times, then the stream creates go through."""

    def __init__(self, refusals: int, error: Exception) -> None:
        super().__init__(0)
        self.unanswered, self.error = refusals, error

    async def stream_info(self, name: str) -> Any:
        if self.unanswered > 0:
            self.unanswered -= 1
            raise self.error
        return await super().stream_info(name)


@pytest.mark.parametrize("error", ["unavailable", "timeout"])
def test_bootstrap_waits_while_jetstream_does_not_answer(monkeypatch, error: str) -> None:  # type: ignore[no-untyped-def]
    """A cluster just started answers its first API requests with 503 or not at all until it has a
    meta leader: bootstrap waits that out like an offline peer (it was a traceback, exit 1)."""
    import asyncio

    import nats.errors
    from nats.js.errors import ServiceUnavailableError

    from bridge.nats import bootstrap as B

    def make() -> Exception:
        if error == "unavailable":
            return ServiceUnavailableError(code=503, description="JetStream system temporarily unavailable")
        return nats.errors.TimeoutError()

    monkeypatch.setattr(B, "OFFLINE_RETRY_S", 0.01)
    told: list[str] = []
    js = _Unanswered(3, make())
    out = asyncio.run(B.bootstrap(js, None, replicas=3, offline_wait_s=5.0, waiting=lambda e: told.append(str(e))))
    assert set(out.values()) == {"created"} and len(told) == 1
    with pytest.raises(type(make())):
        asyncio.run(B.bootstrap(_Unanswered(10**6, make()), None, replicas=3, offline_wait_s=0.2))


def test_bootstrap_command_says_jetstream_did_not_answer(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """`aep-bridge bootstrap` past its --wait on a cluster that never answers: one clear line, exit 1."""
    from nats.js.errors import ServiceUnavailableError

    from bridge.commands import bootstrap as C
    from bridge.nats import bootstrap as B
    from bridge.nats import connection

    class Conn:
        def jetstream(self, timeout: float = 5.0) -> Any:
            return _Unanswered(10**6, ServiceUnavailableError(code=503, description="JetStream system temporarily unavailable"))

        async def close(self) -> None:
            pass

    async def quick_connect(*args: Any, **kwargs: Any) -> Conn:
        return Conn()

    monkeypatch.setattr(connection, "quick_connect", quick_connect)
    monkeypatch.setattr(B, "OFFLINE_RETRY_S", 0.01)
    parser = __import__("argparse").ArgumentParser()
    C.register(parser.add_subparsers())
    args = parser.parse_args(["bootstrap", "--wait", "0.1"])
    assert C.cmd_bootstrap(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("aep-bridge bootstrap: JetStream did not answer") and "Traceback" not in err


def test_bootstrap_waits_out_a_503_on_create_and_names_jetstream_off(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A 503 can come from the create itself (a meta leader lost between lookup and create): waited
    out too, not a BootstrapError at once. JetStream not enabled (10039) is not waited for."""
    import asyncio

    from nats.js.errors import ServiceUnavailableError

    from bridge.nats import bootstrap as B

    class CreateUnavailable(_Refusing):
        def __init__(self, refusals: int, err_code: int = 10008) -> None:
            super().__init__(0)
            self.left, self.err_code = refusals, err_code

        async def add_stream(self, config: Any) -> None:
            if self.left > 0:
                self.left -= 1
                raise ServiceUnavailableError(code=503, err_code=self.err_code, description="unavailable")
            await super().add_stream(config)

    monkeypatch.setattr(B, "OFFLINE_RETRY_S", 0.01)
    js = CreateUnavailable(2)
    assert set(asyncio.run(B.bootstrap(js, None, replicas=1, offline_wait_s=5.0)).values()) == {"created"}
    off = CreateUnavailable(10**6, err_code=10039)
    with pytest.raises(ServiceUnavailableError):
        asyncio.run(B.bootstrap(off, None, replicas=1, offline_wait_s=60.0))
    assert off.left == 10**6 - 1, "asked once: JetStream off is not waited for"
