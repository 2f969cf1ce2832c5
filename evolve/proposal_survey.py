"""How often the llm proposer's answers are valid policies: many proposals on one real prompt.

The parent is a built-in policy run on the suite's first train tasks (replay backend, scripted
agent), so the prompt is the one an evolution run sends. Each setting (`constrain: lark` or
`off`, the rest of the `llm` config alike) asks `count` proposals (one first, then `workers` at
a time so the server batches them and shares the cached prompt), and counts valid ones, why the
others were rejected, and distinct texts.
`akv bench proposals` prints the settings side by side.
"""
from __future__ import annotations

import random
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from evolve.config import LLMProposerConfig
from evolve.context import TRAIN, Candidate, ProposerContext
from evolve.library import library_texts, load_checked
from evolve.proposers.llm import LLMProposer
from evolve.scoring import HarnessEvaluator
from store import TaskResult

REASONS = ("truncated", "no policy", "invalid policy", "after one repair")


@dataclass(frozen=True)
class Survey:
    constrain: str
    count: int
    valid: int
    valid_first: int              # valid without a repair round
    distinct: int                 # distinct canonical texts among the valid ones
    rejected: dict[str, int] = field(default_factory=dict)
    completion_tokens: int = 0
    wall_s: float = 0.0

    @property
    def valid_rate(self) -> float:
        return self.valid / self.count if self.count else 0.0


def parent_candidate(name: str, suite: str, tasks: int, seed: int = 0) -> Candidate:
    """Built-in policy `name` with its results on the first `tasks` train tasks of `suite`."""
    checked = load_checked(name)
    evaluator = HarnessEvaluator(suite, "scripted", "replay", seed)
    results: list[TaskResult] = []
    try:
        evaluator.evaluate(checked.text, name, TRAIN, evaluator.task_ids(TRAIN)[:tasks], results.append)
    finally:
        evaluator.close()
    score = sum(r.score for r in results) / len(results)
    cost = sum(r.cost_usd for r in results) / len(results)
    return Candidate(1, checked.text, 0, score, cost, tuple(results))


def survey(config: LLMProposerConfig, parent: Candidate, count: int, workers: int, seed: int = 0) -> Survey:
    """Ask `count` proposals of `parent` under `config` and classify every answer."""
    started = time.monotonic()

    def one(index: int):
        proposer = LLMProposer(config, library_texts())
        context = ProposerContext((parent,), (parent,), frozenset(), random.Random(seed + index), seed + index)
        return proposer.ask(context)

    proposals = [one(0)]   # alone first: the shared prompt is then in the server's cache for the rest
    with ThreadPoolExecutor(workers) as pool:
        proposals += pool.map(one, range(1, count))
    valid = [p for p in proposals if p.rejection_reason is None]
    rejected = Counter(next((r for r in REASONS if p.rejection_reason.startswith(r)), "other")
                       for p in proposals if p.rejection_reason is not None)
    return Survey(config.constrain, count, len(valid), sum(not p.meta["repaired"] for p in valid),
                  len({p.hash for p in valid}), dict(rejected),
                  sum(p.completion_tokens for p in proposals), time.monotonic() - started)


def render(surveys: list[Survey]) -> str:
    lines = ["| constrain | proposals | valid | valid without repair | distinct valid | rejected | "
             "completion tokens | wall s |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for s in surveys:
        why = ", ".join(f"{reason} {n}" for reason, n in sorted(s.rejected.items())) or "none"
        lines.append(f"| {s.constrain} | {s.count} | {s.valid} ({s.valid_rate:.0%}) | {s.valid_first} | "
                     f"{s.distinct} | {why} | {s.completion_tokens} | {s.wall_s:.0f} |")
    return "\n".join(lines)
