"""A live model as proposer: the embedded 135M model served on loopback for the run, no mock.

The run first meets a dead endpoint (it stops, resumable), then resumes with `--proposer-endpoint
embedded`; every proposal is stored with its prompt, answer and cost, a rejection with its reason.
"""
from __future__ import annotations

import json
import os
import socket
import sqlite3
import subprocess
import sys

import pytest

AKV = [sys.executable, "-m", "akv_cli.main"]
# Small on purpose: prefill and decode on the CPU are the proposal's cost. A constrained policy answer is
# about 40 tokens (max_tokens 64 caps a rambling one, which is then rejected as truncated); a 1664-token
# context still carries both trajectory digests, shortened (a prompt of about 1.55K tokens, not 1.9K).
TINY = """\
proposers: [llm]
max_candidates: 1
cascade: {subset_size: 1, train_limit: 2}
validation: {heldout_limit: 2, top_k: 1}
llm: {model: smollm2, max_tokens: 64, context_tokens: 1664, inspirations: 1, retries: 1, backoff_s: 0, timeout_s: 600}
"""


def env() -> dict[str, str]:
    from akv_core.home import akv_home

    return {**os.environ, "AKV_HOME": str(akv_home().resolve()), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "2"}


def akv(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*AKV, *args], capture_output=True, text=True, timeout=900, env=env())


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.model
@pytest.mark.slow
def test_a_run_stopped_by_a_dead_endpoint_resumes_on_the_embedded_model_and_stores_its_proposals(tmp_path):
    """One run, one model load: the dead endpoint stops it (resumable); the resume serves the embedded
    model for the run (`--proposer-endpoint embedded`), and the served port is never stored."""
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY)
    url = f"sqlite:///{tmp_path / 'akv.db'}"
    dead_endpoint = f"http://127.0.0.1:{closed_port()}/v1"
    dead = akv("evolve", "--config", str(config), "--db", url, "--run-name", "live",
               "--proposer-endpoint", dead_endpoint)
    assert dead.returncode == 3, dead.stderr
    assert "failed after 2 attempts" in dead.stderr and "--resume --run-name live" in dead.stderr
    assert "Traceback" not in dead.stderr

    resumed = akv("evolve", "--resume", "--run-name", "live", "--db", url, "--proposer-endpoint", "embedded")
    assert resumed.returncode == 0, resumed.stderr
    assert "llm proposer: the embedded model at http://127.0.0.1:" in resumed.stdout

    with sqlite3.connect(tmp_path / "akv.db") as conn:
        proposals = conn.execute("SELECT status, rejection_reason, prompt, response, prompt_tokens, "
                                 "completion_tokens, meta FROM akv_policies WHERE proposer = 'llm' "
                                 "ORDER BY id").fetchall()
        heldout = [t for (t,) in conn.execute("SELECT DISTINCT task_id FROM akv_evaluations WHERE split='heldout'")]
        run_status, stored = conn.execute("SELECT status, config FROM akv_runs").fetchone()
    assert len(proposals) == 1 and run_status == "finished"
    assert heldout  # validation ran, after proposing
    # The run keeps the endpoint it was given; the port the resume served on is not stored.
    assert json.loads(stored)["llm"]["endpoint"] == dead_endpoint
    for status, reason, prompt, response, p_tok, c_tok, meta in proposals:
        assert prompt and response is not None and p_tok > 0 and c_tok > 0
        assert status in ("rejected", "evaluated", "pruned", "duplicate")
        assert response.startswith("```akvp\n")   # the served model takes the lark grammar (llm.constrain: auto)
        if status == "rejected":
            # Under the policy grammar the answer is a valid policy unless max_tokens cut it off;
            # when it echoes its parent, that is a duplicate.
            assert reason and reason.startswith(("truncated", "duplicate of"))
        assert json.loads(meta)["digests"]  # the smaller context still leaves train trajectories in the prompt
        assert not any(task in prompt for task in heldout)
        assert "heldout" not in prompt
        assert json.loads(meta)["model"] == "smollm2" and json.loads(meta)["endpoint"].startswith("http://127.0.0.1:")
