"""The outer loop, ask/tell style: propose, de-duplicate, cascade, tell; then validate.

Every step is committed before the next begins. On resume the loop first finishes the
candidates that were proposed but not fully evaluated, then proposes until the run's
candidate budget (counted in the store, rejected proposals included) is reached.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Sequence

from evolve.cascade import Cascade
from evolve.config import EvolveConfig
from evolve.context import TRAIN, ProposerContext, build_context
from evolve.library import load_checked
from evolve.pareto import Point
from evolve.proposers.base import BudgetExhausted, Outcome, Proposer
from evolve.scoring import Evaluator
from evolve.validation import HELDOUT, pick_finalists, validate
from store import PolicyInfo, Proposal, RunInfo, Store, ValidationRecord

PROPOSED_BY = ("llm", "optuna", "mutate")
Progress = Callable[[str, Sequence[Point]], None]  # (what just happened, current train front)


@dataclass(frozen=True)
class EvolutionResult:
    validations: list[ValidationRecord]
    stop_reason: str | None

    @property
    def champion(self) -> ValidationRecord | None:
        return next((v for v in self.validations if v.champion), None)


class Evolution:
    def __init__(self, store: Store, run: RunInfo, config: EvolveConfig, evaluator: Evaluator,
                 proposers: Mapping[str, Proposer], progress: Progress | None = None) -> None:
        self.store, self.run, self.config = store, run, config
        self.evaluator, self.proposers = evaluator, proposers
        self.progress = progress or (lambda _msg, _front: None)
        train = evaluator.task_ids(TRAIN)
        self.train_ids = train[: config.cascade.train_limit] if config.cascade.train_limit else train
        heldout = evaluator.task_ids(HELDOUT)
        limit = config.validation.heldout_limit
        self.heldout_ids = heldout[:limit] if limit else heldout
        self.cascade = Cascade(store, run.id, evaluator, self.train_ids, config.cascade)

    def n_proposed(self) -> int:
        return sum(1 for p in self.store.policies(self.run.id) if p.proposer in PROPOSED_BY)

    def run_all(self) -> EvolutionResult:
        baselines = self.seed_population()
        self.finish_pending()
        stop_reason = None
        while (n := self.n_proposed()) < self.config.max_candidates:
            name = self.config.proposers[n % len(self.config.proposers)]
            try:
                self.step(self.proposers[name], n)
            except BudgetExhausted as err:
                stop_reason = str(err)
                break
        self.progress("validating the front and the baselines on the held-out split", self.cascade.front())
        finalists = pick_finalists(self.cascade.train_points(), set(baselines.values()), self.config.validation.top_k)
        records = validate(self.store, self.run.id, self.cascade, self.heldout_ids, finalists, baselines,
                           self.config.validation, self.config.seed)
        self.store.set_run_status(self.run.id, "finished", stop_reason)
        return EvolutionResult(records, stop_reason)

    def seed_population(self) -> dict[str, int]:
        """Store and evaluate the seed policies and the baselines (idempotent on resume)."""
        roles = self.config.baselines.model_dump()
        entries = [(name, "seed", None) for name in self.config.seed_policies]
        entries += [(name, "baseline", role) for role, name in roles.items()]
        baselines: dict[str, int] = {}
        for name, kind, role in entries:
            checked = load_checked(name)
            pid, _ = self.store.add_policy(self.run.id, Proposal(kind, checked.text, text=checked.text,
                                                                 hash=checked.hash, name=name))
            if role is not None:
                self.store.set_baseline(self.run.id, role, pid)
                baselines[role] = pid
            info = self.store.policy(pid)
            if info.status == "proposed":
                self.progress(f"evaluating {kind} {name} on the train split", self.cascade.front())
                self.cascade.evaluate(pid, checked.text, name, gate=False)
        return baselines

    def finish_pending(self) -> None:
        """Candidates a killed run proposed but did not finish: evaluate them and tell their proposer."""
        for info in self.store.policies(self.run.id, status="proposed"):
            outcome = self.cascade.evaluate(info.id, info.text or "", info.label)
            proposer = self.proposers.get(info.proposer)
            if proposer is not None:
                proposer.tell(_as_proposal(info), info.id, outcome)

    def proposer_context(self, index: int) -> ProposerContext:
        """What the `index`-th proposal may see: train results only (build_context enforces it)."""
        rng = random.Random(self.config.seed * 1_000_003 + index)  # resume-stable per proposal
        evaluated = [p for p in self.store.policies(self.run.id) if p.status == "evaluated"]
        return build_context(evaluated, self.store.evaluations(self.run.id, TRAIN), self.train_ids, rng, index)

    def step(self, proposer: Proposer, index: int) -> None:
        proposal = proposer.ask(self.proposer_context(index))
        if proposal.hash is not None:
            known = self.store.policy_by_hash(self.run.id, proposal.hash)
            if known is not None:
                self._duplicate(proposer, proposal, known)
                return
        pid, _ = self.store.add_policy(self.run.id, proposal)
        if proposal.rejection_reason is not None:
            proposer.tell(proposal, pid, Outcome("rejected", reason=proposal.rejection_reason))
            self.progress(f"{self._count(index)} #{pid} {proposer.name}: rejected ({proposal.rejection_reason[:80]})",
                          self.cascade.front())
            return
        outcome = self.cascade.evaluate(pid, proposal.text or "", f"#{pid}")
        proposer.tell(proposal, pid, outcome)
        where = "on the train subset" if outcome.status == "pruned" else "on train"
        self.progress(f"{self._count(index)} #{pid} {proposer.name}: {outcome.status}, {where} score "
                      f"{outcome.score:.3f} cost ${outcome.cost:.5f}", self.cascade.front())

    def _count(self, index: int) -> str:
        return f"[{index + 1}/{self.config.max_candidates}]"

    def _duplicate(self, proposer: Proposer, proposal: Proposal, known: PolicyInfo) -> None:
        # Stored (without a hash) so the lineage shows the attempt and the budget counts it.
        reason = f"duplicate of #{known.id}"
        pid, _ = self.store.add_policy(self.run.id, replace(proposal, hash=None, rejection_reason=reason))
        full = self.cascade.stored(known.id)
        outcome = Outcome("rejected", reason=reason)
        if known.status == "evaluated" and all(t in full for t in self.train_ids):
            rows = [full[t] for t in self.train_ids]
            outcome = Outcome("duplicate", sum(r.score for r in rows) / len(rows),
                              sum(r.cost_usd for r in rows) / len(rows), reason)
        proposer.tell(proposal, pid, outcome)
        self.progress(f"#{pid} {proposer.name}: {reason}", self.cascade.front())


def _as_proposal(info: PolicyInfo) -> Proposal:
    return Proposal(info.proposer, info.raw_text, info.parent_ids, info.generation, info.text, info.hash,
                    info.name, info.rejection_reason, meta=info.meta)
