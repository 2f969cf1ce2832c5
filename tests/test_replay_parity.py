"""Parity: the replay backend's accounting equals a real `akv serve`, request for request.

Scripted localcomp trajectories are recorded on replay (kv mode with drops and repositions,
text mode with summary calls), read back from their JSONL files and sent in order both to a
real server (a subprocess on 127.0.0.1 with the embedded model) and to one replay backend
whose cache spans all of them, as the server's does. Every request's prompt, cached,
repositioned, drop-skipped and prefilled tokens must agree.
"""
from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from sandbox.backends.http import HttpBackend
from sandbox.backends.replay import ReplayBackend
from sandbox.harness import RunLimits, run_tasks
from sandbox.trajectory import read_trajectory

pytestmark = [pytest.mark.model, pytest.mark.server]

KV_TOKENS = 200_000  # both sides: large enough that nothing is evicted
STEPS = 9  # enough for expert-8k to drop and reposition and text-engineering-8k to summarize
READY_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def server_url() -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    process = subprocess.Popen(
        [sys.executable, "-m", "akv_cli.main", "serve", "--port", "0", "--kv-tokens", str(KV_TOKENS),
         "--device", "cpu"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()
    seen = []
    try:
        while True:
            line = lines.get(timeout=READY_TIMEOUT_S)
            seen.append(line)
            if "ready at" in line:
                yield line.rsplit(" ", 1)[-1].strip()
                break
            if process.poll() is not None:
                pytest.fail("akv serve exited:\n" + "".join(seen))
    finally:
        process.terminate()
        process.wait(timeout=30)


def _recorded(tmp_path: Path) -> list[list]:
    """Per policy, the full requests of one recorded trajectory, with the usage recorded on replay."""
    trajectories = []
    for policy in ("expert-8k", "text-engineering-8k"):
        out = tmp_path / policy
        report = run_tasks("localcomp", "train", policy, limit=1, out_dir=out, limits=RunLimits(max_steps=STEPS))
        assert report.summary["statuses"]["error"] == 0, report.summary["errors"]
        (path,) = sorted((out / "trajectories").glob("*.jsonl"))
        trajectories.append(read_trajectory(path)[1])
    return trajectories


def test_replay_usage_equals_the_server_token_for_token(server_url: str, tmp_path: Path) -> None:
    kv_run, text_run = _recorded(tmp_path)
    assert any(r.request.drop_message for r in kv_run) and any(r.request.reposition for r in kv_run)
    assert any(r.purpose == "summary" for r in text_run)
    server = HttpBackend(server_url, model="smollm2")
    replay = ReplayBackend(kv_tokens=KV_TOKENS, fresh_cache_per_task=False)
    fields = ("prompt_tokens", "cached_tokens", "repos_tokens", "drop_skipped_tokens", "prefilled_tokens")
    mismatches, served_first = [], []
    for number, item in enumerate(kv_run + text_run):
        served = server.complete(item.request).usage
        replayed = replay.complete(item.request).usage
        if any(getattr(served, f) != getattr(replayed, f) for f in fields):
            mismatches.append((number, item.purpose, served, replayed))
        if number < len(kv_run):
            served_first.append(served)
    server.close()
    assert not mismatches, mismatches[:3]
    # The first trajectory met an empty server cache, as the recording's fresh simulator did.
    assert [[getattr(u, f) for f in fields] for u in served_first] == \
        [[getattr(r.usage, f) for f in fields] for r in kv_run]
    assert sum(u.cached_tokens for u in served_first) > 0
