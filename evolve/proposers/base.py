"""The proposer contract: ask for a candidate, tell how it fared (optuna's ask/tell split)."""
from __future__ import annotations

from abc import ABC, abstractmethod

from evolve.candidate import Outcome
from evolve.context import ProposerContext
from store.records import Proposal

__all__ = ["BudgetExhausted", "Outcome", "Proposer", "ProposerUnavailable"]


class ProposerUnavailable(Exception):
    """The proposer cannot go on (endpoint down after retries); the run stops, resumable."""


class BudgetExhausted(Exception):
    """The proposer's token or USD budget is spent; the run goes on to validation."""


class Proposer(ABC):
    name: str
    reads_timelines: bool = False  # the context then carries the population's train message timelines

    @abstractmethod
    def ask(self, context: ProposerContext) -> Proposal:
        """Return one candidate; an invalid one comes back with its rejection_reason set."""

    def tell(self, proposal: Proposal, policy_id: int, outcome: Outcome) -> None:
        """Learn from a candidate's outcome (optuna records it; others need not)."""
