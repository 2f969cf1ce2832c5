"""Grading an imported question: localcomp's normalized exact match, then (optionally) a judge model.

The judge is any OpenAI-compatible endpoint named at import time. It is asked only when the exact
match fails, with the question, the reference answer and the response, and must reply yes or no.
Its calls are grading, not the agent's work, so they are not billed to the policy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from sandbox.backends import BackendRequest
from sandbox.suites.base import Grade
from sandbox.suites.localcomp.grading import final_part, grade_answer, normalize

JUDGE_SYSTEM = ("You grade answers to research questions. Reply with exactly one word: yes if the response "
                "gives the reference answer (other wording, units or spelling are fine), otherwise no.")


@dataclass(frozen=True)
class Judge:
    """An OpenAI-compatible endpoint and model that decide what exact match cannot."""

    url: str
    model: str

    def to_json(self) -> dict[str, str]:
        return {"url": self.url, "model": self.model}


def gold_of(answer: str, aliases: tuple[str, ...]) -> dict[str, Any]:
    """The gold record localcomp's grader takes: a number when the answer is one, else a name."""
    compact = answer.replace(",", "").strip()
    try:
        float(compact)
    except ValueError:
        return {"type": "name", "answer": answer, "aliases": list(aliases)}
    return {"type": "number", "answer": compact, "tolerance": 0.0}


def grade(answer: str | None, gold: Mapping[str, Any], question: str, judge: Judge | None,
          backend: Any = None) -> Grade:
    """Exact match first; a failed match goes to the judge when there is one."""
    exact = grade_answer(answer, gold)
    if exact.score == 1.0 or judge is None or not (answer or "").strip():
        return exact
    reply = backend.complete(BackendRequest(messages=(
        {"role": "system", "content": JUDGE_SYSTEM},
        {"role": "user", "content": f"Question: {question}\nReference answer: {gold['answer']}\n"
                                    f"Response: {final_part(answer)}\nIs the response correct?"}),
        max_tokens=4, temperature=0.0))
    verdict = normalize(str((reply.message or {}).get("content") or ""))
    ok = verdict.startswith("yes")
    return Grade(float(ok), f"{exact.detail}; judge {judge.model} said {verdict[:20]!r}")
