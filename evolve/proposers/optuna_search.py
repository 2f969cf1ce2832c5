"""The optuna proposer: numeric search over the tunable ranges of a front parent.

Each parent gets its own study (its tunables are the search space), kept in optuna's RDB
storage in the run's own database, so a resumed run continues the same studies. The two
objectives (train score up, train cost down) go to TPE or NSGA-II as they are.
"""
from __future__ import annotations

import logging
from typing import Any

import optuna
from optuna.trial import TrialState

from evolve.candidate import check_ast, check_policy
from evolve.config import OptunaProposerConfig
from evolve.context import Candidate, ProposerContext
from evolve.proposers.base import Outcome, Proposer
from policy_dsl import PolicyError, tunables, with_tunables
from store.records import Proposal

optuna.logging.set_verbosity(logging.WARNING)


class OptunaProposer(Proposer):
    name = "optuna"

    def __init__(self, config: OptunaProposerConfig, storage_url: str, run_name: str, seed: int) -> None:
        self.config = config
        self.storage = optuna.storages.RDBStorage(storage_url)
        self.run_name = run_name
        self.seed = seed

    def _study(self, parent_hash: str, index: int) -> optuna.Study:
        # A fresh sampler seed per proposal: a resumed run must not replay the same suggestions.
        seed = self.seed * 100_003 + index
        sampler = (optuna.samplers.NSGAIISampler(seed=seed) if self.config.sampler == "nsga2"
                   else optuna.samplers.TPESampler(seed=seed, n_startup_trials=4))
        return optuna.create_study(storage=self.storage, study_name=f"{self.run_name}/{parent_hash[:16]}",
                                   directions=["maximize", "minimize"], sampler=sampler, load_if_exists=True)

    def _parent(self, context: ProposerContext) -> tuple[Candidate, Any, list] | None:
        order = list(context.front)
        context.rng.shuffle(order)
        for candidate in order + [c for c in context.population if c not in order]:
            ast = check_policy(candidate.text).ast
            found = list(tunables(ast))
            if found:
                return candidate, ast, found
        return None

    def ask(self, context: ProposerContext) -> Proposal:
        chosen = self._parent(context)
        if chosen is None:
            parent = context.pick_parent()
            return Proposal(self.name, None, (parent.policy_id,), parent.generation + 1,
                            rejection_reason="optuna: no evaluated policy has a tunable range (`N in LO..HI`)")
        parent, ast, found = chosen
        parent_hash = check_policy(parent.text).hash
        study = self._study(parent_hash, context.index)
        trial = study.ask()
        values: dict[Any, Any] = {}
        for t in found:
            key = str(t.path)
            if t.kind is int or t.kind == "int":
                values[t.path] = trial.suggest_int(key, int(t.lo), int(t.hi))
            else:
                values[t.path] = trial.suggest_float(key, float(t.lo), float(t.hi))
        meta = {"study": study.study_name, "trial": trial.number,
                "params": {str(k): v for k, v in values.items()}}
        try:
            checked = check_ast(with_tunables(ast, values))
        except PolicyError as err:
            study.tell(trial.number, state=TrialState.FAIL)
            return Proposal(self.name, None, (parent.policy_id,), parent.generation + 1,
                            rejection_reason=f"invalid policy: {err}", meta=meta)
        return Proposal(self.name, checked.text, (parent.policy_id,), parent.generation + 1,
                        text=checked.text, hash=checked.hash, meta=meta)

    def tell(self, proposal: Proposal, policy_id: int, outcome: Outcome) -> None:
        meta = proposal.meta
        if "study" not in meta or "trial" not in meta:
            return
        study = optuna.load_study(study_name=meta["study"], storage=self.storage)
        if study.trials[meta["trial"]].state != TrialState.RUNNING:
            return  # told already (a resumed run re-tells nothing twice)
        if outcome.status in ("evaluated", "duplicate") and outcome.score is not None:
            study.tell(meta["trial"], values=[outcome.score, outcome.cost])
        elif outcome.status == "pruned":
            study.tell(meta["trial"], state=TrialState.PRUNED)
        else:
            study.tell(meta["trial"], state=TrialState.FAIL)
