"""Concurrent tasks (sandbox/runs/lanes.py): the results, their stored order and an evolution's lineage equal
a serial run's; backends that cannot run tasks side by side are refused before anything opens."""
from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from sandbox.backends import check_backend_spec
from sandbox.runs.harness import run_tasks
from store import Store

TASKS = 5


def _without_times(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "wall_s"}


def _trajectories(folder: Path) -> dict[str, list[dict]]:
    return {p.name: [_without_times(json.loads(line)) for line in p.read_text().splitlines()]
            for p in sorted((folder / "trajectories").glob("*.jsonl"))}


def test_replay_tasks_in_three_processes_equal_a_serial_run(tmp_path):
    serial = run_tasks("localcomp", "train", "expert-8k", limit=TASKS, out_dir=tmp_path / "serial")
    concurrent = run_tasks("localcomp", "train", "expert-8k", limit=TASKS, out_dir=tmp_path / "lanes",
                           concurrency=3)
    assert [_without_times(r.to_dict()) for r in concurrent.results] == \
        [_without_times(r.to_dict()) for r in serial.results]
    stored = [[_without_times(json.loads(line)) for line in (tmp_path / d / "results.jsonl").read_text().splitlines()]
              for d in ("serial", "lanes")]
    assert stored[0] == stored[1] and [r["task_id"] for r in stored[1]] == [r.task_id for r in serial.results]
    assert _trajectories(tmp_path / "lanes") == _trajectories(tmp_path / "serial")
    assert concurrent.summary["mean_cost_usd"] == serial.summary["mean_cost_usd"]


@pytest.mark.parametrize("spec, concurrency, expected", [
    ("embedded", 2, "runs one task at a time"),
    ("replay", 0, "positive number"),
    ("http://127.0.0.1:1,htp://127.0.0.1:2", 1, "server 2 of 2 ('htp://127.0.0.1:2'): expected an http"),
    ("http://127.0.0.1:1,http://127.0.0.1:99999", 4, "server 2 of 2 ('http://127.0.0.1:99999'): the port"),
    ("http://127.0.0.1:1,,http://127.0.0.1:2", 1, "server 2 of 3 (''): empty item"),
    ("http://127.0.0.1:1,http://127.0.0.1:1/v1", 1, "listed twice"),
    ("gpu", 1, "expected replay, embedded"),
])
def test_bad_backends_and_concurrency_are_one_located_line(spec, concurrency, expected):
    with pytest.raises(ValueError) as err:
        check_backend_spec(spec, concurrency)
    assert expected in str(err.value) and "\n" not in str(err.value)


SMALL = """\
max_candidates: 3
seed: 3
proposers: [mutate, optuna]  # no model: the default mix asks the embedded one too
cascade:
  subset_size: 2
  train_limit: 4
  promote_margin: 0.5
validation:
  heldout_limit: 4
  top_k: 2
"""


def _evolve(folder: Path, concurrency: int) -> tuple[list, list, list]:
    from evolve.command import run_command

    config = folder / f"c{concurrency}.yaml"
    config.write_text(SMALL + f"evaluation:\n  concurrency: {concurrency}\n")
    url = f"sqlite:///{folder / f'c{concurrency}.db'}"
    run_command(config, {"db": url, "run_name": "lanes-equal"}, resume=False, console=Console(file=io.StringIO()))
    store = Store.open(url)
    try:
        run = store.run("lanes-equal")
        policies = [(p.id, p.text, p.status, p.parent_ids, p.proposer, p.rejection_reason, p.duplicate_of)
                    for p in store.policies(run.id)]
        evaluations = [(e.policy_id, e.result.task_id, e.result.split, e.result.status, e.result.score,
                        e.result.cost_usd, e.result.tokens) for e in store.evaluations(run.id)]
        validations = [(v.policy_id, v.role, v.score_mean, v.cost_mean, v.champion, v.verdict)
                       for v in store.validations(run.id)]
        return policies, evaluations, validations
    finally:
        store.close()


@pytest.mark.slow
def test_an_evolution_with_concurrent_tasks_has_the_serial_lineage_results_and_order(tmp_path):
    serial, concurrent = _evolve(tmp_path, 1), _evolve(tmp_path, 3)
    assert len(serial[0]) >= 7 and len(serial[1]) > 30 and serial[2]  # candidates, results, a validation
    assert concurrent[0] == serial[0]  # the lineage: every policy, its fate and its parents
    assert concurrent[1] == serial[1]  # every result, in the order it was stored
    assert concurrent[2] == serial[2]
