"""The layout of the package is documented where it lives (issue 22): every package's docstring
says in its first line what lives in that folder, and docs/ARCHITECTURE.md opens with the tree of
bridge/ as it is: every folder and module."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = sorted(p.parent for p in (ROOT / "bridge").rglob("__init__.py") if "__pycache__" not in p.parts)
MODULES = sorted(p for p in (ROOT / "bridge").rglob("*.py") if "__pycache__" not in p.parts and p.name != "__init__.py")


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("package", PACKAGES, ids=rel)
def test_every_package_says_what_lives_in_it(package: Path) -> None:
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text()))
    assert doc and doc.splitlines()[0].strip(), f"{rel(package)}/__init__.py has no docstring saying what lives there"


def tree() -> str:
    """The first code block of docs/ARCHITECTURE.md's first section."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    first = re.split(r"^## ", text, flags=re.M)[1]
    match = re.search(r"^```\n(.*?)^```", first, flags=re.M | re.S)
    assert match, "docs/ARCHITECTURE.md's first section has no tree"
    return match.group(1)


def names_in_tree() -> set[str]:
    """Every path the tree shows: an entry's name, under the folders it is indented below."""
    paths: set[str] = set()
    stack: list[tuple[int, str]] = []
    for line in tree().splitlines():
        m = re.match(r"^( *)([\w.]+/|[\w.]+\.py)(?:\s|$)", line)
        if not m:
            continue
        indent, name = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = "".join(n for _, n in stack) + name
        paths.add(path.rstrip("/"))
        if name.endswith("/"):
            stack.append((indent, name))
    return paths


def test_the_architecture_opens_with_the_tree_of_every_folder_and_module() -> None:
    shown = names_in_tree()
    missing = [rel(p) for p in [*PACKAGES, *MODULES] if rel(p) not in shown]
    assert not missing, f"not in docs/ARCHITECTURE.md's tree: {missing}"
    extra = sorted(p for p in shown if not (ROOT / p).exists())
    assert not extra, f"in docs/ARCHITECTURE.md's tree but not in bridge/: {extra}"


def test_no_test_module_imports_another() -> None:
    """Helpers shared by test modules live in tests/support/ (issue 22): a test module imported
    by another runs its module-level code twice and couples two suites."""
    pattern = re.compile(r"^\s*(?:from|import)\s+tests\.(?:\w+\.)*test_\w+", re.M)
    offenders = [rel(p) for p in sorted((ROOT / "tests").rglob("*.py")) if pattern.search(p.read_text())]
    assert not offenders, f"import another test module (move the helper to tests/support/): {offenders}"


TESTS = ROOT / "tests"
SERVICE_FOLDERS = sorted(p.name for p in (ROOT / "bridge" / "services").iterdir() if (p / "__init__.py").exists())


def test_the_service_tests_mirror_the_service_folders() -> None:
    """Issue 38: a service that is a folder in bridge/services/ (relay, gate, exporter) has its
    tests in tests/services/<name>/, never flat in tests/services/; the runtime's tests live in
    tests/runtime/ and the commands' in tests/commands/."""
    assert SERVICE_FOLDERS, "bridge/services has no service folders"
    flat = sorted(p.name for p in (TESTS / "services").glob("test_*.py"))
    misplaced = [f"tests/services/{name} -> tests/services/{folder}/" for name in flat for folder in SERVICE_FOLDERS
                 if name == f"test_{folder}.py" or name.startswith(f"test_{folder}_")]
    runtime = sorted(p.stem for p in (ROOT / "bridge" / "runtime").glob("*.py") if p.name != "__init__.py")
    misplaced += [f"tests/services/{name} -> tests/runtime/" for name in flat
                  if name.startswith(("test_runtime", "test_profiler", "test_hostile_health"))
                  or any(name.startswith(f"test_{module}") for module in runtime)]
    assert not misplaced, f"tests outside the folder of the code they test: {misplaced}"
    for folder in SERVICE_FOLDERS:
        assert list((TESTS / "services" / folder).glob("test_*.py")), f"tests/services/{folder}/ holds no tests"
    for folder in ("runtime", "commands"):
        assert list((TESTS / folder).glob("test_*.py")), f"tests/{folder}/ holds no tests"


def test_one_cli_and_one_free_port_for_every_test() -> None:
    """Issue 38: the tests run the CLI and pick ports through tests/support/cli.py only (the suite
    had `cli()` eight times and `free_port` six times); a module that needs other defaults wraps
    that one with functools.partial or a short function under another name."""
    one = TESTS / "support" / "cli.py"
    pattern = re.compile(r"^\s*def (cli|free_port)\(", re.M)
    offenders = [rel(p) for p in sorted(TESTS.rglob("*.py")) if p != one and pattern.search(p.read_text())]
    assert not offenders, f"define their own cli()/free_port() (use tests/support/cli.py): {offenders}"


def test_the_readme_can_be_read_in_one_sitting() -> None:
    """Issue 38: the README was 454+ lines (55 KB), one table row 4,087 characters, with benchmark
    history. It stays under 250 lines, no line over 300 characters outside code blocks; the rest
    lives in docs/ARCHITECTURE.md ("Reference"), docs/BENCHMARKS.md and deploy/README.md."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < 250, f"README.md has {len(lines)} lines: move details to docs/ and link them"
    long, code = [], False
    for n, line in enumerate(lines, 1):
        if line.startswith("```"):
            code = not code
        elif not code and len(line) > 300:
            long.append(f"line {n}: {len(line)} characters")
    assert not long, f"README.md lines over 300 characters outside code blocks: {long}"


def test_the_readme_links_resolve() -> None:
    """Every local link of the README names a file that exists and, with an anchor, a heading there."""
    def anchors(path: Path) -> set[str]:
        return {re.sub(r"[^a-z0-9 _-]", "", h.lower()).replace(" ", "-")
                for h in re.findall(r"^#+ (.+)$", path.read_text(), flags=re.M)}
    broken = []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#([^)\s]+))?\)", (ROOT / "README.md").read_text()):
        path, anchor = ROOT / target[0], target[1]
        if target[0].startswith("http"):
            continue
        if not path.exists() or (anchor and anchor not in anchors(path)):
            broken.append("#".join(t for t in target if t))
    assert not broken, f"README.md links to what does not exist: {broken}"
