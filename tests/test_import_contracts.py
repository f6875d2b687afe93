"""The import rules of the bridge's folders, checked by import-linter (contracts in pyproject.toml).

They replace the hand-written purity checks: the core imports only the standard library and
msgspec and does no I/O, the shim's hook imports only the standard library, each folder
imports only the floors below it, no service imports another, and the services use the
runtime (bridge/runtime/) through its public module only (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).with_name("lint-imports")
CONTRACTS = [c["name"] for c in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]]


def lint(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(cwd), str(ROOT)])}
    return subprocess.run([str(LINT), "--no-cache", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


@pytest.fixture(scope="module")
def report() -> str:
    out = lint(ROOT)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    return text


def test_the_contracts_are_the_ones_the_issue_asks_for() -> None:
    assert len(CONTRACTS) == 8, CONTRACTS
    # issue 38: the exporter's partitions.py and service.py imported each other (one lazily)
    assert "No import cycle among the services' modules" in CONTRACTS, CONTRACTS
    # verify checks the streams against the simulation by itself: it reuses no service's code (issue 22)
    assert "The verifier imports no service" in CONTRACTS, CONTRACTS


@pytest.mark.parametrize("name", CONTRACTS)
def test_contract_is_kept(report: str, name: str) -> None:
    assert f"{name} KEPT" in report, report


def test_the_runtime_has_no_import_cycle() -> None:
    """Before issue 22 the runtime imported the profiler, which imported the runtime (for a type)."""
    import grimp

    graph = grimp.build_graph("bridge")
    modules = sorted(m for m in graph.modules if m.startswith("bridge.runtime."))
    assert "bridge.runtime.profiling" in modules and "bridge.runtime.lifecycle" in modules, modules
    cycles = [(a, b) for a in modules for b in modules
              if a < b and graph.chain_exists(a, b) and graph.chain_exists(b, a)]
    assert cycles == []


def test_the_allow_list_contract_reports_an_import_outside_it(tmp_path: Path) -> None:
    """A package whose core imports a third-party module (and the stdlib, which is fine)."""
    pkg = tmp_path / "probepkg"
    (pkg / "core").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "__init__.py").write_text("")
    (pkg / "core" / "ok.py").write_text("import json\nimport msgspec\nfrom probepkg.core import bad\n")
    (pkg / "core" / "bad.py").write_text("import hashlib\n\nimport structlog\n")
    (tmp_path / ".importlinter").write_text(
        "[importlinter]\nroot_package = probepkg\ninclude_external_packages = True\n"
        "contract_types =\n    allowed_imports: tests.support.import_contracts.AllowedImportsContract\n\n"
        "[importlinter:contract:core]\nname = core allow-list\ntype = allowed_imports\n"
        "source_modules =\n    probepkg.core\nallowed_modules =\n    probepkg.core\n    msgspec\n"
    )
    out = lint(tmp_path)
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert "core allow-list BROKEN" in text, text
    assert "probepkg.core.bad imports structlog (l.3)" in text, text
    assert "imports json" not in text and "imports msgspec" not in text and "imports hashlib" not in text, text
