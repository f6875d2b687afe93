"""Issue 44 item 1: who can reach whose JetStream consumers, enforced by a real nats-server.

For every user of ``deploy/nats/nats.conf`` and of the chart's ``nats.config.merge``, every
JetStream operation on a consumer (pull ``MSG.NEXT``, ack ``$JS.ACK``, create, by name and by
the nameless ``CREATE.<stream>`` whose body names it, delete, info) is tried on every role's
durable, and a new consumer on every stream (read). The matrix is printed; a cell that is not
the role's own must be empty, and a stream is readable by its readers only (``OWNERS``,
``READERS``). Before the fix the SIEM role (``aep-consumer``), the relay and the exporter
could pull, ack and delete the gate's ``gate-commands`` (an operator's deny never arrived),
and the nameless create let any of them rewrite any durable. deploy/README.md's table
"Consumers per role" is generated from the same data (``readme_table``) and checked here.

The durables are created (as the services name them) by a test-only admin user added to the
configuration; the roles are the configuration's own users."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

from tests.support.chart import REPO
from tests.support.nats_probe import ADMIN, FILTERS, Prober, with_admin
from tests.support.nats_roles import (PASSWORDS, USERS, configured_server, ensure_streams, sample_nats_conf,
                                      values_nats_conf)


#: every role's durables, (stream, name) -> the user that owns it (the names the services use:
#: the mapper's and gate's on HERMES_RAW, the gate's commands and a replicas-1 exporter sink
#: `siem` on AEP_EVENTS, a pairing partition, a partitioned sink's partition on AEP_EXPORT)
OWNERS = {
    ("HERMES_RAW", "mapper"): "aep-mapper",
    ("HERMES_RAW", "gate"): "aep-gate",
    ("AEP_EVENTS", "gate-commands"): "aep-gate",
    ("AEP_EVENTS", "export-siem"): "aep-exporter",
    ("BRIDGE_MAPPED", "pairing-3"): "aep-pairing",
    ("AEP_EXPORT", "export-siem-p0"): "aep-exporter",
}
#: who may create consumers of its own (any new name) on each stream
READERS = {
    "HERMES_RAW": {"aep-mapper"},
    "AEP_EVENTS": {"aep-consumer", "aep-relay", "aep-exporter"},
    "BRIDGE_MAPPED": {"aep-pairing"},
    "AEP_EXPORT": {"aep-exporter"},
}
OPS = ("pull", "ack", "create", "delete", "info")
#: what a role may do on another role's durable: pairing reads the info of the mapper's durable
#: (its ack floor: the mapper's floor its ticks carry, bridge/core/pairing.py rule 3); nothing else
GRANTED = {("aep-pairing", "HERMES_RAW", "mapper"): {"info"}}


@pytest.fixture(scope="module", params=["sample", "values"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp(f"nats-matrix-{request.param}")
    text = sample_nats_conf(tmp / "js") if request.param == "sample" else values_nats_conf(tmp / "js")
    with configured_server(tmp, with_admin(text, request.param)) as url:
        asyncio.run(ensure_streams(url))
        yield {"url": url, "kind": request.param}


async def setup_durables(url: str) -> None:
    """Every durable of OWNERS as its service makes it (a pull consumer, explicit acks), one
    message in each stream, so a pull has something to take."""
    from nats.js.api import AckPolicy, ConsumerConfig

    nc = await nats.connect(url, user=ADMIN[0], password=ADMIN[1])
    js = nc.jetstream(timeout=3)
    try:
        try:
            await js.stream_info("AEP_EXPORT")
        except nats.js.errors.NotFoundError:
            await js.add_stream(name="AEP_EXPORT", subjects=["export.>"])
        for subject in ("hermes.raw.gw.pre_tool_call", "aep.hermes.s1.control.attention.respond",
                        "bridge.mapped.3.s1", "export.siem.0.aep.hermes.s1.session.started"):
            await js.publish(subject, b"{}")
        for (stream, name), _ in OWNERS.items():
            await js.add_consumer(stream, ConsumerConfig(durable_name=name, name=name, ack_policy=AckPolicy.EXPLICIT,
                                                         ack_wait=30, filter_subject=FILTERS[stream]))
    finally:
        await nc.close()





async def matrix(url: str, roles: list[str]) -> dict[str, dict[str, set[str] | bool]]:
    out: dict[str, dict[str, set[str] | bool]] = {}
    for role in roles:
        await setup_durables(url)  # again: a delete that got through removed one
        p = await Prober.connect(url, role)
        try:
            row: dict[str, set[str] | bool] = {}
            for (stream, name) in OWNERS:
                row[f"{stream}/{name}"] = await p.try_ops(stream, name)
            for stream in READERS:
                row[f"read {stream}"] = await p.can_read(stream)
            out[USERS[role][0]] = row
        finally:
            await p.close()
    return out


def render(result: dict[str, dict[str, set[str] | bool]]) -> str:
    cols = [f"{s}/{n}" for s, n in OWNERS] + [f"read {s}" for s in READERS]
    width = max(len(u) for u in result) + 2
    lines = [" " * width + " | ".join(f"{c:>{max(len(c), 8)}}" for c in cols)]
    for user, row in result.items():
        cells = []
        for c in cols:
            v = row[c]
            text = ("yes" if v else "-") if isinstance(v, bool) else ("".join(o[0].upper() for o in OPS if o in v) or "-")
            owner = OWNERS.get(tuple(c.split("/")))  # type: ignore[arg-type]
            cells.append(f"{(text + ('*' if owner == user else '')):>{max(len(c), 8)}}")
        lines.append(f"{user:<{width}}" + " | ".join(cells))
    return "\n".join(lines) + "\n(P pull, A ack, C create, D delete, I info; * the role's own durable)"


def test_no_role_reaches_another_roles_consumers(server: dict) -> None:
    roles = [r for r in USERS if server["kind"] == "sample" or r != "gateway-0"]
    result = asyncio.run(asyncio.wait_for(matrix(server["url"], roles), 240))
    print(f"\n{server['kind']}:\n{render(result)}")
    wrong = []
    for user, row in result.items():
        for (stream, name), owner in OWNERS.items():
            if owner != user and row[f"{stream}/{name}"] - GRANTED.get((user, stream, name), set()):  # type: ignore[operator]
                wrong.append(f"{user} reaches {owner}'s {stream}/{name}: {sorted(row[f'{stream}/{name}'])}")
        for stream, readers in READERS.items():
            if row[f"read {stream}"] != (user in readers):
                wrong.append(f"{user} {'reads' if row[f'read {stream}'] else 'cannot read'} {stream}")
    # each owner can still use its durables (pull and info at least)
    for (stream, name), owner in OWNERS.items():
        if not {"pull", "info"} <= result[owner][f"{stream}/{name}"]:  # type: ignore[operator]
            wrong.append(f"{owner} cannot use its own {stream}/{name}: {sorted(result[owner][f'{stream}/{name}'])}")
    assert not wrong, "\n".join(wrong) + "\n" + render(result)


# ---------------------------------------------------------------- deploy/README.md's table

README = REPO / "deploy" / "README.md"
BEGIN, END = "<!-- consumers-per-role: generated from OWNERS and READERS in tests/deploy/test_nats_permissions_matrix.py -->", "<!-- /consumers-per-role -->"


#: the README shows the names' patterns (the matrix tries one of each)
SHOWN = {"export-siem": "export-<sink>", "pairing-3": "pairing-<n>", "export-siem-p0": "export-<sink>-p<n>"}


def readme_table() -> str:
    """deploy/README.md's "Consumers per role" table, from OWNERS, READERS and GRANTED."""
    users = sorted({name for name, _ in USERS.values()})
    rows = ["| role (user) | its durables | new consumers of its own on | any other role's durable |", "|---|---|---|---|"]
    for user in users:
        own = [f"`{SHOWN.get(n, n)}` ({s})" for (s, n), o in OWNERS.items() if o == user]
        reads = [s for s, r in READERS.items() if user in r]
        granted = [f"{'/'.join(sorted(ops))} of `{n}` ({s})" for (u, s, n), ops in GRANTED.items() if u == user]
        other = (f"{', '.join(granted)} only (its ack floor); no pull, ack, create or delete" if granted
                 else "none: no pull, ack, create, delete or info")
        rows.append(f"| `{user}` | {', '.join(own) or 'none'} | {', '.join(reads) or 'none'} | {other} |")
    return "\n".join(rows)


