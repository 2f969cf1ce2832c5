"""Cost on the held-out splits: score and API-equivalent cost per policy, with bootstrap intervals.

The suites' scripted agents run the held-out tasks under each policy on the replay backend (the
engine's own cache accounting, no model); the harness bills every request with the default price
table (summaries of text-mode policies included). Per suite and pooled over the suites: mean score
and mean cost per task with 95% bootstrap intervals, then AKV (expert-8k) against Standard, Text
Engineering and `full` (doing nothing) on the same tasks: the relative cost change (paired
bootstrap interval) and the score difference (paired bootstrap interval and a paired sign-flip
permutation test); and every other policy judged against the expert by the champion rule of
evolution (`akv_stats.champion.champion_rule`). The statistics are those of `akv_stats`, the only copy.

Target (the paper, vs Standard): at least 27.7% cheaper with no significant score loss.

    python benchmarks/cost.py [--tasks 40] [--swe-tasks 4] [--resamples 2000] [--json]
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from akv_stats.champion import DEFAULT_MARGIN, champion_rule
from akv_stats.paired import bootstrap_ci, compare_paired, relative_change_ci
from benchmarks.common import AKV, STANDARD, SUITES, TEXT_ENGINEERING, format_table, present_suites, run_split

FULL = "full"
POLICIES = (AKV, STANDARD, TEXT_ENGINEERING, FULL)
SPLIT = "heldout"
TARGET_SAVING = 0.277    # the paper's cost reduction of AKV against Standard
PAPER_SAVING_VS_TEXT = 0.219
ALPHA = 0.05


@dataclass(frozen=True)
class Settings:
    tasks: int | None = 40         # held-out tasks of localcomp (None: the whole split)
    swe_tasks: int | None = 4      # held-out tasks of localswe, whose tools run test suites
    resamples: int = 2000
    seed: int = 0
    suites: tuple[str, ...] = SUITES

    def limit(self, suite: str) -> int | None:
        return self.swe_tasks if suite == "localswe" else self.tasks


@dataclass(frozen=True)
class PolicyRun:
    """Per-task score and cost of one policy on one suite, in the split's task order."""

    task_ids: tuple[str, ...]
    scores: np.ndarray
    costs_usd: np.ndarray
    errors: int


def run_policies(settings: Settings, say: Any) -> tuple[dict[str, dict[str, PolicyRun]], list[str], list[str]]:
    """{suite: {policy: PolicyRun}}, the suites used, and notes on suites left out."""
    suites, notes = present_suites(settings.suites)
    runs: dict[str, dict[str, PolicyRun]] = {}
    for suite in suites:
        runs[suite] = {}
        for policy in POLICIES:
            started = time.perf_counter()
            report = run_split(suite, SPLIT, policy, limit=settings.limit(suite))
            results = report.results
            runs[suite][policy] = PolicyRun(tuple(r.task_id for r in results),
                                            np.array([r.score for r in results], dtype=float),
                                            np.array([r.cost_usd for r in results], dtype=float),
                                            sum(r.status == "error" for r in results))
            say(f"{suite} {policy}: {len(results)} tasks in {time.perf_counter() - started:.1f} s")
    return runs, suites, notes


def pooled(runs: Mapping[str, Mapping[str, PolicyRun]]) -> dict[str, PolicyRun]:
    """Every suite's tasks in one sample per policy (same task order for every policy)."""
    out = {}
    for policy in POLICIES:
        parts = [by_policy[policy] for by_policy in runs.values()]
        out[policy] = PolicyRun(tuple(t for p in parts for t in p.task_ids),
                                np.concatenate([p.scores for p in parts]),
                                np.concatenate([p.costs_usd for p in parts]), sum(p.errors for p in parts))
    return out


