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
    """One copy of the whole corpus, in its recorded order, with fresh identities; every
    model call (``post_api_request``) reports its own token counts (`vary_usage`)."""
    return [vary_usage(env) for env in renamed_corpus(f"-c{copy}")]


def call_usage(key: str) -> dict[str, int]:
    """Token counts of one simulated model call, a pure function of ``key`` (its
    ``api_request_id``): different on every call, so a run total that counts a call twice
    or misses one is visible (issue 40)."""
    r = random.Random(key)
    output = r.randint(5, 4000)
    return {"input_tokens": r.randint(50, 20000), "output_tokens": output, "cache_read_tokens": r.randint(0, 8000),
            "cache_write_tokens": r.choice((0, 0, r.randint(1, 3000))), "reasoning_tokens": r.randint(0, output)}


def vary_usage(env: dict[str, Any]) -> dict[str, Any]:
    """``env`` with its own usage when it is a ``post_api_request`` with a usage object (in place)."""
    extra = env.get("extra")
    if env.get("hook_event_name") == "post_api_request" and isinstance(extra, dict) and isinstance(extra.get("usage"), dict):
        key = str(extra.get("api_request_id") or json.dumps(extra.get("turn_id")))
        counts = call_usage(key)
        usage = extra["usage"] = dict(extra["usage"])  # (a template's dict may be shared)
        if isinstance(extra.get("api_duration"), float):
            extra["api_duration"] = round(random.Random(key + "/d").uniform(0.05, 8.0), 6)
        usage.update({k: v for k, v in counts.items() if k in usage or k in ("input_tokens", "output_tokens")})
        if "prompt_tokens" in usage:
            usage["prompt_tokens"] = usage["input_tokens"] + usage.get("cache_read_tokens", 0) + usage.get("cache_write_tokens", 0)
        if "total_tokens" in usage:
            usage["total_tokens"] = usage.get("prompt_tokens", usage["input_tokens"]) + usage["output_tokens"]
    return env


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
