"""Property tests of the pairing state machine (hypothesis).

Scenarios are Hermes-like sessions (runs, tool calls with and without a tool_call_id,
approvals, clarify forms, subagents that may stop after the parent ended, run ends
with and without a turn id, finalizes, resumes), interleaved, then perturbed the way
the pipeline perturbs them: replica reordering, redelivered duplicates, lost
messages, and ticks at arbitrary stream times. Properties:

* the same input fed twice (each message redelivered, or the whole stream again)
  yields the output of one clean run;
* any prefix -> snapshot -> restore into a fresh state -> the rest yields the
  output of one clean run (byte for byte), also with several restarts;
* the output keeps every invariant (`check_invariants`);
* every model call's tokens are counted once (`check_usage`): each statement of a run's
  totals (its end, the ``x.hermes.pairing.orphaned`` that closed it, an
  ``x.hermes.run.usage`` amendment after a late call) carries the sums of exactly the run's
  calls published before it, under any reordering, duplication, restart; none twice (issue 40).

Ticks may carry the mapper's floor (rule 3): what a replay and a restore must give the same.
"""

from __future__ import annotations

import random
from typing import Any

import msgspec

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bridge.core.aep import Event, encode_event
from bridge.core.invariants import check_invariants, check_usage, is_run_end
from bridge.core.pairing import HOUR, MINUTE, SECOND, PairingConfig, PairingState
from tests.support.pairing import BASE_NS, Mk, assert_valid

# a message of the partition stream: an event with its hints, or a tick
Message = tuple[str, Any, Any]

TICK_STEPS = (0, SECOND, 11 * SECOND, 2 * MINUTE, 90 * MINUTE, 7 * HOUR)
IDLE_TTL_NS = PairingConfig().idle_ttl_ns
SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------- scenario generation

Step = tuple[str, ...]


@st.composite
def session_script(draw: Any, s: str) -> list[Step]:
    steps: list[Step] = [("started", s)]
    late: list[Step] = []

    def runs(prefix: str, n: int) -> None:
        for r in range(n):
            run = f"{s}:t:{prefix}{r}"
            steps.append(("run_start", s, run))
            for k in range(draw(st.integers(0, 3))):
                what = draw(st.sampled_from(["tool", "tool_noid", "approval", "clarify", "subagent", "call", "call"]))
                ident = f"{prefix}{r}{k}"
                if what == "call":  # a model call: different counts each time, sometimes a cost
                    tokens = tuple(draw(st.integers(-1, 5000)) for _ in range(5))
                    nanos = draw(st.sampled_from([None, 1, 250_000, 123_456_789]))
                    steps.append(("call", s, run, tokens, nanos))
                elif what in ("tool", "tool_noid"):
                    cid = "" if what == "tool_noid" else draw(st.sampled_from([f"call_{ident}", "call_0"]))
                    args = draw(st.sampled_from(["a", "b"]))
                    steps.append(("tool_req", s, run, cid, args))
                    for _ in range(draw(st.sampled_from([1, 1, 1, 0, 2]))):
                        etype = draw(st.sampled_from(["tool.completed", "tool.failed", "tool.denied"]))
                        steps.append(("tool_end", s, run, cid, args, etype))
                elif what == "approval":
                    cid = draw(st.sampled_from([f"call_{ident}", "call_0", ""]))
                    steps.append(("appr_req", s, run, cid))
                    choice = draw(st.sampled_from(["once", "deny", "timeout", None]))
                    if choice:
                        steps.append(("appr_ans", s, run, cid, choice))
                elif what == "clarify":
                    cid = f"call_q{ident}"
                    steps.append(("clar_req", s, run, cid))
                    outcome = draw(st.sampled_from(["answered", "timeout", "dismissed", None]))
                    if outcome:
                        steps.append(("clar_post", s, run, cid, outcome))
                else:
                    child = f"{s}-child{ident}"
                    steps.append(("sub_start", s, run, child))
                    stop = draw(st.sampled_from(["now", "late", None]))
                    if stop == "now":
                        steps.append(("sub_stop", s, run, child))
                    elif stop == "late":
                        late.append(("sub_stop", s, run, child))
            end = draw(st.sampled_from(["run", "run", "runless", "missing", "twice"]))
            etype = draw(st.sampled_from(["run.finished", "run.failed", "run.cancelled"]))
            if end in ("run", "twice"):
                steps.append(("run_end", s, run, etype))
            if end in ("runless", "twice"):
                steps.append(("run_end", s, "", draw(st.sampled_from(["run.finished", "run.cancelled"]))))

    runs("r", draw(st.integers(0, 2)))
    finalizes = draw(st.sampled_from([0, 1, 1, 2]))
    if finalizes:
        steps.append(("ended", s))
    if finalizes == 2:  # resumed, then finalized again
        steps.append(("started", s))
        runs("x", 1)
        steps.append(("ended", s))
    return steps + late


