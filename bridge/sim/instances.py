"""What a simulated Hermes instance does: its envelopes, built from the real corpus (no I/O).

What it plays
-------------
Every envelope is built from the shape of a real one: the per-hook templates come from
the shipped corpus (`bridge/data/observed_sessions.jsonl`, real hermes-agent 0.19.0
runs), keeping their keys, key order and the fields no mapping reads (model, provider,
usage, middleware_trace, ...); only identities and content are generated. A session
script (`Instance`) plays what HERMES.md describes:

* turns (``pre_llm_call`` .. ``on_session_end``) with 1-3 model calls, API errors and
  retries, ``pre_verify``, the ``transform_*`` hooks, interrupted turns;
* tool calls with all five ``post_tool_call`` statuses (ok / error / blocked /
  cancelled / timeout) and their vendor ``error_type``;
* dangerous-command approvals with every choice (once / session / always / deny /
  timeout), ``session_id: ""`` and each ``session_key`` flavour (the session id, the
  literal ``default``, a gateway key), sometimes preceded by a ``surface: "smart"`` request;
  half of them answered at once: the fleet sends the answer right behind its request
  (same pipelined round, or the next shim process), so two mapper replicas race them
  (issue 17: the replica with the answer filed it under ``unknown``);
* ``clarify`` forms with choices (plain and dict-wrapped) or free text, answered by a
  choice, free text, every timeout / cancel / undeliverable sentinel or nothing;
* background subagents whose own session runs interleaved with the parent and whose
  ``subagent_stop`` can arrive after the parent's ``on_session_finalize``;
* ``execute_code`` with inner tool calls that carry only ``task_id`` (empty session,
  tool call and turn ids); the exit safety net's ``on_session_end`` without ids;
* ``/new`` resets (``on_session_reset`` with the successor's id; gateway flavour with
  old/new ids), and sessions finalized with ``shutdown`` then resumed and finalized again;
* optionally hostile input (not JSON, not UTF-8, not an object, no hook name) and rare
  oversized tool results (stubbed by the shim);
* optionally the hostile mix of issue 13 (`HOSTILE_MIX`, one kind after another across
  the fleet), each with the outcome the bridge owes it: through the shim's code path a
  5,000-character ``session_id``, a 6 KB hook name, a ``session_id`` ending in a newline,
  a real session named ``unknown``, NaN/Infinity, secrets under secret-named keys and in
  ``curl -u user:PASS``, a megabyte envelope (these map, except the hook name:
  ``bad_hook``), plus the shim's own garbage (``shim_not_json`` ...); and raw messages
  published straight to HERMES_RAW, bypassing the shim: ``ts`` -1 and 2**80, an id
  that is not a ULID, ``v`` 2, 100k-deep JSON (``bad_raw``) and a body naming another
  instance than its subject (``instance_mismatch``);
* canary secrets (an AWS key id, a ``password=`` value, a bearer token, a GitHub token,
  an e-mail address) planted in tool arguments, tool results, user messages, approval
  commands and clarify answers, to prove none of them reaches a consumer.

`stream_envelopes` / `envelopes` give the generated (instance, stdin bytes) pairs alone;
`bridge.sim.fleet` publishes them the way the shim does.
"""

from __future__ import annotations

import itertools
import json
import random
import string
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Iterator

from bridge.sim.sessions import corpus, vary_usage

DROP = object()  # a template key to leave out of an envelope

# ---------------------------------------------------------------- templates from the real corpus


@lru_cache(maxsize=1)
def templates() -> dict[str, dict[str, Any]]:
    """One real envelope per hook (and per variant), from the shipped corpus.

    Keys: the hook name, ``post_tool_call:<status>``, ``on_session_end:interrupted``,
    ``on_session_reset:gateway``.
    """
    out: dict[str, dict[str, Any]] = {}
    for record in corpus():
        env = record["envelope"]
        name = env["hook_event_name"]
        extra = env.get("extra") or {}
        keys = [name]
        if name == "post_tool_call":
            keys = [f"{name}:{extra.get('status')}", name]
        elif name == "on_session_end" and extra.get("interrupted"):
            keys = ["on_session_end:interrupted"]
        elif name == "on_session_reset" and "old_session_id" in extra:
            keys = ["on_session_reset:gateway"]
        for key in keys:
            out.setdefault(key, env)
    return out


