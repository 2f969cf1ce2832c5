"""Headroom: how far the built-in policies are from the hindsight oracle, per suite and split.

The suites' scripted agents run each split under `full`, Standard, Text Engineering, the expert,
the hand-written non-window built-ins and the oracle, side by side in one run on the replay
backend (the engine's own cache accounting, no model). The oracle of a task is built from that
task's `full` run (each message dropped right after the last step that read it,
`sandbox/runs/oracle.py`) and then run through the harness like any policy, so its score and cost are
measured; its actions must equal the `full` run's. Per policy: mean score, cents per task, the
cost change against the expert, and the champion rule's verdict against the expert (paired on
the same tasks; the deployable policies are one Holm family, the oracle is judged alone). The
oracle is a ceiling only if no evaluated policy is cheaper at the same or a better mean score;
the policies that are (`oracle_beaten_by`) are named, and the split's oracle is then no ceiling.

Targets (issue 14, held-out): the oracle at least 25% cheaper than the expert at the same score;
a hand-written non-window built-in that passes the champion rule against the expert (significantly
cheaper, non-inferior score); the expert cheaper than Standard; `full` scoring at least as high as
every policy. A suite whose scripted agent records no uses gets no oracle column, and says why.

`--agent llm` runs the llm agent (tools mode) on the embedded model instead, one engine per worker
process, each run from an empty cache: the oracle is then built from the use records inferred
for the llm agent, and its actions equal `full`'s only where the model's replies do not change
under its drops. On a CPU a task takes seconds to minutes per policy: pass a small `--limit`.

    python benchmarks/headroom.py [--suites localcomp,localswe] [--splits train,heldout] [--agent scripted]
                                  [--limit 40] [--swe-limit 8] [--policies a,b] [--seed 0] [--workers 2] [--json]

JSON: costs are USD per task (`cost_usd`), as in the other benchmarks' JSON; the table shows cents.
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import contextlib
import json
import resource
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.common import AKV, STANDARD, SUITES, TEXT_ENGINEERING, format_table, present_suites

FULL, ORACLE = "full", "oracle"
BASELINES = (FULL, STANDARD, TEXT_ENGINEERING, AKV)
# Each suite's hand-written built-ins that are not a keep-last-N window (its example of what a window
# misses: localcomp's dead ends and long-range facts, localswe's stale tool outputs).
HANDWRITTEN: dict[str, tuple[str, ...]] = {"localcomp": ("research",), "localswe": ("drop-settled",)}
SPLITS = ("train", "heldout")
AGENTS = {"scripted": "replay", "llm": "embedded"}  # agent -> the backend it runs on here
TARGET_ORACLE_SAVING = 25.0  # percent cheaper than the expert, held-out


@dataclass(frozen=True)
class Settings:
    suites: tuple[str, ...] = SUITES
    splits: tuple[str, ...] = SPLITS
    limit: int | None = 40          # localcomp tasks per split (None: the whole split)
    swe_limit: int | None = 8       # localswe tasks per split: its tools run test suites; on 6 tasks or
                                    # fewer the sign-flip p (>= 1/2^n) cannot pass Holm over 4 policies
    policies: tuple[str, ...] | None = None  # the hand-written kv policies of every suite (None: HANDWRITTEN's)
    margin: float | None = None     # the champion rule's score margin (None: akv_stats.champion's default)
    alpha: float = 0.05
    resamples: int = 2000
    seed: int = 0
    workers: int = 2                # processes running tasks (each task's policies in one of them): the
                                    # localswe tasks' test runs keep both cores of a 2-core machine busy
    agent: str = "scripted"         # or llm: the embedded model in tools mode (AGENTS)

    def task_limit(self, suite: str) -> int | None:
        return self.swe_limit if suite == "localswe" else self.limit

    def handwritten(self, suite: str) -> tuple[str, ...]:
        return HANDWRITTEN.get(suite, ()) if self.policies is None else self.policies


@dataclass(frozen=True)
class Column:
    """Per-task score and cost of one policy on one split, in the split's task order."""

    task_ids: tuple[str, ...]
    scores: tuple[float, ...]
    costs_usd: tuple[float, ...]
    errors: int

    @classmethod
    def of(cls, results: Sequence[Any]) -> Column:
        return cls(tuple(r.task_id for r in results), tuple(r.score for r in results),
                   tuple(r.cost_usd for r in results), sum(r.status == "error" for r in results))

    def mean_score(self) -> float:
        return sum(self.scores) / len(self.scores) if self.scores else 0.0

    def mean_cost(self) -> float:
        return sum(self.costs_usd) / len(self.costs_usd) if self.costs_usd else 0.0

    def pairs(self) -> list[tuple[float, float]]:
        return list(zip(self.scores, self.costs_usd))


