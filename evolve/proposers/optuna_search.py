"""The optuna proposer: numeric search over the tunable numbers of a policy structure.

A study belongs to a *structure*, the policy with its tunable numbers abstracted (values and
ranges), not to a parent: every parent of that structure shares it, and so does every evaluated
policy of that structure in the population (a mutate child, a seed), entered as a completed
trial. That is what lets TPE and NSGA-II learn: they need completed trials of one search space.
The search space is fixed when the study opens (the first parent's ranges) and kept in the
study; a later parent written with other ranges is searched within the study's. Studies live in
optuna's RDB storage in the run's own database, so a resumed run continues them. Pruned
candidates are told as pruned, with the cascade's subset-stage means as the trial's
intermediate result (user attributes).

The objective is the champion rule's: the cheapest policy at a score non-inferior to the expert's.
Where the expert's train results are known (`ProposerContext.reference`), a study minimizes one
number, `rule_objective`: a trial's cost relative to the expert's when its score is within the
margin of the expert's, and past every such trial, by how far short it falls, when it is not. So
the search is told what the rule will ask, not a mix of score and cost. Without a reference (a run
without an expert baseline) a study keeps the two objectives, score and cost.
"""
from __future__ import annotations

import hashlib
import logging
import warnings
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import optuna
from optuna.distributions import IntDistribution
from optuna.trial import TrialState, create_trial

from evolve.candidate import check_ast, check_policy
from evolve.config import OptunaProposerConfig
from evolve.context import Candidate, ProposerContext
from evolve.proposers.base import Outcome, Proposer
from evolve.proposers.tree import Path, set_at, walk
from policy_dsl import PolicyError, format_policy, tunables, with_tunables
from policy_dsl.nodes import Num
from akv_stats.champion import DEFAULT_MARGIN
from store.records import Proposal

optuna.logging.set_verbosity(logging.WARNING)
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning, module="optuna")

Space = dict[str, tuple[int, int]]  # tunable path -> (lo, hi)
SHORT = 10.0  # where the objective of a trial below the margin starts: past any cost relative to the expert
EXPLOIT = 0.75  # share of proposals whose parent is the rule's best policy with tunable numbers


def rule_objective(score: float, cost: float, reference: tuple[float, float], margin: float) -> float:
    """The champion rule as one number to minimize (module docstring): cost / the expert's for a trial
    within `margin` of the expert's score; SHORT plus the points it falls short by, for the others."""
    expert_score, expert_cost = reference
    short = (expert_score - margin) - score
    if short > 1e-12:
        return SHORT + short
    return cost / expert_cost if expert_cost > 0 else cost


@dataclass(frozen=True)
class Structure:
    """A policy with its tunable numbers abstracted: the key of the study its numbers are searched in."""

    key: str  # 16 hex digits
    text: str  # the canonical text with every tunable number written as 0 and no range
    space: Space  # this policy's own ranges

    @classmethod
    def of(cls, ast: Any) -> Structure:
        abstracted = ast
        for path, num in _tunable_nums(ast).items():
            abstracted = set_at(abstracted, path, Num(0))
        text = format_policy(abstracted)
        space = {t.path: (int(t.lo), int(t.hi)) for t in tunables(ast)}
        # The paths tell a tunable 0 from a fixed one written as 0.
        key = hashlib.sha256((text + "\0" + ",".join(space)).encode()).hexdigest()[:16]
        return cls(key, text, space)


def _dotted(path: Path) -> str:
    """A tree path as policy_dsl's tunable paths spell it: rules[0].action.target.keep_last."""
    out = ""
    for step in path:
        out += f"[{step}]" if isinstance(step, int) else (f".{step}" if out else step)
    return out


def _tunable_nums(ast: Any) -> dict[Path, Num]:
    return {path: value for path, _slot, value in walk(ast) if isinstance(value, Num) and value.tunable}


def with_space(ast: Any, space: Mapping[str, tuple[int, int]]) -> Any:
    """The policy with its tunables' ranges replaced by `space` (values clamped into them)."""
    out = ast
    for path, num in _tunable_nums(ast).items():
        lo, hi = space[_dotted(path)]
        out = set_at(out, path, Num(min(max(num.value, lo), hi), lo, hi, num.loc))
    return out


