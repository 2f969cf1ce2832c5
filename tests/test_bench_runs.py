"""Each benchmark at a tiny size through `akv bench ... --json`: one JSON object with the expected figures.

Only the structure and the accounting identities are checked; timings depend on the machine.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from akv_cli.main import app
from sandbox.suites import get_suite

ROOT = Path(__file__).resolve().parents[1]


def _bench(*args: str) -> dict:
    result = CliRunner().invoke(app, ["bench", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_replay_bench_reports_requests_per_second() -> None:
    figures = _bench("replay", "--tasks", "1", "--repeat", "1")
    assert figures["requests"] > 0 and figures["accounting_requests_per_s"] > 0
    assert isinstance(figures["meets_target"], bool)


@pytest.mark.slow
def test_cost_bench_pairs_policies_on_the_same_tasks() -> None:
    figures = _bench("cost", "--suites", "localcomp", "--tasks", "2", "--resamples", "200")
    group = figures["groups"]["localcomp"]
    assert [p["policy"] for p in group["policies"]] == ["expert-8k", "standard-8k", "text-engineering-8k", "full"]
    for row in group["policies"]:
        assert row["tasks"] == 2
        assert row["cost_ci"][0] <= row["cost_usd"] <= row["cost_ci"][1]
        assert 0.0 <= row["score"] <= 1.0
    assert [c["baseline"] for c in group["comparisons"]] == ["standard-8k", "text-engineering-8k", "full"]
    assert [v["policy"] for v in group["champion_rule"]] == ["standard-8k", "text-engineering-8k", "full"]
    assert all(v["family"] == 3 and not v["champion"] for v in group["champion_rule"])  # nothing beats the expert
    assert 0.0 < group["comparisons"][0]["score_p_value"] <= 1.0
    assert isinstance(figures["target"]["met"], bool)
    _costs_in_usd(figures)


def _costs_in_usd(figures: object, where: str = "") -> None:
    """Every cost in a benchmark's JSON is USD (`cost_usd`, `*_cost_usd`): no cents, as the CLI's tables show."""
    if isinstance(figures, dict):
        for key, value in figures.items():
            assert not re.search(r"(^|_)cents?(_|$)", key), f"{where}.{key}: JSON costs are in USD (cost_usd), the tables show cents"
            _costs_in_usd(value, f"{where}.{key}")
    elif isinstance(figures, list):
        for number, value in enumerate(figures):
            _costs_in_usd(value, f"{where}[{number}]")


@pytest.mark.slow
def test_headroom_bench_puts_the_oracle_beside_the_policies_on_the_same_tasks() -> None:
    # slow (about 15 s): 2 tasks per split under 6 policies and the oracle
    figures = _bench("headroom", "--suites", "localcomp", "--splits", "train,heldout", "--limit", "2", "--workers", "1")
    assert list(figures["groups"]) == ["localcomp/train", "localcomp/heldout"]
    _costs_in_usd(figures)
    for name, group in figures["groups"].items():
        rows = {row["policy"]: row for row in group["policies"]}
        assert list(rows)[:4] == ["full", "standard-8k", "text-engineering-8k", "expert-8k"]
        assert list(rows)[-1] == "oracle" and all(row["tasks"] == 2 for row in rows.values())
        assert group["oracle_check"] == {"same_actions": 2, "tasks": 2, "diverged": []} and group["oracle_valid"]
        assert rows["oracle"]["score"] == rows["full"]["score"] and group["oracle_same_score_as_full"]
        assert rows["oracle"]["cost_usd"] < rows["expert-8k"]["cost_usd"]
        expected_gap = 100 * (1 - rows["oracle"]["cost_usd"] / rows["expert-8k"]["cost_usd"])
        assert group["expert_to_oracle_gap_percent"] == pytest.approx(expected_gap, abs=0.01)
        assert rows["expert-8k"]["verdict"] is None
        assert all(row["verdict"]["family"] == (1 if p == "oracle" else len(rows) - 2)
                   for p, row in rows.items() if p != "expert-8k")
        assert sum(row["verdict"]["champion"] for row in rows.values() if row["verdict"]) <= 1
        assert not rows["oracle"]["verdict"]["champion"]
    assert set(figures["groups"]["localcomp/heldout"]["targets"]) >= {"oracle_25_percent_cheaper_at_same_score",
                                                                      "full_scores_highest"}
    assert figures["groups"]["localcomp/train"]["targets"] is None


@pytest.mark.slow
def test_headroom_bench_workers_measure_what_one_process_measures() -> None:
    # slow (about 10 s): two spawned worker processes against the same tasks in this one
    from benchmarks.headroom import Settings, _each_task, _pool

    task_ids = [t.id for t in get_suite("localcomp").tasks("train")[:2]]

    def run(workers: int) -> list:
        with _pool(workers) as pool:
            assert (pool is None) == (workers == 1)
            return _each_task("localcomp", "train", task_ids, ("expert-8k",), Settings(workers=workers),
                              lambda _text: None, pool)

    runs = {workers: run(workers) for workers in (1, 2)}
    assert [sorted(run.results) for run in runs[2]] == [["expert-8k", "full", "oracle"]] * 2
    def measured(runs):  # all but the wall time
        return [{name: dataclasses.replace(result, wall_s=0.0) for name, result in run.results.items()} for run in runs]

    assert measured(runs[1]) == measured(runs[2])
    assert [run.same_actions for run in runs[1]] == [run.same_actions for run in runs[2]] == [True, True]


def test_headroom_bench_names_a_bad_policy() -> None:
    result = CliRunner().invoke(app, ["bench", "headroom", "--suites", "localcomp", "--policies", "no-such-policy"])
    assert result.exit_code == 2 and "no-such-policy" in result.output


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.server
def test_serving_bench_replays_every_policy_against_a_live_server() -> None:
    figures = _bench("serving", "--suites", "localcomp", "--streams", "1", "--steps", "2",
                     "--concurrency", "1", "--max-tokens", "1")
    cells = figures["cells"]
    assert [(c["policy"], c["concurrency"]) for c in cells] == [
        ("expert-8k", 1), ("standard-8k", 1), ("text-engineering-8k", 1)]
    for cell in cells:
        assert cell["errors"] == 0 and cell["requests"] >= 2
        assert cell["prompt_tokens"] > 0 and cell["prefilled_tokens"] > 0
        assert cell["p50_latency_s"] <= cell["p95_latency_s"]
        assert cell["attention_ms_per_decode_step"] > 0
        # one stream alone in a pool that holds it: nothing is recomputed beyond the replay accounting's
        # minimum, give or take the chat template's opening tokens, which runs share
        assert abs(cell["evicted_recompute_tokens"]) <= 16
    assert [r["baseline"] for r in figures["ratios"]] == ["standard-8k", "text-engineering-8k"]
    assert figures["settings"]["kv_tokens"] > 0


@pytest.mark.model
@pytest.mark.server
def test_a_serving_bench_stopped_with_sigterm_stops_its_server(tmp_path) -> None:
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from benchmarks.serving import akv_server\n"
        "with akv_server(256, 1, Path(sys.argv[1])) as url:\n"
        "    print(url, flush=True)\n"
        "    time.sleep(600)\n")
    bench = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                             cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        url = bench.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:")
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=60) == 128 + signal.SIGTERM
        with pytest.raises(OSError):   # nothing listens on the server's port any more
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
    finally:
        bench.kill()


@pytest.mark.slow
def test_serving_preview_accounts_each_policy_in_the_pool_and_never_evicting() -> None:
    figures = _bench("serving", "--preview", "--suites", "localcomp", "--streams", "2", "--steps", "2",
                     "--concurrency", "1,2")
    rows = figures["preview"]
    assert [(r["policy"], r["concurrency"]) for r in rows] == [
        (policy, c) for c in (1, 2) for policy in ("expert-8k", "standard-8k", "text-engineering-8k")]
    for row in rows:
        assert row["requests"] >= 2 * row["concurrency"]
        assert row["unbounded_prefilled_tokens"] > 0 and row["prefilled_tokens"] > 0
    roomy = _bench("serving", "--preview", "--suites", "localcomp", "--streams", "2", "--steps", "2",
                   "--concurrency", "2", "--kv-tokens", "1000000")
    for row in roomy["preview"]:   # a pool that never fills recomputes nothing
        assert row["prefilled_tokens"] == row["unbounded_prefilled_tokens"]
