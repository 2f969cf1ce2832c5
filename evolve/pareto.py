"""Two objectives, score (maximize) and cost (minimize), and the non-dominated front."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Point:
    policy_id: int
    score: float
    cost: float


def dominates(a: Point, b: Point) -> bool:
    """a is at least as good as b in both objectives and strictly better in one."""
    return a.score >= b.score and a.cost <= b.cost and (a.score > b.score or a.cost < b.cost)


def pareto_front(points: Sequence[Point]) -> list[Point]:
    """The non-dominated points, best score first (ties: cheaper first)."""
    front = [p for p in points if not any(dominates(q, p) for q in points)]
    return sorted(front, key=lambda p: (-p.score, p.cost, p.policy_id))


def rank_by_fronts(points: Sequence[Point]) -> list[Point]:
    """All points ordered front by front (non-dominated sorting), each front best score first."""
    remaining = list(points)
    ordered: list[Point] = []
    while remaining:
        front = pareto_front(remaining)
        ordered.extend(front)
        ids = {p.policy_id for p in front}
        remaining = [p for p in remaining if p.policy_id not in ids]
    return ordered
