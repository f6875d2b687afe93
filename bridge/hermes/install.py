"""Wire the shim into Hermes: ``aep-bridge hermes install | uninstall`` (``doctor``: bridge/hermes/doctor.py).

What ``install`` writes (and ``uninstall`` takes back, exactly):

* ``$HERMES_HOME/config.yaml``: one entry per event under ``hooks:``
  (``{command, timeout}``, the format of HERMES.md), edited round-trip with
  ruamel.yaml so the rest of the file, comments and indentation included, stays
  as it was. Entries already there are not duplicated.
* ``$HERMES_HOME/shell-hooks-allowlist.json``: the consent record for each
  ``(event, command)``, in Hermes's own format and under its lock protocol
  (``agent/shell_hooks.py``: ``{"approvals": [{event, command, approved_at,
  script_mtime_at_approval}]}``, sorted-keys JSON, ``flock`` on the sibling
  ``.lock`` file, atomic replace). Without it a non-interactive Hermes skips
  the hook silently.
* ``$HERMES_HOME/aep-bridge.env``: the ``AEP_BRIDGE_*`` settings for the shim (and the
  control plane's ``AEP_HERMES_CONTROL``, ``AEP_HERMES_GATE_TOOLS``, ``AEP_HERMES_HOLD_MS``,
  ``AEP_INSTRUCT`` when set; with the gate on, the ``pre_tool_call`` entry gets a timeout
  of hold + deadline + 5 s, checked against Hermes's 300 s clamp, and an explicit
  ``--timeout`` must be above hold + deadline)
  (``KEY=VALUE``, mode 0600: it may hold NATS credentials). The command passes
  it with ``--config``, so every Hermes home (profile) can have its own
  instance name and servers; variables in Hermes's environment still win.
* ``$HERMES_HOME/aep-bridge.install.json``: the manifest of what was added, so
  ``uninstall`` removes only that (a pre-existing approval or entry stays).

The command is ``<absolute python> -I -S <shim> --config <env file>``. By
default ``<shim>`` is the byte-compiled ``bridge/shim/hook.py`` (its standard
``__pycache__`` file, refreshed by every import of the module and by every
``install``): a script named on the command line is compiled on every run, which
measured ~11 ms per event for this file, more than the whole rest of the hook.
``--mode source`` registers ``hook.py`` itself; ``doctor`` checks that the
compiled file is current.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq

from bridge.config import BY_NAME, SettingError, load_environ

HOOK_SOURCE = Path(__file__).resolve().parent.parent / "shim" / "hook.py"
ALLOWLIST_FILENAME = "shell-hooks-allowlist.json"
ENV_FILENAME = "aep-bridge.env"
MANIFEST_FILENAME = "aep-bridge.install.json"

# Every event Hermes 0.19.0 can fire (its VALID_HOOKS); all of them appear in the observed
# corpus and the mapper maps every one (unknown ones to x.hermes.*).
ALL_EVENTS = (
    "on_session_start", "pre_llm_call", "pre_api_request", "post_api_request", "api_request_error",
    "pre_tool_call", "post_tool_call", "transform_terminal_output", "transform_tool_result",
    "transform_llm_output", "pre_approval_request", "post_approval_response", "subagent_start",
    "subagent_stop", "pre_verify", "post_llm_call", "on_session_end", "on_session_finalize",
    "on_session_reset", "pre_gateway_dispatch", "kanban_task_claimed", "kanban_task_completed",
    "kanban_task_blocked",
)

# The settings the shim reads; install copies those set in its own environment into the env file.
SHIM_SETTINGS = (
    "AEP_BRIDGE_NATS_URL", "AEP_BRIDGE_NATS_USER", "AEP_BRIDGE_NATS_PASSWORD", "AEP_BRIDGE_NATS_TOKEN",
    "AEP_BRIDGE_NATS_JWT",  # a fleet instance credential (`aep-bridge fleet issue`)
    "AEP_BRIDGE_TLS_CA", "AEP_BRIDGE_TLS_CERT", "AEP_BRIDGE_TLS_KEY", "AEP_BRIDGE_INSTANCE",
    "AEP_BRIDGE_SPOOL_DIR", "AEP_BRIDGE_DEADLINE_MS", "AEP_BRIDGE_MAX_FIELD_BYTES", "AEP_BRIDGE_SPOOL_MAX_BYTES",
    # the opt-in control plane (docs/ARCHITECTURE.md "Control plane")
    "AEP_HERMES_CONTROL", "AEP_HERMES_GATE_TOOLS", "AEP_HERMES_HOLD_MS", "AEP_INSTRUCT",
)
HERMES_MAX_TIMEOUT_S = 300  # Hermes clamps a hook's timeout to 1..300 s
HOLD_MARGIN_S = 5  # above hold + deadline: process start, the release round trip, a loaded host


class InstallError(RuntimeError):
    pass


def hermes_home(explicit: str | os.PathLike[str] | None = None) -> Path:
    """--hermes-home, else $HERMES_HOME, else ~/.hermes (Hermes's own resolution on POSIX)."""
    if explicit:
        return Path(explicit).expanduser().absolute()
    env = os.environ.get("HERMES_HOME", "").strip()
    return Path(env).expanduser().absolute() if env else Path.home() / ".hermes"


def installed_env_file(home: Path | None = None) -> Path | None:
    """The settings file the installed hook is registered with (``--config``) in ``home`` (default
    :func:`hermes_home`), or None when aep-bridge is not installed there."""
    home = hermes_home() if home is None else home
    manifest = Manifest.load(home)
    if manifest is None:
        return None
    return Path(manifest.env_file) if manifest.env_file else home / ENV_FILENAME


def default_timeout_s(deadline_ms: int) -> int:
    """Hermes's per-hook timeout: whole seconds, comfortably above the shim's own deadline."""
    return max(2, math.ceil(deadline_ms / 1000) + 2)


def _on(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def hold_ms_of(values: dict[str, str]) -> int | None:
    """The gate's hold window when AEP_HERMES_CONTROL is on in ``values`` (the shim's settings), else None."""
    if not _on(values.get("AEP_HERMES_CONTROL")):
        return None
    return shim_number(values, "AEP_HERMES_HOLD_MS")


def shim_number(values: dict[str, str], name: str) -> int:
    """The shim's integer setting ``name`` in ``values`` (unset or empty: its default); InstallError
    naming the variable and its range (the settings table's message) when it is not one."""
    raw = values.get(name)
    if not raw:
        return int(BY_NAME[name].default)
    try:
        return int(BY_NAME[name].parse(raw))
    except SettingError as exc:
        raise InstallError(str(exc)) from None


def gate_timeout_s(hold_ms: int, deadline_ms: int) -> int:
    """The pre_tool_call timeout with the gate on: the hold window, the publish deadline and a margin."""
    return math.ceil((hold_ms + deadline_ms) / 1000) + HOLD_MARGIN_S


def check_gate_timeout(timeout_s: int, hold_ms: int, deadline_ms: int) -> None:
    """The invariant of the gate: Hermes must never kill a hook that is still holding (it would
    proceed without a word, and the gate would record a dismissal)."""
    if timeout_s > HERMES_MAX_TIMEOUT_S:
        raise InstallError(
            f"AEP_HERMES_HOLD_MS={hold_ms} needs a pre_tool_call timeout of {timeout_s} s, above the {HERMES_MAX_TIMEOUT_S} s "
            "Hermes clamps hook timeouts to: shorten the hold window"
        )
    if timeout_s * 1000 <= hold_ms + deadline_ms:
        raise InstallError(
            f"the pre_tool_call timeout ({timeout_s} s) must be above the hold window AEP_HERMES_HOLD_MS ({hold_ms} ms) "
            f"plus AEP_BRIDGE_DEADLINE_MS ({deadline_ms} ms): Hermes would kill a hook still waiting for the operator"
        )


# ---------------------------------------------------------------- the command


def compile_hook(python: str, target: Path | None = None) -> Path:
    """Byte-compile hook.py with ``python`` (its magic number must match the interpreter that
    runs it). Default target: the standard __pycache__ file, else a per-user data directory."""
    code = (
        "import importlib.util, py_compile, sys\n"
        "src, dst = sys.argv[1], sys.argv[2] or importlib.util.cache_from_source(sys.argv[1])\n"
        "print(py_compile.compile(src, cfile=dst, doraise=True))\n"
    )
    targets = [str(target)] if target else ["", str(_data_dir() / "hook.pyc")]
    last = ""
    for dst in targets:
        proc = subprocess.run(
            [python, "-I", "-c", code, str(HOOK_SOURCE), dst], capture_output=True, text=True, timeout=60
        )
        if proc.returncode == 0:
            return Path(proc.stdout.strip().splitlines()[-1])
        last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
    raise InstallError(f"cannot byte-compile {HOOK_SOURCE} with {python}: {last}")


def _data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share")
    return Path(base) / "aep-bridge"


def build_command(python: str, script: Path, env_file: Path) -> str:
    return shlex.join([python, "-I", "-S", str(script), "--config", str(env_file)])


def pyc_is_current(pyc: Path, source: Path = HOOK_SOURCE) -> tuple[bool, str]:
    """Whether a timestamp-based pyc matches the source's mtime and size (its header)."""
    try:
        head = pyc.read_bytes()[:16]
        st = source.stat()
    except OSError as exc:
        return False, str(exc)
    flags = int.from_bytes(head[4:8], "little")
    if flags & 1:  # hash-based pyc: compare the source hash

        ok = head[8:16] == importlib.util.source_hash(source.read_bytes())
        return ok, "source hash " + ("matches" if ok else "differs")
    mtime = int.from_bytes(head[8:12], "little")
    size = int.from_bytes(head[12:16], "little")
    ok = mtime == (int(st.st_mtime) & 0xFFFFFFFF) and size == (st.st_size & 0xFFFFFFFF)
    return ok, "compiled from the current hook.py" if ok else "compiled from an older hook.py"


# ---------------------------------------------------------------- config.yaml, round trip


def _yaml() -> Any:
    y = YAML()  # round-trip: comments, key order, quotes and flow style survive
    y.preserve_quotes = True
    y.width = 1 << 16  # never fold a long command line
    return y


def _guess_indent(text: str) -> tuple[int, int, int]:
    """(mapping, sequence, offset) indentation of an existing file, for ruamel's ``indent()``,
    measured at the first nested mapping and the first block sequence; else Hermes's style
    (2, 4, 2). ruamel applies one style to the whole file, so guessing it keeps a file
    written in one style byte-identical."""
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    mapping = sequence = offset = None

    def col(line: str) -> int:
        return len(line) - len(line.lstrip(" "))

    for prev, cur in zip(lines, lines[1:]):
        head = prev.split(" #", 1)[0].rstrip()
        body = cur.lstrip(" ")
        base = col(prev) + (2 if prev.lstrip().startswith("- ") else 0)
        if not head.endswith(":") or col(cur) < base or (col(cur) == base and not body.startswith("- ")):
            continue
        if body.startswith("- "):
            if sequence is None:
                offset = col(cur) - base
                sequence = offset + 2 + (len(body[2:]) - len(body[2:].lstrip(" ")))
        elif mapping is None:
            mapping = col(cur) - base
        if mapping is not None and sequence is not None:
            break
    mapping = mapping or 2
    if sequence is None or offset is None or sequence < offset + 2:
        sequence, offset = mapping + 2, mapping
    return mapping, sequence, offset


def load_config_yaml(path: Path) -> tuple[Any, Any]:
    """(document, yaml instance) of a config.yaml; an absent or empty file is an empty map."""
    y = _yaml()
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    m, s, o = _guess_indent(text)
    y.indent(mapping=m, sequence=s, offset=o)
    doc = y.load(text) if text.strip() else None
    if doc is None:
        doc = CommentedMap()
    if not isinstance(doc, dict):
        raise InstallError(f"{path} does not hold a YAML mapping; refusing to edit it")
    return doc, y


def _atomic_write(path: Path, data: bytes, mode: int | None = None) -> None:
    real = Path(os.path.realpath(path))  # keep a symlinked config.yaml a symlink
    real.parent.mkdir(parents=True, exist_ok=True)
    if mode is None:
        try:
            mode = real.stat().st_mode & 0o7777
        except FileNotFoundError:
            mode = 0o644
    fd, tmp = tempfile.mkstemp(prefix=real.name + ".", suffix=".tmp", dir=str(real.parent))
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, real)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def save_config_yaml(path: Path, doc: Any, y: Any) -> None:
    buf = io.StringIO()
    y.dump(doc, buf)
    _atomic_write(path, buf.getvalue().encode("utf-8"))


# ---------------------------------------------------------------- the allowlist (Hermes's format)


@contextlib.contextmanager
def locked_allowlist(home: Path) -> Iterator[dict[str, Any]]:
    """Read-modify-write of the allowlist under Hermes's lock (flock on ``<file>.lock``);
    the yielded dict is written back (``indent=2, sort_keys=True``) when the block ends."""
    import fcntl

    path = home / ALLOWLIST_FILENAME
    home.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(path.suffix + ".lock"), "a+", encoding="utf-8") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            data = read_allowlist(home)
            yield data
            _atomic_write(path, json.dumps(data, indent=2, sort_keys=True).encode("utf-8"))
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def read_allowlist(home: Path) -> dict[str, Any]:
    """As ``agent.shell_hooks.load_allowlist``: a broken or absent file is an empty skeleton."""
    try:
        raw = json.loads((home / ALLOWLIST_FILENAME).read_text())
    except (FileNotFoundError, json.JSONDecodeError, OSError):
        return {"approvals": []}
    if not isinstance(raw, dict):
        return {"approvals": []}
    if not isinstance(raw.get("approvals"), list):
        raw["approvals"] = []
    return raw


