"""Every command README.md's code blocks and `aep-bridge up`'s banner print, run as a new user runs
them (issue 38): in a clean shell (`env -i` with only PATH and HOME, as a fresh machine has), after
only what the README says to do, against one running `aep-bridge up --demo --gate` (`make run` with
the gate, whose banner holds every line that `up` and `up --demo` print).

The commands are parsed from README.md and from the banner, never copied here: a README edit is
picked up, and a command that breaks fails. What is written here is keyed by a command's text and
fails when that text is no longer printed, so it cannot rot:

* NOT_RUN: what a test cannot run, with the reason;
* LONG: what runs until stopped: started, checked for its first output, then SIGTERM (it must end);
* EXPECT: an exit code other than 0 or an output to look for;
* SUBSTITUTE: where the README names a value its reader fills in (the token `up` printed; up's
  default relay port, free ports here).

Everything else must exit 0 with some output and no traceback. A README block is one shell
session in a fresh HOME (whose state directory is the running up's, as on the machine that ran
`make run`); its setup lines (assignments, `export`, `. FILE`) and those of every block above it
run before each command, as in a reader's terminal. The banner is one session too, without any
of the README's setup. The sessions run at once (module fixture `sessions`), each test reports
one. What the test adds to a clean shell: a ~/.curlrc that makes an HTTP error fail a `curl`,
and for the exporter lines (LONG) ports of their own.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from bridge.stack.server import terminate
from tests.corpus import records
from tests.support.cli import ROOT, free_port
from tests.support.pasted import (FRESH_PATH, HOOK_KEY, Command, Expect, Long, Run, banner_commands, clean_shell,
                                  run_session)

README = ROOT / "README.md"
VENV_BIN = ROOT / ".venv" / "bin"  # where `make run` / `make test` install (Makefile VENV)

# -- what a test cannot run, keyed by the command's text (README code blocks) ---------------------

CLUSTER = ("the cluster section: three NATS servers named nats-0..2, which a test machine does not have "
           "(`up --cluster 3` stands in for them in tests/cluster and tests/stack)")
NOT_RUN: dict[str, str] = {
    "make run": "blocks until Ctrl-C; it is `aep-bridge up --demo` (test_make_run_is_the_up_this_module_runs), "
                "which this module runs (with --gate and free ports): its banner's commands are run below",
    "make test": "the whole test suite, this test among it",
    "cat prices.yaml": "shows the operator's own price table (the lines after it), not a file of the repository",
    "export AEP_BRIDGE_NATS_URL=nats://nats-0:4222,nats://nats-1:4222,nats://nats-2:4222": CLUSTER,
    "aep-bridge bootstrap --replicas 3": CLUSTER,
    "aep-bridge mapper &": CLUSTER,
    "aep-bridge pairing &": CLUSTER,
    "aep-bridge tail": CLUSTER,
}

# banner lines that are templates, keyed by the command with its settings dropped and up's path to
# the CLI written `aep-bridge`
BANNER_NOT_RUN: dict[str, str] = {
    "control respond REQUEST_ID allow": "a template: REQUEST_ID exists only while a shim holds a call "
                                        "(tests/stack/test_up.py answers a held call with it)",
    "control instruct --session SESSION TEXT": "a template: SESSION and TEXT are the operator's "
                                               "(tests/services/gate drive instruct)",
}


def exporter_alone() -> dict[str, str]:
    # no Kafka, no OTel Collector and no NATS of its own here: it must take the README's sink,
    # start, say so and obey SIGTERM; its own metrics port and a closed NATS port keep parallel
    # runs (and anyone's server on 4222) apart
    return {"AEP_BRIDGE_METRICS_PORT": str(free_port()), "AEP_BRIDGE_NATS_URL": f"nats://127.0.0.1:{free_port()}"}


EXPORTER = "a service (runs until SIGTERM) against a Kafka or a collector this machine does not have"
LONG: dict[str, Long] = {
    "aep-bridge exporter --sink 'kafka://kafka-0:9092,kafka-1:9092/aep-ocsf?format=ocsf'":
        Long(r"exporter_starting", EXPORTER, exporter_alone),
    "aep-bridge exporter --sink 'kafka://kafka-0:9092/aep-events'":
        Long(r"exporter_starting", EXPORTER, exporter_alone),
    "aep-bridge exporter --sink 'otlp+http://otel-collector:4318/v1/logs'":
        Long(r"exporter_starting", EXPORTER, exporter_alone),
    """curl -gN -H "Authorization: Bearer $T" 'http://127.0.0.1:8787/stream?filter={"type":["attention.*","tool.denied"]}&capture=metadata'""":
        Long(r": aep-bridge relay", "SSE, live: the stream stays open"),
    "aep-bridge tail --all --type 'x.hermes.api.call'":
        Long(r"x\.hermes\.api\.call +ms=\d+ +model=fake-model", "follows the stream"),
}
BANNER_LONG: dict[str, Long] = {
    # started first, it sees the events of the banner's `demo` (run after it, as in a second terminal)
    "aep-bridge tail": Long(r"── lane \S+", "follows the stream"),
}


EXPECT: dict[str, Expect] = {
    "aep-bridge hermes doctor": Expect(
        r"(?m)^\[FAIL\] cannot connect to NATS at nats://nats\.example:4222", code=1, forbid=r"(?m)^\[FAIL\] (?!cannot connect)",
        why="nats.example stands for the reader's server: that one check fails (exit 1), every other is ok"),
    "curl -s http://127.0.0.1:8787/events": Expect(r'"aep": \["0\.1"\]'),
    'curl -N "http://127.0.0.1:8787/stream?from=all&live=0&access_token=$T"': Expect(r"(?ms)^data: \{.*^: replay-complete"),
    "aep-bridge usage": Expect(r"(?m)^model +calls +errors +input +output\b.*\n^fake-model +\d+"),
}
BANNER_EXPECT: dict[str, Expect] = {
    "aep-bridge demo": Expect(r"shim answered \{\} (\d+)/\1 times"),
    "aep-bridge control hello": Expect(r'"type": "hello"'),
    "aep-bridge control pending": Expect(r"no held calls"),
    # with the settings the banner's `wire Hermes` wrote (run before it): published, not spooled
    "hooks: - command": Expect(r"^\{\}\s*$", forbid="spooled"),
}


@dataclass
class Up:
    home: Path  # HOME of the shell that ran `up`: its state directory is there
    token: str
    relay_port: int
    out: Path


# what the README leaves to its reader, keyed by the text it appears in
SUBSTITUTE: dict[str, Callable[[Up], str]] = {
    "T=...": lambda up: f"T={up.token}",  # "AEP_BRIDGE_RELAY_TOKEN, or the token `up` printed"
    "127.0.0.1:8787": lambda up: f"127.0.0.1:{up.relay_port}",  # up's default; a free one here (up prints it)
}

# -- parsing -----------------------------------------------------------------------------------------


@dataclass
class Block:
    where: str
    commands: list[Command] = field(default_factory=list)


SETUP = re.compile(r"(export\s+)?[A-Za-z_]\w*=\S*|(\.|source)\s+\S+")


def without_comment(line: str) -> str:
    """The line up to a `#` that starts a shell comment (after a blank, outside quotes)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def readme_blocks(text: str) -> list[Block]:
    """The commands of README's fenced code blocks: every line of a `sh` block (a trailing `\\`
    continues it), the `$ ` lines of a block without a language (a transcript)."""
    blocks: list[Block] = []
    section, block, lang, pending = "top", None, "", ""
    for n, line in enumerate(text.splitlines(), start=1):
        if block is None:
            if line.startswith("## "):
                section = line[3:].strip()
            elif line.startswith("```"):
                lang = line[3:].strip()
                block = Block(f"README.md:{n} ({section})")
                blocks.append(block)
            continue
        if line.startswith("```"):
            block = None
            continue
        if lang in ("sh", "bash", "shell"):
            command = line
        elif lang in ("", "console") and line.startswith("$ "):
            command = line[2:]
        else:
            continue
        if command.rstrip().endswith("\\"):
            pending += command.rstrip()[:-1].rstrip() + " "
            continue
        command = without_comment(pending + command.strip())
        pending = ""
        if command:
            block.commands.append(Command(command, f"README.md:{n}", bool(SETUP.fullmatch(command))))
    return [b for b in blocks if b.commands]


