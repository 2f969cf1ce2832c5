"""Evolution runs for `akv bench evolve` (benchmarks/evolve_arms.py): each arm's whole loop in a
throwaway database, one memo of task results shared by all, and what each run gives."""
from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

FATES = ("proposed", "rejected", "duplicate", "pruned", "evaluated")


class LoopRunner:
    """Evolution runs of one suite, each in a throwaway database, sharing one memo of task results.

    A run is evolve's own loop (evolve.loop.Evolution: seed population, propose, cascade, validate)
    with the config `akv evolve` would build from the same overrides (baselines scaled to the suite
    as `akv evolve` does), but without the command's report and export, which would go to the data
    folder. The evaluator is opened once, on the suite's seed-0 build (see the module doc).
    """

    def __init__(self, suite: str) -> None:
        from evolve.scoring import HarnessEvaluator
        from evolve.search import MemoEvaluator

        try:
            self.evaluator = MemoEvaluator(HarnessEvaluator(suite, "scripted", "replay", 0))
        except ValueError as err:
            raise ValueError(f"--suite: {err}") from None
        self.suite = suite

    def check(self, settings: Any) -> None:
        from evolve.context import TRAIN
        from evolve.validation import HELDOUT

        limits = settings.limits()
        train, heldout = len(self.evaluator.task_ids(TRAIN)), len(self.evaluator.task_ids(HELDOUT))
        if min(train, limits["train_limit"]) < limits["subset_size"]:
            raise ValueError(f"--suite: {self.suite} has {train} train tasks; the cascade's first stage needs "
                             f"{limits['subset_size']} (--subset-size) within --train-limit {limits['train_limit']}")
        if heldout < 2:
            raise ValueError(f"--suite: {self.suite} has {heldout} held-out task{'s' if heldout != 1 else ''}; "
                             "validation against the expert needs at least 2")

    def run(self, arm: str, proposers: Sequence[str], seed: int, settings: Any) -> dict[str, Any]:
        from store import Store

        started = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="akv-arms-") as folder:
            url = f"sqlite:///{Path(folder) / 'evolve.db'}"
            store = Store.open(url)
            try:
                run_id = self._evolve(store, url, arm, proposers, seed, settings)
                return {**outcome(store, run_id), "wall_s": round(time.perf_counter() - started, 1)}
            finally:
                store.close()

    def _evolve(self, store: Any, url: str, arm: str, proposers: Sequence[str], seed: int,
                settings: Any) -> int:
        from evolve.command import make_proposers
        from evolve.config import ConfigError, load_config
        from evolve.defaults import DefaultsError, chosen_defaults
        from evolve.loop import Evolution
        from evolve.scoring import code_version

        limits = settings.limits()
        overrides = {"suite": self.suite, "proposers": list(proposers), "max_candidates": settings.budget,
                     "seed": seed, "db": url, "run_name": f"{arm}-{seed}",
                     "cascade.train_limit": limits["train_limit"], "cascade.subset_size": limits["subset_size"],
                     "validation.heldout_limit": limits["heldout_limit"]}
        try:
            config = chosen_defaults(load_config(None, overrides)).config
        except (ConfigError, DefaultsError) as err:
            raise ValueError(str(err)) from None
        run = store.create_run(config.run_name, config.model_dump(mode="json", exclude={"db"}), seed,
                               code_version(), self.evaluator.suite_version)
        Evolution(store, run, config, self.evaluator, make_proposers(config, store, run)).run_all()
        return run.id

    def close(self) -> None:
        self.evaluator.close()


def outcome(store: Any, run_id: int) -> dict[str, Any]:
    """What a finished run gives: the champion or best validated candidate against the expert, and fates."""
    from evolve.export import chosen_validation
    from evolve.loop import PROPOSED_BY

    chosen = chosen_validation(store, run_id, None, allow_best=True)
    fates: dict[str, dict[str, int]] = {}
    for policy in store.policies(run_id):
        if policy.proposer in PROPOSED_BY:
            counts = fates.setdefault(policy.proposer, dict.fromkeys(FATES, 0))
            fate = "pending" if policy.status == "proposed" else policy.status
            counts[fate] = counts.get(fate, 0) + 1
    row: dict[str, Any] = {"champion": False, "chosen": None, "cost_change_pct": 0.0, "score_change_points": 0.0,
                           "champion_cost_change_pct": 0.0, "cost_usd": None, "expert_cost_usd": None,
                           "fates": fates}
    if chosen is None:  # nothing reached validation: the expert stays, a change of 0
        return row
    vs = chosen.stats["vs"]["expert"]
    change = vs["cost"]["percent"]
    row.update(champion=chosen.champion, cost_change_pct=change, score_change_points=100 * vs["score"]["mean_delta"],
               champion_cost_change_pct=change if chosen.champion else 0.0, cost_usd=chosen.cost_mean,
               expert_cost_usd=vs["cost"]["baseline_mean"],
               chosen={"policy_id": chosen.policy_id, "proposer": store.policy(chosen.policy_id).proposer,
                       "verdict": chosen.verdict})
    return row
