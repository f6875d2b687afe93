"""The import rules of the bridge's folders, checked by import-linter (contracts in pyproject.toml).

They replace the hand-written purity checks: the core imports only the standard library and
msgspec and does no I/O, the shim's hook imports only the standard library, each folder
imports only the floors below it, no service imports another, and the services import only
the runtime (bridge/runtime/, through its public module: the doorway to NATS and the settings),
the core and their own package (docs/ARCHITECTURE.md).
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
    assert len(CONTRACTS) == 9, CONTRACTS
    # issue 38: services reached bridge.nats and bridge.config directly (48 imports in 20 modules)
    assert "Services import only the runtime, the core and their own package" in CONTRACTS, CONTRACTS
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


def lint_probe(tmp_path: Path, files: dict[str, str], contract: str) -> str:
    """lint-imports over a package ``probepkg`` of ``files`` (path -> text; every folder gets its
    __init__.py) with one allow-list contract (``contract``: its INI lines); its report, which
    must say the contract is broken."""
    pkg = tmp_path / "probepkg"
    for path, text in {"__init__.py": "", **files}.items():
        (pkg / path).parent.mkdir(parents=True, exist_ok=True)
        (pkg / path).parent.joinpath("__init__.py").touch()
        (pkg / path).write_text(text)
    (tmp_path / ".importlinter").write_text(
        "[importlinter]\nroot_package = probepkg\ninclude_external_packages = True\n"
        "contract_types =\n    allowed_imports: tests.support.import_contracts.AllowedImportsContract\n\n"
        "[importlinter:contract:probe]\nname = probe allow-list\ntype = allowed_imports\n" + contract
    )
    out = lint(tmp_path)
    text = out.stdout + out.stderr
    assert out.returncode == 1 and "probe allow-list BROKEN" in text, text
    return text


def test_the_allow_list_contract_reports_an_import_outside_it(tmp_path: Path) -> None:
    """A package whose core imports a third-party module (and the stdlib, which is fine)."""
    text = lint_probe(tmp_path, {"core/ok.py": "import json\nimport msgspec\nfrom probepkg.core import bad\n",
                                 "core/bad.py": "import hashlib\n\nimport structlog\n"},
                      "source_modules =\n    probepkg.core\nallowed_modules =\n    probepkg.core\n    msgspec\n")
    assert "probepkg.core.bad imports structlog (l.3)" in text, text
    assert "imports json" not in text and "imports msgspec" not in text and "imports hashlib" not in text, text


def test_the_allow_list_contract_checks_only_the_packages_it_is_told_to(tmp_path: Path) -> None:
    """``checked_modules``: the services' rule names the bridge's own modules they may import
    and leaves third-party packages free; an import of another of the package's own breaks it."""
    text = lint_probe(tmp_path, {"services/ok.py": "import json\nimport structlog\nfrom probepkg import runtime\n",
                                 "services/bad.py": "import structlog\n\nfrom probepkg.nats import x\n",
                                 "runtime/__init__.py": "", "nats/x.py": ""},
                      "source_modules =\n    probepkg.services\nallowed_modules =\n    probepkg.services\n"
                      "    probepkg.runtime\nchecked_modules =\n    probepkg\n")
    assert "probepkg.services.bad imports probepkg.nats.x (l.3)" in text, text
    assert "structlog" not in text and "imports probepkg.runtime" not in text, text
