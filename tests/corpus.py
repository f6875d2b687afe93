"""The real Hermes envelopes for tests: the corpus shipped in bridge/data/observed_sessions.jsonl.

That file holds the 169 envelopes real hermes-agent 0.19.0 runs delivered to a shell hook
(the project's shared/hermes/observed_envelopes.jsonl), with the fields the shim drops at
the edge (conversation history, API request/response bodies) already dropped: every mapped
event is the same from either file. It is part of the repository, so every checkout runs
the same tests on the same data. AEP_OBSERVED_ENVELOPES names another file instead (e.g.
the full recording, to run the shim's edge trimming over real API bodies); a missing file
is an error, never a skip.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "bridge" / "data" / "observed_sessions.jsonl"


def corpus_path() -> Path:
    path = Path(os.environ["AEP_OBSERVED_ENVELOPES"]) if os.environ.get("AEP_OBSERVED_ENVELOPES") else SHIPPED
    if not path.is_file():
        raise FileNotFoundError(f"the corpus of real Hermes envelopes is missing: {path}")
    return path


@lru_cache(maxsize=1)
def records() -> tuple[dict, ...]:
    with corpus_path().open() as fh:
        return tuple(json.loads(line) for line in fh if line.strip())


def envelopes() -> list[dict]:
    return [r["envelope"] for r in records()]