def run_split(suite: str, split: str, policies: Sequence[str], settings: Settings,
              say: Any, pool: Any = None) -> tuple[dict[str, Column], dict[str, Any]]:
    """Every policy's column on one split, the oracle's last; and the oracle's action check.

    Each task runs under every policy in one process (`TaskRuns`): its `full` run is the
    oracle's recording, and a localswe task's test runs and grades are shared by its policies
    (the suite's own caches). With a `pool` the tasks are spread over its processes (one pool
    for the whole benchmark); every run is still a fresh replay of one task, so the figures are
    a serial run's.
    A suite whose scripted agent records no uses gets no oracle column: the check then holds the
    oracle's message (which records are missing, how to regenerate them) under "unavailable".
    """
    from sandbox.runs.harness import select_tasks

    task_ids = [task.id for task in select_tasks(_built_suite(suite, settings.seed), split, limit=settings.task_limit(suite))]
    started = time.perf_counter()
    runs = _each_task(suite, split, task_ids, tuple(policies), settings, say, pool)
    say(f"{suite}/{split}: {len(task_ids)} tasks x {len(policies) + 1} runs in {time.perf_counter() - started:.1f} s")
    unavailable = next((run.unavailable for run in runs if run.unavailable), None)
    names = [name for name in policies if name != FULL]
    columns = {FULL: Column.of([run.results[FULL] for run in runs])}
    columns.update({name: Column.of([run.results[name] for run in runs]) for name in names})
    if unavailable is not None:
        say(f"{suite}/{split} {ORACLE}: {unavailable}")
        return columns, {"same_actions": 0, "tasks": 0, "diverged": [], "unavailable": unavailable}
    columns[ORACLE] = Column.of([run.results[ORACLE] for run in runs])
    check = {"same_actions": sum(run.same_actions for run in runs), "tasks": len(runs),
             "diverged": [run.results[FULL].task_id for run in runs if not run.same_actions]}
    return columns, check


@dataclass(frozen=True)
class TaskRuns:
    """One task under `full`, its oracle and every other policy; `unavailable`: why it has no oracle."""

    results: dict[str, Any]  # policy name -> TaskOutcome
    same_actions: bool
    unavailable: str | None = None


def run_task_policies(suite: str, split: str, task_id: str, policies: Sequence[str], seed: int,
                      agent: str = "scripted") -> TaskRuns:
    """`full` and the oracle made from it (or plain `full` where the agent records no uses), then the rest."""
    from sandbox.runs.harness import resolve_policy, run_task, select_tasks
    from sandbox.runs.oracle import OracleError, run_oracle

    suite_obj = _built_suite(suite, seed)
    task = select_tasks(suite_obj, split, [task_id])[0]
    backend, make_agent = _backend_and_agent(agent, suite_obj)
    results: dict[str, Any] = {}
    try:
        recorded = run_oracle(task, suite_obj, backend, seed=seed, agent=make_agent)
    except OracleError as err:
        unavailable, same = str(err), False
        results[FULL], _ = run_task(task, suite_obj, resolve_policy(FULL), make_agent(task), backend(), seed=seed)
    else:
        unavailable, same = None, recorded.same_actions
        results[FULL], results[ORACLE] = recorded.full, recorded.oracle
    for name in policies:
        if name not in results:
            results[name], _ = run_task(task, suite_obj, resolve_policy(name), make_agent(task), backend(), seed=seed)
    return TaskRuns(results, same, unavailable)


_ENGINE: list[Any] = []


def _backend_and_agent(agent: str, suite_obj: Any) -> tuple[Callable[[], Any], Callable[[Any], Any]]:
    """(the maker of each run's backend, the maker of each run's agent) for `agent` (AGENTS)."""
    if agent == "scripted":
        from sandbox.backends.replay import ReplayBackend

        return ReplayBackend, suite_obj.scripted_agent
    from sandbox.agents.llm import LLMAgent

    return _embedded, lambda task: LLMAgent()


def _embedded() -> Any:
    """The embedded model, loaded once per process; each task run starts it from an empty cache."""
    if not _ENGINE:
        from sandbox.backends.embedded import EmbeddedBackend

        _ENGINE.append(EmbeddedBackend())
    return _ENGINE[0]


