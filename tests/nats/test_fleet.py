"""`aep-bridge fleet` (issue 41): per-instance credentials in NATS's decentralized JWT auth,
checked against a real nats-server that trusts only the fleet's operator.

One server for the module (a fleet made by ``Fleet.init``, the server's config its
``resolver.conf`` and a JetStream block, the streams bootstrapped by the ``aep-bootstrap`` role's
``.creds``). Each test issues its own instances, so the tests do not depend on each other.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import time
from pathlib import Path

import nats
import pytest
from nats.errors import TimeoutError as NatsTimeout

from bridge.cli import main as cli
from bridge.config import Settings
from bridge.nats import jwt as J
from bridge.nats.connection import connect
from bridge.nats.fleet import Fleet, FleetError, parse_duration, permissions_from_conf, push, role_permissions
from tests.support.fleet import fleet_server, instance_client, issue_env, jwt_of, role_client
from tests.support.shim import dumps, envelope, run_hook

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fleet_nats(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("fleet")
    with fleet_server(tmp) as (fleet, server):
        yield fleet, server.url, tmp


def raw_count(fleet: Fleet, url: str, instance: str) -> int:
    async def count() -> int:
        nc = await role_client(fleet, url, "mapper")
        try:
            info = await nc.jetstream().stream_info("HERMES_RAW", subjects_filter=f"hermes.raw.{instance}.>")
            return sum((info.state.subjects or {}).values())
        finally:
            await nc.close()
    return asyncio.run(count())


def test_the_keys_directory_is_private_and_roles_have_the_sample_permissions(tmp_path: Path) -> None:
    fleet = Fleet.init(tmp_path / "keys")
    assert stat.S_IMODE(os.stat(fleet.dir).st_mode) == 0o700
    files = [p for p in fleet.dir.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"keys.json", "registry.json", "resolver.conf", "sys.creds", "aep-mapper.creds"}
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files), [oct(p.stat().st_mode) for p in files]
    # the role users carry exactly deploy/nats/nats.conf's rules (bridge/data/role_permissions.json)
    sample = permissions_from_conf((ROOT / "deploy" / "nats" / "nats.conf").read_text())
    assert role_permissions() == sample, ("regenerate bridge/data/role_permissions.json: python -c 'from "
                                          "bridge.nats.fleet import *; write_role_permissions(\"deploy/nats/nats.conf\")'")
    claims = J.decode(J.creds_jwt((fleet.creds_path("aep-mapper")).read_text()))
    assert sorted(claims["nats"]["pub"]["allow"]) == sample["aep-mapper"]["pub"]
    assert claims["iss"] == fleet.key("AEP").public  # signed by the bridge account itself


def test_a_tampered_jwt_does_not_verify() -> None:
    key = J.Key.new("account")
    token = J.encode(J.claims("account", key.public, "x", {}), key)
    assert J.decode(token)["sub"] == key.public
    head, payload, sig = token.split(".")
    forged = J.b64(json.dumps({**J.decode(token), "name": "y"}).encode())
    with pytest.raises(J.JwtError):
        J.decode(f"{head}.{forged}.{sig}")


def test_revocations_of_expired_credentials_leave_the_account(tmp_path: Path) -> None:
    """The account JWT is pushed in one message: a revocation is kept only while the revoked
    credential could still be used (until its exp)."""
    fleet = Fleet.init(tmp_path / "keys")
    _, short = fleet.issue("gw-short", expires_s=3600)
    _, lasting = fleet.issue("gw-long", expires_s=0)
    fleet.revoke("gw-short")
    fleet.revoke("gw-long")
    revoked = J.decode(fleet.account_jwt("FLEET"))["nats"]["revocations"]
    assert set(revoked) == {short.user, lasting.user}
    short.expires = int(time.time()) - 1  # its exp has passed
    assert set(J.decode(fleet.account_jwt("FLEET"))["nats"]["revocations"]) == {lasting.user}
    with pytest.raises(FleetError, match="already holds a fleet"):
        Fleet.init(tmp_path / "keys")
    with pytest.raises(FleetError, match="not a duration"):
        parse_duration("30 days")
    assert parse_duration("30d") == 30 * 86400 and parse_duration("never") == 0

def test_services_connect_with_their_role_creds(fleet_nats) -> None:
    """AEP_BRIDGE_NATS_CREDS (a standard .creds file) through the bridge's own connect()."""
    fleet, url, _ = fleet_nats
    settings = Settings(nats_url=url, nats_creds=str(fleet.creds_path("aep-mapper")))

    async def go() -> str:
        nc = await connect(settings, name="test", role="mapper")
        try:
            return (await nc.jetstream().stream_info("HERMES_RAW")).config.name
        finally:
            await nc.close()

    assert asyncio.run(go()) == "HERMES_RAW"