def describe(runs: Mapping[str, PolicyRun], settings: Settings) -> list[dict[str, Any]]:
    """Mean score and cost per task of each policy with percentile-bootstrap intervals."""
    rows = []
    for policy, run in runs.items():
        rows.append({
            "policy": policy, "tasks": len(run.scores), "errors": run.errors,
            "score": float(run.scores.mean()), "score_ci": bootstrap_ci(run.scores, settings.resamples,
                                                                         seed=settings.seed),
            "cost_usd": float(run.costs_usd.mean()), "cost_ci": bootstrap_ci(run.costs_usd, settings.resamples,
                                                                             seed=settings.seed),
        })
    return rows


def compare(akv: PolicyRun, base: PolicyRun, baseline: str, settings: Settings) -> dict[str, Any]:
    """AKV against a baseline on the same tasks: cost change and score difference, paired."""
    if akv.task_ids != base.task_ids:
        raise ValueError(f"{AKV} and {baseline} ran different tasks; a paired comparison needs the same ones")
    score = compare_paired(akv.scores, base.scores, settings.resamples, settings.resamples, settings.seed)
    return {
        "baseline": baseline, "tasks": score.n,
        "cost_change": float(akv.costs_usd.mean() / base.costs_usd.mean() - 1.0),
        "cost_change_ci": relative_change_ci(akv.costs_usd, base.costs_usd, settings.resamples, seed=settings.seed),
        "score_difference": score.mean_delta, "score_difference_ci": (score.ci_low, score.ci_high),
        "score_p_value": score.p_value,
        "significant_score_loss": bool(score.mean_delta < 0 and score.p_value < ALPHA),
    }


def against_expert(group: Mapping[str, PolicyRun], settings: Settings) -> list[dict[str, Any]]:
    """Every other policy judged against the expert by the champion rule (the Holm family is all of them)."""
    others = {p: run for p, run in group.items() if p != AKV}
    for policy, run in others.items():
        if run.task_ids != group[AKV].task_ids:
            raise ValueError(f"{AKV} and {policy} ran different tasks; a paired comparison needs the same ones")
    verdicts = champion_rule({p: list(zip(r.scores, r.costs_usd)) for p, r in others.items()},
                             list(zip(group[AKV].scores, group[AKV].costs_usd)), DEFAULT_MARGIN, ALPHA,
                             settings.resamples, settings.resamples, settings.seed)
    return [{"policy": p, **v.as_dict(), "eligible": v.eligible} for p, v in verdicts.items()]


def measure(settings: Settings = Settings(), progress: Any = None) -> dict[str, Any]:
    """Run the held-out splits under every policy; every figure of the run in one dict."""
    say = progress or (lambda text: None)
    started = time.perf_counter()
    runs, suites, notes = run_policies(settings, say)
    groups = {suite: runs[suite] for suite in suites}
    if len(suites) > 1:
        groups["pooled"] = pooled(runs)
    figures: dict[str, Any] = {"settings": {"split": SPLIT, "suites": suites, "tasks": settings.tasks,
                                            "swe_tasks": settings.swe_tasks, "resamples": settings.resamples,
                                            "seed": settings.seed, "notes": notes},
                               "groups": {}}
    for name, group in groups.items():
        figures["groups"][name] = {
            "policies": describe(group, settings),
            "comparisons": [compare(group[AKV], group[b], b, settings) for b in (STANDARD, TEXT_ENGINEERING, FULL)],
            "champion_rule": against_expert(group, settings),
        }
    headline = figures["groups"]["pooled" if "pooled" in groups else suites[0]]["comparisons"][0]
    figures["target"] = {"cost_saving_vs_standard": TARGET_SAVING,
                         "met": -headline["cost_change"] >= TARGET_SAVING and not headline["significant_score_loss"]}
    figures["wall_s"] = round(time.perf_counter() - started, 1)
    return figures


