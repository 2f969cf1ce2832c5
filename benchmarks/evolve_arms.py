"""Is the loop worth its budget? Proposer arms at equal budget, judged on held-out tasks (`akv bench evolve`).

Gideoni, Risi and Gal (2026) find IID random sampling competitive with code-evolution frameworks
at equal budget, and small, noisy evaluation sets picking wrong winners. This benchmark asks the
same of `akv evolve`: for each seed 0..seeds-1 and each arm, one whole evolution run (seed
population, propose, cascade, validate the finalists against the expert under the champion rule)
in a throwaway SQLite database, every arm with the same `max_candidates` (rejected and duplicate
proposals count toward it, as the loop counts them). The arms:

- `mix`: the proposers of `make evolve` (evolve.yaml) without the llm proposer: reflect, optuna, mutate;
- `random`: IID random policies from the whole language (`--proposer random`);
- `reflect`, `optuna`, `mutate`: each proposer alone.

Per run: the held-out cost change against the expert (%, negative = cheaper) and score change
(points) of the champion, or without one of the best validated candidate (what `akv export
--best` writes), whether a champion was crowned, and each proposer's proposals by fate. Per arm:
the mean over seeds with a 95% percentile-bootstrap interval over seeds (akv_stats/paired.py). Then
`mix` against `random` and against `reflect`, paired by seed: the mean difference, its bootstrap
interval and a two-sided paired sign-flip p-value (each comparison on its own; without `mix`,
every arm against `random`). With n seeds the smallest such p is 2 / 2^n: 5 seeds cannot show any
difference at 0.05 (0.0625 at best), 6 can (0.03125), which is why the default is 6.

The runs use the scripted agent on the replay backend, which is deterministic, so every (policy,
task) result is computed once and shared by all runs (`evolve.search.MemoEvaluator`): the
baselines run once, not once per run. The tasks are those of the suite as built in the data folder
(seed 0, as `make evolve`); a run's seed moves its proposers and its statistics, not its tasks.
Nothing is written to the data folder: no run, report or export.

Defaults: `--seeds 6 --budget 12`, 20 train tasks with a 6-task first stage and 60 held-out tasks:
the loop's own cascade and validation defaults (those of `make evolve`), so the arms are judged as
a real run judges them, with the fewest seeds that can reach p < 0.05. 6 seeds x 5 arms = 30 runs
of 12 candidates took 432 s of CPU time on one core (12 min of wall time on a 2-core machine
shared with other work, which left it 60% of a core), so about 7.5 minutes on an idle one. The shared
results make the baselines a one-time cost (the first run pays them); a run's own cost is its
candidates (6, then up to 20 train tasks each) and its finalists (60 held-out tasks each).

    akv bench evolve [--suite localcomp] [--seeds 6] [--budget 12] [--arms mix,random] [--json]

The runs need evolve's loop, which benchmarks never import: `akv bench evolve` hands `measure`
`evolve.arms.LoopRunner` (the tests hand it a fake one).
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from akv_stats.paired import bootstrap_ci, compare_paired
from benchmarks.common import format_table

ARMS: Mapping[str, tuple[str, ...]] = {
    "mix": ("reflect", "optuna", "mutate"),  # evolve.yaml's [reflect, optuna, llm, mutate] without llm
    "random": ("random",), "reflect": ("reflect",), "optuna": ("optuna",), "mutate": ("mutate",),
}
PAIRED = (("mix", "random"), ("mix", "reflect"))  # (arm, against): the questions the verdict answers
FATES = ("pending", "rejected", "duplicate", "pruned", "evaluated")  # a policy's status ("proposed": pending)
TRAIN_LIMIT, SUBSET_SIZE, HELDOUT_LIMIT = 20, 6, 60  # the loop's defaults (evolve/config.py)
ALPHA, RESAMPLES = 0.05, 2000

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Settings:
    """`arms` None: every arm of ARMS; a limit None: this benchmark's default above (not a whole split)."""

    suite: str = "localcomp"
    seeds: int = 6
    budget: int = 12
    arms: tuple[str, ...] | None = None
    heldout_limit: int | None = None
    train_limit: int | None = None
    subset_size: int | None = None

    @property
    def chosen_arms(self) -> tuple[str, ...]:
        return tuple(self.arms) if self.arms else tuple(ARMS)

    def limits(self) -> dict[str, int]:
        given = {"train_limit": self.train_limit, "subset_size": self.subset_size, "heldout_limit": self.heldout_limit}
        defaults = {"train_limit": TRAIN_LIMIT, "subset_size": SUBSET_SIZE, "heldout_limit": HELDOUT_LIMIT}
        return {name: defaults[name] if value is None else value for name, value in given.items()}


