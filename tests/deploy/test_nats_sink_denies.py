"""Issue 44 item 1: every exporter sink's durable is denied to the reader roles, in the chart.

A sink's durable is ``export-<sink>``: a name no static configuration can know. The sample
deploy/nats/nats.conf denies its one sink's (``siem``) by hand (deploy/README.md says to copy
those lines per sink). The chart knows its sinks: the bundled server's deny lines of
``aep-consumer`` and ``aep-relay`` are rendered (the NATS chart's ``$tplYamlSpread``) from
``global.aepBridge.exporterSinks``, and the chart refuses to render with the exporter on and a
sink missing from that list. Before, the chart's values denied ``export-siem`` alone: a sink
named otherwise could be pulled, acked, deleted or rewritten by the SIEM role and the relay.

Process level: a real nats-server with the chart's values rendered for two sinks, the
durables made as the exporter names them, every operation of the matrix tried by each role."""

from __future__ import annotations

import asyncio
from pathlib import Path

import nats
import pytest

from tests.support.chart import ci_values, render_chart
from tests.support.nats_probe import ADMIN, FILTERS, Prober, with_admin
from tests.support.nats_roles import USERS, configured_server, ensure_streams, values_nats_conf

SINKS = ("siem", "audit-2")


async def make_durables(url: str) -> None:
    from nats.js.api import AckPolicy, ConsumerConfig

    nc = await nats.connect(url, user=ADMIN[0], password=ADMIN[1])
    js = nc.jetstream(timeout=3)
    try:
        await js.publish("aep.hermes.s1.session.started", b"{}")
        for sink in SINKS:
            await js.add_consumer("AEP_EVENTS", ConsumerConfig(durable_name=f"export-{sink}", name=f"export-{sink}",
                                                               ack_policy=AckPolicy.EXPLICIT, ack_wait=30,
                                                               filter_subject=FILTERS["AEP_EVENTS"]))
    finally:
        await nc.close()


def test_no_reader_reaches_any_configured_sinks_durable(tmp_path: Path) -> None:
    text = with_admin(values_nats_conf(tmp_path / "js", SINKS), "values")
    with configured_server(tmp_path, text) as url:
        asyncio.run(ensure_streams(url))

        async def run() -> dict[str, dict[str, set[str]]]:
            out: dict[str, dict[str, set[str]]] = {}
            for role in ("consumer", "relay", "exporter"):
                await make_durables(url)  # again: a delete that got through removed one
                p = await Prober.connect(url, role)
                try:
                    out[USERS[role][0]] = {s: await p.try_ops("AEP_EVENTS", f"export-{s}") for s in SINKS}
                finally:
                    await p.close()
            return out

        result = asyncio.run(asyncio.wait_for(run(), 120))
    print(result)
    for reader in ("aep-consumer", "aep-relay"):
        assert result[reader] == {s: set() for s in SINKS}, result
    for sink in SINKS:  # the owner still uses each one
        assert {"pull", "info", "ack"} <= result["aep-exporter"][sink], result


def test_the_chart_refuses_a_sink_its_server_does_not_deny() -> None:
    values = ci_values("exporter")
    values["exporter"]["sinks"].append({"name": "audit", "url": "kafka://kafka-0.kafka:9093/aep-audit"})
    with pytest.raises(Exception, match=r'"audit" is not in global.aepBridge.exporterSinks'):
        render_chart(values)
    values["global"]["aepBridge"]["exporterSinks"].append("audit")
    assert any("exporter" in path for path in render_chart(values))
    # a sink without a name cannot be denied by name: refused with the bundled server
    values["exporter"]["sinks"].append({"url": "kafka://kafka-0.kafka:9093/aep-other"})
    with pytest.raises(Exception, match="needs a name with the bundled NATS server"):
        render_chart(values)
    # with a server of your own (nats.enabled false) its configuration is yours (deploy/README.md)
    values["nats"] = {"enabled": False, "url": "nats://nats:4222"}
    assert any("exporter" in path for path in render_chart(values))
