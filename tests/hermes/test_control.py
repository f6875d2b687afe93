"""The control plane under the REAL hermes-agent 0.19.0: a real `AIAgent` runs real turns
against a scripted model (a local OpenAI-compatible server in this process), its shell-hook
dispatcher runs the shim that `aep-bridge hermes install` registered, gated on; the gate, the
mapper and pairing run as processes on a real nats-server.

One session, turn by turn, the way an operator would live it:
1. the model calls `read_file`; the call is held; the operator allows it: the tool runs;
2. the model calls it again; the operator denies it with a reason: Hermes's pre_tool_call
   block resolution gives the model `{"error": <reason>}`; the observed post_tool_call is the
   pinned `tool.denied {by: "policy"}`, cause-linked to its request;
3. an instruction is queued: it reaches that turn's user message once (Hermes's pre_llm_call
   context path), and not the next turn's;
4. nobody answers: the hold window ends and the tool runs;
5. an instruction still queued at the real session end is dropped before `session.ended`.
Every event and ack of it is then checked on AEP_EVENTS.
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from bridge.commands.control import build_command
from bridge.core import control as C
from bridge.hermes import install as inst
from tests.support.plane import Plane, start_plane, stop_plane, types

pytestmark = pytest.mark.hermes

PRICES = Path(__file__).resolve().parents[1] / "fixtures" / "prices.yaml"
#: the module plane's services (its pairing's /metrics)
hermes_plane_services: list[Any] = []
HOOKED = ["on_session_start", "pre_llm_call", "pre_tool_call", "post_tool_call", "post_llm_call", "on_session_end",
          "on_session_finalize"]

DRIVER = r"""
import json, sys
from hermes_cli.config import load_config
from agent.shell_hooks import register_from_config

specs = register_from_config(load_config(), accept_hooks=False)
print(json.dumps({"registered": sorted({s.event for s in specs})}), flush=True)
from run_agent import AIAgent
from hermes_cli.plugins import invoke_hook

base_url, session, workdir = sys.argv[1:4]
agent = AIAgent(base_url=base_url, api_key="test", model="fake-model", provider="custom", quiet_mode=True,
                max_iterations=4, session_id=session, enabled_toolsets=["file"], skip_context_files=True,
                skip_memory=True)
history = []
for line in sys.stdin:
    step = json.loads(line)
    if step.get("finalize"):  # what the CLI does on exit (cli._notify_session_finalize)
        invoke_hook("on_session_finalize", session_id=session, platform="cli", reason="shutdown")
        print(json.dumps({"finalized": True}), flush=True)
        continue
    result = agent.run_conversation(step["user"], conversation_history=history)
    history = result.get("messages") or history
    print(json.dumps({"final": result.get("final_response")}), flush=True)
