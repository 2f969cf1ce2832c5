"""Cascade evaluation: a cheap train subset first, the full train split only for promising candidates.

Stage 1 runs the first `subset_size` train tasks. A candidate is pruned there when some policy
on the current front dominates it on the very same tasks: a mean score at least as high (higher
by at least the margin) at no higher mean cost, and better in one of the two. Survivors run the
rest of the train split. Results already stored are never run again, which is what makes a
killed run resumable.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from evolve.candidate import Outcome
from evolve.config import CascadeConfig
from evolve.context import TRAIN
from evolve.pareto import Point, pareto_front
from evolve.scoring import Evaluator
from evolve.workers import SharedEvaluation
from sandbox.runs.cost import cents
from store import Store, TaskResult


@dataclass(frozen=True)
class Summary:
    score: float
    cost: float
    n: int


def summarize(results: Sequence[TaskResult]) -> Summary:
    if not results:
        return Summary(0.0, 0.0, 0)
    return Summary(sum(r.score for r in results) / len(results), sum(r.cost_usd for r in results) / len(results),
                   len(results))


def train_results(store: Store, run_id: int, train_ids: Sequence[str]) -> dict[int, list[TaskResult]]:
    """Per policy of the run evaluated on all of `train_ids`, its results in that order."""
    by_policy: dict[int, dict[str, TaskResult]] = {}
    for e in store.evaluations(run_id, TRAIN):
        by_policy.setdefault(e.policy_id, {})[e.result.task_id] = e.result
    return {pid: [results[t] for t in train_ids] for pid, results in by_policy.items()
            if train_ids and all(t in results for t in train_ids)}


def train_points(store: Store, run_id: int, train_ids: Sequence[str], exclude: int | None = None) -> list[Point]:
    """(score, cost) of every policy of the run evaluated on all of `train_ids`."""
    return [Point(pid, s.score, s.cost) for pid, rows in train_results(store, run_id, train_ids).items()
            if pid != exclude for s in [summarize(rows)]]


def _dominates(other: Summary, own: Summary, margin: float) -> bool:
    """`other` is no worse in both objectives (score by at least `margin` more) and better in one."""
    return (other.score >= own.score + margin and other.cost <= own.cost
            and (other.score > own.score or other.cost < own.cost))


class Cascade:
    def __init__(self, store: Store, run_id: int, evaluator: Evaluator, train_ids: Sequence[str],
                 config: CascadeConfig, shared: SharedEvaluation | None = None) -> None:
        self.store, self.run_id, self.evaluator = store, run_id, evaluator
        self.shared = shared  # set: tasks go through the run's work queue (evolve/workers.py)
        self.train_ids = list(train_ids)
        self.subset_ids = self.train_ids[: config.subset_size]
        self.margin = config.promote_margin

    def stored(self, policy_id: int, split: str = TRAIN) -> dict[str, TaskResult]:
        return {e.result.task_id: e.result for e in self.store.evaluations(self.run_id, split, [policy_id])}

    def run_missing(self, policy_id: int, text: str, label: str, task_ids: Sequence[str],
                    split: str = TRAIN) -> dict[str, TaskResult]:
        """Run the tasks not yet stored for this policy, committing each result as it comes."""
        done = self.stored(policy_id, split)
        missing = [t for t in task_ids if t not in done]
        if self.shared is not None:
            if missing:
                self.shared.run(policy_id, label, split, missing)
        else:
            self.evaluator.evaluate(text, label, split, missing,
                                    lambda r: self.store.add_evaluation(self.run_id, policy_id, r))
        return self.stored(policy_id, split)

    def enqueue(self, policy_id: int, task_ids: Sequence[str], split: str = TRAIN) -> None:
        """Queue the tasks not yet stored, ahead of running them (other workers may take them meanwhile)."""
        if self.shared is not None:
            done = self.stored(policy_id, split)
            self.shared.enqueue(policy_id, split, [t for t in task_ids if t not in done])

    def evaluate(self, policy_id: int, text: str, label: str, gate: bool = True) -> Outcome:
        subset = self.run_missing(policy_id, text, label, self.subset_ids)
        if gate:
            blocker = self._blocker(policy_id, [subset[t] for t in self.subset_ids])
            if blocker is not None:
                self.store.set_policy_status(policy_id, "pruned", blocker)
                s = summarize([subset[t] for t in self.subset_ids])
                return Outcome("pruned", s.score, s.cost, blocker)
        full = self.run_missing(policy_id, text, label, self.train_ids)
        s = summarize([full[t] for t in self.train_ids])
        self.store.set_policy_status(policy_id, "evaluated")
        return Outcome("evaluated", s.score, s.cost)

    def _blocker(self, policy_id: int, mine: Sequence[TaskResult]) -> str | None:
        """Why the candidate stops after the subset, or None if it goes on to the full split."""
        own = summarize(mine)
        for point in self.front(exclude=policy_id):
            theirs = self.stored(point.policy_id)
            if any(t not in theirs for t in self.subset_ids):
                continue
            other = summarize([theirs[t] for t in self.subset_ids])
            if _dominates(other, own, self.margin):
                return (f"pruned on the {len(self.subset_ids)}-task train subset: front policy #{point.policy_id} "
                        f"scores {other.score:.3f} vs {own.score:.3f} at cost {cents(other.cost)} vs {cents(own.cost)}¢/task")
        return None

    def train_results(self) -> dict[int, list[TaskResult]]:
        """Per policy evaluated on the whole train split, its results in the split's order."""
        return train_results(self.store, self.run_id, self.train_ids)

    def train_points(self, exclude: int | None = None) -> list[Point]:
        """(score, cost) of every policy evaluated on the whole train split."""
        return train_points(self.store, self.run_id, self.train_ids, exclude)

    def front(self, exclude: int | None = None) -> list[Point]:
        """The train Pareto front."""
        return pareto_front(self.train_points(exclude))