def _each_task(suite: str, split: str, task_ids: Sequence[str], policies: tuple[str, ...], settings: Settings,
               say: Any, pool: Any = None) -> list[TaskRuns]:
    """`run_task_policies` of every task, in task order; in `pool`'s processes when there is one."""
    def heard(number: int, runs: TaskRuns) -> None:
        say(f"{suite}/{split} task {number + 1}/{len(task_ids)}: {runs.results[FULL].task_id}")

    out: list[TaskRuns] = []
    if pool is None or len(task_ids) <= 1:
        for number, task_id in enumerate(task_ids):
            out.append(run_task_policies(suite, split, task_id, policies, settings.seed, settings.agent))
            heard(number, out[-1])
        return out
    futures = [pool.submit(run_task_policies, suite, split, task_id, policies, settings.seed, settings.agent)
               for task_id in task_ids]
    for number, future in enumerate(futures):
        out.append(future.result())
        heard(number, out[-1])
    return out


def _pool(workers: int) -> Any:
    """The processes that run tasks (None: this one); spawned once, so each loads the suites once."""
    if workers <= 1:
        return contextlib.nullcontext(None)
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))  # never fork threads


_BUILT: dict[tuple[str, int], Any] = {}


def _built_suite(suite: str, seed: int) -> Any:
    """The suite, built (fast when already built), once per process."""
    if (suite, seed) not in _BUILT:
        from sandbox.suites import get_suite

        from akv_core.home import akv_home

        suite_obj = get_suite(suite)
        suite_obj.build(akv_home(), seed)
        _BUILT[suite, seed] = suite_obj
    return _BUILT[suite, seed]


def verdicts(columns: Mapping[str, Column], settings: Settings) -> dict[str, dict[str, Any]]:
    """The champion rule against the expert: the deployable policies together, the oracle alone."""
    from akv_stats.champion import DEFAULT_MARGIN, champion_rule

    margin = DEFAULT_MARGIN if settings.margin is None else settings.margin
    options = {"margin": margin, "alpha": settings.alpha, "resamples": settings.resamples, "seed": settings.seed}
    expert = columns[AKV].pairs()
    deployable = {name: c.pairs() for name, c in columns.items() if name not in (AKV, ORACLE)}
    found = dict(champion_rule(deployable, expert, **options))
    if ORACLE in columns:
        found.update(champion_rule({ORACLE: columns[ORACLE].pairs()}, expert, **options))
    out = {name: {**v.as_dict(), "eligible": v.eligible, "reason": v.reason} for name, v in found.items()}
    if ORACLE in out:
        out[ORACLE]["champion"] = False  # it knows the future: never a candidate, only measured by the same rule
    return out


def describe(columns: Mapping[str, Column], check: Mapping[str, Any], settings: Settings) -> dict[str, Any]:
    """The rows of one split: score, cost per task in USD, change against the expert, verdict."""
    for name, column in columns.items():
        if column.task_ids != columns[AKV].task_ids:
            raise ValueError(f"{name} ran other tasks than {AKV}; the comparison is paired on the same tasks")
    found = verdicts(columns, settings)
    expert_cost = columns[AKV].mean_cost()
    rows = [{"policy": name, "tasks": len(c.scores), "errors": c.errors, "score": round(c.mean_score(), 4),
             "cost_usd": round(c.mean_cost(), 9),  # per task; the table shows cents
             "vs_expert_percent": round(100 * (c.mean_cost() / expert_cost - 1), 2) if expert_cost else None,
             "verdict": found.get(name)} for name, c in columns.items()]
    oracle = columns.get(ORACLE)
    gap = 100 * (1 - oracle.mean_cost() / expert_cost) if oracle and expert_cost else None
    beaten_by = oracle_beaten_by(columns)
    return {"policies": rows, "oracle_check": dict(check),
            "expert_to_oracle_gap_percent": None if gap is None else round(gap, 2),
            "oracle_same_score_as_full": oracle is not None and oracle.scores == columns[FULL].scores,
            "oracle_beaten_by": beaten_by,
            # the oracle is the ceiling only where it replayed the recorded actions on every task
            # and no evaluated policy did better
            "oracle_valid": oracle is not None and check["same_actions"] == check["tasks"] and not oracle.errors
            and not beaten_by}


def oracle_beaten_by(columns: Mapping[str, Column]) -> list[str]:
    """The evaluated policies cheaper than the oracle at the same or a better mean score (none
    without an oracle column).

    The oracle keeps the `full` run's actions and drops each message after its last use; a policy
    that changes the actions (a shorter path to the same score) can cost less. Where one does, the
    oracle's cost is no lower bound and the expert-to-oracle gap is no measure of headroom.
    """
    oracle = columns.get(ORACLE)
    if oracle is None:
        return []
    return [name for name, c in columns.items() if name != ORACLE
            and c.mean_cost() < oracle.mean_cost() and c.mean_score() >= oracle.mean_score()]