def test_an_instance_publishes_its_own_events_with_acks(fleet_nats) -> None:
    fleet, url, tmp = fleet_nats
    env = issue_env(fleet, "gw-pub", url, tmp / "pub")
    run = run_hook(dumps(envelope()), env)
    assert run.answered_empty_object, run.stderr
    assert b"spooled" not in run.stderr, run.stderr
    assert raw_count(fleet, url, "gw-pub") == 1


def test_an_instance_cannot_publish_as_another_read_raw_or_touch_buckets(fleet_nats) -> None:
    fleet, url, tmp = fleet_nats
    env_a = issue_env(fleet, "gw-a", url, tmp / "a")
    # A's credential, configured as instance B: refused by the server, counted, `{}` in time
    spoof = dict(env_a, AEP_BRIDGE_INSTANCE="gw-b")
    run = run_hook(dumps(envelope()), spoof)
    assert run.answered_empty_object and run.elapsed < 2.0, (run.elapsed, run.stderr)
    assert b"Permissions Violation" in run.stderr, run.stderr
    refused = (tmp / "a" / "gw-b.refused").read_text().splitlines()
    assert len(refused) == 1 and "Violation" in refused[0]
    assert raw_count(fleet, url, "gw-b") == 0
    assert (tmp / "a" / "gw-b.spool").stat().st_size > 0  # kept, not lost

    async def probe() -> dict[str, str]:
        errors: list[str] = []

        async def on_error(exc: Exception) -> None:
            errors.append(str(exc))

        nc = await instance_client(url, jwt_of(env_a), "gw-a", error_cb=on_error)
        out = {}
        try:
            js = nc.jetstream(timeout=1.0)
            ack = await js.publish("hermes.raw.gw-a.pre_tool_call", b"{}")
            out["own"] = ack.stream
            await nc.publish("hermes.raw.gw-b.pre_tool_call", b"{}")
            for what, call in (("stream_info", js.stream_info("HERMES_RAW")),
                               ("kv", js.key_value("aep_lanes"))):
                try:
                    await call
                    out[what] = "allowed"
                except (NatsTimeout, nats.js.errors.Error, nats.errors.Error) as exc:
                    out[what] = type(exc).__name__
            try:
                await nc.subscribe("hermes.raw.>")
                await nc.flush(1)
                await asyncio.sleep(0.3)
            except Exception:
                pass
        finally:
            await nc.close()
        out["errors"] = " | ".join(errors)
        return out

    out = asyncio.run(probe())
    assert out["own"] == "HERMES_RAW"
    assert 'publish to "hermes.raw.gw-b.pre_tool_call"' in out["errors"], out
    assert "$js.api.stream.info.hermes_raw" in out["errors"].lower() and out["stream_info"] != "allowed", out
    assert out["kv"] != "allowed", out
    assert 'subscription to "hermes.raw.>"' in out["errors"], out


def test_revocation_closes_the_live_connection_and_the_spool_drains_after_reissue(fleet_nats) -> None:
    fleet, url, tmp = fleet_nats
    env_a = issue_env(fleet, "gw-r", url, tmp / "r")
    env_b = issue_env(fleet, "gw-s", url, tmp / "s")
    assert run_hook(dumps(envelope()), env_a).answered_empty_object

    async def revoke_with_live() -> tuple[bool, float, list[str]]:
        events: list[str] = []

        async def on_error(exc: Exception) -> None:
            events.append(str(exc))

        async def on_closed() -> None:
            events.append("closed")

        nc = await instance_client(url, jwt_of(env_a), "gw-r", error_cb=on_error, closed_cb=on_closed,
                                   allow_reconnect=False)
        await nc.jetstream().publish("hermes.raw.gw-r.x", b"{}")
        fleet.revoke("gw-r")
        started = time.monotonic()
        await push(fleet, url)
        while not nc.is_closed and time.monotonic() - started < 5:
            await asyncio.sleep(0.02)
        return nc.is_closed, time.monotonic() - started, events

    closed, took, events = asyncio.run(revoke_with_live())
    assert closed and took < 5, (took, events)
    # A's next runs: refused, `{}` in time, spooled and counted; B unaffected
    for i in range(3):
        run = run_hook(dumps(envelope(session=f"r{i}")), env_a)
        assert run.answered_empty_object and run.elapsed < 2.0, run
        assert b"Authorization Violation" in run.stderr, run.stderr
    assert len((tmp / "r" / "gw-r.refused").read_text().splitlines()) == 3
    from bridge.shim.hook import Config, spool_for
    st = spool_for(Config(environ=env_a)).status()  # what `aep-bridge spool status` prints
    assert st["refused_runs"] == 3 and st["pending_records"] == 3
    assert run_hook(dumps(envelope()), env_b).answered_empty_object
    assert raw_count(fleet, url, "gw-s") == 1
    before = raw_count(fleet, url, "gw-r")
    assert before == 2  # the first run and the live connection's publish
    # re-issued: the spool drains with the next run; every spooled event lands exactly once
    env_a2 = issue_env(fleet, "gw-r", url, tmp / "r")
    run = run_hook(dumps(envelope(session="after")), env_a2)
    assert run.answered_empty_object and b"Violation" not in run.stderr, run.stderr
    assert raw_count(fleet, url, "gw-r") == before + 3 + 1
    assert (tmp / "r" / "gw-r.spool").stat().st_size == 0
    states = {(r["instance"], r["state"]) for r in fleet.listing()}
    assert ("gw-r", "revoked") in states and ("gw-r", "issued") in states


