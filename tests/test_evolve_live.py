"""A live model as proposer: `akv serve` with the embedded 135M model on loopback, no mock.

The run first meets a dead endpoint (it stops, resumable), then resumes against the live
server; every proposal is stored with its prompt, answer and cost, a rejection with its reason.
"""
from __future__ import annotations

import json
import os
import socket
import sqlite3
import subprocess
import sys

import pytest

from test_server_support import interrupt, ready_url

AKV = [sys.executable, "-m", "akv_cli.main"]
TINY = """\
proposers: [llm]
max_candidates: 1
cascade: {subset_size: 1, train_limit: 2}
validation: {heldout_limit: 2, top_k: 1}
llm: {model: smollm2, max_tokens: 128, context_tokens: 2048, inspirations: 1, retries: 1, backoff_s: 0.2, timeout_s: 600}
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


@pytest.fixture(scope="module")
def server():
    process = subprocess.Popen([*AKV, "serve", "--port", "0", "--kv-tokens", "8192", "--device", "cpu"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    try:
        yield ready_url(process) + "/v1"
    finally:
        interrupt(process)


@pytest.mark.server
@pytest.mark.model
@pytest.mark.slow
def test_live_model_proposes_and_its_rejections_are_stored_with_reasons(server, tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY)
    url = f"sqlite:///{tmp_path / 'akv.db'}"
    dead = akv("evolve", "--config", str(config), "--db", url, "--run-name", "live",
               "--proposer-endpoint", f"http://127.0.0.1:{closed_port()}/v1")
    assert dead.returncode == 3, dead.stderr
    assert "failed after 2 attempts" in dead.stderr and "--resume --run-name live" in dead.stderr
    assert "Traceback" not in dead.stderr

    resumed = akv("evolve", "--resume", "--run-name", "live", "--db", url, "--proposer-endpoint", server)
    assert resumed.returncode == 0, resumed.stderr

    with sqlite3.connect(tmp_path / "akv.db") as conn:
        proposals = conn.execute("SELECT status, rejection_reason, prompt, response, prompt_tokens, "
                                 "completion_tokens FROM akv_policies WHERE proposer = 'llm' ORDER BY id").fetchall()
        heldout = [t for (t,) in conn.execute("SELECT DISTINCT task_id FROM akv_evaluations WHERE split='heldout'")]
        run_status = conn.execute("SELECT status FROM akv_runs").fetchone()[0]
    assert len(proposals) == 1 and run_status == "finished"
    assert heldout  # validation ran, after proposing
    for status, reason, prompt, response, p_tok, c_tok in proposals:
        assert prompt and response is not None and p_tok > 0 and c_tok > 0
        assert status in ("rejected", "evaluated", "pruned", "duplicate")
        assert response.startswith("```akvp\n")   # akv serve takes the lark grammar (llm.constrain: auto)
        if status == "rejected":
            # Under the policy grammar the answer is a valid policy unless max_tokens cut it off;
            # when it echoes its parent, that is a duplicate.
            assert reason and reason.startswith(("truncated", "duplicate of"))
        assert not any(task in prompt for task in heldout)
        assert "heldout" not in prompt


@pytest.mark.model
@pytest.mark.slow
def test_the_embedded_endpoint_serves_the_model_for_the_run_and_stores_no_port(tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY)
    url = f"sqlite:///{tmp_path / 'akv.db'}"
    done = akv("evolve", "--config", str(config), "--db", url, "--run-name", "embedded",
               "--proposer-endpoint", "embedded")
    assert done.returncode == 0, done.stderr
    assert "llm proposer: the embedded model at http://127.0.0.1:" in done.stdout
    with sqlite3.connect(tmp_path / "akv.db") as conn:
        (stored,) = conn.execute("SELECT config FROM akv_runs").fetchone()
        (response, meta) = conn.execute("SELECT response, meta FROM akv_policies WHERE proposer = 'llm'").fetchone()
    assert json.loads(stored)["llm"]["endpoint"] == "embedded"  # a resume serves the model again
    assert response and json.loads(meta)["model"] == "smollm2"
    assert json.loads(meta)["endpoint"].startswith("http://127.0.0.1:")
