"""Fixtures of the command tests: a clean environment (HOME in a temporary directory, no
settings file, no AEP_* variable), as in a fresh shell of a new user."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture
def clean_env(tmp_path: Path) -> dict[str, str]:
    home = tmp_path / "home"
    home.mkdir()
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "XDG_STATE_HOME": str(home / ".state"),
            "LANG": "C.UTF-8"}
