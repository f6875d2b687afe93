"""The per-role NATS users of deploy/nats/nats.conf and the chart's bundled server, for the
tests that connect as them: the passwords and users, each role's inbox, a real nats-server
started with a configuration (:func:`configured_server`: the sample, :func:`sample_nats_conf`,
or the chart's values, :func:`values_nats_conf`), a :class:`Client` that records the server's
permission errors, and the refusals it expects (:func:`expect_publish_refused`,
:func:`expect_api_refused`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest

from bridge.config import Settings
from bridge.nats.bootstrap import bootstrap as bridge_bootstrap
from tests.natsfixture import nats_server_binary
from tests.support.cli import free_port
from tests.support.chart import CHART_DIR, REPO, chart_max_file_store, load_values


SAMPLE_CONF = REPO / "deploy" / "nats" / "nats.conf"


PASSWORDS = {
    "AEP_BOOTSTRAP_PASSWORD": "bootstrap-pw",
    "AEP_MAPPER_PASSWORD": "mapper-pw",
    "AEP_PAIRING_PASSWORD": "pairing-pw",
    "AEP_SHIM_PASSWORD": "shim-pw",
    "AEP_CONSUMER_PASSWORD": "consumer-pw",
    "AEP_GATEWAY_0_PASSWORD": "gateway-0-pw",
    "AEP_GATE_PASSWORD": "gate-pw",
    "AEP_OPERATOR_PASSWORD": "operator-pw",
    "AEP_SHIM_CONTROL_PASSWORD": "shim-control-pw",
    "AEP_EXPORTER_PASSWORD": "exporter-pw",
    "AEP_RELAY_PASSWORD": "relay-pw",
}


USERS = {
    "bootstrap": ("aep-bootstrap", "bootstrap-pw"),
    "mapper": ("aep-mapper", "mapper-pw"),
    "pairing": ("aep-pairing", "pairing-pw"),
    "shim": ("hermes-shim", "shim-pw"),
    "consumer": ("aep-consumer", "consumer-pw"),
    "gateway-0": ("hermes-gateway-0", "gateway-0-pw"),
    "gate": ("aep-gate", "gate-pw"),
    "operator": ("aep-operator", "operator-pw"),
    "shim-control": ("hermes-shim-control", "shim-control-pw"),
    "exporter": ("aep-exporter", "exporter-pw"),
    "relay": ("aep-relay", "relay-pw"),
}


#: each role's own inbox prefix (bridge.nats.connection.ROLE_INBOX; the shim's names its
#: instance): its user may subscribe there only
INBOX = {
    "bootstrap": "_INBOX.aep-bootstrap", "mapper": "_INBOX.aep-mapper", "pairing": "_INBOX.aep-pairing",
    "consumer": "_INBOX.aep-consumer", "gate": "_INBOX.aep-gate", "operator": "_INBOX.aep-operator",
    "shim": "_INBOX.hermes.gateway-0", "shim-control": "_INBOX.hermes.gateway-0",
    "gateway-0": "_INBOX.hermes.gateway-0", "exporter": "_INBOX.aep-exporter",
    "relay": "_INBOX.aep-relay",
}


DENY_WAIT = 0.3  # seconds to wait for a refused request (the server refuses at once)


def values_merge(sinks: tuple[str, ...] = ("siem",)) -> dict:
    """`nats.config.merge` of values.yaml: what the chart adds to the bundled server's config,
    its templated items rendered for the exporter sinks ``sinks`` (`render_spreads`; by
    default the sample's one sink, siem)."""
    return render_spreads(load_values(CHART_DIR / "values.yaml")["nats"]["config"]["merge"], sinks)


def render_spreads(doc: Any, sinks: tuple[str, ...]) -> Any:
    """``doc`` with its templated values rendered as the NATS chart renders its values (its
    README, "Templating Values"): a ``{$tplYaml: <template>}`` replaced by what the template
    renders to, a ``{$tplYamlSpread: <template>}`` item of a list by the items it renders to.
    The templates are rendered by Helm's own engine (helm_python) with
    ``global.aepBridge.exporterSinks`` = ``sinks``, as a subchart sees the parent's globals."""
    import tempfile

    import helm_python as helm
    import yaml

    keys = ("$tplYaml", "$tplYamlSpread")
    templates: list[str] = []

    def templated(node: Any) -> str | None:
        return next(iter(node)) if isinstance(node, dict) and len(node) == 1 and next(iter(node)) in keys else None

    def collect(node: Any) -> None:
        if templated(node):
            templates.append(next(iter(node.values())))
        elif isinstance(node, dict):
            for v in node.values():
                collect(v)
        elif isinstance(node, list):
            for v in node:
                collect(v)

    collect(doc)
    if not templates:
        return doc
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "spreads"
        (root / "templates").mkdir(parents=True)
        (root / "Chart.yaml").write_text("apiVersion: v2\nname: spreads\nversion: 0.1.0\n")
        for i, text in enumerate(templates):
            (root / "templates" / f"t{i}.yaml").write_text(text)
        with helm.Chart.load(root) as chart:
            out = chart.render({"global": {"aepBridge": {"exporterSinks": list(sinks)}}}, name="t", namespace="t",
                               is_install=True)
    rendered = [yaml.safe_load(out[f"spreads/templates/t{i}.yaml"]) for i in range(len(templates))]
    n = iter(rendered)

    def render(node: Any) -> Any:
        if templated(node) == "$tplYaml":
            return next(n)
        if isinstance(node, dict):
            return {k: render(v) for k, v in node.items()}
        if isinstance(node, list):
            items: list[Any] = []
            for v in node:
                if templated(v) == "$tplYamlSpread":
                    items.extend(next(n) or [])
                else:
                    items.append(render(v))
            return items
        return node

    return render(doc)


def values_nats_conf(store_dir: Path, sinks: tuple[str, ...] = ("siem",)) -> str:
    """A nats.conf holding values.yaml's `nats.config.merge` (JSON is valid nats.conf),
    with JetStream on in ``store_dir`` and `nats.config.jetstream.merge` (sync_interval) in
    its jetstream block, where the NATS chart puts it. ``<< $VAR >>`` (a value the NATS chart leaves
    unquoted) becomes ``$VAR``, which nats-server reads from its environment. Its templated
    items (``$tplYamlSpread``: each exporter sink's deny lines) are rendered with the exporter
    sinks ``sinks`` (`render_spreads`)."""
    merge = load_values(CHART_DIR / "values.yaml")["nats"]["config"]["jetstream"].get("merge", {})
    # max_file_store as the NATS chart renders it (left out, nats-server takes 75 % of the free
    # disk, and the reservations fit or not by machine)
    jetstream = {"store_dir": str(store_dir), "max_file_store": chart_max_file_store(), **merge}
    conf = {"server_name": "aep-test-values", "jetstream": jetstream, **values_merge(sinks)}
    text, n = re.subn(r'"<< (\$[A-Z0-9_]+) >>"', r"\1", json.dumps(conf, indent=2))
    assert n == len(USERS) - 1, "one password variable per user of the merge block"
    assert "<<" not in text
    return text


def sample_nats_conf(store_dir: Path) -> str:
    """deploy/nats/nats.conf with its store directory (the pod's path) moved to ``store_dir``."""
    text, n = re.subn(r"(store_dir:\s*)/data\S*", lambda m: f'{m.group(1)}"{store_dir}"', SAMPLE_CONF.read_text())
    assert n == 1, "store_dir not found"
    return text


@contextlib.contextmanager
def configured_server(tmp: Path, conf_text: str, monitor_port: int | None = None) -> Iterator[str]:
    """A real nats-server started with ``conf_text`` (the role passwords in its environment)
    on free loopback ports (monitoring on ``monitor_port`` when given); yields its URL, its
    log at ``tmp/server.log``."""
    conf = tmp / "nats.conf"
    conf.write_text(conf_text)
    port = free_port()
    # Command-line flags override the file's listen address and ports.
    cmd = [nats_server_binary(), "-c", str(conf), "-a", "127.0.0.1", "-p", str(port), "-m", str(monitor_port or free_port())]
    log = open(tmp / "server.log", "wb")
    proc = subprocess.Popen(cmd, env={**os.environ, **PASSWORDS}, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                log.close()
                pytest.fail(f"nats-server did not start:\n{(tmp / 'server.log').read_text()}")
            time.sleep(0.02)
    try:
        yield f"nats://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:  # pragma: no cover
            proc.kill()
        log.close()


class Client:
    """A nats-py connection as one role, recording the server's permission errors."""

    def __init__(self, nc, errors: list[str]) -> None:
        self.nc, self.errors = nc, errors
        self.js = nc.jetstream(timeout=2)

    @classmethod
    async def connect(cls, url: str, role: str, password: str | None = None, inbox_prefix: str | None = None) -> "Client":
        user, pw = USERS[role]
        errors: list[str] = []

        async def on_error(exc: Exception) -> None:
            errors.append(str(exc))

        nc = await nats.connect(
            url, user=user, password=password or pw, error_cb=on_error,
            allow_reconnect=False, connect_timeout=2, inbox_prefix=inbox_prefix or INBOX[role],
        )
        return cls(nc, errors)

    async def refused(self, what: str, since: int = 0, wait: float = DENY_WAIT) -> bool:
        """True once the server reported a permissions violation naming `what` (among the
        errors from index ``since`` on)."""
        deadline = time.monotonic() + wait
        while True:
            if any("permissions violation" in e.lower() and what.lower() in e.lower() for e in self.errors[since:]):
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.005)

    async def close(self) -> None:
        await self.nc.close()


#: how long a refusal may take to be reported (it comes at once: this only bounds a failure)
REFUSAL_WAIT = 3.0


async def _refused_while(client: Client, coro, what: str) -> None:
    """Start ``coro`` (a publish or an API request the server must refuse), wait for the
    server's permissions violation naming ``what`` (a new one), then give the request up. It
    must not have succeeded: a refused message gets no answer. Waiting for the error rather
    than for the request's timeout makes each check milliseconds instead of a timeout
    (54 checks in test_nats_permissions.py alone)."""
    since = len(client.errors)
    task = asyncio.ensure_future(coro)
    try:
        refused = await client.refused(what, since=since, wait=REFUSAL_WAIT)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    assert task.cancelled() or task.exception() is not None, f"{what}: the request succeeded"
    assert refused, (what, client.errors)


async def expect_publish_refused(client: Client, subject: str) -> None:
    await _refused_while(client, client.js.publish(subject, b"x", timeout=REFUSAL_WAIT * 2), subject)


async def expect_api_refused(client: Client, coro, subject_part: str) -> None:
    await _refused_while(client, coro, subject_part)


def role_settings(url: str, role: str) -> "Settings":
    settings = Settings()
    settings.nats_url = url
    settings.nats_user, settings.nats_password = USERS[role]
    return settings


async def ensure_streams(url: str) -> None:
    c = await Client.connect(url, "bootstrap")
    try:
        await bridge_bootstrap(c.js, replicas=1)
    finally:
        await c.close()


# ---------------------------------------------------------------- a role's shim runs and reads (issue 44)


def as_user(role: str) -> dict[str, str]:
    """The shim settings of ``role``'s user."""
    user, password = USERS[role]
    return {"AEP_BRIDGE_NATS_USER": user, "AEP_BRIDGE_NATS_PASSWORD": password}


def role_hook(url: str, tmp: Path, role: str, instance: str, data: dict[str, Any], **extra: str) -> bytes:
    """One real hook run of ``instance`` as ``role``'s user: answered, nothing spooled."""
    from tests.support.shim import dumps, run_hook, shim_env

    env = shim_env(url, tmp / f"spool-{instance}", instance, DEADLINE_MS="3000")
    env.update(as_user(role), **extra)
    run = run_hook(dumps(data), env)
    assert run.returncode == 0, run.stderr
    assert not any(p.stat().st_size for p in (tmp / f"spool-{instance}").glob("*.spool")), run.stderr
    return run.stdout


async def read_as(url: str, role: str, stream: str, filt: str, settle: float = 0.5) -> list[Any]:
    """Every message of ``stream`` under ``filt``, as ``role`` (an ordered consumer)."""
    from bridge.nats.connection import ordered_subscribe

    user, password = USERS[role]
    nc = await nats.connect(url, user=user, password=password, inbox_prefix=INBOX[role])
    got: list[Any] = []
    try:
        sub = await ordered_subscribe(nc.jetstream(), filt, stream, deliver_policy=nats.js.api.DeliverPolicy.ALL)
        while True:
            try:
                got.append(await sub.next_msg(timeout=settle))
            except Exception:
                return got
    finally:
        await nc.close()


async def dlq_subjects(url: str) -> dict[str, int]:
    """BRIDGE_DLQ's message count per subject (as the bootstrap user)."""
    user, password = USERS["bootstrap"]
    nc = await nats.connect(url, user=user, password=password, inbox_prefix=INBOX["bootstrap"])
    try:
        return dict((await nc.jetstream().stream_info("BRIDGE_DLQ", subjects_filter=">")).state.subjects or {})
    finally:
        await nc.close()