def test_the_readme_table_is_the_matrix_data() -> None:
    text = README.read_text()
    assert BEGIN in text and END in text, f"deploy/README.md has no generated table between {BEGIN} and {END}"
    block = text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip()
    assert block == readme_table(), "deploy/README.md's consumers table differs; generated:\n" + readme_table()


def test_every_user_is_in_the_matrix() -> None:
    assert set(PASSWORDS) and {o for o in OWNERS.values()} <= {name for name, _ in USERS.values()}
    assert set(READERS) | {s for s, _ in OWNERS} == set(FILTERS)


# ---------------------------------------------------------------- a durable that disappears


def test_the_gate_recreates_a_durable_that_disappears(tmp_path: Path) -> None:
    """Deleted by hand (no role but its owner may now), the gate's gate-commands comes back:
    before the fix the gate looped on fetch_failed for ever, /healthz 200, and every command
    went unanswered. Now it notices, is unhealthy until the durable is back, creates it again
    and an operator's command is answered."""
    from bridge.commands.control import build_command, send_command
    from bridge.core import control as C
    from tests.support.nats_roles import role_settings
    from tests.support.services import Service, wait_for

    text = with_admin(sample_nats_conf(tmp_path / "js"), "sample")
    with configured_server(tmp_path, text) as url:
        asyncio.run(ensure_streams(url))
        user, password = USERS["gate"]
        gate = Service("gate", url, tmp_path, env={"AEP_BRIDGE_NATS_USER": user, "AEP_BRIDGE_NATS_PASSWORD": password,
                                                   "AEP_HERMES_CONTROL": "1", "AEP_INSTRUCT": "1"}).start()
        try:
            wait_for(lambda: "gate_ready" in gate.log(), 20, what=f"the gate ready:\n{gate.log()}")

            async def admin(action: str) -> bool:
                nc = await nats.connect(url, user=ADMIN[0], password=ADMIN[1])
                try:
                    js = nc.jetstream(timeout=2)
                    if action == "delete":
                        return await js.delete_consumer("AEP_EVENTS", "gate-commands")
                    try:
                        await js.consumer_info("AEP_EVENTS", "gate-commands")
                        return True
                    except nats.js.errors.NotFoundError:
                        return False
                finally:
                    await nc.close()

            assert asyncio.run(admin("delete"))
            wait_for(lambda: "consumer_gone" in gate.log(), 15, what=f"the gate to notice:\n{gate.log()}")
            wait_for(lambda: asyncio.run(admin("exists")), 15, what=f"gate-commands back:\n{gate.log()}")
            assert 'aep_bridge_gate_consumers_recreated_total{consumer="gate-commands"} 1.0' in gate.metrics_text()
            # healthy again, and ready, on a quiet stream (no message needed to say so)
            from tests.support.services import http_json
            port = gate.metrics_port()
            wait_for(lambda: http_json(f"http://127.0.0.1:{port}/healthz")[0] == 200
                     and http_json(f"http://127.0.0.1:{port}/readyz")[0] == 200, 10, what="/healthz and /readyz 200")
            # a command reaches it again (an unknown session: rejected, but answered)
            kind, _ = asyncio.run(send_command(role_settings(url, "operator"),
                                               build_command(C.INSTRUCT, "s-none", {"text": "x"}, sender="op"),
                                               C.ACK_WINDOW_MS / 1000))
            assert kind == "rejected", (kind, gate.log())
            assert asyncio.run(asyncio.to_thread(lambda: gate.alive()))
        finally:
            gate.terminate()
        assert "Traceback" not in gate.log(), gate.log()