# -- running -------------------------------------------------------------------------------------


def fresh_home(tmp: Path, up: Up) -> Path:
    """A new user's HOME on the machine where `make run` runs: up's state directory is its own."""
    home = tmp / "home"
    (home / ".local" / "state").mkdir(parents=True)
    (home / ".local" / "state" / "aep-bridge").symlink_to(up.home / ".local" / "state" / "aep-bridge")
    # the test's one addition: an HTTP error fails a `curl` (exit 22; `curl -s` otherwise prints a
    # 404's body and exits 0)
    (home / ".curlrc").write_text("fail-with-body\n")
    return home


def substituted(text: str, up: Up) -> str:
    for key, value in SUBSTITUTE.items():
        if key in text:
            text = text.replace(key, value(up))
    return text


# -- the running up ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    """`make run` (`.venv/bin/aep-bridge up --demo`) with the gate, free ports, in a clean shell;
    ready once its demo is over (what the README's usage and tail show)."""
    if not (VENV_BIN / "activate").is_file() or not (VENV_BIN / "aep-bridge").is_file():
        pytest.fail(f"the README's commands run from the venv `make` creates, {VENV_BIN}; it is not there")
    tmp = tmp_path_factory.mktemp("readme-up")
    home = tmp / "home"
    home.mkdir()
    relay = free_port()
    argv = clean_shell(home, f"exec {VENV_BIN / 'aep-bridge'} up --demo --gate --port {free_port()} "
                             f"--mapper-port {free_port()} --pairing-port {free_port()} --gate-port {free_port()} "
                             f"--relay-port {relay}")
    out = tmp / "up.out"
    with out.open("wb") as fh:
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while "aep-bridge up: following AEP_EVENTS" not in out.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"`up --demo` did not get to following the stream (exit {proc.poll()}):\n{out.read_text()[-3000:]}")
            time.sleep(0.2)
        state = json.loads((home / ".local" / "state" / "aep-bridge" / "up.json").read_text())
        yield Up(home, state["relay"]["token"], relay, out)
    finally:
        terminate(proc, 60, signal.SIGINT)