def test_an_expired_credential_is_refused_and_the_spool_drains_after_reissue(fleet_nats) -> None:
    fleet, url, tmp = fleet_nats
    env = issue_env(fleet, "gw-x", url, tmp / "x", expires_s=1)
    time.sleep(2.1)  # a JWT's exp is in whole seconds
    run = run_hook(dumps(envelope()), env)
    assert run.answered_empty_object and b"Violation" in run.stderr, run.stderr
    assert raw_count(fleet, url, "gw-x") == 0
    assert [r["state"] for r in fleet.listing() if r["instance"] == "gw-x"] == ["expired"]
    env2 = issue_env(fleet, "gw-x", url, tmp / "x")
    assert run_hook(dumps(envelope(session="later")), env2).answered_empty_object
    assert raw_count(fleet, url, "gw-x") == 2


def test_hermes_install_takes_the_issued_settings(fleet_nats, tmp_path: Path) -> None:
    """`fleet issue`'s file, as `hermes install` reads it, becomes the installed shim's settings:
    the hook run with `--config` publishes as the instance."""
    from bridge.config import read_env_file
    from bridge.hermes.install import ENV_FILENAME, install

    fleet, url, _ = fleet_nats
    issued = tmp_path / "gw-inst.env"
    issued.write_text(fleet.issue("gw-inst", urls=url)[0])
    home = tmp_path / "hermes"
    home.mkdir()
    install(home, settings={**read_env_file(issued), "AEP_BRIDGE_SPOOL_DIR": str(tmp_path / "spool")})
    assert f"AEP_BRIDGE_NATS_JWT={jwt_of({'AEP_BRIDGE_CONFIG': str(issued)})}" in (home / ENV_FILENAME).read_text()
    run = run_hook(dumps(envelope()), {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path)},
                   args=["--config", str(home / ENV_FILENAME)])
    assert run.answered_empty_object and not run.stderr, run.stderr
    assert raw_count(fleet, url, "gw-inst") == 1

def test_the_commands_issue_list_revoke_and_push(fleet_nats, tmp_path: Path, capsys) -> None:
    fleet, url, _ = fleet_nats
    out = tmp_path / "gw-cli.env"
    assert cli(["fleet", "issue", "--dir", str(fleet.dir), "--instance", "gw-cli", "--expires", "2h",
                "--out", str(out), "--nats", url]) == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    text = out.read_text()
    assert "AEP_BRIDGE_INSTANCE=gw-cli" in text and f"AEP_BRIDGE_NATS_URL={url}" in text
    claims = J.decode(next(ln.split("=", 1)[1] for ln in text.splitlines() if ln.startswith("AEP_BRIDGE_NATS_JWT=")))
    assert claims["name"] == "gw-cli" and 7100 < claims["exp"] - claims["iat"] <= 7200
    capsys.readouterr()
    assert cli(["fleet", "list", "--dir", str(fleet.dir), "--json"]) == 0
    rows = [r for r in json.loads(capsys.readouterr().out) if r["instance"] == "gw-cli"]
    assert [r["state"] for r in rows] == ["issued"]
    assert cli(["fleet", "revoke", "--dir", str(fleet.dir), "--instance", "gw-cli", "--nats", url]) == 0
    assert "pushed account FLEET to 1 server(s)" in capsys.readouterr().out
    assert cli(["fleet", "list", "--dir", str(fleet.dir)]) == 0
    assert "revoked" in capsys.readouterr().out
    assert cli(["fleet", "revoke", "--dir", str(fleet.dir), "--instance", "nobody", "--nats", url]) == 2