"""


class Model:
    """A scripted OpenAI-compatible chat endpoint: a user message gets the planned tool call
    (if any), a tool result gets a final answer. Every request is recorded."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.tool_call: dict[str, Any] | None = None
        #: the usage the n-th request (1-based) reports; None: 1 prompt + 1 completion token
        self.usage: Any = None
        model = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                self._send({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                if not self.path.endswith("/chat/completions"):
                    self.send_response(404)
                    self.end_headers()
                    return
                model.requests.append(body)
                usage = model.usage(len(model.requests)) if model.usage else {"prompt_tokens": 1, "completion_tokens": 1,
                                                                                "total_tokens": 2}
                last = body["messages"][-1]
                msg: dict[str, Any] = {"role": "assistant", "content": "done"}
                finish = "stop"
                if last.get("role") == "user" and model.tool_call is not None:
                    call = model.tool_call
                    msg = {"role": "assistant", "content": "", "tool_calls": [{
                        "id": call["id"], "type": "function",
                        "function": {"name": call["name"], "arguments": json.dumps(call["args"])}}]}
                    finish = "tool_calls"
                if body.get("stream"):
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.end_headers()
                    delta = dict(msg)
                    if "tool_calls" in delta:
                        delta["tool_calls"] = [dict(tc, index=0) for tc in delta["tool_calls"]]
                    for chunk in ({"delta": delta, "finish_reason": None}, {"delta": {}, "finish_reason": finish}):
                        data = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "fake-model",
                                "choices": [{"index": 0, **chunk}], "usage": usage}
                        self.wfile.write(b"data: " + json.dumps(data).encode() + b"\n\n")
                    self.wfile.write(b"data: [DONE]\n\n")
                    return
                self._send({"id": "c", "object": "chat.completion", "created": 0, "model": "fake-model",
                            "choices": [{"index": 0, "message": msg, "finish_reason": finish}], "usage": usage})

            def _send(self, obj: Any) -> None:
                data = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def tool_message(request: dict[str, Any], call_id: str) -> str:
    return next(m["content"] for m in request["messages"] if m.get("role") == "tool" and m.get("tool_call_id") == call_id)


def user_message(request: dict[str, Any]) -> str:
    content = [m for m in request["messages"] if m.get("role") == "user"][-1]["content"]
    return content if isinstance(content, str) else json.dumps(content)


@pytest.fixture(scope="module")
def hermes_plane(nats_backend: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plane]:
    pytest.importorskip("run_agent", reason="hermes-agent==0.19.0 (the [hermes] extra) is required")
    if nats_backend == "external":
        pytest.skip("the control-plane tests start servers of their own")
    p, services = start_plane(nats_backend, tmp_path_factory.mktemp("hermes-control"),
                              {"AEP_HERMES_CONTROL": "1", "AEP_INSTRUCT": "1"},
                              mapper_env={"AEP_BRIDGE_PRICE_TABLE": str(PRICES)})
    hermes_plane_services[:] = services
    try:
        yield p
    finally:
        stop_plane(p, services)


class Driver:
    """The Hermes process: one turn per `turn()`; its output line when the turn is over."""

    def __init__(self, home: Path, workdir: Path, model: Model, session: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AEP_", "HERMES_"))}
        env.update(HERMES_HOME=str(home), HOME=str(workdir), AEP_BRIDGE_CONFIG=os.devnull)
        self.proc = subprocess.Popen([sys.executable, "-c", DRIVER, model.url, session, str(workdir)], env=env, cwd=workdir,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.registered = self.read()["registered"]

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"the Hermes driver stopped: {self.proc.stderr.read()[-3000:] if self.proc.stderr else ''}")
        return json.loads(line)

    def send(self, step: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(step) + "\n")
        self.proc.stdin.flush()

    def close(self) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.stdin = None
        try:
            _, err = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return err


def test_operator_gate_and_steering_under_real_hermes(hermes_plane: Plane, tmp_path: Path) -> None:
    plane = hermes_plane
    home, workdir = tmp_path / "hermes", tmp_path / "work"
    home.mkdir()
    workdir.mkdir()
    (home / "config.yaml").write_text("model:\n  default: fake-model\n")
    secret = workdir / "notes.txt"
    secret.write_text("the launch code is 0000\n")
    settings = {
        "AEP_BRIDGE_NATS_URL": plane.url, "AEP_BRIDGE_INSTANCE": plane.instance, "AEP_BRIDGE_SPOOL_DIR": str(tmp_path / "spool"),
        "AEP_BRIDGE_DEADLINE_MS": "1000", "AEP_HERMES_CONTROL": "1", "AEP_HERMES_HOLD_MS": "8000", "AEP_INSTRUCT": "1",
        "AEP_HERMES_GATE_TOOLS": "read_file|write_file|patch|terminal",
    }
    res = inst.install(home, events=HOOKED, settings=settings)
    cfg = (home / "config.yaml").read_text()
    assert cfg.count("timeout: 14") == 1 and cfg.count("timeout: 3") == len(HOOKED) - 1  # 8 s hold + 1 s + 5 s margin
    session = f"hermes-ctl-{os.getpid()}-{int(time.time())}"
    model = Model()
    driver = Driver(home, workdir, model, session)
    try:
        assert driver.registered == sorted(HOOKED)

        def turn(user: str, call_id: str | None, answer: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
            model.tool_call = {"id": call_id, "name": "read_file", "args": {"path": str(secret)}} if call_id else None
            before = len(model.requests)
            driver.send({"user": user})
            if answer is not None:
                request = plane.wait(session, lambda e: any(x["type"] == "attention.requested" and x["subject"] == "read_file"
                                                            and x["id"] not in seen for x in e), f"the held {call_id}",
                                     timeout=30.0)  # an upper bound: the first turn starts Hermes on a loaded machine
                req = next(x for x in request if x["type"] == "attention.requested" and x["id"] not in seen)
                seen.add(req["id"])
                kind, ack, _ = plane.send(build_command(C.RESPOND, session, {"answer": answer}, sender="test-console",
                                                        subject=req["id"]))
                assert kind == "accepted", ack
            return driver.read(), model.requests[before:]

        seen: set[str] = set()
        # 1. allow: the tool runs
        out, reqs = turn("read my notes", "call_allow", {"option": "allow"})
        assert out == {"final": "done"}
        assert "the launch code is 0000" in tool_message(reqs[-1], "call_allow")
        # 2. deny with a reason: the model gets Hermes's {"error": reason}; the tool did not run
        out, reqs = turn("read them again", "call_deny", {"option": "deny", "text": "not without a ticket"})
        assert json.loads(tool_message(reqs[-1], "call_deny")) == {"error": "not without a ticket"}
        # 3. steering: queued now, in this turn's user message once, not in the next turn's
        kind, ack, _ = plane.instruct(session, "Answer in French from now on.")
        assert kind == "accepted", ack
        out, reqs = turn("hello", None)
        assert user_message(reqs[0]).count("Answer in French from now on.") == 1
        assert user_message(reqs[0]).startswith("hello")
        out, reqs = turn("and now?", None)
        assert "Answer in French" not in user_message(reqs[0])
        # 4. nobody answers: the hold window ends, the tool runs (Hermes's own fail-open)
        env_file = home / inst.ENV_FILENAME
        env_file.write_text(env_file.read_text().replace("AEP_HERMES_HOLD_MS=8000", "AEP_HERMES_HOLD_MS=1500"))
        t0 = time.monotonic()
        out, reqs = turn("last try", "call_expire")
        assert time.monotonic() - t0 >= 1.5
        assert "the launch code is 0000" in tool_message(reqs[-1], "call_expire")
        # 5. the real session end drops what is still queued, before session.ended
        assert plane.instruct(session, "never delivered")[0] == "accepted"
        driver.send({"finalize": True})
        assert driver.read() == {"finalized": True}
    finally:
        err = driver.close()
        model.close()
    for trouble in ("shell hook failed", "shell hook timed out", "not allowlisted"):
        assert trouble not in err, err[-2000:]

    evs = plane.wait(session, lambda e: "session.ended" in types(e) and "x.hermes.instruction.dropped" in types(e)
                     and types(e).count("tool.completed") == 2 and "tool.denied" in types(e), "the whole session")
    by_id = {e["id"]: e for e in evs}
    requests = [e for e in evs if e["type"] == "attention.requested"]
    assert len(requests) == 3
    calls = [by_id[r["cause"]]["data"]["tool"]["call_id"] for r in requests]  # each caused by its tool.requested
    assert calls == ["call_allow", "call_deny", "call_expire"]
    allow, deny, expire = requests

    def follow(req: dict[str, Any]) -> list[str]:
        return [e["type"] for e in evs if e.get("subject") == req["id"] and e["type"] != "attention.requested"]

    assert follow(allow) == [C.RESPOND, "attention.answered", "attention.resolved"]
    assert follow(deny) == [C.RESPOND, "attention.answered", "attention.resolved"]
    assert follow(expire) == ["attention.timeout"]
    acks = [e for e in evs if e["type"] in C.ACK_TYPES]
    commands = [e for e in evs if e["type"] in (C.RESPOND, C.INSTRUCT)]
    assert len(commands) == 4 and sorted(a["cause"] for a in acks) == sorted(c["id"] for c in commands)
    assert all(a["type"] == C.ACCEPTED for a in acks)  # exactly one ack per command, all accepted
    answered = [e for e in evs if e["type"] == "attention.answered"]
    assert [a["data"]["answer"] for a in answered] == [{"option": "allow"}, {"option": "deny", "text": "not without a ticket"}]
    denied = next(e for e in evs if e["type"] == "tool.denied")
    assert denied["data"]["by"] == "policy" and by_id[denied["cause"]]["data"]["tool"]["call_id"] == "call_deny"
    assert [by_id[e["cause"]]["data"]["tool"]["call_id"] for e in evs if e["type"] == "tool.completed"] == ["call_allow", "call_expire"]
    delivered = [e for e in evs if e["type"] == "x.hermes.instruction.delivered"]
    dropped = [e for e in evs if e["type"] == "x.hermes.instruction.dropped"]
    instructs = [c for c in commands if c["type"] == C.INSTRUCT]
    assert [d["cause"] for d in delivered] == [instructs[0]["id"]] and [d["cause"] for d in dropped] == [instructs[1]["id"]]
    ended = next(e for e in evs if e["type"] == "session.ended")
    assert dropped[0]["seq"] < ended["seq"] and dropped[0]["data"]["reason"] == C.DROP_REASON
    sequenced = [e for e in evs if "seq" in e]
    assert len({e["seq"] for e in sequenced}) == len(sequenced)  # one ordering, no seq used twice
    for req in requests:  # each gate card sorts right after the tool.requested that caused it
        assert by_id[req["cause"]]["seq"] < req["seq"]
    assert res.command in cfg


# ---------------------------------------------------------------- issue 40: what the model calls cost


def request_usage(n: int) -> dict[str, Any]:
    """What the fake model reports for its n-th request: different counts every time, with cached
    prompt tokens and reasoning tokens (OpenAI chat-completions shape)."""
    prompt, completion = 1000 + 137 * n, 40 + 29 * n
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": 100 + 11 * n},
            "completion_tokens_details": {"reasoning_tokens": 3 * n}}


def hermes_counts(u: dict[str, Any]) -> dict[str, int]:
    """The AEP members of Hermes's buckets for a chat-completions usage (agent/usage_pricing.py
    normalize_usage: input = prompt - cached; output = completion, reasoning included)."""
    cached = u["prompt_tokens_details"]["cached_tokens"]
    return {"gen_ai.usage.input_tokens": u["prompt_tokens"] - cached, "gen_ai.usage.output_tokens": u["completion_tokens"],
            "gen_ai.usage.cache_read.input_tokens": cached, "gen_ai.usage.cache_creation.input_tokens": 0,
            "gen_ai.usage.reasoning.output_tokens": u["completion_tokens_details"]["reasoning_tokens"]}


def table_cost(c: dict[str, int]) -> dict[str, Any]:
    """The price table's arithmetic (tests/fixtures/prices.yaml), by hand, in Decimal."""
    from decimal import Decimal

    m, q = Decimal(1_000_000), Decimal("1e-9")
    out = {
        "prompt": (c["gen_ai.usage.input_tokens"] * Decimal("2.5") / m).quantize(q),
        "completion": ((c["gen_ai.usage.output_tokens"] - c["gen_ai.usage.reasoning.output_tokens"]) * Decimal(10) / m).quantize(q),
        "cache": ((c["gen_ai.usage.cache_read.input_tokens"] * Decimal("1.25")
                   + c["gen_ai.usage.cache_creation.input_tokens"] * Decimal("3.75")) / m).quantize(q),
        "reasoning": (c["gen_ai.usage.reasoning.output_tokens"] * Decimal("12.5") / m).quantize(q),
    }
    out["total"] = sum(out.values())
    return out


def official_problems(ev: dict[str, Any]) -> list[str]:
    """The envelope against schemas/aep-event.schema.json, the data against the official AEP type
    schema (bridge/data/aep_spec, vendored) or, for x.hermes.* types, ours (schemas/types)."""
    import jsonschema

    from bridge.core.schemas import generate

    root = Path(__file__).resolve().parents[2]
    official = root / "bridge" / "data" / "aep_spec" / "types" / f"{ev['type']}.schema.json"
    docs = generate()
    schema = json.loads(official.read_text()) if official.exists() else docs.get(f"types/{ev['type']}.schema.json")
    out = [e.message for e in jsonschema.Draft202012Validator(docs["aep-event.schema.json"]).iter_errors(ev)]
    if schema is not None:
        out += [e.message for e in jsonschema.Draft202012Validator(schema).iter_errors(ev.get("data", {}))]
    return out


def test_model_calls_tokens_and_run_totals_under_real_hermes(hermes_plane: Plane, tmp_path: Path) -> None:
    """Real turns of the real AIAgent against a fake model that reports different token counts on
    every request: each post_api_request is one x.hermes.api.call naming its model with Hermes's
    exact counts and the price table's cost; each run.finished carries the sums of its calls."""
    from decimal import Decimal

    plane = hermes_plane
    home, workdir = tmp_path / "hermes", tmp_path / "work"
    home.mkdir()
    workdir.mkdir()
    (home / "config.yaml").write_text("model:\n  default: fake-model\n")
    (workdir / "notes.txt").write_text("nothing secret\n")
    hooked = ["on_session_start", "pre_llm_call", "post_api_request", "api_request_error", "pre_tool_call",
              "post_tool_call", "on_session_end", "on_session_finalize"]
    settings = {"AEP_BRIDGE_NATS_URL": plane.url, "AEP_BRIDGE_INSTANCE": plane.instance,
                "AEP_BRIDGE_SPOOL_DIR": str(tmp_path / "spool"), "AEP_BRIDGE_DEADLINE_MS": "1000"}
    inst.install(home, events=hooked, settings=settings)
    session = f"hermes-use-{os.getpid()}-{int(time.time())}"
    model = Model()
    model.usage = request_usage
    driver = Driver(home, workdir, model, session)
    try:
        assert driver.registered == sorted(hooked)
        for user, call in (("read my notes", "call_u1"), ("thanks", None), ("read them again", "call_u2")):
            model.tool_call = {"id": call, "name": "read_file", "args": {"path": str(workdir / "notes.txt")}} if call else None
            driver.send({"user": user})
            assert driver.read() == {"final": "done"}
        driver.send({"finalize": True})
        assert driver.read() == {"finalized": True}
    finally:
        err = driver.close()
        model.close()
    assert "shell hook failed" not in err and "shell hook timed out" not in err, err[-2000:]
    n = len(model.requests)
    assert n == 5  # two turns with a tool call (2 requests each), one without
    evs = plane.wait(session, lambda e: "session.ended" in types(e) and types(e).count("run.finished") == 3
                     and types(e).count("x.hermes.api.call") == n, "the whole session", timeout=30.0)
    calls = [e for e in evs if e["type"] == "x.hermes.api.call"]
    # every model request is one event, naming its model, with Hermes's exact counts and the table's cost
    for i, ev in enumerate(calls, start=1):
        d = ev["data"]
        want = hermes_counts(request_usage(i))
        assert {k: d[k] for k in want} == want, (i, d)
        assert d["gen_ai.request.model"] == "fake-model" and d["gen_ai.provider.name"] == "custom"
        assert isinstance(d["duration_ms"], int) and d["call_index"] in (1, 2)
        cost = table_cost(want)
        assert d["cost"]["currency"] == "USD"
        assert {k: Decimal(repr(d["cost"][k])) for k in cost} == cost, (i, d["cost"], cost)
        assert "content" not in json.dumps(d) and "notes.txt" not in json.dumps(d)  # no text at metadata
    # every finished run carries the sums of its calls (tokens, model_calls, cost)
    runs = [e for e in evs if e["type"] == "run.finished"]
    for run in runs:
        mine = [c["data"] for c in calls if c["run"] == run["run"]]
        assert mine and run["data"]["model_calls"] == len(mine)
        for member in hermes_counts(request_usage(1)):
            assert run["data"][member] == sum(c[member] for c in mine), (member, run)
        for member in ("total", "prompt", "completion", "cache", "reasoning"):
            assert Decimal(repr(run["data"]["cost"][member])) == sum(Decimal(repr(c["cost"][member])) for c in mine)
    assert sum(r["data"]["model_calls"] for r in runs) == n
    # every event valid against the official schemas
    bad = {e["id"]: p for e in evs if (p := official_problems(e))}
    assert bad == {}, bad

    # the same stream through `aep-bridge usage` (the real command): its session row is the calls' sums
    from bridge.core.usage import TOKENS
    from tests.support.up import cli

    done = cli("usage", "--nats", plane.url, "--by", "session", "--since", "all", "--json",
               env={**os.environ, "AEP_BRIDGE_CONFIG": os.devnull}, timeout=60)
    assert done.returncode == 0, done.stderr
    (row,) = [r for r in json.loads(done.stdout)["groups"] if r["group"] == session]
    assert row["calls"] == n and row["errors"] == 0 and row["unpriced_calls"] == 0
    for member, column in TOKENS:
        assert row[f"{column}_tokens"] == sum(c["data"][member] for c in calls), column
    assert Decimal(repr(row["cost"]["USD"])).quantize(Decimal("1e-9")) == sum(
        Decimal(repr(c["data"]["cost"]["total"])) for c in calls)
    durations = sorted(c["data"]["duration_ms"] for c in calls)
    assert row["p99_ms"] == durations[-1]

    # and pairing's activity metrics (one module-wide plane: only this test's turns make model calls)
    pairing = next(s for s in hermes_plane_services if s.name == "pairing")

    def metric(name: str, **labels: str) -> float:
        want = "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
        for line in pairing.metrics_text().splitlines():
            head, _, value = line.rpartition(" ")
            if head.split("{")[0] == name and "{" + ",".join(sorted(head[head.index("{") + 1:-1].split(","))) + "}" == want:
                return float(value)
        return 0.0

    assert metric("aep_bridge_model_calls_total", model="fake-model", outcome="ok") == n
    for member, column in TOKENS:
        assert metric("aep_bridge_model_tokens_total", model="fake-model", kind=column) == sum(
            c["data"][member] for c in calls), column
    assert metric("aep_bridge_runs_total", outcome="finished") >= len(runs)
