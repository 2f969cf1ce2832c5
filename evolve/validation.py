"""Held-out validation and the champion rule.

The finalists (the top-k of the train front) and the baselines run the held-out split with the
same agent, backend and seed. The reference is the strongest baseline, the expert: every finalist
is judged against it on the same tasks by `akv_stats.champion.champion_rule` (a one-sided paired test
that it is cheaper, Holm-Bonferroni across all finalists of the round, and non-inferiority of its
score within `margin`). Every policy is also compared, task by task, with each baseline (Standard,
Text Engineering, the expert and `full`) for the table and the report. Each validation is a new
round in the store; earlier rounds are kept.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping, Sequence

from akv_stats.champion import Verdict, champion_rule
from akv_stats.paired import bootstrap_ci, compare_paired
from evolve.cascade import Cascade, summarize
from evolve.config import ValidationConfig
from evolve.fidelity import Judged, LikelihoodJudge, judged_scores
from evolve.pareto import Point, pareto_front
from store import PolicyInfo, Store, TaskResult, ValidationRecord

HELDOUT = "heldout"
REFERENCE = "expert"  # the baseline every finalist must beat
SHOWN_AGAINST = ("expert", "standard", "text_engineering", "full")  # the table's comparison columns


def train_verdicts(rows: Mapping[int, Sequence[TaskResult]], expert: Sequence[TaskResult], config: ValidationConfig,
                   seed: int) -> dict[int, Verdict]:
    """Each policy judged alone against the expert on the train tasks by the champion rule (a family
    of one): whether it would be crowned there, and by how much. What decides who is validated."""
    reference = [(r.score, r.cost_usd) for r in expert]
    return {pid: champion_rule({str(pid): [(r.score, r.cost_usd) for r in results]}, reference, config.margin,
                               config.alpha, config.resamples, config.permutations, seed)[str(pid)]
            for pid, results in rows.items()}


def pick_finalists(verdicts: Mapping[int, Verdict], top_k: int, behaviours: Mapping[int, str] | None = None,
                   dearer: Mapping[int, int] | None = None) -> list[int]:
    """The `top_k` policies that beat the expert on train (cheaper, significantly, at a score
    non-inferior by the rule's margin), the most promising first: those that lose no score against
    it, then the others; among each, first those that cost no more than the expert on any train task
    (`dearer`: per policy, on how many it costs more), as the rule's paired cost test is surest of
    them, then the rest; cheapest first within. A policy that does not beat the expert on train is
    never a finalist: it would only widen the Holm family of those that could win.

    Policies with the same train behaviour (`behaviours`: `outcome_digests`) count once, as the
    earliest of them; `twins` names the others.
    """
    return _ranked_finalists({pid: v for pid, v in verdicts.items() if v.eligible}, top_k, behaviours, dearer)


def near_finalists(verdicts: Mapping[int, Verdict], top_k: int, margin: float,
                   behaviours: Mapping[int, str] | None = None, dearer: Mapping[int, int] | None = None) -> list[int]:
    """What goes to held-out when no policy beats the expert on train by the rule (`pick_finalists` finds
    none: a train split too small for the paired cost test to reach its level, or savings too close to
    call): the `top_k` cheaper than the expert there on average at a mean score within the margin, in
    `pick_finalists`'s order. Never a policy that costs the expert's or more."""
    near = {pid: v for pid, v in verdicts.items() if v.cost_delta < 0 and v.score_delta >= -margin}
    return _ranked_finalists(near, top_k, behaviours, dearer)


def _ranked_finalists(verdicts: Mapping[int, Verdict], top_k: int, behaviours: Mapping[int, str] | None,
                      dearer: Mapping[int, int] | None) -> list[int]:
    eligible = [(v.score_delta < 0, (dearer or {}).get(pid, 0) > 0, v.cost_delta, pid) for pid, v in verdicts.items()]
    ranked = [pid for *_order, pid in sorted(eligible)]
    seen: set[str] = set()
    finalists = []
    for pid in ranked:
        key = (behaviours or {}).get(pid, str(pid))
        if key not in seen and len(finalists) < top_k:
            seen.add(key)
            finalists.append(min(q for q in ranked if (behaviours or {}).get(q, str(q)) == key))
    return finalists


def left_out(verdicts: Mapping[int, Verdict], finalists: Sequence[int], margin: float) -> list[dict[str, Any]]:
    """Why each policy that does not beat the expert on train stays out of validation, cheapest first."""
    out = []
    for pid, v in sorted(verdicts.items(), key=lambda item: item[1].cost_delta):
        if pid in finalists or v.eligible:
            continue
        if v.cost_delta >= 0:
            why = f"costs {v.cost_percent:+.1f}% vs the expert on train"
        elif not v.cheaper:
            why = f"{v.cost_percent:+.1f}% vs the expert on train, not significantly cheaper (p={v.cost_p:.2g})"
        else:
            why = (f"{v.cost_percent:+.1f}% vs the expert on train, but score {100 * v.score_delta:+.1f} points, "
                   f"lower bound {100 * v.score_low:+.1f} vs margin -{100 * margin:.1f}")
        out.append({"policy_id": pid, "cost_percent": round(v.cost_percent, 2),
                    "score_delta": round(v.score_delta, 4), "why": why})
    return out


def with_parents(finalists: Sequence[int], train_points: Sequence[Point], parents: Mapping[int, Sequence[int]],
                 behaviours: Mapping[int, str] | None = None) -> list[int]:
    """`finalists` followed by each one's parents that were scored on the whole train split and behave
    differently from every policy already chosen (baselines are never in `train_points`' candidates;
    pass only the points that beat the expert on train, so that no parent widens the family in vain).

    A child that beats its parent on 20 train tasks may only fit those tasks (a tweak of a good policy
    is most often chosen for noise); validating the parent too lets the held-out split, where the
    champion is the cheapest eligible finalist, choose between them.
    """
    scored = {p.policy_id for p in train_points}
    chosen = list(finalists)
    seen = {(behaviours or {}).get(pid, str(pid)) for pid in chosen}
    for pid in finalists:
        for parent in parents.get(pid, ()):
            key = (behaviours or {}).get(parent, str(parent))
            if parent in scored and parent not in chosen and key not in seen:
                chosen.append(parent)
                seen.add(key)
    return chosen


def twins(finalists: Sequence[int], candidates: Sequence[int], behaviours: Mapping[int, str]) -> dict[int, list[int]]:
    """Per finalist, the later candidates whose train behaviour is the same as its own."""
    return {f: [c for c in candidates if c > f and f in behaviours and behaviours.get(c) == behaviours[f]]
            for f in finalists}


def outcome_digests(store: Store, run_id: int, split: str, task_ids: Sequence[str]) -> dict[int, str]:
    """Per policy run on every one of `task_ids`: a digest of what it did there.

    Every task's status, score, cost and token counts, in task order, and where they are kept
    (train) its message timelines: when each message arrived, was dropped, was read. Two
    policies whose decisions are the same on the histories they are scored on have the same
    digest; the converse is what the digest claims, with a margin of every token count.
    """
    results: dict[int, dict[str, TaskResult]] = {}
    for e in store.evaluations(run_id, split):
        results.setdefault(e.policy_id, {})[e.result.task_id] = e.result
    complete = {pid: rows for pid, rows in results.items() if all(t in rows for t in task_ids)}
    lines: dict[tuple[int, str], Any] = {(t.policy_id, t.task_id): t.data
                                         for t in store.timelines(run_id, list(complete)) if t.split == split}
    digests = {}
    for pid, rows in complete.items():
        record = [[t, rows[t].status, rows[t].score, rows[t].cost_usd, rows[t].n_requests, dict(rows[t].tokens),
                   lines.get((pid, t))] for t in task_ids]
        digests[pid] = hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()).hexdigest()
    return digests


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
             suite_version: str, train_twins: Mapping[int, Sequence[int]] | None = None,
             likelihood: LikelihoodJudge | None = None,
             selection: Mapping[str, Any] | None = None) -> list[ValidationRecord]:
    """Run the held-out split for baselines and finalists, judge, store a new round and return it.

    `train_twins` (`twins`): per finalist, the later policies that behaved as it did on train. They
    run the held-out split too; one that behaves the same there as well is stored as the
    finalist's duplicate and counts once (in the Holm correction too), one that does not is a
    finalist of its own. `selection` (`Evolution.finalists`): how the finalists were chosen on train,
    kept with the expert's record of the round. `likelihood` (`validation.fidelity: likelihood`, a trace set): the rule
    judges the finalists' and the expert's likelihood fidelity instead of their scores
    (`evolve/fidelity.py`).
    """
    if REFERENCE not in baselines:
        raise ValueError("validation needs an expert baseline (baselines.expert)")
    entries: list[tuple[PolicyInfo, str, str]] = [(store.policy(pid), "baseline", role) for role, pid in
                                                  baselines.items()]
    later = [t for f in finalists for t in (train_twins or {}).get(f, ())]
    entries += [(info, "candidate", info.label) for info in map(store.policy, [*finalists, *later])]
    for info, _role, _label in entries:  # all queued first: workers of a shared run take them side by side
        cascade.enqueue(info.id, heldout_ids, split=HELDOUT)
    runs: dict[int, list[TaskResult]] = {}
    for info, _role, _label in entries:  # progress names the policy (standard-8k), not its role (standard)
        results = cascade.run_missing(info.id, info.text or "", info.label, heldout_ids, split=HELDOUT)
        runs[info.id] = [results[t] for t in heldout_ids]
    source = heldout_source(cascade, suite_version, config, heldout_ids)
    duplicates = _held_out_duplicates(store, cascade.run_id, finalists, train_twins or {}, heldout_ids)
    entries = [e for e in entries if e[0].id not in duplicates]
    finalists = [*finalists, *(t for t in later if t not in duplicates)]
    means = {pid: summarize(rows) for pid, rows in runs.items()}
    front = {p.policy_id for p in pareto_front([Point(pid, m.score, m.cost) for pid, m in means.items()])}
    ruled = [info for info, role, label in entries if role == "candidate" or label in (REFERENCE, "full")]
    judged = judged_scores(ruled, runs, heldout_ids, likelihood, config.resamples, seed)
    verdicts = _verdicts(judged, runs, finalists, baselines[REFERENCE], config, seed)
    records = []
    for info, role, label in entries:
        rows = runs[info.id]
        stats: dict[str, Any] = {
            "vs": {shown: versus(rows, runs[baselines[shown]], config, seed) for shown in SHOWN_AGAINST
                   if shown in baselines and baselines[shown] != info.id},
            "score_ci": bootstrap_ci([r.score for r in rows], config.resamples, seed=seed),
            "cost_ci": bootstrap_ci([r.cost_usd for r in rows], config.resamples, seed=seed),
            "alpha": config.alpha, "margin": config.margin, "policy_name": info.name, "heldout": source,
            "fidelity": judged.stats[info.id],
        }
        if role == "baseline" and label == REFERENCE and selection is not None:
            stats["train_selection"] = dict(selection)
        if role == "candidate":
            verdict = verdicts[str(info.id)]
            stats["rule"] = verdict.as_dict()
            text, champion = ("champion: " if verdict.champion else "") + verdict.reason, verdict.champion
        else:
            text, champion = f"baseline ({label.replace('_', ' ')})", False
        records.append(ValidationRecord(info.id, role, label if role == "candidate" else info.name or role,
                                        len(rows), means[info.id].score, means[info.id].cost, stats,
                                        info.id in front, champion, text))
    store.save_validations(run_id, records, code_version, source["suite_version"], config.model_dump(mode="json"))
    return records


def _verdicts(judged: Judged, runs: Mapping[int, Sequence[TaskResult]], finalists: Sequence[int], expert: int,
              config: ValidationConfig, seed: int) -> dict[str, Any]:
    """The champion rule over the judged figures (scores, or likelihood changes) and the held-out costs."""
    def rows(pid: int) -> list[tuple[float, float]]:
        return [(score, r.cost_usd) for score, r in zip(judged.scores[pid], runs[pid], strict=True)]

    return champion_rule({str(pid): rows(pid) for pid in finalists}, rows(expert), config.margin, config.alpha,
                         config.resamples, config.permutations, seed, score_unit=judged.unit)


def heldout_source(cascade: Cascade, suite_version: str, config: ValidationConfig,
                   heldout_ids: Sequence[str]) -> dict[str, Any]:
    """Where this round's held-out tasks come from: the build (the run's own, or the fresh one of
    `heldout_seed`: its version), the settings that chose them, how many, the first and the last."""
    source = getattr(cascade.evaluator, "heldout", None)  # a HarnessEvaluator says; other evaluators run the own build
    found = source.as_dict() if source is not None else {"suite_version": suite_version, "seed": None, "range": None,
                                                         "left_out": 0}
    return {**found, "limit": config.heldout_limit, "tasks": len(heldout_ids),
            "first": heldout_ids[0] if heldout_ids else None, "last": heldout_ids[-1] if heldout_ids else None}


def round_heldout(settings: Mapping[str, Any], suite_version: str) -> dict[str, Any]:
    """A stored round's held-out source from its settings (rounds before fresh held-outs: the run's own build)."""
    span = settings.get("heldout_range")
    return {"suite_version": suite_version, "seed": settings.get("heldout_seed"),
            "range": list(span) if span else None, "limit": settings.get("heldout_limit")}


def describe_heldout(source: Mapping[str, Any]) -> str:
    """One line: which held-out tasks of which build, e.g. `tasks 60-169 of the run's build (localcomp@e2-…)`."""
    span, limit, seed = source.get("range"), source.get("limit"), source.get("seed")
    if limit and source.get("tasks") is not None:
        limit = min(limit, source["tasks"])
    if span:
        which = f"tasks {span[0]}-{span[1] - 1}"
        which = f"the first {limit} of {which}" if limit and limit < span[1] - span[0] else which
    else:
        which = f"the first {limit} tasks" if limit else "all tasks"
    build = "the run's build" if seed is None else f"a fresh build with seed {seed}"
    left = source.get("left_out")
    left_text = f"; {left} left out that the run's build asks too" if left else ""
    return f"{which} of {build} ({source.get('suite_version')}{left_text})"


def _held_out_duplicates(store: Store, run_id: int, finalists: Sequence[int], train_twins: Mapping[int, Sequence[int]],
                         heldout_ids: Sequence[str]) -> set[int]:
    """The twins that behaved as their finalist on the held-out split too, stored as its duplicates."""
    held_out = outcome_digests(store, run_id, HELDOUT, heldout_ids)
    found = set()
    for finalist in finalists:
        for twin in train_twins.get(finalist, ()):
            if twin in held_out and held_out.get(twin) == held_out.get(finalist):
                label = store.policy(finalist).label
                store.set_duplicate(twin, finalist, f"duplicate of {label}: the same results and message timelines "
                                                    f"on every train task and the same results on every held-out task")
                found.add(twin)
    return found
