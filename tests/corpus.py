"""The real Hermes envelopes (../shared/hermes/observed_envelopes.jsonl) for tests."""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CANDIDATES = [
    Path(os.environ["AEP_OBSERVED_ENVELOPES"]) if os.environ.get("AEP_OBSERVED_ENVELOPES") else None,
    ROOT.parent / "shared" / "hermes" / "observed_envelopes.jsonl",
    # The same real envelopes as shipped in the package (API bodies and conversation history dropped).
    ROOT / "bridge" / "data" / "observed_sessions.jsonl",
]


def corpus_path() -> Path:
    for path in CANDIDATES:
        if path and path.is_file():
            return path
    raise FileNotFoundError("observed_envelopes.jsonl not found (set AEP_OBSERVED_ENVELOPES)")


@lru_cache(maxsize=1)
def records() -> tuple[dict, ...]:
    with corpus_path().open() as fh:
        return tuple(json.loads(line) for line in fh if line.strip())


def envelopes() -> list[dict]:
    return [r["envelope"] for r in records()]