def targets(group: Mapping[str, Any], handwritten: Sequence[str]) -> dict[str, bool | None]:
    rows = {row["policy"]: row for row in group["policies"]}
    # beating the expert under the champion rule: significantly cheaper (Holm) with a non-inferior score
    passing = [name for name in handwritten if name in rows and rows[name]["verdict"]["eligible"]]
    has_oracle = "unavailable" not in group["oracle_check"]
    return {
        "oracle_25_percent_cheaper_at_same_score": group["oracle_valid"] and group["oracle_same_score_as_full"]
        and (group["expert_to_oracle_gap_percent"] or 0) >= TARGET_ORACLE_SAVING if has_oracle else None,
        "handwritten_non_window_beats_expert": bool(passing) if handwritten else None,
        "expert_cheaper_than_standard": rows[AKV]["cost_usd"] < rows[STANDARD]["cost_usd"],
        "full_scores_highest": all(rows[FULL]["score"] >= row["score"] for row in rows.values()),
    }


def measure(settings: Settings = Settings(), progress: Any = None) -> dict[str, Any]:
    """Every split of every suite under every policy and the oracle; all figures in one dict."""
    say = progress or (lambda text: None)
    if settings.agent not in AGENTS:
        raise ValueError(f"--agent: expected {' or '.join(AGENTS)}, got {settings.agent!r}")
    started = time.perf_counter()
    suites, notes = present_suites(settings.suites)
    chosen: dict[str, list[str]] = {}
    for suite in suites:  # every name checked before anything runs
        chosen[suite], missing = _present_policies(settings.handwritten(suite))
        notes += [f"{name} left out of {suite}: not a built-in policy of this checkout" for name in missing]
    groups: dict[str, Any] = {}
    cpu_before = _cpu_s()
    with _pool(settings.workers) as pool:
        for suite, handwritten in chosen.items():
            policies = BASELINES + tuple(p for p in handwritten if p not in BASELINES)
            for split in settings.splits:
                columns, check = run_split(suite, split, policies, settings, say, pool)
                group = describe(columns, check, settings)
                group["targets"] = targets(group, handwritten) if split == "heldout" else None
                groups[f"{suite}/{split}"] = group
    return {"settings": {"suites": suites, "splits": list(settings.splits), "limit": settings.limit,
                         "swe_limit": settings.swe_limit, "policies": chosen, "margin": settings.margin,
                         "alpha": settings.alpha, "resamples": settings.resamples, "seed": settings.seed,
                         "workers": settings.workers, "agent": settings.agent,
                         "backend": AGENTS[settings.agent], "notes": notes},
            "groups": groups, "wall_s": round(time.perf_counter() - started, 1),
            # CPU seconds of this process, its workers and their commands (test runs): the wall time
            # of an idle machine is about this divided by the cores kept busy
            "cpu_s": round(_cpu_s() - cpu_before, 1)}


def _cpu_s() -> float:
    """User and system CPU seconds of this process and its finished children (workers, sandboxed commands)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _present_policies(names: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the policies to run, the default built-ins this checkout lacks); ValueError for a bad one asked for."""
    from policy_dsl import builtin_names
    from sandbox.runs.harness import resolve_policy

    known = set(builtin_names())
    defaults = {name for names_of_suite in HANDWRITTEN.values() for name in names_of_suite}
    missing = [n for n in names if n in defaults and n not in known]
    present = [n for n in names if n not in missing]
    for name in present:
        policy = resolve_policy(name)  # ValueError naming an unknown built-in or a bad file
        if policy.mode != "kv":
            raise ValueError(f"--policies: {name} is a {policy.mode}-mode policy; the hand-written built-ins "
                             "compared with the oracle are kv policies")
    return present, missing


