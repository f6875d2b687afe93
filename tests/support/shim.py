"""Run the shim the way Hermes does (``<python> -I -S <file>``, stdin in, stdout out)."""

from __future__ import annotations

import json
import os
import py_compile
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HOOK_SOURCE = ROOT / "bridge" / "shim" / "hook.py"


@lru_cache(maxsize=1)
def compiled_hook() -> Path:
    """hook.py byte-compiled into a private directory (what `hermes install` registers)."""
    import hashlib

    tag = hashlib.sha256(HOOK_SOURCE.read_bytes() + sys.version.encode()).hexdigest()[:12]
    out = Path(tempfile.gettempdir()) / f"aep-bridge-test-hook-{tag}.pyc"
    if not out.exists():
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        py_compile.compile(str(HOOK_SOURCE), cfile=str(tmp), doraise=True)
        os.replace(tmp, out)
    return out


def shim_env(url: str, spool_dir: str | os.PathLike[str], instance: str, **settings: Any) -> dict[str, str]:
    """A clean environment for the hook: no user config file, only the given settings."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(spool_dir),
        "AEP_BRIDGE_CONFIG": os.devnull,
        "AEP_BRIDGE_NATS_URL": url,
        "AEP_BRIDGE_SPOOL_DIR": str(spool_dir),
        "AEP_BRIDGE_INSTANCE": instance,
        "TMPDIR": str(Path(spool_dir) / "tmp"),  # the fallback spool's parent: private to the test
    }
    for key, value in settings.items():
        env[key if key.startswith("AEP_BRIDGE_") else "AEP_BRIDGE_" + key.upper()] = str(value)
    return env


@dataclass
class HookRun:
    stdout: bytes
    stderr: bytes
    returncode: int
    elapsed: float  # seconds, wall clock around the process (start-up included)

    @property
    def answered_empty_object(self) -> bool:
        return self.returncode == 0 and self.stdout.strip() == b"{}"


def run_hook(data: bytes | str, env: dict[str, str], script: Path | None = None, args: list[str] | None = None,
             timeout: float = 30.0) -> HookRun:
    if isinstance(data, str):
        data = data.encode("utf-8")
    cmd = [sys.executable, "-I", "-S", str(script or compiled_hook()), *(args or [])]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, input=data, env=env, capture_output=True, timeout=timeout)
    return HookRun(proc.stdout, proc.stderr, proc.returncode, time.perf_counter() - t0)


def envelope(hook: str = "pre_tool_call", session: str = "s1", **extra: Any) -> dict[str, Any]:
    return {
        "hook_event_name": hook,
        "tool_name": "terminal" if "tool" in hook else None,
        "tool_input": {"command": "echo hi"} if "tool" in hook else None,
        "session_id": session,
        "cwd": "/home/dev/proj",
        "extra": {"telemetry_schema_version": "hermes.observer.v1", **extra},
    }


def dumps(obj: Any) -> bytes:
    """As Hermes serialises the stdin payload."""
    return json.dumps(obj, ensure_ascii=False, default=str).encode("utf-8")
