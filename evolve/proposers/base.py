"""The proposer contract: ask for a candidate, tell how it fared (optuna's ask/tell split)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from evolve.context import ProposerContext
from store.records import Proposal


class ProposerUnavailable(Exception):
    """The proposer cannot go on (endpoint down after retries); the run stops, resumable."""


class BudgetExhausted(Exception):
    """The proposer's token or USD budget is spent; the run goes on to validation."""


@dataclass(frozen=True)
class Outcome:
    """How a candidate fared: rejected, duplicate, pruned (subset stage) or evaluated (full train)."""

    status: str
    score: float | None = None
    cost: float | None = None
    reason: str | None = None


class Proposer(ABC):
    name: str

    @abstractmethod
    def ask(self, context: ProposerContext) -> Proposal:
        """Return one candidate; an invalid one comes back with its rejection_reason set."""

    def tell(self, proposal: Proposal, policy_id: int, outcome: Outcome) -> None:
        """Learn from a candidate's outcome (optuna records it; others need not)."""