def test_the_nameless_create_rewrites_a_durable_named_in_its_body(server: dict) -> None:
    """Why no role but a stream's owner may have `$JS.API.CONSUMER.CREATE.<stream>`: its body
    may name an existing durable, and nats-server updates that durable (the rules on names
    never see it). What the real server does (as the unrestricted admin): the filter and
    max_ack_pending change; only `action: create` with a config that differs is refused."""
    async def run() -> tuple[dict, dict, str]:
        from nats.js.api import AckPolicy, ConsumerConfig

        nc = await nats.connect(server["url"], user=ADMIN[0], password=ADMIN[1])
        js = nc.jetstream(timeout=3)
        try:
            await js.add_consumer("AEP_EVENTS", ConsumerConfig(durable_name="victim", ack_policy=AckPolicy.EXPLICIT,
                                                               filter_subject="aep.hermes.*.control.>"))
            body = {"stream_name": "AEP_EVENTS", "config": {"name": "victim", "ack_policy": "explicit",
                                                            "filter_subject": "aep.ingest.>", "max_ack_pending": 1}}
            rewritten = json.loads((await nc.request("$JS.API.CONSUMER.CREATE.AEP_EVENTS", json.dumps(body).encode(),
                                                     timeout=3)).data)
            refused = json.loads((await nc.request("$JS.API.CONSUMER.CREATE.AEP_EVENTS", json.dumps(
                {"stream_name": "AEP_EVENTS", "action": "create", "config": {**body["config"], "max_ack_pending": 2}}
            ).encode(), timeout=3)).data)
            now = (await js.consumer_info("AEP_EVENTS", "victim")).config
            await js.delete_consumer("AEP_EVENTS", "victim")
            return rewritten, refused, f"{now.filter_subject} {now.max_ack_pending}"
        finally:
            await nc.close()

    rewritten, refused, now = asyncio.run(run())
    assert "error" not in rewritten and rewritten["name"] == "victim", rewritten
    assert now == "aep.ingest.> 1", now
    assert refused["error"]["err_code"] == 10148, refused  # consumer already exists
