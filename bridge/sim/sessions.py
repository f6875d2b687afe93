"""Realistic Hermes traffic built from the real envelopes shipped in `bridge/data`.

The corpus holds real sessions (scenarios). `realistic_envelopes` replays them
over and over with fresh identities (session ids, turn ids, task ids, tool call
ids get a per-copy suffix), so a benchmark or a fault test gets as many distinct,
correctly-shaped sessions as it needs, deterministically from a seed.
"""

from __future__ import annotations

import json
import random
import re
from functools import lru_cache
from importlib import resources
from typing import Any, Iterator

_ID = re.compile(r"\b(20\d{6}_\d{6}_[0-9a-f]{6}|[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|sa-\d+-[0-9a-f]{8})\b")


@lru_cache(maxsize=1)
def corpus() -> tuple[dict[str, Any], ...]:
    """The shipped records: ``{"scenario", "seq", "envelope"}``."""
    text = resources.files("bridge.data").joinpath("observed_sessions.jsonl").read_text(encoding="utf-8")
    return tuple(json.loads(line) for line in text.splitlines() if line.strip())


def scenarios() -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for record in corpus():
        out.setdefault(record["scenario"], []).append(record["envelope"])
    return out


def _rename(text: str, suffix: str) -> str:
    """Give every session id, task id and subagent id (and the ids built on them) a copy-specific suffix."""
    return _ID.sub(lambda m: f"{m.group(1)}{suffix}", text).replace('"call_', f'"call{suffix}_')


def renamed_corpus(suffix: str) -> list[dict[str, Any]]:
    """The whole corpus, in its recorded order, every identity given the suffix `suffix`."""
    return [json.loads(_rename(json.dumps(r["envelope"]), suffix)) for r in corpus()]


def session_copies(copy: int) -> list[dict[str, Any]]:
    """One copy of the whole corpus, in its recorded order, with fresh identities."""
    return renamed_corpus(f"-c{copy}")


def realistic_envelopes(n: int, seed: int = 0, interleave: int = 8) -> Iterator[dict[str, Any]]:
    """`n` envelopes: copies of the real sessions, `interleave` copies running at once.

    Sessions keep their own internal order; copies are interleaved the way a fleet's
    traffic is.
    """
    rng = random.Random(seed)
    produced = 0
    copy = 0
    active: list[list[dict[str, Any]]] = []
    while produced < n:
        while len(active) < interleave:
            active.append(session_copies(copy))
            copy += 1
        lane = rng.randrange(len(active))
        yield active[lane].pop(0)
        produced += 1
        if not active[lane]:
            active.pop(lane)