def render(figures: Mapping[str, Any]) -> str:
    s = figures["settings"]
    lines = [f"headroom: {s.get('agent', 'scripted')} agent on {', '.join(s['suites'])} ({', '.join(s['splits'])}), "
             f"{s.get('backend', 'replay')} backend; "
             f"champion rule against {AKV} (alpha {s['alpha']}); {figures['wall_s']:.0f} s in all"
             + (f", {figures['cpu_s']:.0f} CPU s, {s['workers']} workers" if "cpu_s" in figures else "")]
    for name, group in figures["groups"].items():
        check = group["oracle_check"]
        warning = "" if group["oracle_valid"] else f" (NOT a ceiling: {_not_a_ceiling(group)})"
        oracle = (f"no oracle: {check['unavailable']}" if "unavailable" in check else
                  f"expert-to-oracle gap {_percent(group['expert_to_oracle_gap_percent'])}; oracle actions equal "
                  f"full's on {check['same_actions']}/{check['tasks']} tasks{warning}")
        lines += ["", f"[{name}] {oracle}",
                  format_table(["policy", "tasks", "errors", "score", "cents/task", "vs expert", "verdict"],
                               [[r["policy"], r["tasks"], r["errors"], r["score"], f"{100 * r['cost_usd']:.4f}",
                                 _percent(r["vs_expert_percent"]), _verdict(r["verdict"])]
                                for r in group["policies"]])]
        if group["targets"]:
            lines.append("targets: " + "; ".join(f"{k.replace('_', ' ')}: {_met(v)}" for k, v in group["targets"].items()))
    lines += s["notes"]
    return "\n".join(lines)


def _not_a_ceiling(group: Mapping[str, Any]) -> str:
    """Why a split's oracle is no ceiling: it left the recorded actions, failed, or a policy beat it."""
    check, beaten_by = group["oracle_check"], group.get("oracle_beaten_by") or []
    errors = sum(row["errors"] for row in group["policies"] if row["policy"] == ORACLE)
    reasons = [] if check["same_actions"] == check["tasks"] else ["the oracle left the recorded actions"]
    reasons += [f"the oracle failed on {errors} task{'s' if errors != 1 else ''}"] if errors else []
    if beaten_by:
        reasons.append(f"{', '.join(beaten_by)} {'is' if len(beaten_by) == 1 else 'are'} cheaper than the oracle "
                       "at the same or a better score")
    return "; ".join(reasons)


def _verdict(verdict: Mapping[str, Any] | None) -> str:
    """The champion rule's finding in a word: champion, eligible, not cheaper, or inferior score."""
    if verdict is None:
        return "(reference)"
    if verdict["champion"]:
        return "champion"
    if verdict["eligible"]:
        return "eligible" if verdict["family"] > 1 else "eligible (alone)"
    return "not cheaper" if not verdict["cheaper"] else "inferior score"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1f}%"


def _met(value: bool | None) -> str:
    return "n/a" if value is None else ("met" if value else "missed")


def parse_args(argv: Sequence[str] | None = None) -> tuple[Settings, bool]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suites", default=",".join(SUITES), help="comma-separated suites")
    parser.add_argument("--splits", default=",".join(SPLITS), help="comma-separated splits")
    parser.add_argument("--limit", type=int, default=Settings.limit,
                        help="localcomp tasks per split (0: the whole split)")
    parser.add_argument("--swe-limit", type=int, default=Settings.swe_limit,
                        help="localswe tasks per split (0: the whole split)")
    parser.add_argument("--policies", default=None,
                        help="comma-separated hand-written kv policies for every suite (built-in names or .akvp "
                             "files; default: each suite's own, research for localcomp, drop-settled for localswe)")
    parser.add_argument("--seed", type=int, default=Settings.seed,
                        help="the suites' build seed (another seed: other bugs and documents, fresh splits)")
    parser.add_argument("--workers", type=int, default=Settings.workers,
                        help="processes running tasks (each task's policies in one of them)")
    parser.add_argument("--agent", default=Settings.agent, choices=tuple(AGENTS),
                        help="scripted (replay backend) or llm (the embedded model, tools mode)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = parser.parse_args(argv)
    if args.workers < 1:
        raise SystemExit(f"--workers expects a positive number of processes, got {args.workers}")
    names = None if args.policies is None else tuple(p.strip() for p in args.policies.split(",") if p.strip())
    settings = Settings(_names(args.suites, "--suites"), _names(args.splits, "--splits"), args.limit or None,
                        args.swe_limit or None, names, seed=args.seed, workers=args.workers, agent=args.agent)
    return settings, args.json


def _names(text: str, option: str) -> tuple[str, ...]:
    names = tuple(p.strip() for p in text.split(",") if p.strip())
    if not names:
        raise SystemExit(f"{option} expects at least one name")
    return names


def main(argv: Sequence[str] | None = None) -> None:
    settings, as_json = parse_args(argv)
    try:
        figures = measure(settings, progress=lambda text: print(text, file=sys.stderr, flush=True))
    except ValueError as err:
        raise SystemExit(f"headroom: {err}") from None
    print(json.dumps(figures) if as_json else render(figures))


if __name__ == "__main__":
    main()