def materialize(m: Mk, step: Step) -> list[tuple[Event, dict[str, Any]]]:
    kind, s, *rest = step
    if kind == "started":
        return [m.started(s)]
    if kind == "ended":
        return [m.ended(s)]
    run = rest[0] or None
    if kind == "run_start":
        return [m.run_start(s, run=run)]  # type: ignore[arg-type]
    if kind == "run_end":
        return [m.run_end(s, run=run, etype=rest[1])]
    if kind == "call":
        tokens, nanos = rest[1], rest[2]
        cost = None if nanos is None else {"currency": "USD", "total": nanos * 2 / 1e9, "prompt": nanos / 1e9,
                                           "completion": nanos / 1e9, "cache": 0.0, "reasoning": 0.0}
        return [m.api_call(s, run=run, tokens=tokens, cost=cost)]  # type: ignore[arg-type]
    if kind == "tool_req":
        cid, args = rest[1], rest[2]
        return [m.tool_req(s, run=None if not cid else run, cid=cid, args=args)]
    if kind == "tool_end":
        cid, args, etype = rest[1], rest[2], rest[3]
        return [m.tool_end(s, run=None if not cid else run, cid=cid, args=args, etype=etype)]
    if kind == "appr_req":
        return [m.appr_req(s, sk=s, cid=rest[1], run=run)]  # type: ignore[arg-type]
    if kind == "appr_ans":
        return [m.appr_ans(s, sk=s, cid=rest[1], run=run, choice=rest[2])]  # type: ignore[arg-type]
    if kind == "clar_req":
        return m.clar_req(s, run=run, cid=rest[1])  # type: ignore[arg-type]
    if kind == "clar_post":
        return m.clar_post(s, run=run, cid=rest[1], outcome=rest[2])  # type: ignore[arg-type]
    if kind == "sub_start":
        return [m.sub_start(s, child=rest[1], run=run)]  # type: ignore[arg-type]
    if kind == "sub_stop":
        return [m.sub_stop(s, child=rest[1], run=run)]  # type: ignore[arg-type]
    raise AssertionError(step)