def _build(template: str, session_id: str, cwd: str, tool_name: Any = None, tool_input: Any = None,
           **extra: Any) -> dict[str, Any]:
    """An envelope of the template's shape: its keys in their order, overridden by ``extra``
    (``DROP`` removes a key); keys the template does not have are appended."""
    tpl = templates()[template]
    base = tpl.get("extra") or {}
    ext: dict[str, Any] = {}
    for k, v in base.items():
        if k in extra:
            v = extra[k]
            if v is DROP:
                continue
        ext[k] = v
    for k, v in extra.items():
        if k not in base and v is not DROP:
            ext[k] = v
    return {
        "hook_event_name": tpl["hook_event_name"],
        "tool_name": tool_name,
        "tool_input": tool_input,
        "session_id": session_id,
        "cwd": cwd,
        "extra": ext,
    }


# ---------------------------------------------------------------- canaries


@dataclass(frozen=True)
class Canaries:
    """Secrets planted in the traffic; none may reach AEP_EVENTS, BRIDGE_MAPPED or the DLQ
    at the default capture level (the redaction pipeline must catch each of these shapes)."""

    aws_key: str
    password: str
    bearer: str
    github: str
    email: str
    curl_password: str = ""  # in `curl -u user:PASS`
    key_value: str = ""  # a plain value, secret only by the key it is under (`password`, `X-Api-Key`, ...)

    @classmethod
    def make(cls, rng: random.Random) -> "Canaries":
        up = string.ascii_uppercase + string.digits
        alnum = string.ascii_letters + string.digits
        tag = "".join(rng.choice(string.ascii_lowercase + string.digits) for _ in range(10))
        made = dict(
            aws_key="AKIA" + "".join(rng.choice(up) for _ in range(16)),
            password=f"Cn4ry-{tag}-pw",
            bearer="cnry" + "".join(rng.choice(alnum) for _ in range(20)) + "9",
            github="ghp_" + "".join(rng.choice(alnum) for _ in range(36)),
            email=f"canary.{tag}@example.org",
        )
        # Drawn after the others, so a seed keeps the canaries it always had.
        more = "".join(rng.choice(string.ascii_lowercase + string.digits) for _ in range(10))
        return cls(**made, curl_password=f"Cu{more}rlpw", key_value=f"kv{more}plain")

    def strings(self) -> list[str]:
        return [s for s in (self.aws_key, self.password, self.bearer, self.github, self.email, self.curl_password,
                            self.key_value) if s]

    # Contexts a user, a tool or a model would really put a secret in.
    def command(self, rng: random.Random) -> str:
        return rng.choice([
            f"AWS_ACCESS_KEY_ID={self.aws_key} aws s3 rm --recursive s3://backups/old",
            f"mysql -h db.internal -u root --password={self.password} -e 'DROP DATABASE staging'",
            f"curl -X DELETE -H 'Authorization: Bearer {self.bearer}' https://api.internal/v1/projects/42",
            f"git push https://x:{self.github}@github.com/acme/app.git --force",
        ])

    def text(self, rng: random.Random) -> str:
        return rng.choice([
            f"my aws key is {self.aws_key}, please configure the cli",
            f"the db password={self.password} -- connect and list the tables",
            f"call the api with Authorization: Bearer {self.bearer}",
            f"use token {self.github} to open the PR",
            f"send the report to {self.email}",
        ])

    def result(self, rng: random.Random) -> str:
        return rng.choice([
            json.dumps({"output": f"[default]\naws_access_key_id = {self.aws_key}\n", "exit_code": 0, "error": None}),
            json.dumps({"output": f"DATABASE_URL=postgres://app@db/app\nDB_PASSWORD={self.password}\n", "exit_code": 0, "error": None}),
            json.dumps({"content": f"Authorization: Bearer {self.bearer}\n", "total_lines": 1}),
            json.dumps({"output": f"remote: token {self.github} accepted\n", "exit_code": 0, "error": None}),
        ])


# ---------------------------------------------------------------- identities and content