def is_approved(data: dict[str, Any], event: str, command: str) -> bool:
    return any(
        isinstance(e, dict) and e.get("event") == event and e.get("command") == command
        for e in data.get("approvals", [])
    )


def command_script_path(command: str) -> str:
    """Which token Hermes treats as the script (``agent.shell_hooks._command_script_path``)."""
    try:
        from agent.shell_hooks import _command_script_path  # the real rule, when Hermes is importable

        return _command_script_path(command)
    except ImportError:
        pass
    parts = shlex.split(command)
    exts = (".sh", ".bash", ".zsh", ".fish", ".py", ".pyw", ".rb", ".pl", ".lua", ".js", ".mjs", ".cjs", ".ts")
    for part in parts:
        if part.lower().endswith(exts):
            return part
    for part in parts:
        if "/" in part or part.startswith("~"):
            return part
    return parts[0] if parts else command


def _utc_iso(ts: float | None = None) -> str:
    when = datetime.now(tz=timezone.utc) if ts is None else datetime.fromtimestamp(ts, tz=timezone.utc)
    return when.isoformat().replace("+00:00", "Z")


def approval_entry(event: str, command: str) -> dict[str, Any]:
    script = os.path.expanduser(command_script_path(command))
    try:
        mtime: str | None = _utc_iso(os.path.getmtime(script))
    except OSError:
        mtime = None
    return {"event": event, "command": command, "approved_at": _utc_iso(), "script_mtime_at_approval": mtime}