class OptunaProposer(Proposer):
    name = "optuna"

    def __init__(self, config: OptunaProposerConfig, storage_url: str, run_name: str, seed: int,
                 margin: float = DEFAULT_MARGIN) -> None:
        self.config = config
        self.storage = optuna.storages.RDBStorage(storage_url)
        self.run_name = run_name
        self.seed = seed
        self.margin = margin  # the champion rule's (validation.margin)

    def sampler(self, index: int) -> optuna.samplers.BaseSampler:
        # A fresh seed per proposal: a resumed run must not replay the same suggestions. The samplers
        # keep no state of their own between asks; what they learn from is the study's trials.
        seed = self.seed * 100_003 + index
        if self.config.sampler == "nsga2":
            return optuna.samplers.NSGAIISampler(seed=seed, population_size=self.config.population_size)
        if self.config.sampler == "random":
            return optuna.samplers.RandomSampler(seed=seed)
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=self.config.startup_trials,
                                          multivariate=True)

    def study(self, structure: Structure, index: int, rule: bool = False) -> optuna.Study:
        """The structure's study (opened with this structure's ranges as its search space if new): on the
        champion rule's objective with `rule`, else on score and cost."""
        name, directions = (f"{self.run_name}/{structure.key}/rule", ["minimize"]) if rule else \
            (f"{self.run_name}/{structure.key}", ["maximize", "minimize"])
        study = optuna.create_study(storage=self.storage, study_name=name, directions=directions,
                                    sampler=self.sampler(index), load_if_exists=True)
        if "space" not in study.user_attrs:
            study.set_user_attr("space", {p: list(r) for p, r in structure.space.items()})
            study.set_user_attr("structure", structure.text)
        return study

    def _parent(self, context: ProposerContext) -> tuple[Candidate, Any] | None:
        """A policy with tunable numbers: from the front in a random order; with the expert known, most
        often (EXPLOIT) the one the champion rule's objective ranks first, so that the search tunes
        the structures that could win rather than, say, a summary threshold no trace ever reaches."""
        order = list(context.front)
        context.rng.shuffle(order)
        reference = context.reference
        if reference is not None and context.rng.random() < EXPLOIT:
            judge = (reference.score, reference.cost)
            ranked = sorted(context.population, key=lambda c: rule_objective(c.score, c.cost, judge, self.margin))
            order = ranked + [c for c in order if c not in ranked]
        for candidate in order + [c for c in context.population if c not in order]:
            ast = check_policy(candidate.text).ast
            if tunables(ast):
                return candidate, ast
        return None

    def ask(self, context: ProposerContext) -> Proposal:
        chosen = self._parent(context)
        if chosen is None:
            parent = context.pick_parent()
            return Proposal(self.name, None, (parent.policy_id,), parent.generation + 1,
                            rejection_reason="optuna: no evaluated policy has a tunable range (`N in LO..HI`)")
        parent, ast = chosen
        structure = Structure.of(ast)
        reference = context.reference
        judge = (reference.score, reference.cost) if reference is not None else None
        study = self.study(structure, context.index, rule=judge is not None)
        space: Space = {p: (int(r[0]), int(r[1])) for p, r in study.user_attrs["space"].items()}
        added = add_population(study, structure.key, space, context.population, judge, self.margin)
        trial = study.ask()
        values = {path: trial.suggest_int(path, lo, hi) for path, (lo, hi) in space.items()}
        meta = {"study": study.study_name, "trial": trial.number, "params": dict(values),
                "structure": structure.key, "population_trials": added,
                **({"reference": list(judge), "margin": self.margin} if judge is not None else {})}
        try:
            checked = check_ast(with_tunables(with_space(ast, space), values))
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
        number = meta["trial"]
        if study.trials[number].state != TrialState.RUNNING:
            return  # told already (a resumed run re-tells nothing twice)
        trial_id = self.storage.get_trial_id_from_study_id_trial_number(
            self.storage.get_study_id_from_name(meta["study"]), number)
        self.storage.set_trial_user_attr(trial_id, "policy_id", policy_id)
        if outcome.status in ("evaluated", "duplicate") and outcome.score is not None:
            if "reference" in meta:
                self.storage.set_trial_user_attr(trial_id, "score", outcome.score)
                self.storage.set_trial_user_attr(trial_id, "cost", outcome.cost)
                reference = (float(meta["reference"][0]), float(meta["reference"][1]))
                study.tell(number, values=[rule_objective(outcome.score, outcome.cost, reference, meta["margin"])])
            else:
                study.tell(number, values=[outcome.score, outcome.cost])
        elif outcome.status == "pruned" and outcome.score is not None:
            # The subset stage's means: the trial's intermediate result, kept with it.
            self.storage.set_trial_user_attr(trial_id, "subset_score", outcome.score)
            self.storage.set_trial_user_attr(trial_id, "subset_cost", outcome.cost)
            study.tell(number, state=TrialState.PRUNED)
        else:
            study.tell(number, state=TrialState.FAIL)


def add_population(study: optuna.Study, key: str, space: Space, population: Sequence[Candidate],
                   reference: tuple[float, float] | None = None, margin: float = DEFAULT_MARGIN) -> int:
    """Enter every evaluated policy of the structure as a completed trial, once per point (valued by the
    champion rule's objective against `reference`, else by score and cost); returns how many."""
    seen = {tuple(sorted(t.params.items())) for t in study.get_trials(deepcopy=False)
            if t.state in (TrialState.COMPLETE, TrialState.PRUNED)}
    seen_ids = {t.user_attrs.get("policy_id") for t in study.get_trials(deepcopy=False)}
    distributions = {path: IntDistribution(lo, hi) for path, (lo, hi) in space.items()}
    added = 0
    for candidate in population:
        ast = check_policy(candidate.text).ast
        if candidate.policy_id in seen_ids or Structure.of(ast).key != key:
            continue
        params = {t.path: int(t.value) for t in tunables(ast)}
        point = tuple(sorted(params.items()))
        if point in seen or any(not space[p][0] <= v <= space[p][1] for p, v in params.items()):
            continue
        values = ([rule_objective(candidate.score, candidate.cost, reference, margin)] if reference is not None
                  else [candidate.score, candidate.cost])
        study.add_trial(create_trial(params=params, distributions=distributions, values=values,
                                     user_attrs={"policy_id": candidate.policy_id, "source": "population",
                                                 "score": candidate.score, "cost": candidate.cost}))
        seen.add(point)
        added += 1
    return added
