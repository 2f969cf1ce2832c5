"""Whether a finished run's champion may replace a refining proxy's live policy.

`akv evolve` crowns its champion against the expert on the held-out traces. Deployed behind a
refining proxy (`akv proxy --refine`), a champion must also beat what is serving now: the live
policy runs the same held-out traces with the run's own evaluator (the suite, agent, backend and
seed it stored; on a trace set the replay backend, seconds), and the champion rule judges the
run's finalists against it with the run's validation settings, as one Holm family. The champion
is promoted only if it is crowned against both.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from akv_stats.champion import champion_rule
from evolve.config import stored_config
from evolve.scoring import HarnessEvaluator
from evolve.validation import HELDOUT, REFERENCE
from store import RunInfo, Store, TaskResult

LIVE = "the live policy"


@dataclass(frozen=True)
class Judgement:
    """The decision on a run's champion: `policy_id` and `text` are set when it beats the live policy too."""

    reason: str
    policy_id: int | None = None
    label: str | None = None
    text: str | None = None
    figures: Mapping[str, Any] = field(default_factory=dict)

    @property
    def promotable(self) -> bool:
        return self.policy_id is not None


def judge_against_live(store: Store, run_name: str, live_name: str, live_text: str) -> Judgement:
    """The run's champion (against the expert) judged against the live policy on the same held-out traces."""
    run = store.run(run_name)
    validations = store.validations(run.id)
    finalists = [v for v in validations if v.role == "candidate"]
    champion = next((v for v in finalists if v.champion), None)
    if champion is None:
        return Judgement(f"no champion against the expert among {len(finalists)} finalist"
                         f"{'s' if len(finalists) != 1 else ''} of {run.name}")
    expert = store.baselines(run.id)[REFERENCE]
    config = stored_config(dict(run.config))
    evaluator = HarnessEvaluator(config.suite, config.agent, config.backend, run.seed,
                                 recorded_version=run.suite_version, agent_mode=config.agent_mode)
    try:
        held_out = _held_out(store, run, [expert, *(v.policy_id for v in finalists)], evaluator.task_ids(HELDOUT))
        task_ids = [r.task_id for r in held_out[expert]]
        live = _run_live(evaluator, live_name, live_text, task_ids)
    finally:
        evaluator.close()
    settings = config.validation
    verdicts = champion_rule({str(v.policy_id): _rows(held_out[v.policy_id]) for v in finalists}, _rows(live),
                             settings.margin, settings.alpha, settings.resamples, settings.permutations, run.seed,
                             reference=LIVE)
    against_live = verdicts[str(champion.policy_id)]
    label = f"{run.name}#{champion.policy_id}"
    figures = {"heldout": len(task_ids), "vs_expert": champion.stats.get("rule", {}),
               "vs_live": against_live.as_dict(), "live": live_name,
               "cost_usd": {"candidate": champion.cost_mean, "live": _mean(r.cost_usd for r in live),
                            "expert": _mean(r.cost_usd for r in held_out[expert])},
               "score": {"candidate": champion.score_mean, "live": _mean(r.score for r in live),
                         "expert": _mean(r.score for r in held_out[expert])}}
    if not against_live.champion:
        why = against_live.reason if not against_live.eligible else \
            f"another finalist is cheaper against {LIVE} ({against_live.reason})"
        return Judgement(f"{label}, the champion against the expert, is not crowned against {LIVE} "
                         f"{live_name}: {why}", figures=figures)
    text = store.policy(champion.policy_id).text or ""
    return Judgement(f"{label} crowned against the expert and against {LIVE} {live_name}: "
                     f"{against_live.reason}", champion.policy_id, label, text, figures)


def _held_out(store: Store, run: RunInfo, policy_ids: list[int], split_order: list[str]) -> dict[int, list[TaskResult]]:
    """Each policy's held-out results on the tasks all of them ran (the validation ran them alike), in split order."""
    found: dict[int, dict[str, TaskResult]] = {pid: {} for pid in policy_ids}
    for record in store.evaluations(run.id, HELDOUT, policy_ids):
        found[record.policy_id][record.result.task_id] = record.result
    order = [t for t in split_order if all(t in results for results in found.values())]
    return {pid: [results[t] for t in order] for pid, results in found.items()}


def _run_live(evaluator: HarnessEvaluator, name: str, text: str, task_ids: list[str]) -> list[TaskResult]:
    """The live policy on the held-out traces, with the run's own evaluator, in `task_ids`' order."""
    results: dict[str, TaskResult] = {}
    evaluator.evaluate(text, name, HELDOUT, task_ids, lambda r: results.__setitem__(r.task_id, r))
    missing = [t for t in task_ids if t not in results]
    if missing:
        raise RuntimeError(f"the live policy {name} did not run held-out trace {missing[0]}")
    return [results[t] for t in task_ids]


def _rows(results: list[TaskResult]) -> list[tuple[float, float]]:
    return [(r.score, r.cost_usd) for r in results]


def _mean(values: Any) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0
