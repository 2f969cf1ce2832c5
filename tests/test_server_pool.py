"""`--backend URL1,URL2`: two real `akv serve` processes; the first is killed as a task starts on it,
the task moves to the other server and the move is recorded in its result and trajectory; the next
task is pinned to the server that answers."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sandbox.runs.harness import RunLimits, run_tasks
from sandbox.runs.progress import TaskDisplay
from test_server_support import interrupt, ready_url

pytestmark = [pytest.mark.model, pytest.mark.server, pytest.mark.slow]


def _serve() -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "akv_cli.main", "serve", "--port", "0", "--kv-tokens", "8192"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


class _KillOnFirstTask(TaskDisplay):
    """The real display, which also kills the first server as the first task starts (pinned to it)."""

    def __init__(self, victim: subprocess.Popen) -> None:
        super().__init__(live=False)
        self.victim = victim

    def started(self, job=None) -> None:
        if self.victim.poll() is None:
            self.victim.kill()
            self.victim.wait()
        super().started(job)


def test_a_task_moves_off_a_server_that_stops_answering_and_the_move_is_recorded(tmp_path):
    servers = [_serve(), _serve()]
    try:
        first, second = (ready_url(s) for s in servers)
        report = run_tasks("localcomp", "train", "expert-8k", agent="llm", backend=f"{first},{second}", limit=2,
                           limits=RunLimits(max_steps=1, max_tokens=1), out_dir=tmp_path,
                           display=_KillOnFirstTask(servers[0]))
    finally:
        for server in servers:
            if server.poll() is None:
                interrupt(server)
    moved, after = report.results
    assert moved.status != "error" and after.status != "error", (moved.reason, after.reason)
    assert len(moved.server_moves) == 1 and f"{first} -> {second}" in moved.server_moves[0]
    assert after.server_moves == ()  # pinned to the server that answers from its start
    trajectory = [json.loads(line) for line in (tmp_path / "trajectories" / f"{moved.task_id}.jsonl").open()]
    [note] = [r for r in trajectory if r["type"] == "server_moved"]
    assert (note["step"], note["from_url"], note["to_url"]) == (0, first, second)
    stored = [json.loads(line) for line in (tmp_path / "results.jsonl").open()]
    assert stored[0]["server_moves"] == list(moved.server_moves) and "server_moves" not in stored[1]
