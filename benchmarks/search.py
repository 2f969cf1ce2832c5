"""Search efficiency: what each proposer mix finds in N proposals, against an exhaustive grid.

On the first `tasks` train tasks of one suite (scripted agent, replay backend), every point of a
fixed structure's tunable grid is evaluated, and its optimum taken: the cheapest grid policy whose
mean score is within `margin` of the grid's best score. Then each proposer mix (random sampling,
TPE, NSGA-II, mutate, mutate with TPE, and the llm proposer with the others when an endpoint is
given) runs the evolution loop's proposing part from the structure's own values for `budget`
proposals (duplicates and rejections count, as in a run), `repeats` times with seeds 0, 1, ...
The regret after n proposals is how much dearer the best policy found so far that scores at least
as well as that threshold is than the grid optimum (in %; negative: better than the grid, which
mutate may find outside it). All in one run, with one memo of (policy, task) results, so the grid
and the mixes see the very same numbers.

Target: TPE on a two-tunable structure reaches the grid optimum in fewer evaluations than random
sampling with the same seeds and budget (mean over the repeats; an evaluation is a candidate that ran
tasks, so duplicates and rejections are free; a repeat that never reaches it counts as budget + 1).
The proposals to reach it are printed beside.

    akv bench search [--suite localcomp] [--tasks 6] [--budget 16] [--repeats 8] [--json]

The mixes run evolve's loop, which the benchmarks do not import (layers); `akv bench search`
hands `measure` a searcher (evolve/search.py).
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence

from benchmarks.common import format_table
from policy_dsl import PolicyError, format_policy, parse, tunables, with_tunables

# Drop a search result page `age` turns after it came, and keep the last `keep` tool results.
STRUCTURE = """mode kv
on each turn: drop tool_name "search" and age >= 4 in 1..6 turns
on each tool_response: drop role tool keep last 4 in 3..8
reposition after each drop
"""
MIXES = ("random", "tpe", "nsga2", "mutate+tpe")
CHECKPOINTS = (1, 2, 4, 8, 12, 16, 24, 32)


class Searcher(Protocol):
    def evaluate(self, text: str) -> tuple[float, float]: ...

    def run(self, mix: str, seed: int, budget: int, seed_policy: str,
            progress: Callable[[str], None] | None = None) -> Sequence[Any]: ...


@dataclass(frozen=True)
class Settings:
    suite: str = "localcomp"
    tasks: int = 6
    budget: int = 16
    repeats: int = 8
    margin: float = 0.02
    structure: str = STRUCTURE
    mixes: tuple[str, ...] = MIXES
    notes: tuple[str, ...] = field(default=())


def grid(structure: str) -> list[tuple[dict[str, int], str]]:
    """Every point of the structure's tunable ranges: (values, canonical text)."""
    try:
        ast = parse(structure, filename="structure.akvp")
    except PolicyError as err:
        raise ValueError(f"--structure: {err}") from None
    found = tunables(ast)
    if len(found) < 1:
        raise ValueError("--structure: the policy has no tunable number (`N in LO..HI`) to search")
    size = math.prod(int(t.hi) - int(t.lo) + 1 for t in found)
    if size > 400:
        raise ValueError(f"--structure: its grid has {size} points; at most 400 are evaluated exhaustively")
    points = []
    for values in itertools.product(*(range(int(t.lo), int(t.hi) + 1) for t in found)):
        chosen = {t.path: v for t, v in zip(found, values)}
        points.append((chosen, format_policy(with_tunables(ast, chosen))))
    return points


def regret_curve(steps: Sequence[Any], start: tuple[float, float], threshold: float, optimum: float,
                 budget: int) -> list[float | None]:
    """Regret in % after 0..budget proposals (None while nothing found scores at the threshold)."""
    best = start[1] if start[0] >= threshold else math.inf
    curve = [_regret(best, optimum)]
    for step in list(steps)[:budget]:
        if step.score is not None and step.score >= threshold:
            best = min(best, step.cost)
        curve.append(_regret(best, optimum))
    return curve + [curve[-1]] * (budget + 1 - len(curve))


def _regret(best: float, optimum: float) -> float | None:
    return None if math.isinf(best) else round(100 * (best - optimum) / optimum, 3)


def reached(curve: Sequence[float | None], budget: int) -> int:
    """Proposals until the grid optimum (regret <= 0) was first found; budget + 1 if never."""
    return next((n for n, r in enumerate(curve) if r is not None and r <= 1e-9), budget + 1)


def evaluations_until(steps: Sequence[Any], proposals: int, budget: int) -> int:
    """Evaluations (candidates that ran tasks: evaluated or pruned; duplicates and rejections run none)
    among the first `proposals` steps; budget + 1 if the optimum was never reached."""
    if proposals > budget:
        return budget + 1
    return sum(s.status in ("evaluated", "pruned") for s in list(steps)[:proposals])


