"""Export: the champion's policy text plus a JSON provenance record."""
from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from evolve.cascade import summarize
from evolve.context import TRAIN
from evolve.validation import describe_heldout, round_heldout
from store import Store, StoreError, ValidationRecord, ValidationRound


@dataclass(frozen=True)
class Exported:
    policy_path: Path
    provenance_path: Path
    policy_id: int
    champion: bool


def chosen_validation(store: Store, run_id: int, policy_id: int | None, allow_best: bool) -> ValidationRecord | None:
    """The champion; a named policy's record; or (allow_best) the cheapest non-dominated candidate."""
    records = store.validations(run_id)
    if policy_id is not None:
        return next((v for v in records if v.policy_id == policy_id), None)
    champion = next((v for v in records if v.champion), None)
    if champion is not None or not allow_best:
        return champion
    candidates = [v for v in records if v.role == "candidate"]
    if not candidates:
        return None
    # Exact ties go to the earlier policy (a parent over its identical child), as in the champion rule.
    return min(candidates, key=lambda v: (not v.non_dominated, v.cost_mean, -v.score_mean, v.policy_id))


def export_run(store: Store, run_ref: str | int, out: Path | None = None, policy_id: int | None = None,
               allow_best: bool = False) -> Exported:
    from akv_core.home import data_path

    run, record, policy = chosen_policy(store, run_ref, policy_id, allow_best)
    pid = policy.id
    out = out or data_path("exports", f"{run.name}.akvp")
    out.parent.mkdir(parents=True, exist_ok=True)
    champion = bool(record and record.champion)
    header = (f"# exported from run {run.name}, policy #{pid} ({'champion' if champion else 'not a champion'})\n")
    out.write_text(header + policy.text.rstrip() + "\n", encoding="utf-8")
    provenance_path = out.with_suffix(".json")
    provenance_path.write_text(json.dumps(provenance(store, run, pid, record), indent=2, default=str) + "\n",
                               encoding="utf-8")
    return Exported(out, provenance_path, pid, champion)


def export_akvalgo(store: Store, run_ref: str | int, out: Path | None = None,
                   policy_id: int | None = None, allow_best: bool = False) -> Exported:
    """The policy as upstream akvalgo `AKVPolicy` keyword arguments (JSON) plus its provenance record.

    Raises policy_dsl.akvalgo.NotExpressible, located in the policy's canonical text, when the policy
    has no exact akvalgo equivalent; nothing is written then. The options file holds the keyword
    arguments alone (`AKVPolicy(**json.load(f))`), so what the harness must add for them to decide as
    the policy (a token counter, requests that end at their last call) goes in the provenance record,
    under "akvalgo": the options and their conditions.
    """
    from akv_core.home import data_path
    from policy_dsl import parse
    from policy_dsl.akvalgo import to_akvalgo

    run, record, policy = chosen_policy(store, run_ref, policy_id, allow_best)
    filename = f"{run.name}#{policy.id}.akvp"
    options = to_akvalgo(parse(policy.text, filename=filename), filename)
    out = out or data_path("exports", f"{run.name}.akvalgo.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(options.kwargs(), indent=2) + "\n", encoding="utf-8")
    provenance_path = out.with_name(out.name.removesuffix(".json") + ".provenance.json")
    written = {**provenance(store, run, policy.id, record),
               "akvalgo": {"options": options.kwargs(), "conditions": options.conditions()}}
    provenance_path.write_text(json.dumps(written, indent=2, default=str) + "\n", encoding="utf-8")
    return Exported(out, provenance_path, policy.id, bool(record and record.champion))


def chosen_policy(store: Store, run_ref: str | int, policy_id: int | None, allow_best: bool):  # noqa: ANN201
    """(run, validation record or None, policy) of what an export writes; StoreError when there is none."""
    run = store.run(run_ref)
    record = chosen_validation(store, run.id, policy_id, allow_best)
    if record is None and policy_id is None:
        raise StoreError(f"RUN: run {run.name!r} has no champion (nothing beat the baselines on held-out); "
                         "pass --best for the best validated candidate or --policy ID for any one")
    pid = policy_id if policy_id is not None else record.policy_id
    policy = store.policy(pid)
    if policy.run_id != run.id or policy.text is None:
        raise StoreError(f"--policy: #{pid} is not a valid policy of run {run.name!r}")
    return run, record, policy


def lineage_of(store: Store, run_id: int, policy_id: int) -> list[dict[str, Any]]:
    """The policy and all its ancestors, nearest first."""
    by_id = {p.id: p for p in store.policies(run_id)}
    seen, order, queue = set(), [], [policy_id]
    while queue:
        pid = queue.pop(0)
        if pid in seen or pid not in by_id:
            continue
        seen.add(pid)
        p = by_id[pid]
        order.append({"id": p.id, "name": p.name, "proposer": p.proposer, "generation": p.generation,
                      "parents": list(p.parent_ids), "hash": p.hash, "meta": dict(p.meta)})
        queue.extend(p.parent_ids)
    return order


def heldout_of(latest: ValidationRound, record: ValidationRecord | None) -> dict[str, Any]:
    """Which held-out tasks of which build the round ran (a fresh build's version, its seed, the range), in words too."""
    source = (record.stats.get("heldout") if record is not None else None) or round_heldout(latest.settings,
                                                                                           latest.suite_version)
    return {**source, "text": describe_heldout(source)}


def provenance(store: Store, run, policy_id: int, record: ValidationRecord | None) -> dict[str, Any]:
    policy = store.policy(policy_id)
    train = [e.result for e in store.evaluations(run.id, TRAIN, [policy_id])]
    s = summarize(train)
    rounds = store.validation_rounds(run.id)
    latest = rounds[-1] if rounds else None
    return {
        "format": "akv-policy-provenance/1",
        "exported_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "run": {"id": run.id, "name": run.name, "seed": run.seed, "status": run.status, "config": run.config,
                "code_version": run.code_version, "suite_version": run.suite_version,
                "created_at": run.created_at},
        "policy": {"id": policy.id, "hash": policy.hash, "structure_hash": policy.structure_hash,
                   "behaviour_hash": policy.behaviour_hash, "generation": policy.generation,
                   "proposer": policy.proposer, "parents": list(policy.parent_ids), "text": policy.text},
        # The validation round whose verdict this is (the latest; earlier rounds stay in the store).
        "validation": None if latest is None else {
            "round": latest.round, "rounds": len(rounds), "code_version": latest.code_version,
            "suite_version": latest.suite_version, "created_at": latest.created_at, "settings": latest.settings,
            "heldout": heldout_of(latest, record)},
        "lineage": lineage_of(store, run.id, policy_id),
        "champion": bool(record and record.champion),
        "verdict": record.verdict if record else None,
        "metrics": {
            "train": {"tasks": s.n, "score_mean": s.score, "cost_mean_usd": s.cost},
            "heldout": None if record is None else {"tasks": record.n_tasks, "score_mean": record.score_mean,
                                                     "cost_mean_usd": record.cost_mean, "stats": record.stats},
        },
    }
