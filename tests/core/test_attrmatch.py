"""AEP-0003 §6 attr-match (bridge/core/attrmatch.py) against the AEP repository's corpus, plus
the rules the corpus leaves implicit (no coercion, inclusion of patterns, fail closed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bridge.core.attrmatch import InvalidFilter, compile_filter

CASES = json.loads((Path(__file__).parents[1] / "fixtures" / "aep" / "attr-match" / "cases.json").read_text())


def test_the_corpus_is_all_there():
    assert len(CASES["match"]) == 14 and len(CASES["invalid"]) == 10


@pytest.mark.parametrize("case", CASES["match"], ids=lambda c: c["name"])
def test_corpus_match(case):
    assert compile_filter(case["filter"]).matches(case["event"]) is case["match"]


@pytest.mark.parametrize("case", CASES["invalid"], ids=lambda c: c["name"])
def test_corpus_invalid_fails_closed(case):
    with pytest.raises(InvalidFilter):
        compile_filter(case["filter"])


@pytest.mark.parametrize(
    ("flt", "event", "expected"),
    [
        ({"epoch": 1}, {"type": "a.b", "epoch": True}, False),  # no coercion: true is not 1
        ({"ext1": True}, {"type": "a.b", "ext1": 1}, False),
        ({"ext1": True}, {"type": "a.b", "ext1": True}, True),
        ({"type": ["tool.*", "session.started"]}, {"type": "session.started"}, True),
        ({"type": ["tool.*", "session.started"]}, {"type": "session.ended"}, False),
        ({"type": "attention.*"}, {"type": "attention"}, False),  # strictly under the prefix
        ({"type": "tool.*"}, {"type": "toolbox.opened"}, False),
        ({"severity": "info"}, {"type": "a.b"}, True),  # the default, by equality
        ({"severity": {"lte": "notice"}}, {"type": "a.b", "severity": "error"}, False),
        ({"capture": "metadata"}, {"type": "a.b"}, True),
        ({"capture": ["full", "redacted"]}, {"type": "a.b"}, False),
    ],
)
def test_rules_beyond_the_corpus(flt, event, expected):
    assert compile_filter(flt).matches(event) is expected


@pytest.mark.parametrize(
    "flt",
    [[], "x", {"type": []}, {"type": "*.x"}, {"type": ".*"}, {"severity": {}}, {"severity": {"gte": "loud"}},
     {"agent": 1.5}, {"agent": None}, {"agent": {"gte": "info"}}, {"session": ["s", ["t"]]}, {"run": "r*"}],
)
def test_more_invalid_filters(flt):
    with pytest.raises(InvalidFilter):
        compile_filter(flt)