# ---------------------------------------------------------------- env file


def write_env_file(path: Path, values: dict[str, str]) -> None:
    """Set ``values`` in a KEY=VALUE file, keeping its other lines; mode 0600."""
    lines: list[str] = []
    seen: set[str] = set()
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            key = line.split("=", 1)[0].strip().removeprefix("export ").strip() if "=" in line else None
            if key in values and not line.lstrip().startswith("#"):
                lines.append(f"{key}={_quote(values[key])}")
                seen.add(key)
            else:
                lines.append(line)
    else:
        lines.append("# aep-bridge settings for the Hermes shell hook (read by bridge/shim/hook.py).")
        lines.append("# Written by `aep-bridge hermes install`; variables in Hermes's environment win over these.")
    for key, value in values.items():
        if key not in seen:
            lines.append(f"{key}={_quote(value)}")
    _atomic_write(path, ("\n".join(lines) + "\n").encode("utf-8"), mode=0o600)


def _quote(value: str) -> str:
    return f'"{value}"' if (value != value.strip() or "#" in value) and '"' not in value else value


# ---------------------------------------------------------------- install / uninstall


@dataclass
class Manifest:
    """What install added, so uninstall can take exactly that back."""

    command: str
    events: list[str] = field(default_factory=list)  # events whose entry install appended
    created_events: list[str] = field(default_factory=list)  # event keys install created
    hooks_key: str = "present"  # "absent" | "null" | "present": the hooks key before install
    config_created: bool = False
    approvals: list[str] = field(default_factory=list)  # events whose approval install recorded
    allowlist_created: bool = False
    config_blank: bool = False  # the file existed but held nothing
    env_file: str = ""
    env_file_created: bool = False
    mode: str = "compiled"
    script: str = ""
    python: str = ""

    @classmethod
    def load(cls, home: Path) -> "Manifest | None":
        try:
            data = json.loads((home / MANIFEST_FILENAME).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})

    def save(self, home: Path) -> None:
        _atomic_write(home / MANIFEST_FILENAME, json.dumps(self.__dict__, indent=2).encode("utf-8"), mode=0o600)