PROJECTS = ("api", "web", "infra", "billing", "docs", "ml-pipeline", "mobile", "etl")
USER_MESSAGES = (
    "please run the test suite and fix what fails",
    "what does this repository do?",
    "clean up the build artifacts",
    "deploy the staging branch",
    "rename the config option and update the docs",
    "why is the nightly job slow?",
    "bitte prüfe die Logdateien auf Fehler",
    "ログを確認してください 🙏",
    "summarise the last three commits",
)
ANSWERS = ("Done.", "All tests pass now.", "I found two issues and fixed them.", "Here is the summary.", "Fertig ✅")
PLAIN_TOOLS = (
    ("terminal", lambda r: {"command": r.choice(["ls -la", "pytest -q", "git status", "make build", "du -sh ."])}),
    ("read_file", lambda r: {"path": f"/home/dev/{r.choice(PROJECTS)}/{r.choice(['README.md', 'setup.py', 'src/main.py'])}"}),
    ("write_file", lambda r: {"path": f"/home/dev/{r.choice(PROJECTS)}/notes.md", "content": "# notes\n" * r.randint(1, 20)}),
    ("search_files", lambda r: {"pattern": r.choice(["TODO", "def main", "import os"]), "path": "."}),
    ("web_search", lambda r: {"query": r.choice(["python asyncio timeout", "nats jetstream dedupe window"])}),
    ("patch", lambda r: {"path": "src/app.py", "old_string": "x = 1", "new_string": "x = 2"}),
)
DANGEROUS = (
    ("rm -rf /home/dev/{p}/build", "recursive delete"),
    ("git push --force origin main", "force push"),
    ("chmod -R 777 /home/dev/{p}", "world writable"),
    ("DROP TABLE users;", "sql drop"),
)
STATUS_WEIGHTS = (("ok", 0.72), ("error", 0.12), ("blocked", 0.06), ("cancelled", 0.05), ("timeout", 0.05))
BLOCK_TYPES = ("plugin_block", "tool_scope_block", "guardrail_block")
CHOICES = ("once", "session", "always", "deny")
CLARIFY_SENTINELS = (
    "The user did not provide a response within the time limit. Use your best judgement to make the choice and proceed.",
    "The user cancelled. Use your best judgement to proceed.",
    "[user did not respond within 5m]",
    "[clarify prompt could not be delivered]",
    "",
)


def _weighted(rng: random.Random, pairs: tuple[tuple[str, float], ...]) -> str:
    x = rng.random() * sum(w for _, w in pairs)
    for value, w in pairs:
        x -= w
        if x <= 0:
            return value
    return pairs[-1][0]


class Ids:
    """Unique, realistically shaped identities (session ids look like Hermes's)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.used: set[str] = set()

    def session(self) -> str:
        stamp = time.strftime("%Y%m%d_%H%M%S", time.gmtime())
        while True:
            sid = f"{stamp}_{self.rng.getrandbits(24):06x}"
            if sid not in self.used:
                self.used.add(sid)
                return sid

    def hostile_kind(self) -> str:
        """The next kind of the hostile mix, fleet-wide in turn (every kind shows up early)."""
        self.hostile_n = getattr(self, "hostile_n", 0) + 1
        return HOSTILE_KINDS[(self.hostile_n - 1) % len(HOSTILE_KINDS)]

    def uuid(self) -> str:
        return str(uuid.UUID(int=self.rng.getrandbits(128), version=4))

    def hex8(self) -> str:
        return f"{self.rng.getrandbits(32):08x}"


@dataclass
class Spawn:
    """Yielded by a script: run ``script`` concurrently in the same instance (a subagent)."""

    script: Iterator[Any]


@dataclass
class Glued:
    """Yielded by a script: an envelope whose successor in the same script is sent right
    behind it, before any other instance's event (an approval answered at once)."""

    envelope: dict[str, Any]


# The hostile mix (issue 13): kind -> the DLQ reason the bridge must give it, or None when it
# must map like normal traffic. `raw_*` kinds are raw messages published straight to
# HERMES_RAW (the simulator's sender, bypassing the shim); the `shim_*` ones are not JSON
# objects, so only the in-process shim path can send them (a real shim's input carries the
# tracking marker in `extra`).
HOSTILE_MIX: dict[str, str | None] = {
    "long_session_id": None,  # 5,000 characters: a bounded hashed lane token
    "long_hook_name": "bad_hook",  # 'a_' * 3000: no type within the grammar's cap
    "newline_session_id": None,  # "nl-...\n": not plain, hashed
    "session_unknown": None,  # a real session named `unknown`, not the unknown lane; one id in every
    # instance that draws it: the first instance seen for it owns it, the others' are instance_conflict
    # (the verifier tells them by HERMES_RAW order)
    "nonfinite": None,  # NaN / Infinity: null at the edge (edge.nonfinite)
    "secret_keys": None,  # secrets under secret-named keys and in `curl -u user:PASS`
    "huge_envelope": None,  # over a megabyte: stubbed at the edge
    "no_hook": "no_hook",
    "shim_not_json": "shim_not_json",
    "shim_not_utf8": "shim_not_utf8",
    "shim_not_object": "shim_not_object",
    "raw_ts_negative": "bad_raw",
    "raw_ts_2_80": "bad_raw",
    "raw_id_not_ulid": "bad_raw",
    "raw_v2": "bad_raw",
    "raw_instance_mismatch": "instance_mismatch",
    "raw_deep_json": "bad_raw",
}
HOSTILE_KINDS = tuple(HOSTILE_MIX)


