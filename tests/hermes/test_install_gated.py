"""`aep-bridge hermes install` with the gate on: a longer pre_tool_call timeout, always above the
hold window plus the publish deadline, checked (and re-checked by `doctor`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bridge.hermes import install as inst
from bridge.hermes.doctor import doctor

BASE = {"AEP_BRIDGE_NATS_URL": "nats://127.0.0.1:1", "AEP_BRIDGE_INSTANCE": "gate-test", "AEP_BRIDGE_DEADLINE_MS": "250"}
EVENTS = ["pre_tool_call", "post_tool_call", "pre_llm_call"]


def timeouts(home: Path) -> dict[str, list[int]]:
    from ruamel.yaml import YAML

    hooks = YAML(typ="safe").load((home / "config.yaml").read_text())["hooks"]
    return {event: [e["timeout"] for e in entries] for event, entries in hooks.items()}


def home(tmp_path: Path) -> Path:
    h = tmp_path / "hermes"
    h.mkdir()
    return h


def test_gated_off_every_timeout_is_the_default(tmp_path: Path) -> None:
    h = home(tmp_path)
    inst.install(h, events=EVENTS, settings=BASE)
    assert timeouts(h) == {e: [3] for e in EVENTS}
    assert "AEP_HERMES_CONTROL" not in (h / inst.ENV_FILENAME).read_text()


@pytest.mark.parametrize(("hold", "expected"), [(None, 61), ("55000", 61), ("1000", 7), ("120000", 126)])
def test_gated_on_pre_tool_call_waits_longer_than_the_hold(tmp_path: Path, hold: str | None, expected: int) -> None:
    h = home(tmp_path)
    settings = {**BASE, "AEP_HERMES_CONTROL": "1", "AEP_INSTRUCT": "1", "AEP_HERMES_GATE_TOOLS": "terminal|write_.*"}
    if hold:
        settings["AEP_HERMES_HOLD_MS"] = hold
    inst.install(h, events=EVENTS, settings=settings)
    t = timeouts(h)
    assert t == {"pre_tool_call": [expected], "post_tool_call": [3], "pre_llm_call": [3]}
    assert expected * 1000 > int(hold or 55000) + 250
    env = (h / inst.ENV_FILENAME).read_text()
    for key in ("AEP_HERMES_CONTROL=1", "AEP_INSTRUCT=1", "AEP_HERMES_GATE_TOOLS=terminal|write_.*"):
        assert key in env  # the shim reads its opt-ins from the env file the command names
    assert [c for c in doctor(h, nats_timeout=0.2) if c.what.startswith("gate:")][0].ok


def test_turning_the_gate_on_updates_the_existing_entry(tmp_path: Path) -> None:
    h = home(tmp_path)
    inst.install(h, events=EVENTS, settings=BASE)
    res = inst.install(h, events=EVENTS, settings={**BASE, "AEP_HERMES_CONTROL": "1", "AEP_HERMES_HOLD_MS": "20000"})
    assert res.added == [] and sorted(res.already) == sorted(EVENTS)  # not duplicated ...
    assert timeouts(h)["pre_tool_call"] == [26]  # ... but no longer too short for the hold


@pytest.mark.parametrize(("settings", "timeout", "message"), [
    ({"AEP_HERMES_HOLD_MS": "296000"}, None, "300 s"),  # Hermes clamps a hook timeout at 300 s
    ({"AEP_HERMES_HOLD_MS": "30000"}, 30, "must be above the hold window"),  # an explicit --timeout too short
    ({"AEP_HERMES_HOLD_MS": "soon"}, None, "AEP_HERMES_HOLD_MS must be an integer in 1-86400000, got 'soon'"),
    ({"AEP_HERMES_HOLD_MS": "0"}, None, "AEP_HERMES_HOLD_MS must be an integer in 1-86400000, got '0'"),
    ({"AEP_BRIDGE_DEADLINE_MS": "abc"}, None, "AEP_BRIDGE_DEADLINE_MS must be an integer in 1-60000, got 'abc'"),
])
def test_a_hold_that_hermes_would_cut_short_is_refused(tmp_path: Path, settings: dict[str, str], timeout: int | None,
                                                       message: str) -> None:
    h = home(tmp_path)
    with pytest.raises(inst.InstallError, match=message):
        inst.install(h, events=EVENTS, settings={**BASE, "AEP_HERMES_CONTROL": "1", **settings}, timeout=timeout)
    assert not (h / "config.yaml").exists()  # checked before anything is written


def test_an_explicit_timeout_above_the_hold_is_kept(tmp_path: Path) -> None:
    h = home(tmp_path)
    inst.install(h, events=EVENTS, settings={**BASE, "AEP_HERMES_CONTROL": "1", "AEP_HERMES_HOLD_MS": "30000"}, timeout=45)
    assert timeouts(h) == {e: [45] for e in EVENTS}


def test_doctor_flags_a_timeout_edited_below_the_hold(tmp_path: Path) -> None:
    h = home(tmp_path)
    inst.install(h, events=EVENTS, settings={**BASE, "AEP_HERMES_CONTROL": "1", "AEP_HERMES_HOLD_MS": "10000"})
    cfg = h / "config.yaml"
    cfg.write_text(cfg.read_text().replace("timeout: 16", "timeout: 10"))
    gate = [c for c in doctor(h, nats_timeout=0.2) if c.what.startswith("gate:")]
    assert len(gate) == 1 and not gate[0].ok and "hold window" in gate[0].what


@pytest.mark.parametrize("control", ["0", "1"])
def test_install_names_a_bad_deadline_and_its_range(tmp_path: Path, control: str) -> None:
    """Not a bare int() error: the settings table's message, variable and range (issue 22)."""
    h = home(tmp_path)
    with pytest.raises(inst.InstallError, match=r"AEP_BRIDGE_DEADLINE_MS must be an integer in 1-60000, got '99999999'"):
        inst.install(h, events=EVENTS, settings={**BASE, "AEP_HERMES_CONTROL": control, "AEP_BRIDGE_DEADLINE_MS": "99999999"})
    assert not (h / "config.yaml").exists()


def test_doctor_names_a_bad_deadline_edited_into_the_settings_file(tmp_path: Path) -> None:
    """The shim falls back to its default on a bad number; doctor says which variable and range
    instead of failing with a bare int() error."""
    h = home(tmp_path)
    inst.install(h, events=EVENTS, settings={**BASE, "AEP_HERMES_CONTROL": "1", "AEP_HERMES_HOLD_MS": "10000"})
    env = h / inst.ENV_FILENAME
    env.write_text(env.read_text().replace("AEP_BRIDGE_DEADLINE_MS=250", "AEP_BRIDGE_DEADLINE_MS=abc"))
    bad = [c for c in doctor(h, nats_timeout=0.2) if "AEP_BRIDGE_DEADLINE_MS" in c.what]
    assert len(bad) == 1 and not bad[0].ok, bad
    assert "must be an integer in 1-60000, got 'abc'" in bad[0].what
