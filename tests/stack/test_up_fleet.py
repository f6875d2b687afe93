"""`aep-bridge up --fleet` (issue 41): the embedded server in a fleet's operator mode, so a
user can try issue and revoke on a laptop. The workers run with their roles' .creds (an event
an issued instance's shim publishes is mapped and paired onto AEP_EVENTS); revoking the
instance refuses its next hook run; nothing of the server's configuration changes."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path

import pytest

from tests.support.fleet import role_client
from tests.support.pasted import Expect, Long, Run, banner_commands, run_session
from tests.support.services import wait_for
from tests.support.shim import dumps, envelope, run_hook, shim_env
from tests.support.up import cli, running_up

pytestmark = pytest.mark.slow


def aep_events_of(fleet, url: str, instance: str) -> int:
    async def count() -> int:
        nc = await role_client(fleet, url, "consumer")
        try:
            info = await nc.jetstream().stream_info("AEP_EVENTS")
            return info.state.messages
        finally:
            await nc.close()
    return asyncio.run(count())


def test_up_fleet_issues_and_revokes_without_touching_the_server(tmp_path: Path) -> None:
    from bridge.nats.fleet import Fleet

    with running_up(tmp_path, "--fleet", "--no-follow") as (proc, env, info, tmp):
        fleet_dir = Path(info["fleet"]["dir"])
        url = info["nats_url"]
        conf = tmp / "state" / "aep-bridge" / "nats-fleet.conf"
        before = hashlib.sha256(conf.read_bytes()).hexdigest()
        out = tmp / "gw-up.env"
        issued = cli("fleet", "issue", "--dir", str(fleet_dir), "--instance", "gw-up", "--out", str(out), env=env)
        assert issued.returncode == 0, issued.stderr
        assert f"AEP_BRIDGE_NATS_URL={url}" in out.read_text()  # up recorded its server for issue
        hook_env = shim_env(url, tmp / "spool", "gw-up")
        hook_env["AEP_BRIDGE_CONFIG"] = str(out)
        for hook in ("on_session_start", "pre_llm_call"):
            run = run_hook(dumps(envelope(hook=hook, session="up-fleet")), hook_env)
            assert run.answered_empty_object and not run.stderr, run.stderr
        fleet = Fleet.load(fleet_dir)
        # the mapper and pairing, each with its role's creds, carried them onto AEP_EVENTS
        wait_for(lambda: aep_events_of(fleet, url, "gw-up") >= 2, 30, what="events on AEP_EVENTS")
        revoked = cli("fleet", "revoke", "--dir", str(fleet_dir), "--instance", "gw-up", env=env)
        assert revoked.returncode == 0 and "pushed account FLEET to 1 server(s)" in revoked.stdout, revoked.stderr
        run = run_hook(dumps(envelope(session="up-fleet")), hook_env)
        assert run.answered_empty_object and b"Authorization Violation" in run.stderr, run.stderr
        listed = cli("fleet", "list", "--dir", str(fleet_dir), "--json", env=env)
        assert [r["state"] for r in json.loads(listed.stdout)] == ["revoked"]
        assert hashlib.sha256(conf.read_bytes()).hexdigest() == before
        assert "Reloaded" not in (tmp / "state" / "aep-bridge" / "logs" / "nats-server.log").read_text()
        failures = fleet_banner_as_printed(tmp, tmp / "state" / "aep-bridge")
        assert not failures, "\n\n".join(failures)
    assert proc.returncode == 0


#: what `up --fleet`'s banner prints (keys: tests/support/pasted.banner_key), in its order
FLEET_BANNER = {
    # no event comes while it runs: it must connect with the consumer's .creds and keep following
    "aep-bridge tail": Long("", "follows the stream"),
    "aep-bridge fleet issue --dir STATE/fleet --instance NAME --out NAME.env": Expect(),
    "(set -a; . ./NAME.env; aep-bridge hermes install)": Expect(r"config +\S+config\.yaml: added \d+ event"),
    "aep-bridge fleet revoke --dir STATE/fleet --instance NAME": Expect(r"pushed account FLEET to 1 server"),
    "aep-bridge fleet list --dir STATE/fleet": Expect(r"gw-banner"),
}


def fleet_banner_as_printed(tmp: Path, state_dir: Path) -> list[str]:
    """Issue 38: every command of up --fleet's banner pasted into a fresh shell (PATH and HOME
    only, in a directory of its own) as printed, with the instance's NAME filled in."""
    commands = banner_commands((tmp / "up.out").read_text(), state_dir)
    runs = [Run(key, c.text.replace("NAME", "gw-banner"), FLEET_BANNER.get(key, Expect()), c.where) for key, c in commands]
    (tmp / "fresh" / "home").mkdir(parents=True)
    failures = run_session(runs, tmp / "fresh" / "home", tmp / "fresh", cwd=tmp / "fresh")
    printed = [key for key, _ in commands]
    return failures + [f"FLEET_BANNER lists `{key}`, which the banner no longer prints ({printed})"
                       for key in FLEET_BANNER if key not in printed]
