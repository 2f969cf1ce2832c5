"""Search runs for `akv bench search`: a proposer mix given a fixed budget of proposals on train.

Each run is the loop's proposing part (evolve/loop.py: seed, propose, de-duplicate, cascade,
tell) in a throwaway SQLite database, with one policy as the seed and as every baseline, so the
population starts from that policy alone; nothing is validated. The scripted agent on the replay
backend is deterministic, so every (policy, task) result is computed once and shared by all runs
and by the grid the benchmark compares them with (`MemoEvaluator`).
"""
from __future__ import annotations

import contextlib
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from evolve.candidate import check_policy
from evolve.config import EvolveConfig
from evolve.context import TRAIN
from evolve.loop import PROPOSED_BY, Evolution
from evolve.scoring import HarnessEvaluator, History, OnResult, code_version
from store import Store, TaskResult

# A mix: the proposers asked in turn and optuna's sampler.
MIXES: Mapping[str, tuple[tuple[str, ...], str]] = {
    "random": (("optuna",), "random"), "tpe": (("optuna",), "tpe"), "nsga2": (("optuna",), "nsga2"),
    "mutate": (("mutate",), "tpe"), "mutate+tpe": (("mutate", "optuna"), "tpe"),
    "llm+mutate+tpe": (("llm", "mutate", "optuna"), "tpe"),
}


@dataclass(frozen=True)
class Step:
    """One proposal of a search run, in order: its fate and, when evaluated, its train means."""

    proposer: str
    status: str
    text: str | None
    score: float | None
    cost: float | None


class MemoEvaluator:
    """An Evaluator that runs each (policy, split, task) once: deterministic on the replay backend."""

    def __init__(self, inner: HarnessEvaluator) -> None:
        self.inner = inner
        self.suite_version = inner.suite_version
        self.results: dict[tuple[str, str, str], TaskResult] = {}
        self.histories: dict[tuple[str, str, tuple[str, ...]], list[History]] = {}
        self.runs = 0  # tasks actually run

    def task_ids(self, split: str) -> list[str]:
        return self.inner.task_ids(split)

    def evaluate(self, policy_text: str, label: str, split: str, task_ids: Sequence[str],
                 on_result: OnResult) -> None:
        key = check_policy(policy_text).hash
        missing = [t for t in task_ids if (key, split, t) not in self.results]

        def keep(result: TaskResult) -> None:
            self.results[(key, split, result.task_id)] = result
            self.runs += 1
        self.inner.evaluate(policy_text, label, split, missing, keep)
        for task in task_ids:
            on_result(self.results[(key, split, task)])

    def request_histories(self, policy_text: str, split: str, task_ids: Sequence[str]) -> list[History]:
        key = (check_policy(policy_text).hash, split, tuple(task_ids))
        if key not in self.histories:
            self.histories[key] = self.inner.request_histories(policy_text, split, task_ids)
        return self.histories[key]

    def close(self) -> None:
        self.inner.close()


class Searcher:
    """Scores policies on the first `tasks` train tasks of a suite, and runs proposer mixes there."""

    def __init__(self, suite: str, tasks: int, llm: Mapping[str, Any] | None = None) -> None:
        self.evaluator = MemoEvaluator(HarnessEvaluator(suite, "scripted", "replay", 0))
        self.suite, self.llm = suite, dict(llm or {})
        self.train_ids = self.evaluator.task_ids(TRAIN)[:tasks]
        if len(self.train_ids) < tasks:
            raise ValueError(f"--tasks: {suite} has {len(self.train_ids)} train tasks, asked for {tasks}")

    def evaluate(self, text: str) -> tuple[float, float]:
        """(mean score, mean cost in USD per task) on the train tasks."""
        rows: list[TaskResult] = []
        self.evaluator.evaluate(text, "grid", TRAIN, self.train_ids, rows.append)
        return sum(r.score for r in rows) / len(rows), sum(r.cost_usd for r in rows) / len(rows)

    def run(self, mix: str, seed: int, budget: int, seed_policy: str,
            progress: Callable[[str], None] | None = None, keep_in: Path | None = None) -> list[Step]:
        """`budget` proposals of `mix` from `seed_policy` (a policy text), in order. The run's database
        (optuna's studies included) is thrown away, or kept in the existing folder `keep_in`."""
        proposers, sampler = MIXES[mix]
        with (contextlib.nullcontext(str(keep_in)) if keep_in else
              tempfile.TemporaryDirectory(prefix="akv-search-")) as folder:
            seed_file = Path(folder) / "seed.akvp"
            seed_file.write_text(seed_policy, encoding="utf-8")
            name = str(seed_file)
            config = EvolveConfig.model_validate({
                "run_name": f"search-{mix}-{seed}", "seed": seed, "suite": self.suite, "proposers": list(proposers),
                "seed_policies": [name], "max_candidates": budget,
                "baselines": {"standard": name, "text_engineering": name, "expert": name, "full": name},
                "cascade": {"subset_size": len(self.train_ids), "train_limit": len(self.train_ids)},
                "optuna": {"sampler": sampler}, "llm": self.llm})
            store = Store.open(f"sqlite:///{Path(folder) / 'search.db'}")
            try:
                return self._run(store, config, progress)
            finally:
                store.close()

    def _run(self, store: Store, config: EvolveConfig, progress: Callable[[str], None] | None) -> list[Step]:
        from evolve.command import make_proposers

        run = store.create_run(config.run_name or "search", config.model_dump(mode="json"), config.seed,
                               code_version(), self.evaluator.suite_version)
        loop = Evolution(store, run, config, self.evaluator, make_proposers(config, store, run),
                         (lambda message, _front: progress(message)) if progress else None)
        loop.seed_population()
        loop.propose()
        means = {p.policy_id: (p.score, p.cost) for p in loop.cascade.train_points()}
        steps = []
        for policy in store.policies(run.id):
            if policy.proposer in PROPOSED_BY:
                score, cost = means.get(policy.id, (None, None))
                steps.append(Step(policy.proposer, policy.status, policy.text, score, cost))
        return steps

    def close(self) -> None:
        self.evaluator.close()