@st.composite
def streams(draw: Any, *, reorder: bool = True, drops: bool = True, ticks: bool = True) -> tuple[list[Message], dict[str, bool]]:
    n = draw(st.integers(1, 3))
    scripts = [draw(session_script(f"S{i}")) for i in range(n)]
    order = draw(st.permutations([i for i, sc in enumerate(scripts) for _ in sc]))
    m = Mk()
    cursor = [0] * n
    msgs: list[Message] = []
    for i in order:
        step = scripts[i][cursor[i]]
        cursor[i] += 1
        for ev, h in materialize(m, step):
            msgs.append(("ev", ev, h))
    flags = {"reorder": False, "drops": False, "ticks": False}
    origin = list(range(len(msgs)))  # each message's place before the reordering
    if reorder and draw(st.booleans()):
        window = draw(st.sampled_from([1, 2, 4]))
        rng = random.Random(draw(st.integers(0, 2**16)))
        keyed = sorted((i + rng.uniform(0, window), i, msg) for i, msg in enumerate(msgs))
        msgs = [msg for _, _, msg in keyed]
        origin = [i for _, i, _ in keyed]
        flags["reorder"] = True
    if drops and msgs and draw(st.booleans()):
        gone = set(draw(st.lists(st.integers(0, len(msgs) - 1), max_size=3)))
        origin = [o for i, o in enumerate(origin) if i not in gone]
        msgs = [msg for i, msg in enumerate(msgs) if i not in gone]
        flags["drops"] = bool(gone)
    if ticks and draw(st.booleans()):
        points = draw(st.lists(st.tuples(st.integers(0, len(msgs)), st.sampled_from(TICK_STEPS)), max_size=4))
        # A quiet spell past the idle TTL may not fall between two reordered messages: that
        # would be a message delayed longer than the idle TTL, past which an idle session is
        # forgotten by design (PairingConfig.idle_ttl_ns: its runs' terminals are no longer
        # recognised). The pipeline reorders within a redelivery (ack wait, nak backoff).
        before = [max(origin[:p], default=-1) for p in range(len(msgs) + 1)]
        cuts = {p for p in range(len(msgs) + 1) if before[p] < min(origin[p:], default=len(origin))}
        points = [(at, step) for at, step in points if step < IDLE_TTL_NS or at in cuts]
        for at, step in sorted(points, reverse=True):
            msgs.insert(at, ("tick", step, None))  # the step is resolved against the stream time below
        flags["ticks"] = bool(points)
    # ticks carry absolute times: the latest event time seen so far plus their step, and (when
    # drawn) the mapper's floor: the raw message right before the lowest one still to come (a
    # message reordered behind the tick is still inside the mapper; a lost one counts as mapped)
    floors = ticks and draw(st.booleans())
    flags["floors"] = floors
    out: list[Message] = []
    now = BASE_NS
    for i, (kind, a, b) in enumerate(msgs):
        if kind == "ev":
            now = max(now, b["ts"])
            out.append((kind, a, b))
        else:
            rest = [x[1].seq >> 10 for x in msgs[i + 1:] if x[0] == "ev"]
            floor = (min(rest) - 1 if rest else m.raw) if floors else None
            out.append(("tick", now + a, floor))
    out.append(("tick", now + 30 * HOUR, None))  # the end: everything closes
    return out, flags


# ---------------------------------------------------------------- feeding


class Feeder:
    def __init__(self, state: PairingState | None = None, position: int = 0) -> None:
        self.state = state or PairingState()
        self.position = position

    def feed(self, msg: Message, *, position: int | None = None) -> list[Event]:
        if position is None:
            self.position += 1
            position = self.position
        kind, a, b = msg
        if kind == "ev":
            return self.state.process(a, b, position)
        return self.state.tick(a, position, None if b is None else (0, b))

    def feed_all(self, msgs: list[Message]) -> list[Event]:
        out: list[Event] = []
        for msg in msgs:
            out += self.feed(msg)
        return out


def clean_run(msgs: list[Message]) -> list[Event]:
    return Feeder().feed_all(msgs)


def wire(events: list[Event]) -> list[bytes]:
    return [encode_event(e) for e in events]


# ---------------------------------------------------------------- properties


@SETTINGS
@given(streams(), st.data())
def test_redelivered_messages_change_nothing(stream: tuple[list[Message], dict[str, bool]], data: Any) -> None:
    msgs, _ = stream
    clean = clean_run(msgs)
    f = Feeder()
    got: list[Event] = []
    modes = data.draw(st.lists(st.sampled_from(["once", "replay", "again", "later"]), min_size=len(msgs), max_size=len(msgs)))
    later: list[Message] = []
    for msg, mode in zip(msgs, modes):
        got += f.feed(msg)
        if mode == "replay":  # redelivered before the ack: same stream position
            assert f.feed(msg, position=f.position) == []
        elif mode == "again" and msg[0] == "ev":  # republished: a new position, same event
            got += f.feed(msg)
        elif mode == "later" and msg[0] == "ev":
            later.append(msg)
    for msg in later[:-1]:  # duplicates arriving late (the last message is the closing tick)
        got += f.feed(msg)
    assert wire(got) == wire(clean)


@SETTINGS
@given(streams())
def test_the_whole_stream_twice_is_one_run(stream: tuple[list[Message], dict[str, bool]]) -> None:
    msgs, _ = stream
    clean = clean_run(msgs)
    f = Feeder()
    first = f.feed_all(msgs)
    second = f.feed_all(msgs)
    assert wire(first) == wire(clean)
    assert second == []