def render(figures: Mapping[str, Any]) -> str:
    s = figures["settings"]
    lines = [f"cost: scripted agent on the {s['split']} splits of {', '.join(s['suites'])} (replay backend); "
             f"95% bootstrap intervals, {s['resamples']} resamples; {figures['wall_s']:.0f} s in all"]
    for name, group in figures["groups"].items():
        lines += ["", f"[{name}]", format_table(
            ["policy", "tasks", "errors", "score", "score 95% CI", "cents/task", "cents 95% CI"],
            [[p["policy"], p["tasks"], p["errors"], p["score"], _span(p["score_ci"]), p["cost_usd"] * 100,
              _span(p["cost_ci"], 100)] for p in group["policies"]])]
        lines.append(format_table(
            ["AKV vs", "cost change", "95% CI", "score diff", "95% CI", "p (paired)", "significant loss"],
            [[c["baseline"], _percent(c["cost_change"]), _span(c["cost_change_ci"], 100, percent=True),
              c["score_difference"], _span(c["score_difference_ci"]), _p(c["score_p_value"]),
              "yes" if c["significant_score_loss"] else "no"] for c in group["comparisons"]]))
        lines.append(format_table(
            ["vs the expert", "cost change", "p (1-sided)", "Holm p", "score diff", "lower bound", "beats expert"],
            [[v["policy"], _percent(v["cost_percent"] / 100), _p(v["cost_p"]), _p(v["cost_p_holm"]),
              v["score_delta"], v["score_low"], "yes" if v["eligible"] else "no"] for v in group["champion_rule"]]))
    headline = figures["groups"]["pooled" if "pooled" in figures["groups"] else s["suites"][0]]["comparisons"]
    lines += ["", f"champion rule vs the expert: one-sided paired sign-flip test of the cost, Holm-adjusted over "
                  f"the other policies; score non-inferior when the one-sided {1 - ALPHA:.0%} bootstrap lower "
                  f"bound exceeds -{DEFAULT_MARGIN}",
              f"paper: AKV {_percent(-TARGET_SAVING)} vs Standard, {_percent(-PAPER_SAVING_VS_TEXT)} vs Text "
              f"Engineering. Target (>= {TARGET_SAVING:.1%} cheaper than Standard, no significant score loss): "
              f"{'met' if figures['target']['met'] else 'missed'} (measured {_percent(headline[0]['cost_change'])}; "
              f"vs full {_percent(headline[2]['cost_change'])})"]
    lines += s["notes"]
    return "\n".join(lines)


def _span(bounds: Sequence[float], scale: float = 1.0, percent: bool = False) -> str:
    low, high = (bound * scale for bound in bounds)
    return f"[{low:+.1f}%, {high:+.1f}%]" if percent else f"[{low:.3f}, {high:.3f}]"


def _p(value: float) -> str:
    return "<0.001" if value < 0.001 else f"{value:.3f}"


def _percent(value: float) -> str:
    return f"{value * 100:+.1f}%"


def parse_args(argv: Sequence[str] | None = None) -> tuple[Settings, bool]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=Settings.tasks,
                        help="localcomp held-out tasks (0: the whole split)")
    parser.add_argument("--swe-tasks", type=int, default=Settings.swe_tasks,
                        help="localswe held-out tasks (0: the whole split)")
    parser.add_argument("--resamples", type=int, default=Settings.resamples, help="bootstrap resamples")
    parser.add_argument("--seed", type=int, default=Settings.seed, help="seed of the resampling")
    parser.add_argument("--suites", default=",".join(SUITES), help="comma-separated suites")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = parser.parse_args(argv)
    settings = Settings(args.tasks or None, args.swe_tasks or None, args.resamples, args.seed,
                        tuple(args.suites.split(",")))
    return settings, args.json


def main(argv: Sequence[str] | None = None) -> None:
    settings, as_json = parse_args(argv)
    figures = measure(settings, progress=lambda text: print(text, file=sys.stderr, flush=True))
    print(json.dumps(figures) if as_json else render(figures))


if __name__ == "__main__":
    main()
