"""What a proposer may see: train-split results only.

The held-out split decides the champion; if a proposer ever saw it, validation would be
measuring how well the proposer memorised it. `build_context` is the one door between
the store and the proposers, and it refuses anything but train evaluations.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from evolve.pareto import Point, pareto_front
from store.records import EvaluationRecord, PolicyInfo, TaskResult, TimelineRecord

TRAIN = "train"


class HeldOutLeak(Exception):
    """A non-train evaluation was about to reach a proposer."""


@dataclass(frozen=True)
class Candidate:
    """An evaluated policy as a proposer sees it: its text and its train results."""

    policy_id: int
    text: str
    generation: int
    score: float  # mean over the full train split
    cost: float
    results: tuple[TaskResult, ...]
    # task id -> message timeline (evolve/reflection.py), train tasks only; empty unless the proposer reads them
    timelines: Mapping[str, Mapping[str, Any]] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class ProposerContext:
    front: tuple[Candidate, ...]  # non-dominated on train, best score first
    population: tuple[Candidate, ...]  # every fully evaluated policy
    known_hashes: frozenset[str]
    rng: random.Random = field(compare=False)
    index: int = 0  # the number of proposals made before this one
    known_structures: frozenset[str] = frozenset()  # texts without tunable ranges (range variants are duplicates)
    reference_id: int | None = None  # the baseline a champion must beat (the expert), when it is evaluated

    @property
    def reference(self) -> Candidate | None:
        """The expert's train results: the bar every proposal is judged against."""
        return next((c for c in self.population if c.policy_id == self.reference_id), None)

    def pick_parent(self) -> Candidate:
        return self.rng.choice(self.front)

    def pick_two(self) -> tuple[Candidate, Candidate]:
        pool = list(self.front) if len(self.front) >= 2 else list(self.population)
        if len(pool) < 2:
            return pool[0], pool[0]
        a, b = self.rng.sample(pool, 2)
        return a, b


def build_context(
    policies: Sequence[PolicyInfo],
    evaluations: Sequence[EvaluationRecord],
    train_task_ids: Sequence[str],
    rng: random.Random,
    index: int = 0,
    timelines: Sequence[TimelineRecord] = (),
    reference_id: int | None = None,
) -> ProposerContext:
    """Assemble a proposer's view; raises HeldOutLeak if any evaluation or timeline is not from train."""
    for record in evaluations:
        if record.result.split != TRAIN:
            raise HeldOutLeak(
                f"evaluation of policy #{record.policy_id} on task {record.result.task_id!r} is from split "
                f"{record.result.split!r}; proposers may only see {TRAIN!r}"
            )
    for line in timelines:
        if line.split != TRAIN or line.data.get("split") != TRAIN:
            raise HeldOutLeak(f"timeline of policy #{line.policy_id} on task {line.task_id!r} is from split "
                              f"{line.split!r}; proposers may only see {TRAIN!r}")
    seen: dict[int, dict[str, Mapping[str, Any]]] = {}
    for line in timelines:
        seen.setdefault(line.policy_id, {})[line.task_id] = line.data
    by_policy: dict[int, dict[str, TaskResult]] = {}
    for record in evaluations:
        by_policy.setdefault(record.policy_id, {})[record.result.task_id] = record.result
    wanted = list(train_task_ids)
    population = []
    for policy in policies:
        results = by_policy.get(policy.id, {})
        if policy.text is None or not wanted or any(t not in results for t in wanted):
            continue  # only policies evaluated on the whole train split compete
        rows = tuple(results[t] for t in wanted)
        population.append(Candidate(policy.id, policy.text, policy.generation,
                                    sum(r.score for r in rows) / len(rows), sum(r.cost_usd for r in rows) / len(rows),
                                    rows, {t: d for t, d in seen.get(policy.id, {}).items() if t in wanted}))
    points = [Point(c.policy_id, c.score, c.cost) for c in population]
    front_ids = [p.policy_id for p in pareto_front(points)]
    by_id: Mapping[int, Candidate] = {c.policy_id: c for c in population}
    hashes = frozenset(p.hash for p in policies if p.hash)
    structures = frozenset(p.structure_hash for p in policies if p.structure_hash)
    return ProposerContext(tuple(by_id[i] for i in front_ids), tuple(population), hashes, rng, index, structures,
                           reference_id)
