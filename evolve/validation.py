"""Held-out validation and the champion rule.

The finalists (the top-k of the train front) and the baselines run the held-out split with the
same agent, backend and seed. The reference is the strongest baseline, the expert: every finalist
is judged against it on the same tasks by `sandbox.stats.champion_rule` (a one-sided paired test
that it is cheaper, Holm-Bonferroni across all finalists of the round, and non-inferiority of its
score within `margin`). Every policy is also compared, task by task, with each baseline (Standard,
Text Engineering, the expert and `full`) for the table and the report. Each validation is a new
round in the store; earlier rounds are kept.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from evolve.cascade import Cascade, summarize
from evolve.config import ValidationConfig
from evolve.pareto import Point, pareto_front, rank_by_fronts
from sandbox.stats import bootstrap_ci, champion_rule, compare_paired
from store import PolicyInfo, Store, TaskResult, ValidationRecord

HELDOUT = "heldout"
REFERENCE = "expert"  # the baseline every finalist must beat
SHOWN_AGAINST = ("expert", "standard", "text_engineering", "full")  # the table's comparison columns


def pick_finalists(train_points: Sequence[Point], exclude: set[int], top_k: int) -> list[int]:
    """The best `top_k` train policies by non-dominated sorting, baselines excluded."""
    ranked = [p for p in rank_by_fronts(train_points) if p.policy_id not in exclude]
    return [p.policy_id for p in ranked[:top_k]]


def versus(rows: Sequence[TaskResult], base: Sequence[TaskResult], config: ValidationConfig,
           seed: int) -> dict[str, Any]:
    """Paired two-sided comparisons of cost and score with one baseline, as stored in the stats."""
    cost = compare_paired([r.cost_usd for r in rows], [r.cost_usd for r in base], config.resamples,
                          config.permutations, seed)
    score = compare_paired([r.score for r in rows], [r.score for r in base], config.resamples,
                           config.permutations, seed)
    return {"cost": cost.as_dict(), "score": score.as_dict()}


def validate(store: Store, run_id: int, cascade: Cascade, heldout_ids: Sequence[str], finalists: Sequence[int],
             baselines: Mapping[str, int], config: ValidationConfig, seed: int, code_version: str,
             suite_version: str) -> list[ValidationRecord]:
    """Run the held-out split for baselines and finalists, judge, store a new round and return it."""
    if REFERENCE not in baselines:
        raise ValueError("validation needs an expert baseline (baselines.expert)")
    entries: list[tuple[PolicyInfo, str, str]] = [(store.policy(pid), "baseline", role) for role, pid in
                                                  baselines.items()]
    entries += [(info, "candidate", info.label) for info in map(store.policy, finalists)]
    for info, _role, _label in entries:  # all queued first: workers of a shared run take them side by side
        cascade.enqueue(info.id, heldout_ids, split=HELDOUT)
    runs: dict[int, list[TaskResult]] = {}
    for info, _role, _label in entries:  # progress names the policy (standard-8k), not its role (standard)
        results = cascade.run_missing(info.id, info.text or "", info.label, heldout_ids, split=HELDOUT)
        runs[info.id] = [results[t] for t in heldout_ids]
    means = {pid: summarize(rows) for pid, rows in runs.items()}
    front = {p.policy_id for p in pareto_front([Point(pid, m.score, m.cost) for pid, m in means.items()])}
    expert = runs[baselines[REFERENCE]]
    verdicts = champion_rule({str(pid): [(r.score, r.cost_usd) for r in runs[pid]] for pid in finalists},
                             [(r.score, r.cost_usd) for r in expert], config.margin, config.alpha,
                             config.resamples, config.permutations, seed)
    records = []
    for info, role, label in entries:
        rows = runs[info.id]
        stats: dict[str, Any] = {
            "vs": {shown: versus(rows, runs[baselines[shown]], config, seed) for shown in SHOWN_AGAINST
                   if shown in baselines and baselines[shown] != info.id},
            "score_ci": bootstrap_ci([r.score for r in rows], config.resamples, seed=seed),
            "cost_ci": bootstrap_ci([r.cost_usd for r in rows], config.resamples, seed=seed),
            "alpha": config.alpha, "margin": config.margin, "policy_name": info.name,
        }
        if role == "candidate":
            verdict = verdicts[str(info.id)]
            stats["rule"] = verdict.as_dict()
            text, champion = ("champion: " if verdict.champion else "") + verdict.reason, verdict.champion
        else:
            text, champion = f"baseline ({label.replace('_', ' ')})", False
        records.append(ValidationRecord(info.id, role, label if role == "candidate" else info.name or role,
                                        len(rows), means[info.id].score, means[info.id].cost, stats,
                                        info.id in front, champion, text))
    store.save_validations(run_id, records, code_version, suite_version, config.model_dump(mode="json"))
    return records
