"""The random proposer: policies drawn independently from the whole language, the search's baseline.

IID sampling at the same budget is the baseline a search has to beat (Gideoni, Risi, Gal 2026
find it competitive with code evolution), so this proposer knows nothing a search would learn:
it reads neither the population nor the outcomes (it ignores `tell`) and borrows nothing from
the built-in policies. Its one use of the context is the random generator, which the loop seeds
from the run's seed and the proposal's index, so a run and its resume draw the same policies;
and the known hashes, so that it does not spend a candidate on a policy the run already has.
"""
from __future__ import annotations

from evolve.candidate import unknown_candidate
from evolve.context import ProposerContext
from evolve.proposers.base import Proposer
from policy_dsl.sample import draw_policy
from store.records import Proposal


class RandomProposer(Proposer):
    name = "random"

    def __init__(self, attempts: int = 20) -> None:
        self.attempts = attempts  # draws before giving up on a policy the run does not know yet

    def ask(self, context: ProposerContext) -> Proposal:
        last_error, draws = "no draw", 0
        for _ in range(self.attempts):
            ast, tries = draw_policy(context.rng)
            draws += tries
            checked = unknown_candidate(ast, context.known_hashes, context.known_structures)
            if isinstance(checked, str):
                last_error = checked
                continue
            return Proposal(self.name, raw_text=checked.text, parent_ids=(), generation=0, text=checked.text,
                            hash=checked.hash, meta={"draws": draws})
        return Proposal(self.name, raw_text=None, parent_ids=(), generation=0,
                        rejection_reason=f"random: no new valid policy after {self.attempts} draws ({last_error})")