@SETTINGS
@given(streams(), st.data())
def test_restart_from_a_checkpoint_anywhere_is_invisible(stream: tuple[list[Message], dict[str, bool]], data: Any) -> None:
    msgs, _ = stream
    clean_feeder = Feeder()
    clean = clean_feeder.feed_all(msgs)
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(msgs)), min_size=1, max_size=3))))
    f = Feeder()
    got: list[Event] = []
    done = 0
    for cut in cuts + [len(msgs)]:
        got += f.feed_all(msgs[done:cut])
        done = cut
        snap = f.state.snapshot()
        restored = PairingState.restore(snap)
        assert restored.snapshot() == snap
        assert restored.position == f.position
        f = Feeder(restored, f.position)
    assert wire(got) == wire(clean)
    assert f.state.counters == clean_feeder.state.counters
    assert f.state.open_pairs() == clean_feeder.state.open_pairs()


@SETTINGS
@given(streams())
def test_output_keeps_every_invariant(stream: tuple[list[Message], dict[str, bool]]) -> None:
    msgs, flags = stream
    out = clean_run(msgs)
    for e in out:
        assert_valid(e)
    perturbed = flags["reorder"] or flags["drops"] or flags["ticks"]
    problems = check_invariants(out, complete=True, linked=not perturbed, stream_order=not flags["reorder"])
    assert problems == []
    state = Feeder()
    state.feed_all(msgs)
    assert state.state.open_pairs() == {"run": 0, "tool": 0, "card": 0, "subagent": 0}
    assert state.state.metrics()["held_now"] == 0


@SETTINGS
@given(streams(reorder=False, drops=False, ticks=False))
def test_every_input_event_is_published_once(stream: tuple[list[Message], dict[str, bool]]) -> None:
    msgs, _ = stream
    out = clean_run(msgs)
    ids = [e.id for e in out]
    assert len(ids) == len(set(ids))
    assert {msg[1].id for msg in msgs if msg[0] == "ev"} <= set(ids)


# ---------------------------------------------------------------- issue 40: run totals

@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams(), st.data())
def test_each_model_call_is_counted_once_in_its_runs_totals(stream: tuple[list[Message], dict[str, bool]],
                                                            data: Any) -> None:
    msgs, flags = stream
    # redelivered and republished copies, and a restart from a checkpoint somewhere
    cut = data.draw(st.integers(0, len(msgs)))
    f = Feeder()
    out: list[Event] = []
    for i, msg in enumerate(msgs):
        if i == cut:
            f = Feeder(PairingState.restore(f.state.snapshot()), f.position)
        out += f.feed(msg)
        if msg[0] == "ev" and data.draw(st.booleans()):
            out += f.feed(msg)  # the same event again at a new position
    check = check_usage(out)
    assert check.problems == []
    if not flags["ticks"]:  # a closed run is remembered recent_ns of stream time; only a tick jumps past it
        assert check.late == 0
    if not (flags["reorder"] or flags["drops"] or flags["ticks"]):
        assert check.amended == 0  # in order, no call comes after its run's end
    for e in out:
        assert_valid(e)


def test_run_totals_sum_the_calls_and_cost_only_when_every_call_had_one() -> None:
    m = Mk()
    usd = {"currency": "USD", "total": 0.00035, "prompt": 0.00025, "completion": 0.0001, "cache": 0.0, "reasoning": 0.0}
    msgs = [m.started("S"), m.run_start("S", run="S:t:1"),
            m.api_call("S", run="S:t:1", tokens=(100, 10, 5, -1, 0), cost=usd),
            m.api_call("S", run="S:t:1", tokens=(250, 31, 0, -1, 7), cost=usd),
            m.run_end("S", run="S:t:1"),
            m.run_start("S", run="S:t:2"),
            m.api_call("S", run="S:t:2", tokens=(1, 2, 3, 4, 5), cost=usd),
            m.api_call("S", run="S:t:2", tokens=(1, 2, 3, 4, 5)),
            m.run_end("S", run="S:t:2", etype="run.cancelled"),
            m.run_start("S", run="S:t:3"),
            m.api_call("S", run="S:t:3", tokens=(9, 9, 9, 9, 9)),
            m.ended("S")]
    state = PairingState()
    out: list[Event] = []
    for pos, (ev, h) in enumerate(msgs, start=1):
        out += state.process(ev, h, pos)
    ends = {e.run: e for e in out if is_run_end(e)}
    assert ends["S:t:1"].data == {"gen_ai.usage.input_tokens": 350, "gen_ai.usage.output_tokens": 41,
                                  "gen_ai.usage.cache_read.input_tokens": 5,
                                  "gen_ai.usage.reasoning.output_tokens": 7,
                                  "cost": {"currency": "USD", "total": 0.0007, "prompt": 0.0005,
                                           "completion": 0.0002, "cache": 0.0, "reasoning": 0.0},
                                  "model_calls": 2}
    # one call without a cost: no cost for the run (never a partial sum); cancelled keeps its totals
    assert ends["S:t:2"].type == "run.cancelled" and ends["S:t:2"].data["model_calls"] == 2
    assert "cost" not in ends["S:t:2"].data and ends["S:t:2"].data["gen_ai.usage.cache_creation.input_tokens"] == 8
    # a run the bridge closed at its session's end carries its totals too
    assert ends["S:t:3"].type == "x.hermes.pairing.orphaned"
    assert ends["S:t:3"].data["model_calls"] == 1 and ends["S:t:3"].data["gen_ai.usage.output_tokens"] == 9


