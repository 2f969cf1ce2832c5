"""Workers sharing a run through a real PostgreSQL server: three `akv worker` processes join an
`akv evolve` run, one is killed with SIGKILL while it holds a task, and the run still finishes with
every task evaluated and stored exactly once. Bad input to `akv worker` is one line."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_evolve_run import akv_env
from test_lanes import SMALL

AKV = [sys.executable, "-m", "akv_cli.main"]
# test_lanes.py's small evolution, with leases short enough that a killed worker's tasks return soon.
SHARED = SMALL + "evaluation:\n  lease_s: 5\n"


def _rows(url: str, sql: str, *args) -> list[tuple]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute(sql, args).fetchall()


def _wait(what: str, check, timeout: float, processes: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        if any(p.poll() not in (None, 0) for p in processes):
            pytest.fail(f"a process failed while waiting for {what}")
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


def _held_by(url: str, pid: int) -> list[tuple]:
    return _rows(url, "SELECT k.id, w.id FROM akv_work k JOIN akv_workers w ON k.worker_id = w.id "
                      "WHERE k.status = 'leased' AND w.name LIKE %s", f"%:{pid}")


@pytest.mark.slow
def test_three_workers_one_killed_mid_run_lose_nothing_and_repeat_nothing(postgres_url, tmp_path):
    config = tmp_path / "shared.yaml"
    config.write_text(SHARED)
    logs = [open(tmp_path / f"log-{i}.txt", "w") for i in range(4)]
    evolve = subprocess.Popen([*AKV, "evolve", "--config", str(config), "--db", postgres_url, "--run-name", "shared"],
                              env=akv_env(), stdout=logs[0], stderr=subprocess.STDOUT)
    processes = [evolve]
    try:
        _wait("the run", lambda: _rows(postgres_url, "SELECT 1 FROM pg_tables WHERE tablename = 'akv_work'")
              and _rows(postgres_url, "SELECT 1 FROM akv_runs WHERE name = 'shared'"), 180, processes)
        workers = [subprocess.Popen([*AKV, "worker", "--run", "shared", "--db", postgres_url], env=akv_env(),
                                    stdout=logs[i], stderr=subprocess.STDOUT) for i in (1, 2, 3)]
        processes += workers
        victim = workers[0]
        _wait("the first worker to hold a task", lambda: _held_by(postgres_url, victim.pid), 240, processes)
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        processes.remove(victim)
        lost = [item for item, _ in _held_by(postgres_url, victim.pid)]  # held when it died, never finished
        assert evolve.wait(timeout=900) == 0, (tmp_path / "log-0.txt").read_text()[-3000:]
        for worker in workers[1:]:
            assert worker.wait(timeout=60) == 0, worker.args
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        for log in logs:
            log.close()
    assert _rows(postgres_url, "SELECT status FROM akv_runs WHERE name = 'shared'") == [("finished",)]
    work = _rows(postgres_url, "SELECT id, policy_id, split, task_id, status, attempts FROM akv_work")
    evaluations = _rows(postgres_url, "SELECT policy_id, split, task_id, worker_id FROM akv_evaluations")
    assert work and all(row[4] == "done" for row in work)  # nothing lost
    assert sorted(e[:3] for e in evaluations) == sorted(w[1:4] for w in work)  # each task stored once, no more
    assert lost, "the worker was killed while it held a task"
    by_key = {e[:3]: e[3] for e in evaluations}
    [victim_id] = {w for (w,) in _rows(postgres_url, "SELECT id FROM akv_workers WHERE name LIKE %s",
                                          f"%:{victim.pid}")}
    for row in work:
        if row[0] in lost:  # its lease ran out and another process evaluated it, once
            assert row[5] >= 2 and by_key[row[1:4]] != victim_id
    helpers = {w for (w,) in _rows(postgres_url, "SELECT DISTINCT worker_id FROM akv_evaluations")}
    roles = dict(_rows(postgres_url, "SELECT id, role FROM akv_workers"))
    assert len(roles) == 4 and sum(roles[w] == "worker" for w in helpers) >= 1  # workers took part
    for index, worker in zip((2, 3), workers[1:]):  # one line per task a worker ran, none per lease
        [worker_id] = {w for (w,) in _rows(postgres_url, "SELECT id FROM akv_workers WHERE name LIKE %s",
                                           f"%:{worker.pid}")}
        lines = (tmp_path / f"log-{index}.txt").read_text().splitlines()
        stored = sum(e[3] == worker_id for e in evaluations)
        assert sum("score=" in line for line in lines) == stored, lines
        assert not [line for line in lines if re.search(r": \d+ tasks?$", line)], lines  # no lease headers
    shown = subprocess.run([*AKV, "runs", "show", "shared", "--db", postgres_url], env=akv_env(),
                           capture_output=True, text=True)
    assert shown.returncode == 0 and shown.stdout.count(":") and f":{victim.pid}" in shown.stdout


def test_worker_bad_input_is_one_line(tmp_path, postgres_server):
    cases = [
        (["--run", "x", "--db", f"sqlite:///{tmp_path / 'a.db'}"], "SQLite"),
        (["--run", "nope", "--db", f"{postgres_server}/postgres"], "no run named 'nope'"),
        (["--run", "x", "--db", "postgresql://akv@127.0.0.1:1/akv"], "cannot open"),
    ]
    for args, expected in cases:
        result = subprocess.run([*AKV, "worker", *args], env=akv_env(), capture_output=True, text=True)
        assert result.returncode == 2 and expected in result.stderr, (args, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_a_worker_prints_one_line_per_task_naming_its_policy_and_split():
    """A worker leases a task or a few at a time: no batch header, each line says what it scored."""
    import io

    from rich.console import Console

    from evolve.scoring import HarnessEvaluator
    from policy_dsl.library import builtin_source
    from sandbox.runs.progress import TaskDisplay

    out = io.StringIO()
    display = TaskDisplay(Console(file=out, width=80), labelled=True)  # as evolve/join.py makes it
    evaluator = HarnessEvaluator("localcomp", "scripted", "replay", 0, display=display)
    try:
        tasks = evaluator.task_ids("train")[:2]
        for task in tasks:  # two leases of one task each, as a worker with concurrency 1 takes them
            evaluator.evaluate(builtin_source("expert-8k"), "#3", "train", [task], lambda result: None)
    finally:
        evaluator.close()
    lines = out.getvalue().splitlines()
    assert [line.split()[:2] for line in lines] == [["#3", "on"], ["#3", "on"]], lines
    assert all(f"{task}  " in line and "score=" in line for task, line in zip(tasks, lines)), lines
