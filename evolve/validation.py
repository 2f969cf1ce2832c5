"""Held-out validation and the champion rule.

The top-k of the train front and the baselines run the held-out split with the same agent,
backend and seed. Each is compared with Standard task by task (paired statistics). A champion
is crowned only if it is non-dominated on held-out, its cost saving against Standard is
significant, and its score loss (if any) is not; otherwise nothing beat the baselines.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from evolve.cascade import Cascade, summarize
from evolve.config import ValidationConfig
from evolve.pareto import Point, pareto_front, rank_by_fronts
from sandbox.stats import PairedComparison, bootstrap_ci, compare_paired
from store import PolicyInfo, Store, ValidationRecord

HELDOUT = "heldout"


def pick_finalists(train_points: Sequence[Point], exclude: set[int], top_k: int) -> list[int]:
    """The best `top_k` train policies by non-dominated sorting, baselines excluded."""
    ranked = [p for p in rank_by_fronts(train_points) if p.policy_id not in exclude]
    return [p.policy_id for p in ranked[:top_k]]


def verdict(cost: PairedComparison, score: PairedComparison, non_dominated: bool, alpha: float) -> tuple[bool, str]:
    """(eligible to be champion, why) by the champion rule."""
    saving = cost.mean_delta < 0 and cost.significant(alpha)
    score_loss = score.mean_delta < 0 and score.significant(alpha)
    if not non_dominated:
        return False, "dominated on held-out"
    if not saving:
        return False, f"cost saving vs Standard not significant (p={cost.p_value:.3g})"
    if score_loss:
        return False, f"significant score loss vs Standard (p={score.p_value:.3g})"
    return True, f"saves {-cost.percent:.1f}% vs Standard (p={cost.p_value:.3g}), no significant score loss"


def validate(store: Store, run_id: int, cascade: Cascade, heldout_ids: Sequence[str], finalists: Sequence[int],
             baselines: Mapping[str, int], config: ValidationConfig, seed: int) -> list[ValidationRecord]:
    """Run the held-out split for finalists and baselines, store and return the summary."""
    if "standard" not in baselines:
        raise ValueError("validation needs a standard baseline")
    entries: list[tuple[PolicyInfo, str, str]] = []
    for role, pid in baselines.items():
        entries.append((store.policy(pid), "baseline", role))
    for pid in finalists:
        info = store.policy(pid)
        entries.append((info, "candidate", info.label))
    runs = {}
    for info, _role, label in entries:
        results = cascade.run_missing(info.id, info.text or "", label, heldout_ids, split=HELDOUT)
        runs[info.id] = [results[t] for t in heldout_ids]
    standard = runs[baselines["standard"]]
    means = {pid: summarize(rows) for pid, rows in runs.items()}
    front = {p.policy_id for p in pareto_front([Point(pid, m.score, m.cost) for pid, m in means.items()])}
    records, eligible = [], []
    for info, role, label in entries:
        rows = runs[info.id]
        scores, costs = [r.score for r in rows], [r.cost_usd for r in rows]
        cost = compare_paired(costs, [r.cost_usd for r in standard], config.resamples, config.permutations, seed)
        score = compare_paired(scores, [r.score for r in standard], config.resamples, config.permutations, seed)
        ok, why = verdict(cost, score, info.id in front, config.alpha)
        if role == "baseline":
            ok, why = False, f"baseline ({label.replace('_', ' ')})"
        if ok:
            eligible.append((cost.mean_delta, -score.mean_delta, info.id))
        stats = {"cost": cost.as_dict(), "score": score.as_dict(),
                 "score_ci": bootstrap_ci(scores, config.resamples, seed=seed),
                 "cost_ci": bootstrap_ci(costs, config.resamples, seed=seed), "alpha": config.alpha,
                 "policy_name": info.name}
        records.append(ValidationRecord(info.id, role, label if role == "candidate" else info.name or role,
                                        len(rows), means[info.id].score, means[info.id].cost, stats,
                                        info.id in front, False, why))
    champion = min(eligible)[2] if eligible else None
    records = [_crown(r) if r.policy_id == champion and r.role == "candidate" else r for r in records]
    store.save_validations(run_id, records)
    return records


def _crown(record: ValidationRecord) -> ValidationRecord:
    from dataclasses import replace

    return replace(record, champion=True, verdict="champion: " + record.verdict)