@dataclass
class InstallResult:
    command: str
    config_path: Path
    env_file: Path
    added: list[str]
    already: list[str]
    approved: list[str]


def install(
    home: Path,
    events: list[str] | None = None,
    python: str | None = None,
    mode: str = "compiled",
    timeout: int | None = None,
    settings: dict[str, str] | None = None,
) -> InstallResult:
    """Register the shim for ``events`` in ``home``; idempotent. A previous install with a
    different command is uninstalled first."""
    events = list(dict.fromkeys(events or ALL_EVENTS))
    python = python or sys.executable
    if not os.path.isabs(python):
        raise InstallError(f"--python must be an absolute path (Hermes runs it without a shell): {python}")
    if not os.access(python, os.X_OK):
        raise InstallError(f"{python} is not an executable interpreter")
    _check_events(events)
    effective = load_environ() if settings is None else dict(settings)
    values = {k: effective[k] for k in SHIM_SETTINGS if effective.get(k)}
    values.setdefault("AEP_BRIDGE_NATS_URL", "nats://127.0.0.1:4222")
    deadline_ms = shim_number(values, "AEP_BRIDGE_DEADLINE_MS")
    explicit = timeout
    timeout = timeout or default_timeout_s(deadline_ms)
    if timeout * 1000 <= deadline_ms:
        raise InstallError(f"the hook timeout ({timeout} s) must be above AEP_BRIDGE_DEADLINE_MS ({deadline_ms} ms)")
    timeouts = {event: timeout for event in events}
    hold_ms = hold_ms_of(values)
    if hold_ms is not None and "pre_tool_call" in timeouts:  # the gate holds pre_tool_call: a longer leash
        timeouts["pre_tool_call"] = explicit or max(timeout, gate_timeout_s(hold_ms, deadline_ms))
        check_gate_timeout(timeouts["pre_tool_call"], hold_ms, deadline_ms)

    if mode not in ("compiled", "source"):
        raise InstallError(f"unknown mode {mode!r} (compiled or source)")
    script = compile_hook(python) if mode == "compiled" else HOOK_SOURCE
    env_file = home / ENV_FILENAME
    command = build_command(python, script, env_file)

    previous = Manifest.load(home)
    if previous is not None and previous.command != command:
        uninstall(home, keep_env_file=True)
        previous = None

    home.mkdir(parents=True, exist_ok=True)
    env_created = not env_file.exists() if previous is None else previous.env_file_created
    write_env_file(env_file, values)

    config_path = home / "config.yaml"
    config_created = not config_path.exists() if previous is None else previous.config_created
    doc, y = load_config_yaml(config_path)

    manifest = previous or Manifest(command=command)
    manifest.command, manifest.mode, manifest.script, manifest.python = command, mode, str(script), python
    manifest.env_file, manifest.env_file_created, manifest.config_created = str(env_file), env_created, config_created
    if previous is None:
        manifest.hooks_key = "absent" if "hooks" not in doc else ("null" if doc["hooks"] is None else "present")
        manifest.config_blank = config_path.exists() and not config_path.read_text(encoding="utf-8").strip()
    hooks = doc.get("hooks")
    if hooks is None:
        hooks = doc["hooks"] = CommentedMap()
    if not isinstance(hooks, dict):
        raise InstallError(f"{config_path}: 'hooks' is not a mapping; fix it by hand first")
    added, already = [], []
    for event in events:
        entries = hooks.get(event)
        if entries is None:
            entries = hooks[event] = CommentedSeq()
            if event not in manifest.created_events:
                manifest.created_events.append(event)
        if not isinstance(entries, list):
            raise InstallError(f"{config_path}: hooks.{event} is not a list; fix it by hand first")
        ours = [e for e in entries if isinstance(e, dict) and e.get("command") == command]
        if ours:
            for e in ours:  # ours: keep the timeout in step with the settings (the gate needs a longer one)
                if e.get("timeout") != timeouts[event]:
                    e["timeout"] = timeouts[event]
            already.append(event)
            continue
        entry = CommentedMap()
        entry["command"] = command
        entry["timeout"] = timeouts[event]
        entries.append(entry)
        added.append(event)
        if event not in manifest.events:
            manifest.events.append(event)
    save_config_yaml(config_path, doc, y)

    approved = []
    if previous is None:
        manifest.allowlist_created = not (home / ALLOWLIST_FILENAME).exists()
    with locked_allowlist(home) as data:
        for event in events:
            if is_approved(data, event, command):
                continue
            data["approvals"].append(approval_entry(event, command))
            approved.append(event)
            if event not in manifest.approvals:
                manifest.approvals.append(event)
    manifest.save(home)
    return InstallResult(command, config_path, env_file, added, already, approved)