def test_doctor_names_an_expired_or_revoked_credential(fleet_nats) -> None:
    from bridge.hermes.doctor import credential_checks
    from bridge.shim.hook import Config

    fleet, url, tmp = fleet_nats
    env = issue_env(fleet, "gw-doc", url, tmp / "doc")
    checks = credential_checks(Config(environ=env))
    assert [c.ok for c in checks] == [True] and "accepted, expires in 30.0 days" in checks[0].what, checks
    # expired: read from the JWT itself (the clock moved past exp)
    late = credential_checks(Config(environ=env), now=time.time() + 31 * 86400)
    assert not late[0].ok and "EXPIRED" in late[0].what and "fleet issue --instance gw-doc" in late[0].what
    # revoked: the server refuses it; the shim's recorded refusals are named too
    fleet.revoke("gw-doc")
    asyncio.run(push(fleet, url))
    run_hook(dumps(envelope()), env)
    checks = credential_checks(Config(environ=env))
    assert not checks[0].ok and "REFUSED" in checks[0].what and "Authorization Violation" in checks[0].what, checks
    assert "refused 1 time(s)" in checks[1].what


def test_the_system_user_counts_refused_instances(fleet_nats) -> None:
    """The servers' auth-error advisories name the refused instance's JWT: `fleet watch` counts
    them per instance and reason (the services, in account AEP, cannot see them)."""
    from bridge.nats.fleet import watch_refusals

    fleet, url, tmp = fleet_nats
    short = issue_env(fleet, "gw-w-exp", url, tmp / "w", expires_s=1)
    gone = issue_env(fleet, "gw-w-rev", url, tmp / "w")
    fleet.revoke("gw-w-rev")
    asyncio.run(push(fleet, url))
    seen: list[tuple[str, str]] = []

    async def go() -> None:
        stop, ready = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(watch_refusals(fleet, url, lambda i, r, s: seen.append((i, r)), stop, ready))
        await asyncio.wait_for(ready.wait(), 5)
        await asyncio.to_thread(run_hook, dumps(envelope()), gone)
        await asyncio.sleep(max(0.0, J.decode(jwt_of(short))["exp"] + 1.1 - time.time()))  # exp: whole seconds
        await asyncio.to_thread(run_hook, dumps(envelope()), short)
        deadline = time.monotonic() + 5
        while len(seen) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        stop.set()
        await task

    asyncio.run(go())
    assert seen == [("gw-w-rev", "revoked"), ("gw-w-exp", "expired")], seen


def test_the_control_scope_crosses_accounts_both_ways(fleet_nats) -> None:
    """`fleet issue --control`: the gate (account AEP) reaches the shim's inbox (FLEET exports it)
    and gets its confirmation; the shim pulls instructions (AEP exports the pull) and gets the
    gate's answer. An observe-only instance can do neither."""
    fleet, url, tmp = fleet_nats
    ctl = issue_env(fleet, "gw-ctl", url, tmp / "ctl", control=True)
    obs = issue_env(fleet, "gw-obs", url, tmp / "obs")

    async def go() -> dict[str, object]:
        c = await instance_client(url, jwt_of(ctl), "gw-ctl")
        o = await instance_client(url, jwt_of(obs), "gw-obs")
        gate = await role_client(fleet, url, "gate")
        out: dict[str, object] = {}
        try:
            async def confirm(msg) -> None:
                try:
                    await msg.respond(b"confirmed")
                except Exception:  # nats-py refuses nothing here; the server does
                    pass

            await c.subscribe("_INBOX.hermes.gw-ctl.x1.g", cb=confirm)
            await o.subscribe("_INBOX.hermes.gw-obs.x1.g", cb=confirm)

            async def serve(msg) -> None:
                await msg.respond(b'{"context":"steer"}')

            await gate.subscribe("aep.gate.instruct.*", queue="aep-gate", cb=serve)
            for nc in (c, o, gate):
                await nc.flush()
            for name, nc, subject in (("release_ctl", gate, "_INBOX.hermes.gw-ctl.x1.g"),
                                      ("release_obs", gate, "_INBOX.hermes.gw-obs.x1.g"),
                                      ("pull_ctl", c, "aep.gate.instruct.s1"), ("pull_obs", o, "aep.gate.instruct.s1")):
                try:
                    out[name] = (await nc.request(subject, b"{}", timeout=1.0)).data
                except (NatsTimeout, nats.errors.NoRespondersError):
                    out[name] = None
        finally:
            for nc in (c, o, gate):
                await nc.close()
        return out

    assert asyncio.run(go()) == {"release_ctl": b"confirmed", "release_obs": None,
                                 "pull_ctl": b'{"context":"steer"}', "pull_obs": None}