class Runner(Protocol):
    def check(self, settings: Settings) -> None:
        """Raise ValueError, naming the option, when the suite cannot run these settings."""

    def run(self, arm: str, proposers: Sequence[str], seed: int, settings: Settings) -> dict[str, Any]:
        """One evolution run: the row `outcome` describes, without seed and arm."""

    def close(self) -> None: ...


def check_settings(settings: Settings) -> None:
    """Refuse, before any run, what the user got wrong (ValueError naming the option)."""
    if settings.seeds < 1:
        raise ValueError(f"--seeds: expected at least 1 seed, got {settings.seeds}")
    if settings.budget < 1:
        raise ValueError(f"--budget: expected at least 1 candidate per run, got {settings.budget}")
    unknown = [a for a in settings.chosen_arms if a not in ARMS]
    if unknown:
        raise ValueError(f"--arms: unknown arm {unknown[0]!r}; expected some of {', '.join(ARMS)}")
    for name, value in settings.limits().items():
        if value < (2 if name == "heldout_limit" else 1):
            raise ValueError(f"--{name.replace('_', '-')}: expected at least {2 if name == 'heldout_limit' else 1}, "
                             f"got {value}")


def measure(settings: Settings, progress: Progress | None = None, runner: Runner | None = None) -> dict[str, Any]:
    """Every arm's run for every seed, then the per-arm summaries and the paired comparisons."""
    say = progress or (lambda _text: None)
    check_settings(settings)
    started = time.perf_counter()
    own = runner is None
    if runner is None:  # the loop lives in evolve, above what benchmarks import: akv bench evolve passes it
        raise ValueError("akv bench evolve runs the arms (benchmarks/ does not import the loop itself)")
    try:
        runner.check(settings)
        rows = []
        for seed in range(settings.seeds):  # seed-major: a partial run still pairs the arms of each seed
            for arm in settings.chosen_arms:
                row = {"seed": seed, "arm": arm, **runner.run(arm, ARMS[arm], seed, settings)}
                say(f"seed {seed + 1}/{settings.seeds} {arm}: {_said(row)}")
                rows.append(row)
    finally:
        if own:
            runner.close()
    arms = {arm: summary([r for r in rows if r["arm"] == arm]) for arm in settings.chosen_arms}
    paired = {f"{a}-{b}": compare(rows, a, b) for a, b in pairs(settings.chosen_arms)}
    return {"settings": {"suite": settings.suite, "seeds": settings.seeds, "budget": settings.budget,
                         "arms": {arm: list(ARMS[arm]) for arm in settings.chosen_arms}, **settings.limits(),
                         "alpha": ALPHA},
            "rows": rows, "arms": arms, "paired": paired, "verdict": verdict(arms, paired, settings.seeds),
            "wall_s": round(time.perf_counter() - started, 1)}


def pairs(arms: Sequence[str]) -> list[tuple[str, str]]:
    """(arm, against) compared by seed: mix against random and reflect; without mix, every arm against random."""
    if "mix" in arms:
        return [(a, b) for a, b in PAIRED if b in arms]
    return [(a, "random") for a in arms if a != "random" and "random" in arms]