def _check_events(events: list[str]) -> None:
    try:
        from hermes_cli.plugins import VALID_HOOKS
    except ImportError:
        VALID_HOOKS = set(ALL_EVENTS)
    unknown = [e for e in events if e not in VALID_HOOKS]
    if unknown:
        raise InstallError(f"unknown Hermes hook event(s): {', '.join(unknown)} (valid: {', '.join(sorted(VALID_HOOKS))})")


def uninstall(home: Path, keep_env_file: bool = False) -> list[str]:
    """Remove what ``install`` added (per its manifest). Returns what was done, as lines."""
    manifest = Manifest.load(home)
    if manifest is None:
        raise InstallError(f"nothing to uninstall: no {MANIFEST_FILENAME} in {home}")
    done: list[str] = []
    config_path = home / "config.yaml"
    if config_path.exists():
        doc, y = load_config_yaml(config_path)
        hooks = doc.get("hooks")
        if isinstance(hooks, dict):
            for event in manifest.events:
                entries = hooks.get(event)
                if isinstance(entries, list):
                    keep = [e for e in entries if not (isinstance(e, dict) and e.get("command") == manifest.command)]
                    if len(keep) != len(entries):
                        done.append(f"removed the hooks.{event} entry")
                        while len(entries) > len(keep):
                            for i, e in enumerate(entries):
                                if isinstance(e, dict) and e.get("command") == manifest.command:
                                    del entries[i]
                                    break
                    if not entries and event in manifest.created_events:
                        del hooks[event]
            if not hooks and manifest.hooks_key != "present":
                if manifest.hooks_key == "absent":
                    del doc["hooks"]
                else:
                    doc["hooks"] = None
        if manifest.config_created and not doc:
            config_path.unlink()
            done.append(f"removed {config_path} (install created it)")
        elif manifest.config_blank and not doc:
            _atomic_write(config_path, b"")
        else:
            save_config_yaml(config_path, doc, y)
    with locked_allowlist(home) as data:
        before = len(data["approvals"])
        data["approvals"] = [
            e for e in data["approvals"]
            if not (isinstance(e, dict) and e.get("command") == manifest.command and e.get("event") in manifest.approvals)
        ]
        if before != len(data["approvals"]):
            done.append(f"revoked {before - len(data['approvals'])} approval(s) in {ALLOWLIST_FILENAME}")
        remove_allowlist = manifest.allowlist_created and data == {"approvals": []}
    if remove_allowlist:  # install created it and nothing else is in it now
        for path in (home / ALLOWLIST_FILENAME, home / (ALLOWLIST_FILENAME + ".lock")):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
    env_file = Path(manifest.env_file) if manifest.env_file else None
    if env_file and manifest.env_file_created and not keep_env_file and env_file.exists():
        env_file.unlink()
        done.append(f"removed {env_file}")
    (home / MANIFEST_FILENAME).unlink()
    return done