def test_a_checkpoint_written_before_run_totals_is_read() -> None:
    """A checkpoint of the release before issue 40 (sessions without the ``usage`` member) restores."""
    import msgspec

    m = Mk()
    state = PairingState()
    for pos, (ev, h) in enumerate([m.started("S"), m.run_start("S", run="S:t:1")], start=1):
        state.process(ev, h, pos)
    snap = msgspec.msgpack.decode(state.snapshot())
    for session in snap[6].values():
        assert len(session) == 9 and session[8] is None  # the new member, last and empty
        del session[8]
        for pair in session[5]:  # a pair's new member (a closed run's sums), last
            assert len(pair) == 17 and pair[16] is None
            del pair[16]
    old = msgspec.msgpack.encode(snap)
    restored = PairingState.restore(old)
    ev, h = m.api_call("S", run="S:t:1", tokens=(3, 4, 0, 0, 0))
    restored.process(ev, h, 3)
    ev, h = m.run_end("S", run="S:t:1")
    (end,) = restored.process(ev, h, 4)
    assert end.data["model_calls"] == 1 and end.data["gen_ai.usage.input_tokens"] == 3


def test_a_call_after_its_runs_end_amends_the_runs_totals_once() -> None:
    """A mapper replica killed holding a post_api_request: its redelivery reaches pairing after
    the run's end. Right after it goes x.hermes.run.usage with the run's new totals (cause = the
    end), once, also when the call comes again; its tokens are in the run's total exactly once."""
    m = Mk()
    msgs = [m.started("S"), m.run_start("S", run="S:t:1")]
    first = m.api_call("S", run="S:t:1", tokens=(100, 10, 0, 0, 0))
    late = m.api_call("S", run="S:t:1", tokens=(7, 3, 1, 0, 2))
    msgs += [first, m.run_end("S", run="S:t:1"), late, late, m.ended("S")]
    state = PairingState()
    out: list[Event] = []
    for pos, (ev, h) in enumerate(msgs, start=1):
        out += state.process(ev, h, pos)
    end = next(e for e in out if e.type == "run.finished")
    assert end.data["model_calls"] == 1 and end.data["gen_ai.usage.input_tokens"] == 100
    (amend,) = [e for e in out if e.type == "x.hermes.run.usage"]
    assert out.index(amend) == out.index(next(e for e in out if e.id == late[0].id)) + 1
    assert amend.cause == end.id and amend.run == "S:t:1" and amend.seq == late[0].seq - 512 + 768
    assert amend.data == {"gen_ai.usage.input_tokens": 107, "gen_ai.usage.output_tokens": 13,
                          "gen_ai.usage.cache_read.input_tokens": 1, "gen_ai.usage.cache_creation.input_tokens": 0,
                          "gen_ai.usage.reasoning.output_tokens": 2, "model_calls": 2}
    check = check_usage(out)
    assert check.problems == [] and check.late == 0 and check.amended == 1 and check.calls == 2
    assert state.counters["usage.amended"] == 1
    for e in out:
        assert_valid(e)
    # the check sees a total that counts a call twice
    bad = [msgspec.structs.replace(e, data={**e.data, "model_calls": 3}) if e.id == amend.id else e for e in out]
    assert len(check_usage(bad).problems) == 1