def summary(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One arm over its seeds: means, the cost change's bootstrap interval, champions, fates."""
    changes = [r["cost_change_pct"] for r in rows]
    fates: dict[str, dict[str, int]] = {}
    for row in rows:
        for proposer, counts in row["fates"].items():
            total = fates.setdefault(proposer, dict.fromkeys(FATES, 0))
            for fate, n in counts.items():
                total[fate] = total.get(fate, 0) + n
    low, high = bootstrap_ci(changes, RESAMPLES)
    return {"seeds": len(rows), "cost_change_pct": _mean(changes), "ci_low": low, "ci_high": high,
            "score_change_points": _mean([r["score_change_points"] for r in rows]),
            "champions": sum(r["champion"] for r in rows),
            "champion_cost_change_pct": _mean([r["champion_cost_change_pct"] for r in rows]),
            "fates": fates, "wall_s": round(sum(r["wall_s"] for r in rows), 1)}


def compare(rows: Sequence[Mapping[str, Any]], arm: str, against: str) -> dict[str, Any]:
    """`arm` minus `against`, paired by seed (the same tasks, the same seed): cost change and champion's."""
    by = {(r["arm"], r["seed"]): r for r in rows}
    seeds = sorted(s for a, s in by if a == arm and (against, s) in by)
    found = {}
    for key in ("cost_change_pct", "champion_cost_change_pct"):
        paired = compare_paired([by[arm, s][key] for s in seeds], [by[against, s][key] for s in seeds], RESAMPLES)
        found[key] = {"mean_delta": paired.mean_delta, "ci_low": paired.ci_low, "ci_high": paired.ci_high,
                      "p_value": paired.p_value}
    return {"arm": arm, "against": against, "seeds": len(seeds), "smallest_p": smallest_p(len(seeds)), **found}


def smallest_p(n: int) -> float:
    """The smallest two-sided exact sign-flip p-value n paired seeds can give (all deltas one sign)."""
    return min(1.0, 2.0 / 2 ** n)


def verdict(arms: Mapping[str, Any], paired: Mapping[str, Any], seeds: int) -> str:
    """One line: the cheapest arm, and whether mix beats random and reflect significantly."""
    best = min(arms, key=lambda a: (arms[a]["cost_change_pct"], -arms[a]["score_change_points"]))
    parts = [f"cheapest on held-out: {best} ({arms[best]['cost_change_pct']:+.1f}% vs the expert, "
             f"score {arms[best]['score_change_points']:+.1f} points)"]
    for found in paired.values():
        d = found["cost_change_pct"]
        beats = d["mean_delta"] < 0 and d["p_value"] < ALPHA
        side = "cheaper" if d["mean_delta"] < 0 else "dearer"
        parts.append(f"{found['arm']} {'beats' if beats else 'does not beat'} {found['against']} "
                     f"({abs(d['mean_delta']):.1f} percentage points {side}, p={d['p_value']:.3g})")
    if paired and smallest_p(seeds) >= ALPHA:
        parts.append(f"{seeds} seeds cannot reach p < {ALPHA} (at best {smallest_p(seeds):.3g})")
    return "; ".join(parts)


def _said(row: Mapping[str, Any]) -> str:
    kind = "champion" if row["champion"] else ("best candidate" if row["chosen"] else "nothing validated")
    return (f"{kind}, cost {row['cost_change_pct']:+.1f}% vs the expert, score "
            f"{row['score_change_points']:+.1f} points ({row['wall_s']:.0f} s)")


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


# -- the table --------------------------------------------------------------------------------------


def render(figures: Mapping[str, Any]) -> str:
    s, arms = figures["settings"], figures["arms"]
    lines = [f"evolve arms: {s['suite']}, {s['seeds']} seed{'s' if s['seeds'] != 1 else ''} x {len(arms)} arms, "
             f"{s['budget']} candidates per run (rejected and duplicate proposals count, as in the loop); "
             f"{s['train_limit']} train tasks ({s['subset_size']} in the first stage), {s['heldout_limit']} held-out; "
             f"scripted agent, replay backend; {figures['wall_s']:.0f} s in all",
             "mix = make evolve's proposers without llm (" + ", ".join(ARMS["mix"]) + ")", ""]
    lines.append("held-out, per arm over seeds: cost of the champion (else the best validated candidate) vs "
                 "the expert, % (negative: cheaper), 95% bootstrap CI over seeds; champion only: 0 without one")
    rows = [[arm, _pct(a["cost_change_pct"]), f"[{a['ci_low']:+.1f}, {a['ci_high']:+.1f}]",
             f"{a['score_change_points']:+.1f}", f"{a['champions']}/{a['seeds']}",
             _pct(a["champion_cost_change_pct"]), f"{a['wall_s']:.0f}"] for arm, a in arms.items()]
    lines.append(format_table(["arm", "cost %", "95% CI", "score pts", "champions", "champion only %", "s"], rows))
    lines.append("s: the arm's wall seconds; results are shared, so the first run pays for the baselines")
    lines += ["", "cost % vs the expert per seed (* champion)"]
    lines.append(format_table(["arm", *(f"seed {n}" for n in range(s["seeds"]))],
                              [[arm, *(_pct(r["cost_change_pct"]) + ("*" if r["champion"] else "")
                                       for r in figures["rows"] if r["arm"] == arm)] for arm in arms]))
    lines += ["", "proposals by fate, all seeds"]
    lines.append(format_table(["arm", "proposer", "proposed", *FATES[1:]],
                              [[arm, proposer, sum(counts.values()), *(counts.get(f, 0) for f in FATES[1:])]
                               for arm, a in arms.items() for proposer, counts in a["fates"].items()]))
    if figures["paired"]:
        lines += ["", "paired by seed (same tasks): mean difference of cost %, 95% bootstrap CI, two-sided "
                      "sign-flip p"]
        lines.append(format_table(["difference", "seeds", "cost %", "95% CI", "p", "champion only %", "its p",
                                   "smallest p"], [_paired_row(p) for p in figures["paired"].values()]))
    return "\n".join(lines + ["", f"verdict: {figures['verdict']}"])


def _paired_row(found: Mapping[str, Any]) -> list[Any]:
    d, c = found["cost_change_pct"], found["champion_cost_change_pct"]
    return [f"{found['arm']} - {found['against']}", found["seeds"], f"{d['mean_delta']:+.1f}",
            f"[{d['ci_low']:+.1f}, {d['ci_high']:+.1f}]", f"{d['p_value']:.3g}", f"{c['mean_delta']:+.1f}",
            f"{c['p_value']:.3g}", f"{found['smallest_p']:.3g}"]


def _pct(value: float) -> str:
    return f"{value:+.1f}"


def parse_args(argv: Sequence[str] | None) -> tuple[Settings, bool]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default="localcomp")
    parser.add_argument("--seeds", type=int, default=Settings.seeds)
    parser.add_argument("--budget", type=int, default=Settings.budget)
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--train-limit", type=int)
    parser.add_argument("--subset-size", type=int)
    parser.add_argument("--heldout-limit", type=int)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    arms = tuple(a.strip() for a in args.arms.split(",") if a.strip())
    return Settings(args.suite, args.seeds, args.budget, arms, args.heldout_limit, args.train_limit,
                    args.subset_size), args.json


def main(argv: Sequence[str] | None = None) -> None:
    settings, as_json = parse_args(argv)
    try:
        figures = measure(settings, progress=lambda text: print(text, file=sys.stderr, flush=True))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(json.dumps(figures) if as_json else render(figures))


if __name__ == "__main__":
    main()
