"""Normalized exact-match grading: case, accents, punctuation, articles, aliases, numeric tolerance."""
from __future__ import annotations

import re
import unicodedata
from typing import Mapping

from sandbox.suites.base import Grade

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")
_ANSWER_LINE = re.compile(r"answer\s*:\s*(.+)", re.IGNORECASE)


def final_part(answer: str) -> str:
    """What follows the last "Answer:" in a reply (the system prompt asks for it), else the reply."""
    found = _ANSWER_LINE.findall(answer)
    return found[-1].strip() if found else answer.strip()


def normalize(text: str) -> str:
    """Lower case, no accents, no punctuation, no articles, single spaces."""
    text = unicodedata.normalize("NFKD", text)
    text = "".join(ch for ch in text if not unicodedata.combining(ch)).lower()
    text = re.sub(r"[^\w\s]", " ", text)
    return " ".join(_ARTICLES.sub(" ", text).split())


def first_number(text: str) -> float | None:
    """The first number in an answer ("1,204 years" -> 1204.0); None when there is none."""
    m = _NUMBER.search(text)
    return float(m.group(0).replace(",", "")) if m else None


def grade_answer(answer: str | None, gold: Mapping[str, object]) -> Grade:
    """`gold` is a task's meta["gold"]: {"type": "number"|"name", "answer", "aliases", "tolerance"}."""
    if not answer or not answer.strip():
        return Grade(0.0, "no answer")
    answer = final_part(answer)
    expected = str(gold["answer"])
    if gold["type"] == "number":
        got = first_number(answer)
        tolerance = float(gold.get("tolerance", 0.0))  # type: ignore[arg-type]
        if got is None:
            return Grade(0.0, f"no number in {answer!r}; expected {expected}")
        ok = abs(got - float(expected)) <= tolerance
        return Grade(float(ok), f"{got:g} {'within' if ok else 'outside'} {tolerance:g} of {expected}")
    names = {normalize(a) for a in [expected, *gold.get("aliases", ())]}  # type: ignore[misc]
    ok = normalize(answer) in names
    return Grade(float(ok), f"{answer!r} {'matches' if ok else 'does not match'} {expected!r}")
