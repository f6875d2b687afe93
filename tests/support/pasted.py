"""Commands run as a user pastes them (issue 38): in a clean shell (`env -i` with only PATH and
HOME, as a fresh machine has them), one session of commands in order, each checked: a command
that ends must exit with its code, print something and show no traceback; one that runs until
stopped (`Long`) must print what it should, live a little, and end on SIGTERM. And the parser of
`aep-bridge up`'s banner, whose commands must work pasted as printed.

Used by tests/commands/test_readme_commands.py (the README and `up --demo --gate`) and
tests/stack/test_up_fleet.py (`up --fleet`)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.support.cli import ROOT

FRESH_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # a fresh Debian/Ubuntu login
TRACEBACK = "Traceback (most recent call last)"
FIRST_OUTPUT_S = 30.0  # how long a long-running command may take to print what it should
MIN_RUN_S = 3.0  # ... runs at least this long before it is stopped (a crash just after its first line shows)
STOP_S = 15.0  # ... and must end this soon after SIGTERM


@dataclass(frozen=True)
class Long:
    """A command that runs until stopped: `first` (a regex) must show in its output within
    FIRST_OUTPUT_S, it must not fail before MIN_RUN_S, then SIGTERM must end it within STOP_S."""
    first: str  # "": nothing to wait for (it must still live MIN_RUN_S)
    why: str
    env: Callable[[], dict[str, str]] = dict  # isolation only: ports of its own on a shared machine


@dataclass(frozen=True)
class Expect:
    output: str = r"\S"  # a regex the output (stdout, then stderr) must match
    code: int = 0
    forbid: str | None = None  # a regex it must not match
    why: str = ""


@dataclass(frozen=True)
class Command:
    text: str  # as printed: continuation lines joined, its comment dropped
    where: str
    setup: bool = False  # changes the shell: runs before every command after it


@dataclass(frozen=True)
class Run:
    key: str  # how a test's tables name it
    script: str  # what the shell runs: the setup lines before it, then the command
    spec: Long | Expect
    where: str
    stdin: str | None = None


# -- up's banner ---------------------------------------------------------------------------------------

# settings, then the CLI as up prints it (a path, `python -m bridge.cli`, or bare), then its
# arguments up to the end or a `   (comment)`
BANNER_COMMAND = re.compile(r"(?<!\S)(?:[A-Z][A-Z0-9_]*=\S+ )*(?P<cli>(?:\S*/)?aep-bridge|\S+ -m bridge\.cli)(?= |$)(?: \S.*?)?(?=\s{3}\(|$)")
# a subshell that runs the CLI: `(set -a; . ./NAME.env; .../aep-bridge hermes install)`
SUBSHELL = re.compile(r"(?<!\S)\([^()]*(?:(?<=[\s/])aep-bridge|-m bridge\.cli)(?= )[^()]*\)(?=\s{3}\(|$)")
CLI = re.compile(r"(?<!\S)(?:\S*/)?aep-bridge(?= |\)|$)|(?<!\S)\S+ -m bridge\.cli(?= |\)|$)")
HOOK = re.compile(r'^\s*- command: "(?P<command>.+)"$')
HOOK_KEY = "hooks: - command"


def banner_key(command: str, state_dir: Path | None) -> str:
    """How a test names a banner command: no settings before the CLI, the CLI written
    `aep-bridge`, up's state directory written STATE."""
    key = CLI.sub("aep-bridge", command)
    key = re.sub(r"^(?:[A-Z][A-Z0-9_]*=\S+ )+", "", key)
    return key.replace(str(state_dir), "STATE") if state_dir else key


def banner_commands(out: str, state_dir: Path | None = None) -> list[tuple[str, Command]]:
    """The commands in up's banner (from its first blank line to `stop`), each with its key
    (banner_key): a line's command with its settings, or its subshell; the hook command it
    writes into config.yaml; and the `...` templates."""
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
        found = [m.group(0) for m in SUBSHELL.finditer(line)] or [m.group(0) for m in BANNER_COMMAND.finditer(line)]
        commands += [(banner_key(c, state_dir), Command(c, f"banner: {label}")) for c in found]
        for span in re.findall(r"`([^`]+ [^`]+)`", line):
            commands.append((banner_key(span, state_dir), Command(span, f"banner: {label}")))
    return commands


# -- running -------------------------------------------------------------------------------------------


def clean_shell(home: Path, script: str, extra: dict[str, str] | None = None) -> list[str]:
    """`script` in bash (-e) in a clean environment: PATH and HOME as a fresh machine has them."""
    env = [f"PATH={FRESH_PATH}", f"HOME={home}", *(f"{k}={v}" for k, v in (extra or {}).items())]
    return ["env", "-i", *env, "bash", "-ec", script]


class Background:
    """A long-running command: its output in files, read as it comes."""

    def __init__(self, argv: list[str], tmp: Path, name: str, cwd: Path) -> None:
        self.out, self.err = tmp / f"{name}.out", tmp / f"{name}.err"
        with self.out.open("wb") as out, self.err.open("wb") as err:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, cwd=cwd,
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
            return f"still running {STOP_S:.0f} s after SIGTERM:\n{text[-2000:]}"
        return None


def checked(done: subprocess.CompletedProcess[str], expect: Expect) -> str | None:
    text = done.stdout + done.stderr
    if done.returncode != expect.code:
        return f"exit code {done.returncode}, expected {expect.code}:\n{text[-2000:]}"
    if TRACEBACK in text:
        return f"a traceback:\n{text[-2000:]}"
    if not text.strip():
        return "no output"
    if not re.search(expect.output, done.stdout) and not re.search(expect.output, done.stderr):
        return f"no /{expect.output}/ in its output:\n{text[-2000:]}"
    if expect.forbid and re.search(expect.forbid, text):
        return f"/{expect.forbid}/ in its output:\n{text[-2000:]}"
    return None


def finish(argv: list[str], stdin: str | None, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess[str] | str:
    """Run to its end (its whole process group killed after `timeout`: a command that does not
    end is a failure, or a Long)."""
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, start_new_session=True)
    try:
        out, err = proc.communicate(stdin, timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return f"still running after {timeout:.0f} s (if it runs until stopped, it is a Long):\n{(out + err)[-2000:]}"
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def run_session(runs: list[Run], home: Path, tmp: Path, cwd: Path = ROOT) -> list[str]:
    """Run each in order in one HOME and working directory; a Long starts in the background and
    is checked once the others ran. Returns every failure, each naming its command."""
    failures: list[str] = []
    background: list[tuple[Run, Background]] = []
    try:
        for i, run in enumerate(runs):
            if isinstance(run.spec, Long):
                argv = clean_shell(home, run.script, run.spec.env())
                background.append((run, Background(argv, tmp, f"long{i}", cwd)))
                continue
            done = finish(clean_shell(home, run.script), run.stdin, cwd)
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