# -- the tests ---------------------------------------------------------------------------------------

BLOCKS = readme_blocks(README.read_text())


def spec_of(text: str) -> Long | Expect:
    return LONG.get(text) or EXPECT.get(text) or Expect()


#: the blocks with a command to run (the others hold only setup lines and NOT_RUN commands)
RUNNABLE = [i for i, b in enumerate(BLOCKS) if any(not c.setup and c.text not in NOT_RUN for c in b.commands)]


def readme_runs(index: int, up: Up) -> list[Run]:
    """One code block of the README as a reader runs it: in order, in one shell, each command
    after the setup lines above it (this block's and every block's before it)."""
    setup = [substituted(c.text, up) for b in BLOCKS[:index] for c in b.commands if c.setup and c.text not in NOT_RUN]
    runs = []
    for c in BLOCKS[index].commands:
        if c.text in NOT_RUN:
            continue
        if c.setup:
            setup.append(substituted(c.text, up))
            continue
        runs.append(Run(c.text, "\n".join([*setup, substituted(c.text, up)]), spec_of(c.text), c.where))
    return runs


def banner_runs(commands: list[tuple[str, Command]]) -> list[Run]:
    """The banner's commands pasted into a fresh shell as printed (nothing from the README done
    there first); the hook command gets a real envelope on stdin."""
    envelope = json.dumps(next(r["envelope"] for r in records() if r["envelope"]["hook_event_name"] == "pre_tool_call"))
    return [Run(key, c.text, BANNER_LONG.get(key) or BANNER_EXPECT.get(key) or Expect(), c.where,
                envelope if key == HOOK_KEY else None)
            for key, c in commands if key not in BANNER_NOT_RUN]


@pytest.fixture(scope="module")
def sessions(up: Up, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[list[str]]]]:
    """Every README block's session and the banner's, all at once (each in its own HOME, each in
    order within itself): the module takes its longest session, not their sum. Each test below
    reports one session's failures."""
    def session(runs: list[Run], name: str, in_clone: bool) -> list[str]:
        tmp = tmp_path_factory.mktemp(name)
        # the README is read in the clone (`. .venv/bin/activate`); the banner pasted anywhere
        return run_session(runs, fresh_home(tmp, up), tmp, cwd=ROOT if in_clone else tmp)

    with ThreadPoolExecutor(max_workers=len(RUNNABLE) + 1) as pool:
        futures = {BLOCKS[i].where: pool.submit(session, readme_runs(i, up), f"block{i}", True) for i in RUNNABLE}
        futures["banner"] = pool.submit(session, banner_runs(banner_commands(up.out.read_text())), "banner", False)
        yield futures


@pytest.mark.parametrize("where", [BLOCKS[i].where for i in RUNNABLE])
def test_readme_block(where: str, sessions: dict[str, Future[list[str]]]) -> None:
    failures = sessions[where].result(timeout=600)
    assert not failures, "\n\n".join(failures)


def test_banner_commands(up: Up, sessions: dict[str, Future[list[str]]]) -> None:
    keys = [key for key, _ in banner_commands(up.out.read_text())]
    for key in ["aep-bridge demo", "aep-bridge hermes install", *BANNER_NOT_RUN, *BANNER_LONG, *BANNER_EXPECT]:
        assert key in keys, f"the banner no longer prints `{key}` (found: {keys}): update this test"
    failures = sessions["banner"].result(timeout=600)
    assert not failures, "\n\n".join(failures)


def test_every_listed_command_is_still_in_the_readme() -> None:
    """NOT_RUN, LONG, EXPECT and SUBSTITUTE name README text; when it goes, so must the entry."""
    texts = [c.text for b in BLOCKS for c in b.commands]
    for table in (NOT_RUN, LONG, EXPECT):
        for key in table:
            assert key in texts, f"`{key}` is listed in this test but no README code block prints it: remove it"
    for key in SUBSTITUTE:
        assert any(key in t for t in texts), f"SUBSTITUTE `{key}`: no README command has it any more: remove it"
    assert not set(NOT_RUN) & (set(LONG) | set(EXPECT)), "a command is either run or not"


def test_make_run_is_the_up_this_module_runs() -> None:
    """NOT_RUN["make run"] says the module runs what it runs: `make -n run` (what make would do,
    nothing done) ends with `.venv/bin/aep-bridge up --demo`."""
    done = subprocess.run(["make", "-n", "run"], cwd=ROOT, capture_output=True, text=True, timeout=30,
                          env={"PATH": FRESH_PATH})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == ".venv/bin/aep-bridge up --demo", done.stdout
