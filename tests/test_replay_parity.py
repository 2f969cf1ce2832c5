"""Parity: the replay backend's accounting equals a real `akv serve`, request for request.

Trajectories are recorded on replay against the real localcomp environment (a kv policy that
drops and repositions, a text policy that summarizes), written as JSONL, read back, and sent in
order both to a real server (a subprocess on 127.0.0.1 with the embedded model) and to one
replay backend whose cache spans all of them, as the server's does. Every request's prompt,
cached, repositioned, drop-skipped and prefilled tokens must agree. The task is kept short
(a small system prompt, small documents, a few steps) because the server prefills on the CPU.
"""
from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from sandbox.backends import BackendRequest
from sandbox.backends.http import HttpBackend
from sandbox.backends.replay import ReplayBackend
from sandbox.runs.harness import resolve_policy, run_task
from sandbox.runs.trajectory import read_trajectory
from sandbox.suites import get_suite
from sandbox.suites.base import Task
from test_sandbox_support import Reader

pytestmark = [pytest.mark.model, pytest.mark.server]

KV_TOKENS = 16_384  # both sides; the trajectories stay far below it, so nothing is evicted
READY_TIMEOUT_S = 300
TINY_TEXT_POLICY = "mode text\non history_tokens > 700: summarize all within 96 tokens\n"
CUT_POLICY = 'mode kv\non each tool_response: cut after "\\n" from role tool keep last 1\n'   # keep_text_drop


@pytest.fixture(scope="module")
def server_url():
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
                yield re.search(r"ready at (http://\S+)", line)[1]   # the line goes on: "(prefill: ...)"
                break
            if process.poll() is not None:
                pytest.fail("akv serve exited:\n" + "".join(seen))
    finally:
        process.terminate()
        process.wait(timeout=30)




def _recorded(tmp_path: Path, policy: str, n_docs: int) -> list:
    suite = get_suite("localcomp")
    from akv_core.home import akv_home

    suite.build(akv_home(), 0)
    tools = suite.tasks("train")[0].tools[1:]  # get_document only: a short system prompt
    task = Task("parity", "localcomp", "train", "You read documents.", "Read them.", tools)
    _, trajectory = run_task(task, suite, resolve_policy(policy), Reader(n_docs), ReplayBackend())
    path = tmp_path / f"{len(list(tmp_path.iterdir()))}.jsonl"
    trajectory.write(path)
    return read_trajectory(path)[1]


def test_replay_usage_equals_the_server_token_for_token(server_url: str, tmp_path: Path) -> None:
    policy_file = tmp_path.parent / "tiny-text.akvp"
    policy_file.write_text(TINY_TEXT_POLICY)
    kv_run = _recorded(tmp_path, "rolling-3", 5)
    text_run = _recorded(tmp_path, str(policy_file), 5)
    cut_file = tmp_path.parent / "cut.akvp"
    cut_file.write_text(CUT_POLICY)
    cut_run = _recorded(tmp_path, str(cut_file), 3)
    assert any(r.request.drop_message for r in kv_run) and any(r.request.reposition for r in kv_run)
    assert any(r.purpose == "summary" for r in text_run)
    assert any((r.request.drop_rule or {}).get("type") == "keep_text_drop" for r in cut_run)
    server = HttpBackend(server_url, model="smollm2")
    replay = ReplayBackend(kv_tokens=KV_TOKENS, fresh_cache_per_task=False)
    fields = ("prompt_tokens", "cached_tokens", "repos_tokens", "drop_skipped_tokens", "prefilled_tokens")
    served_all, mismatches = [], []
    for number, item in enumerate(kv_run + text_run + cut_run):
        served = server.complete(item.request).usage
        replayed = replay.complete(item.request).usage
        served_all.append(served)
        if any(getattr(served, f) != getattr(replayed, f) for f in fields):
            mismatches.append((number, item.purpose, served, replayed))
    # Text drops on a short history, on the same two caches: the cut tokens are accounted alike.
    for number, request in enumerate(text_drop_requests(), start=len(served_all)):
        served, replayed = server.complete(request).usage, replay.complete(request).usage
        served_all.append(served)
        if any(getattr(served, f) != getattr(replayed, f) for f in fields):
            mismatches.append((number, request.drop_rule["type"], served, replayed))
    server.close()
    assert not mismatches, mismatches[:3]
    assert sum(u.drop_skipped_tokens for u in served_all[-4:]) > 0
    # The first trajectory met an empty server cache, as the recording's fresh simulator did.
    assert [[getattr(u, f) for f in fields] for u in served_all[:len(kv_run)]] == \
        [[getattr(r.usage, f) for f in fields] for r in kv_run]
    assert sum(u.drop_skipped_tokens for u in served_all) > 0 and sum(u.repos_tokens for u in served_all) > 0


def text_drop_requests() -> list[BackendRequest]:
    """A text_drop, its repeat, then keep_text_drop on the grown history (a tool result trimmed)."""
    history = [{"role": "system", "content": "You read documents (parity of text drops)."},
               {"role": "user", "content": "Note the code 4721, then read doc-1. The code is only for now."},
               {"role": "assistant", "content": "Reading doc-1."},
               {"role": "user", "content": "Here is doc-1: the library opened in 1901 and holds 3 million books."}]
    cut = [None, {"role": "user", "content": ["4721", " The code is only for now."]}, None,
           {"role": "user", "content": "opened in 1901 and "}]
    grown = history + [{"role": "assistant", "content": "It holds 3 million books."},
                       {"role": "user", "content": "And when did it open?"}]
    kept = [grown[0], {"role": "user", "content": "then read doc-1."}, grown[2],
            {"role": "user", "content": "the library opened in 1901"}, grown[5]]
    text = BackendRequest(messages=tuple(history), drop_rule={"type": "text_drop", "drop_messages": cut})
    keep = BackendRequest(messages=tuple(kept), drop_rule={"type": "keep_text_drop", "full_messages": grown})
    return [text, text, keep, keep]