def measure(settings: Settings, searcher: Searcher, progress: Any = None) -> dict[str, Any]:
    say = progress or (lambda text: None)
    started = time.perf_counter()
    points = grid(settings.structure)
    say(f"grid: {len(points)} policies on {settings.tasks} {settings.suite} train tasks")
    scored = [(values, text, *searcher.evaluate(text)) for values, text in points]
    threshold = max(s for _v, _t, s, _c in scored) - settings.margin
    feasible = [row for row in scored if row[2] >= threshold]
    best_values, best_text, best_score, optimum = min(feasible, key=lambda row: (row[3], -row[2]))
    start = searcher.evaluate(settings.structure)
    mixes: dict[str, Any] = {}
    for mix in settings.mixes:
        runs = []
        for seed in range(settings.repeats):
            say(f"{mix}, seed {seed}: {settings.budget} proposals")
            steps = searcher.run(mix, seed, settings.budget, settings.structure)
            curve = regret_curve(steps, start, threshold, optimum, settings.budget)
            n = reached(curve, settings.budget)
            runs.append({"seed": seed, "curve": curve, "reached": n,
                         "reached_evaluations": evaluations_until(steps, n, settings.budget),
                         "evaluated": sum(s.score is not None for s in steps),
                         "duplicates": sum(s.status == "duplicate" for s in steps),
                         "rejected": sum(s.status == "rejected" for s in steps)})
        mixes[mix] = {"runs": runs, "mean_reached": round(sum(r["reached"] for r in runs) / len(runs), 2),
                      "mean_reached_evaluations": round(sum(r["reached_evaluations"] for r in runs) / len(runs), 2),
                      "reached_in": sum(r["reached"] <= settings.budget for r in runs),
                      "median_curve": [_median([r["curve"][n] for r in runs]) for n in range(settings.budget + 1)]}
    figures = {"settings": {"suite": settings.suite, "tasks": settings.tasks, "budget": settings.budget,
                            "repeats": settings.repeats, "margin": settings.margin, "structure": settings.structure,
                            "notes": list(settings.notes)},
               "grid": {"points": len(points), "threshold": round(threshold, 6), "optimum_cost_usd": optimum,
                        "optimum_score": best_score, "optimum": best_values, "optimum_text": best_text,
                        "start": {"score": start[0], "cost_usd": start[1]},
                        "table": [{"values": v, "score": s, "cost_usd": c} for v, _t, s, c in scored]},
               "mixes": mixes}
    if "tpe" in mixes and "random" in mixes:
        tpe, rnd = mixes["tpe"], mixes["random"]
        figures["target"] = {"tpe_mean_reached": tpe["mean_reached"], "random_mean_reached": rnd["mean_reached"],
                             "tpe_mean_reached_evaluations": tpe["mean_reached_evaluations"],
                             "random_mean_reached_evaluations": rnd["mean_reached_evaluations"],
                             "met": tpe["mean_reached_evaluations"] < rnd["mean_reached_evaluations"]}
    figures["wall_s"] = round(time.perf_counter() - started, 1)
    return figures


def _median(values: Sequence[float | None]) -> float | None:
    """The median, a missing value counting as the worst (a search that found nothing yet)."""
    ordered = sorted(values, key=lambda v: math.inf if v is None else v)
    middle = ordered[(len(ordered) - 1) // 2]
    return middle


def render(figures: Mapping[str, Any]) -> str:
    s, g = figures["settings"], figures["grid"]
    budget = s["budget"]
    shown = [n for n in CHECKPOINTS if n < budget] + [budget]
    lines = [f"search: {s['suite']} train, first {s['tasks']} tasks (scripted agent, replay); {g['points']}-point "
             f"grid; {budget} proposals x {s['repeats']} seeds per mix; {figures['wall_s']:.0f} s in all",
             f"grid optimum: {g['optimum']} score {g['optimum_score']:.3f} at {100 * g['optimum_cost_usd']:.4f} "
             f"cents/task (cheapest within {s['margin']} of the grid's best score); the start "
             f"{100 * g['start']['cost_usd']:.4f} cents, score {g['start']['score']:.3f}", "",
             "median regret in % after n proposals (- : nothing at the threshold yet)"]
    rows = [[mix, *(_cell(m["median_curve"][n]) for n in shown), f"{m['reached_in']}/{s['repeats']}",
             m["mean_reached"], m["mean_reached_evaluations"]] for mix, m in figures["mixes"].items()]
    lines.append(format_table(["mix", *(f"n={n}" for n in shown), "reached", "mean n to reach",
                               "mean evaluations to reach"], rows))
    target = figures.get("target")
    if target:
        lines += ["", f"target: TPE reaches the grid optimum in fewer evaluations than random sampling (mean over "
                      f"{s['repeats']} seeds; never reached counts {budget + 1}): TPE "
                      f"{target['tpe_mean_reached_evaluations']} vs random {target['random_mean_reached_evaluations']}"
                      f" ({target['tpe_mean_reached']} vs {target['random_mean_reached']} proposals): "
                      f"{'met' if target['met'] else 'missed'}"]
    return "\n".join(lines + list(s["notes"]))


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1f}"
