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

Everything else must exit 0 with output on stdout and no traceback. A README block is one shell
session in a fresh HOME (whose state directory is the running up's, as on the machine that ran
`make run`); its setup lines (assignments, `export`, `. FILE`) and those of every block above it
run before each command, as in a reader's terminal. The banner is one session too, without any
of the README's setup. The sessions run at once (module fixture `sessions`), each test reports
one. What the test adds to a clean shell: a ~/.curlrc that makes an HTTP error fail a `curl`,
and for the exporter lines (LONG) ports of their own.
"""

from __future__ import annotations

import json
import os
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

README = ROOT / "README.md"
VENV_BIN = ROOT / ".venv" / "bin"  # where `make run` / `make test` install (Makefile VENV)
FRESH_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # a fresh Debian/Ubuntu login
TRACEBACK = "Traceback (most recent call last)"
FIRST_OUTPUT_S = 30.0  # how long a long-running command may take to print what it should
STOP_S = 15.0  # ... and to end after SIGTERM
MIN_RUN_S = 3.0  # ... and runs at least this long before it is stopped (a crash just after its first line shows)

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


@dataclass(frozen=True)
class Long:
    """A command that runs until stopped: `first` (a regex) must show in its output within
    FIRST_OUTPUT_S, it must not fail before MIN_RUN_S, then SIGTERM must end it within STOP_S."""
    first: str
    why: str
    env: Callable[[], dict[str, str]] = dict  # isolation only: ports of its own on a shared machine


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


@dataclass(frozen=True)
class Expect:
    output: str = r"\S"  # a regex the output (stdout, then stderr) must match
    code: int = 0
    forbid: str | None = None  # a regex it must not match
    why: str = ""


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
    "hooks: - command": Expect(r"^\{\}\s*$"),
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


@dataclass(frozen=True)
class Command:
    text: str  # as printed: continuation lines joined, its comment dropped
    where: str
    setup: bool = False  # changes the shell: runs before every command after it


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


# settings, then the CLI as up prints it (a path, `python -m bridge.cli`, or bare), then its
# arguments up to the end or a `   (comment)`
BANNER_COMMAND = re.compile(r"(?<!\S)(?:[A-Z][A-Z0-9_]*=\S+ )*(?P<cli>(?:\S*/)?aep-bridge|\S+ -m bridge\.cli)(?= |$)(?: \S.*?)?(?=\s{3}\(|$)")
HOOK = re.compile(r'^\s*- command: "(?P<command>.+)"$')
HOOK_KEY = "hooks: - command"


def banner_commands(out: str) -> list[tuple[str, Command]]:
    """The commands in up's banner (from its first blank line to `stop`), each with its key: a
    line's command with its settings (key: without them, up's path to the CLI written
    `aep-bridge`), the hook command it writes into config.yaml, and the `...` templates."""
    lines = out.splitlines()
    commands = []
    label = ""
    for line in lines[lines.index("") + 1:]:
        if line.startswith("  stop "):
            break
        if line[2:3].strip():
            label = line[2:17].strip()
        hook = HOOK.match(line)
        if hook:
            commands.append((HOOK_KEY, Command(hook["command"], f"banner: {label}: hooks")))
            continue
        for m in BANNER_COMMAND.finditer(line):
            commands.append(("aep-bridge" + line[m.end("cli"):m.end()], Command(m.group(0), f"banner: {label}")))
        for span in re.findall(r"`([^`]+ [^`]+)`", line):
            commands.append((span, Command(span, f"banner: {label}")))
    return commands


# -- running -------------------------------------------------------------------------------------


def clean_shell(home: Path, script: str, extra: dict[str, str] | None = None) -> list[str]:
    """`script` in bash in a clean environment: PATH and HOME as a fresh machine has them."""
    env = [f"PATH={FRESH_PATH}", f"HOME={home}", *(f"{k}={v}" for k, v in (extra or {}).items())]
    return ["env", "-i", *env, "bash", "-ec", script]


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


class Background:
    """A long-running command: its output in files, read as it comes."""

    def __init__(self, argv: list[str], tmp: Path, name: str) -> None:
        self.out, self.err = tmp / f"{name}.out", tmp / f"{name}.err"
        with self.out.open("wb") as out, self.err.open("wb") as err:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, cwd=ROOT,
                                         start_new_session=True)
        self.started = time.monotonic()

    def output(self) -> str:
        return self.out.read_text(errors="replace") + self.err.read_text(errors="replace")

    def check(self, spec: Long) -> str | None:
        """Why it failed (no first output in time, an early exit, a traceback, no end on SIGTERM)."""
        while not re.search(spec.first, self.output()) and self.proc.poll() is None:
            if time.monotonic() - self.started > FIRST_OUTPUT_S:
                break
            time.sleep(0.2)
        # it printed what it should; it must keep running (or end well) a little beyond that
        while self.proc.poll() is None and time.monotonic() - self.started < MIN_RUN_S:
            time.sleep(0.2)
        early = self.proc.poll()
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(STOP_S)
            stopped = True
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            stopped = False
        text = self.output()
        if not re.search(spec.first, text):
            return (f"no /{spec.first}/ in its output within {FIRST_OUTPUT_S:.0f} s"
                    + (f" (it exited with code {early})" if early is not None else "") + f":\n{text[-2000:]}")
        if early not in (None, 0):
            return f"exited with code {early}:\n{text[-2000:]}"
        if TRACEBACK in text:
            return f"a traceback:\n{text[-2000:]}"
        if not stopped:
            return f"still running {STOP_S:.0f} s after SIGTERM"
        return None


def checked(done: subprocess.CompletedProcess[str], expect: Expect) -> str | None:
    text = done.stdout + done.stderr
    if done.returncode != expect.code:
        return f"exit code {done.returncode}, expected {expect.code}:\n{text[-2000:]}"
    if TRACEBACK in text:
        return f"a traceback:\n{text[-2000:]}"
    if not done.stdout.strip():
        return f"no output on stdout:\n{text[-2000:]}"
    if not re.search(expect.output, done.stdout) and not re.search(expect.output, done.stderr):
        return f"no /{expect.output}/ in its output:\n{text[-2000:]}"
    if expect.forbid and re.search(expect.forbid, text):
        return f"/{expect.forbid}/ in its output:\n{text[-2000:]}"
    return None


def finish(argv: list[str], stdin: str | None, timeout: float = 60) -> subprocess.CompletedProcess[str] | str:
    """Run to its end (its whole process group killed after `timeout`: a command that does not
    end is a failure, or belongs in LONG)."""
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True)
    try:
        out, err = proc.communicate(stdin, timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return f"still running after {timeout:.0f} s (if it runs until stopped, list it in LONG):\n{(out + err)[-2000:]}"
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


@dataclass(frozen=True)
class Run:
    key: str  # how the tables above name it
    script: str  # what the shell runs: the setup lines before it, then the command, substituted
    spec: Long | Expect
    where: str
    stdin: str | None = None


def run_session(runs: list[Run], home: Path, tmp: Path) -> list[str]:
    """Run each in order in one HOME; a Long starts in the background and is checked once the
    others ran. Returns every failure, each naming its command."""
    failures: list[str] = []
    background: list[tuple[Run, Background]] = []
    try:
        for i, run in enumerate(runs):
            if isinstance(run.spec, Long):
                background.append((run, Background(clean_shell(home, run.script, run.spec.env()), tmp, f"long{i}")))
                continue
            done = finish(clean_shell(home, run.script), run.stdin)
            why = done if isinstance(done, str) else checked(done, run.spec)
            if why:
                failures.append(f"{run.where}: `{run.key}`: {why}")
        for run, bg in background:
            assert isinstance(run.spec, Long)
            why = bg.check(run.spec)
            if why:
                failures.append(f"{run.where}: `{run.key}`: {why}")
    finally:  # nothing left running, whatever happened
        for _, bg in background:
            if bg.proc.poll() is None:
                os.killpg(bg.proc.pid, signal.SIGKILL)
                bg.proc.wait()
    return failures


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
    def session(runs: list[Run], name: str) -> list[str]:
        tmp = tmp_path_factory.mktemp(name)
        return run_session(runs, fresh_home(tmp, up), tmp)

    with ThreadPoolExecutor(max_workers=len(RUNNABLE) + 1) as pool:
        futures = {BLOCKS[i].where: pool.submit(session, readme_runs(i, up), f"block{i}") for i in RUNNABLE}
        futures["banner"] = pool.submit(session, banner_runs(banner_commands(up.out.read_text())), "banner")
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
                          env={"PATH": FRESH_PATH, "HOME": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == ".venv/bin/aep-bridge up --demo", done.stdout