def test_a_revocation_survives_a_server_restart(tmp_path: Path) -> None:
    """The servers keep pushed accounts in their resolver's directory and preload only the system
    account: a preloaded FLEET (the state of `fleet init`) would replace the revoking JWT at the
    next start and let the revoked instance in again."""
    with fleet_server(tmp_path) as (fleet, server):
        env = issue_env(fleet, "gw-restart", server.url, tmp_path / "spool")
        assert not run_hook(dumps(envelope()), env).stderr
        fleet.revoke("gw-restart")
        asyncio.run(push(fleet, server.url))
        server.stop()
        server.start()
        run = run_hook(dumps(envelope()), env)
        assert run.answered_empty_object and b"Authorization Violation" in run.stderr, run.stderr


def test_a_role_credential_is_reissued_and_the_old_one_revoked(fleet_nats) -> None:
    """`fleet roles --role aep-consumer`: a stolen role credential ends like an instance's."""
    fleet, url, _ = fleet_nats
    old = fleet.creds_path("aep-consumer").read_text()

    async def info(creds_text: str, path: Path, role: str = "consumer", stream: str = "AEP_EVENTS") -> str:
        path.write_text(creds_text)
        path.chmod(0o600)
        try:
            nc = await nats.connect(url, user_credentials=str(path), inbox_prefix=f"_INBOX.aep-{role}",
                                    connect_timeout=2, max_reconnect_attempts=0, allow_reconnect=False)
        except Exception as exc:  # nats-py: the server's refusal
            return f"refused: {type(exc).__name__}"
        try:
            return (await nc.jetstream().stream_info(stream)).config.name
        finally:
            await nc.close()

    tmp = fleet.dir.parent
    assert asyncio.run(info(old, tmp / "old.creds")) == "AEP_EVENTS"
    assert fleet.reissue_roles(["aep-consumer"]) == ["aep-consumer"]
    asyncio.run(push(fleet, url, ("AEP",)))
    assert asyncio.run(info(old, tmp / "old.creds")).startswith("refused")
    assert asyncio.run(info(fleet.creds_path("aep-consumer").read_text(), tmp / "new.creds")) == "AEP_EVENTS"
    # the other roles keep working
    assert asyncio.run(info(fleet.creds_path("aep-mapper").read_text(), tmp / "mapper.creds", "mapper",
                            "HERMES_RAW")) == "HERMES_RAW"
    with pytest.raises(FleetError, match="unknown role"):
        fleet.reissue_roles(["aep-nobody"])


def test_rotating_the_signing_keys_keeps_old_credentials_until_retired(fleet_nats) -> None:
    """Retiring the old key ends every credential it signed (this module's earlier ones too: each
    test issues its own credentials when it starts, so none spans it)."""
    fleet, url, tmp = fleet_nats
    old = issue_env(fleet, "gw-rot-old", url, tmp / "rot")
    fleet.rotate()
    asyncio.run(push(fleet, url))
    new = issue_env(fleet, "gw-rot-new", url, tmp / "rot")
    assert J.decode(jwt_of(new))["iss"] != J.decode(jwt_of(old))["iss"]
    for env in (old, new):  # both valid while the old key is retiring
        run = run_hook(dumps(envelope()), env)
        assert run.answered_empty_object and not run.stderr, run.stderr

    async def retire_with_live() -> bool:
        nc = await instance_client(url, jwt_of(old), "gw-rot-old", allow_reconnect=False)
        retired = fleet.retire()
        names = {r.instance for r in retired}  # every credential the old key signed (this module's too)
        assert "gw-rot-old" in names and "gw-rot-new" not in names
        await push(fleet, url)
        started = time.monotonic()
        while not nc.is_closed and time.monotonic() - started < 5:
            await asyncio.sleep(0.02)
        return nc.is_closed

    assert asyncio.run(retire_with_live())
    assert b"Authorization Violation" in run_hook(dumps(envelope()), old).stderr
    run = run_hook(dumps(envelope()), new)
    assert run.answered_empty_object and not run.stderr, run.stderr