def hostile_raw_body(message: dict[str, Any], kind: str) -> bytes:
    """The raw message the shim stamped (``message``), made into hostile raw ``kind``."""
    msg = dict(message)
    if kind == "raw_ts_negative":
        msg["ts"] = -1
    elif kind == "raw_ts_2_80":
        msg["ts"] = 2**80
    elif kind == "raw_id_not_ulid":
        msg["id"] = "not-a-ulid-" + str(msg["id"])[-8:].lower()
    elif kind == "raw_v2":
        msg["v"] = 2
    elif kind == "raw_instance_mismatch":
        msg["instance"] = f"{msg['instance']}-forged"  # the subject keeps the real instance
    elif kind == "raw_deep_json":
        head = json.dumps({k: v for k, v in msg.items() if k != "envelope"}, separators=(",", ":"))
        return (head[:-1] + ',"envelope":' + "[" * 100_000 + "]" * 100_000 + "}").encode()
    else:
        raise ValueError(f"not a raw hostile kind: {kind}")
    return json.dumps(msg, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


@dataclass
class SimOptions:
    canary_fraction: float = 0.02
    hostile_fraction: float = 0.0
    hostile_mix: float = 0.0  # fraction of events replaced by the next kind of HOSTILE_MIX
    big_fraction: float = 0.0005  # tool results over the shim's field limit (stubbed at the edge)
    turns: tuple[int, int] = (1, 4)


@dataclass
class Emitted:
    """One event an instance produced: the stdin bytes and what the manifest needs."""

    data: bytes
    hook: str
    canary: bool = False
    glue: bool = False  # the instance's next event goes right behind this one
    kind: str | None = None  # of HOSTILE_MIX: `expect` is what the bridge owes it
    expect: str | None = None  # the DLQ reason it must get (None: it maps)

    @property
    def raw(self) -> bool:
        """``data`` is an envelope the fleet stamps, then publishes as hostile raw ``kind``."""
        return self.kind is not None and self.kind.startswith("raw_")

    @property
    def inproc_only(self) -> bool:
        """Only the in-process path can send it (a raw message, or no object to mark)."""
        return self.raw or (self.kind or "").startswith("shim_")


class Instance:
    """One simulated Hermes instance: a main session script plus concurrent subagent scripts."""

    def __init__(self, name: str, rng: random.Random, ids: Ids, canaries: Canaries, options: SimOptions,
                 platform: str) -> None:
        self.name = name
        self.rng = rng
        self.ids = ids
        self.canaries = canaries
        self.opts = options
        self.platform = platform  # cli | telegram | discord
        self.gateway = platform != "cli"
        self.scripts: list[Iterator[Any]] = []
        self.main: Iterator[Any] | None = None
        self.resumable: list[str] = []
        self.reset_next: str | None = None  # the session a /new came from
        self.winding_down = False
        self.planted = False
        self.markable = False  # served by real shim processes: every input must carry the marker
        self.sticky: Iterator[Any] | None = None  # the script whose next item is glued to the last one
        self.stats: Counter[str] = Counter()

    # ------------------------------------------------------------ driving

    @property
    def done(self) -> bool:
        return self.winding_down and not self.scripts

    def next(self) -> Emitted | None:
        """The instance's next event, or None when it has nothing more to say (wound down)."""
        while True:
            if self.main is None and not self.winding_down:
                self.main = self._session_script()
                self.scripts.insert(0, self.main)
            if not self.scripts:
                return None
            if self.opts.hostile_mix and self.rng.random() < self.opts.hostile_mix:
                return self._hostile_mix(self.ids.hostile_kind())
            if self.opts.hostile_fraction and self.rng.random() < self.opts.hostile_fraction:
                return self._hostile(markable=self.markable)
            if self.sticky is not None and self.sticky in self.scripts:
                script = self.sticky
            else:
                script = self.scripts[0] if len(self.scripts) == 1 or self.rng.random() < 0.6 else self.rng.choice(self.scripts)
            self.sticky = None
            try:
                item = next(script)
            except StopIteration:
                self.scripts.remove(script)
                if script is self.main:
                    self.main = None
                continue
            if isinstance(item, Spawn):
                self.scripts.append(item.script)
                continue
            glue = isinstance(item, Glued)
            if glue:
                item = item.envelope
                self.sticky = script
                self.stats["glued"] += 1
            self.stats[item["hook_event_name"]] += 1
            canary, self.planted = self.planted, False
            return Emitted(json.dumps(item, ensure_ascii=False).encode("utf-8"), item["hook_event_name"], canary, glue)

    def _plant(self) -> bool:
        if self.rng.random() < self.opts.canary_fraction:
            self.planted = True
            return True
        return False

    def _hostile(self, markable: bool = False) -> Emitted:
        r = self.rng
        secret = self.canaries.text(r) if self._plant() else "hello"
        # Through a real shim only an object with an `extra` can carry the tracking marker.
        kind = 3 if markable else r.randrange(5)
        if kind == 0:
            data = ("{not json: " + secret).encode()
        elif kind == 1:
            data = b"\xff\xfe" + secret.encode() + b"\x80"
        elif kind == 2:
            data = json.dumps([secret, 1, 2]).encode()
        elif kind == 3:
            data = json.dumps({"tool_name": "terminal", "extra": {"note": secret}}).encode()
        else:
            data = b"   \n"
        self.stats["_hostile"] += 1
        canary, self.planted = self.planted, False
        return Emitted(data, "_hostile", canary)

    def _hostile_mix(self, kind: str) -> Emitted:
        """One input of the hostile mix, on a session of its own (it never touches the
        instance's running sessions, so the normal traffic stays whole)."""
        r = self.rng
        c = self.canaries
        sid = self.ids.session()
        cwd = f"/home/dev/{r.choice(PROJECTS)}"
        note = c.text(r)  # a canary in every hostile input: none may leave HERMES_RAW
        start = {"hook_event_name": "on_session_start", "tool_name": None, "tool_input": None, "session_id": sid,
                 "cwd": cwd, "extra": {"platform": self.platform, "note": note}}
        data: bytes
        if kind == "long_session_id":
            start["session_id"] = sid + "S" * (5000 - len(sid))
        elif kind == "long_hook_name":
            start["hook_event_name"] = "a_" * 3000
        elif kind == "newline_session_id":
            start["session_id"] = f"nl-{sid}\n"
        elif kind == "session_unknown":
            start["session_id"] = "unknown"
        elif kind == "nonfinite":
            start["extra"].update(temperature=float("nan"), budget=float("inf"), floor=float("-inf"))
        elif kind == "secret_keys":
            start = _build("pre_tool_call", sid, cwd, "terminal", {
                "command": f"curl -u admin:{c.curl_password} https://api.internal/v1/export",
                "headers": {"X-Api-Key": c.key_value}, "password": c.key_value,
                "env": {"AWS_SECRET_ACCESS_KEY": c.key_value}},
                task_id=sid, tool_call_id="call_0001", turn_id=f"{sid}:{sid}:{self.ids.hex8()}", middleware_trace=[])
        elif kind == "huge_envelope":
            start["extra"]["system_prompt"] = "You are a helpful agent. " * 48_000  # ~1.2 MB
        elif kind == "no_hook":
            del start["hook_event_name"]
        elif kind == "shim_not_json":
            data = ("{not json: " + note).encode()
        elif kind == "shim_not_utf8":
            data = b"\xff\xfe" + note.encode() + b"\x80"
        elif kind == "shim_not_object":
            data = json.dumps([note, 1, 2]).encode()
        elif not kind.startswith("raw_"):
            raise ValueError(f"unknown hostile kind {kind}")
        if not kind.startswith("shim_"):
            data = json.dumps(start, ensure_ascii=False).encode("utf-8")  # NaN/Infinity as Python writes them
        self.stats["_hostile"] += 1
        self.stats[f"_hostile:{kind}"] += 1
        return Emitted(data, "_hostile", True, kind=kind, expect=HOSTILE_MIX[kind])

    # ------------------------------------------------------------ sessions

    def _session_script(self) -> Iterator[Any]:
        r = self.rng
        resumed = None
        if self.resumable and r.random() < 0.3:
            resumed = self.resumable.pop(r.randrange(len(self.resumable)))
        sid = resumed or self.ids.session()
        cwd = f"/home/dev/{r.choice(PROJECTS)}"
        interactive = self.platform == "cli" and r.random() < 0.5
        session_key = sid if interactive else ("default" if self.platform == "cli" else
                                               f"agent:main:{self.platform}:dm:{r.randrange(10**6)}")
        if self.reset_next is not None and resumed is None:
            previous, self.reset_next = self.reset_next, None
            if self.gateway:
                yield _build("on_session_reset:gateway", sid, cwd, platform=self.platform, reason="new_session",
                             old_session_id=previous, new_session_id=sid)
            else:
                yield _build("on_session_reset", sid, cwd, platform=self.platform, reason="new_session")
        yield _build("on_session_start", sid, cwd, platform=self.platform)
        task = sid if interactive else self.ids.uuid()
        calls = [0]
        for turn in range(r.randint(*self.opts.turns)):
            yield from self._turn(sid, task, cwd, turn == 0, calls, session_key)
        if r.random() < 0.15:  # the exit safety net: on_session_end with no turn_id or task_id
            yield _build("on_session_end", sid, cwd, task_id=DROP, turn_id=DROP, platform=self.platform,
                         completed=True, interrupted=False)
        if resumed is not None:
            reason = "shutdown"
        else:
            reason = _weighted(r, (("shutdown", 0.5), ("session_boundary", 0.3), ("idle_expiry", 0.2)))
        if reason == "session_boundary" and r.random() < 0.7:
            self.reset_next = sid
        yield _build("on_session_finalize", sid, cwd, platform=self.platform, reason=reason)
        self.stats["sessions"] += 1
        if reason == "shutdown" and resumed is None and r.random() < 0.5:
            self.resumable.append(sid)  # resumed later with --resume: finalized twice
            if len(self.resumable) > 4:
                self.resumable.pop(0)

    def _turn(self, sid: str, task: str, cwd: str, first: bool, calls: list[int], session_key: str,
              platform: str | None = None, subagent: bool = False) -> Iterator[Any]:
        r = self.rng
        platform = platform or self.platform
        turn_id = f"{sid}:{task}:{self.ids.hex8()}"
        msg = self.canaries.text(r) if self._plant() else r.choice(USER_MESSAGES)
        history = [{"role": "user", "content": msg}]
        common = {"task_id": task, "turn_id": turn_id, "model": "fake-model", "platform": platform}
        yield _build("pre_llm_call", sid, cwd, **common, user_message=msg, conversation_history=history,
                     is_first_turn=first, sender_id="")
        interrupted = r.random() < 0.04
        n_api = r.randint(1, 3)
        for a in range(1, n_api + 1):
            api = {"api_request_id": f"{turn_id}:api:{a}", "api_call_count": a, "started_at": time.time()}
            yield _build("pre_api_request", sid, cwd, **common, **api, user_message=msg,
                         request_messages=history, middleware_trace=[])
            if r.random() < 0.05:
                yield _build("api_request_error", sid, cwd, **common, **api, ended_at=time.time(),
                             status_code=r.choice([429, 500, 502, 503]), retry_count=0, max_retries=3, retryable=True,
                             reason=r.choice(["rate_limit", "server_error"]),
                             error={"type": "APIStatusError", "message": "upstream said no"})
                yield _build("pre_api_request", sid, cwd, **common, **api, user_message=msg,
                             request_messages=history, middleware_trace=[])
            yield vary_usage(_build("post_api_request", sid, cwd, **common, **api, ended_at=time.time(),
                                    response_messages=[]))
            if a == n_api:
                break
            for _ in range(r.choices((1, 2, 3), (0.6, 0.3, 0.1))[0]):
                kind = _weighted(r, (("plain", 0.62), ("approval", 0.12), ("clarify", 0.08), ("execute_code", 0.08),
                                     ("delegate", 0.0 if subagent else 0.10)))
                last = interrupted and a == n_api - 1
                if kind == "plain":
                    yield from self._tool(sid, cwd, task, turn_id, calls, cancelled=last)
                elif kind == "approval":
                    yield from self._approval(sid, cwd, task, turn_id, calls, session_key, platform)
                elif kind == "clarify":
                    yield from self._clarify(sid, cwd, task, turn_id, calls)
                elif kind == "execute_code":
                    yield from self._execute_code(sid, cwd, task, turn_id, calls)
                else:
                    yield from self._delegate(sid, cwd, task, turn_id, calls)
        if r.random() < 0.15:
            yield _build("pre_verify", sid, cwd, platform=platform, coding=True, attempt=0,
                         final_response=r.choice(ANSWERS), changed_paths=[f"{cwd}/src/app.py"])
        answer = r.choice(ANSWERS)
        yield _build("transform_llm_output", sid, cwd, response_text=answer, model="fake-model", platform=platform)
        if interrupted:
            yield _build("on_session_end:interrupted", sid, cwd, **common, completed=False, interrupted=True,
                         reason="keyboard_interrupt")
        else:
            yield _build("post_llm_call", sid, cwd, **common, user_message=msg, assistant_response=answer,
                         conversation_history=history + [{"role": "assistant", "content": answer}])
            yield _build("on_session_end", sid, cwd, **common, completed=True, interrupted=False)

    # ------------------------------------------------------------ tools

    def _call_id(self, calls: list[int]) -> str:
        calls[0] += 1
        return f"call_{calls[0]:04d}"

    def _post(self, sid: str, cwd: str, name: str, args: dict[str, Any], ids: dict[str, Any], status: str,
              result: str | None = None, error_message: str | None = None, error_type: str | None = None) -> dict[str, Any]:
        r = self.rng
        if status == "ok":
            et, em = None, None
            if result is None:
                if r.random() < self.opts.big_fraction:
                    result = json.dumps({"output": "x" * 70_000, "exit_code": 0, "error": None})
                elif self._plant():
                    result = self.canaries.result(r)
                else:
                    result = json.dumps({"output": r.choice(["ok", "3 passed", "hi"]), "exit_code": 0, "error": None})
        elif status == "error":
            et, em = error_type or "tool_error", error_message or "No such file or directory"
            result = result or json.dumps({"output": "", "exit_code": 1, "error": em})
        elif status == "blocked":
            et, em = error_type or r.choice(BLOCK_TYPES), error_message or "Blocked by policy"
            result = json.dumps({"error": em})
        elif status == "cancelled":
            et, em = "keyboard_interrupt", "interrupted by the user"
            result = json.dumps({"error": em})
        else:
            et, em = "tool_timeout", "tool timed out after 300s"
            result = json.dumps({"error": em})
        template = f"post_tool_call:{status}" if f"post_tool_call:{status}" in templates() else "post_tool_call"
        return _build(template, sid, cwd, name, args, result=result, **ids, duration_ms=r.randint(0, 5000),
                      status=status, error_type=et, error_message=em, middleware_trace=[])

    def _tool(self, sid: str, cwd: str, task: str, turn_id: str, calls: list[int], cancelled: bool = False,
              name: str | None = None, args: dict[str, Any] | None = None) -> Iterator[Any]:
        r = self.rng
        if name is None:
            name, make = r.choice(PLAIN_TOOLS)
            args = make(r)
            if self._plant():
                args = {**args, "env": {"AWS_ACCESS_KEY_ID": self.canaries.aws_key}, "note": self.canaries.text(r)}
        ids = {"task_id": task, "tool_call_id": self._call_id(calls), "turn_id": turn_id,
               "api_request_id": f"{turn_id}:api:1"}
        yield _build("pre_tool_call", sid, cwd, name, args, **ids, middleware_trace=[])
        status = "cancelled" if cancelled else _weighted(r, STATUS_WEIGHTS)
        if name == "terminal" and status in ("ok", "error"):
            yield _build("transform_terminal_output", "", cwd, command=(args or {}).get("command", ""), output="ok\n",
                         returncode=0 if status == "ok" else 1, task_id="default", env_type="local")
        yield self._post(sid, cwd, name, args or {}, ids, status)
        if status in ("ok", "error"):
            yield _build("transform_tool_result", sid, cwd, name, args, result="{}", **ids, status=status)

    def _approval(self, sid: str, cwd: str, task: str, turn_id: str, calls: list[int], session_key: str,
                  platform: str) -> Iterator[Any]:
        r = self.rng
        command, pattern = r.choice(DANGEROUS)
        command = command.format(p=r.choice(PROJECTS))
        if self._plant():
            command = self.canaries.command(r)
        args = {"command": command}
        call = self._call_id(calls)
        ids = {"task_id": task, "tool_call_id": call, "turn_id": turn_id, "api_request_id": f"{turn_id}:api:1"}
        yield _build("pre_tool_call", sid, cwd, "terminal", args, **ids, middleware_trace=[])
        surface = "gateway" if self.gateway else "cli"
        card = {"command": command, "description": pattern, "pattern_key": pattern, "pattern_keys": [pattern],
                "session_key": session_key, "turn_id": turn_id, "tool_call_id": call}
        if r.random() < 0.1:  # approvals.mode smart: an automatic look first
            yield _build("pre_approval_request", "", cwd, **card, surface="smart")
        request = _build("pre_approval_request", "", cwd, **card, surface=surface)
        yield Glued(request) if r.random() < 0.5 else request  # answered at once: sent right behind it
        choice = r.choice(CHOICES + (("timeout",) if self.gateway else ()))
        yield _build("post_approval_response", "", cwd, **card, surface=surface, choice=choice)
        if choice in ("once", "session", "always"):
            yield _build("transform_terminal_output", "", cwd, command=command, output="", returncode=0,
                         task_id="default", env_type="local")
            yield self._post(sid, cwd, "terminal", args, ids, "ok", result=json.dumps({"output": "", "exit_code": 0, "error": None}))
        else:
            why = "BLOCKED: User denied" if choice == "deny" else "BLOCKED: approval timed out"
            yield self._post(sid, cwd, "terminal", args, ids, "error", error_message=why)

    def _clarify(self, sid: str, cwd: str, task: str, turn_id: str, calls: list[int]) -> Iterator[Any]:
        r = self.rng
        question = r.choice(["Which environment?", "Should I overwrite the file?", "What should the new name be?"])
        options = r.choice([None, ["staging", "production"], ["yes", "no", "ask me later"],
                            [{"label": "keep"}, {"description": "overwrite"}, "  merge  ", ""]])
        args: dict[str, Any] = {"question": question}
        if options is not None:
            args["choices"] = options
        ids = {"task_id": task, "tool_call_id": self._call_id(calls), "turn_id": turn_id,
               "api_request_id": f"{turn_id}:api:1"}
        yield _build("pre_tool_call", sid, cwd, "clarify", args, **ids, middleware_trace=[])
        status = _weighted(r, (("ok", 0.9), ("error", 0.05), ("timeout", 0.05)))
        offered = [c if isinstance(c, str) else next(iter(c.values())) for c in (options or [])]
        offered = [c.strip() for c in offered if c.strip()]
        how = r.random()
        if offered and how < 0.5:
            response = r.choice(offered)
        elif how < 0.75:
            response = self.canaries.text(r) if self._plant() else r.choice(["call it beta", "do whatever is safest"])
        else:
            response = r.choice(CLARIFY_SENTINELS)
        result = json.dumps({"question": question, "choices_offered": offered or None, "user_response": response})
        yield self._post(sid, cwd, "clarify", args, ids, status, result=result if status == "ok" else None)

    def _execute_code(self, sid: str, cwd: str, task: str, turn_id: str, calls: list[int]) -> Iterator[Any]:
        r = self.rng
        args = {"code": "from hermes_tools import terminal, read_file\nprint(terminal('ls'))\n"}
        ids = {"task_id": task, "tool_call_id": self._call_id(calls), "turn_id": turn_id,
               "api_request_id": f"{turn_id}:api:1"}
        yield _build("pre_tool_call", sid, cwd, "execute_code", args, **ids, middleware_trace=[])
        inner = {"task_id": task, "tool_call_id": "", "turn_id": "", "api_request_id": ""}
        for _ in range(r.randint(1, 3)):  # inner calls: only task_id (HERMES.md)
            name, make = r.choice(PLAIN_TOOLS[:3])
            a = make(r)
            yield _build("pre_tool_call", "", cwd, name, a, **inner, middleware_trace=[])
            yield self._post("", cwd, name, a, inner, _weighted(r, (("ok", 0.9), ("error", 0.1))))
        yield self._post(sid, cwd, "execute_code", args, ids, "ok",
                         result=json.dumps({"status": "success", "output": "ok\n", "tool_calls_made": 2}))

    def _delegate(self, sid: str, cwd: str, task: str, turn_id: str, calls: list[int]) -> Iterator[Any]:
        r = self.rng
        goal = r.choice(["Say hi from the child agent.", "Summarise the open issues.", "Run the linters."])
        ids = {"task_id": task, "tool_call_id": self._call_id(calls), "turn_id": turn_id,
               "api_request_id": f"{turn_id}:api:1"}
        yield _build("pre_tool_call", sid, cwd, "delegate_task", {"goal": goal}, **ids, middleware_trace=[])
        child = self.ids.session()
        sa = f"sa-0-{self.ids.hex8()}"
        yield _build("subagent_start", sid, cwd, parent_turn_id=turn_id, parent_subagent_id=None, child_session_id=child,
                     child_subagent_id=sa, child_role="leaf", child_goal=goal)
        yield Spawn(self._child(sid, cwd, turn_id, child, sa))
        yield self._post(sid, cwd, "delegate_task", {"goal": goal}, ids, "ok",
                         result=json.dumps({"status": "dispatched", "mode": "background", "count": 1}))

    def _child(self, parent: str, cwd: str, parent_turn: str, child: str, sa: str) -> Iterator[Any]:
        r = self.rng
        started = time.monotonic()
        yield _build("on_session_start", child, cwd, platform="subagent")
        yield from self._turn(child, sa, cwd, True, [0], child, platform="subagent", subagent=True)
        status = _weighted(r, (("completed", 0.85), ("failed", 0.1), ("interrupted", 0.05)))
        yield _build("subagent_stop", parent, cwd, parent_turn_id=parent_turn, child_session_id=child, child_role="leaf",
                     child_summary="ok", child_status=status, duration_ms=int(1000 * (time.monotonic() - started)))


# ---------------------------------------------------------------- generated envelopes, no publishing


def stream_envelopes(instances: int = 8, seed: int = 0, **options: Any) -> Iterator[tuple[str, bytes]]:
    """Endless simulated (instance, stdin bytes) pairs, interleaved across instances (no I/O)."""
    rng = random.Random(seed)
    ids = Ids(rng)
    canaries = Canaries.make(random.Random(seed + 1))
    opts = SimOptions(**options)
    platforms = ("cli", "cli", "telegram", "discord")
    insts = [Instance(f"gen-{i}", random.Random(rng.getrandbits(64)), ids, canaries, opts, platforms[i % 4])
             for i in range(instances)]
    while True:
        inst = rng.choice(insts)
        ev = inst.next()
        if ev is not None:
            yield inst.name, ev.data


def envelopes(n: int, instances: int = 8, seed: int = 0, **options: Any) -> list[tuple[str, bytes]]:
    """The first ``n`` of `stream_envelopes`."""
    return list(itertools.islice(stream_envelopes(instances, seed, **options), n))
