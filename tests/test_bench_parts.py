"""The benchmarks' arithmetic on made-up figures: tables, ratios, pool sizing, intervals, the paired test."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from benchmarks import common, cost, headroom, replay, serving


def test_format_table_aligns_columns_and_marks_missing_values() -> None:
    text = common.format_table(["name", "value"], [["a", 1234], ["longer", None], ["b", 0.5]])
    lines = text.splitlines()
    assert len({len(line) for line in lines}) == 1
    assert lines[2].endswith("1,234") and lines[3].endswith("-") and lines[4].endswith("0.500")


def test_ratio_and_verdict() -> None:
    assert common.ratio(3.0, 2.0) == 1.5
    assert common.ratio(1.0, 0.0) is None
    assert common.verdict(1.6, 1.53) == "met"
    assert common.verdict(1.2, 1.53) == "missed"
    assert common.verdict(None, 1.53) == "-"


def _cell(policy: str, c: int, **figures: float) -> dict:
    base = {"input_tok_s": 100.0, "visible_input_tok_s": 100.0, "output_tok_s": 10.0, "agent_steps_per_s": 1.0,
            "p50_latency_s": 1.0, "p95_latency_s": 2.0, "prefilled_tokens": 1000,
            "attention_ms_per_decode_step": 1.0}
    return {"policy": policy, "concurrency": c, **base, **figures}


def test_serving_ratios_put_akv_over_each_baseline_per_concurrency() -> None:
    cells = [_cell(serving.AKV, 4, input_tok_s=300.0, p95_latency_s=1.0, prefilled_tokens=500,
                   attention_ms_per_decode_step=0.5),
             _cell(serving.STANDARD, 4), _cell(serving.TEXT_ENGINEERING, 4, input_tok_s=150.0)]
    rows = serving.ratios(cells)
    assert [(r["baseline"], r["concurrency"]) for r in rows] == [(serving.STANDARD, 4),
                                                                  (serving.TEXT_ENGINEERING, 4)]
    vs_standard = rows[0]
    assert vs_standard["input_throughput"] == 3.0       # higher is better: AKV / baseline
    assert vs_standard["p95_latency"] == 2.0            # lower is better: baseline / AKV
    assert vs_standard["prefilled_tokens"] == 2.0
    assert vs_standard["attention_per_decode_step"] == 2.0
    assert rows[1]["input_throughput"] == 2.0


def test_serving_at_the_stretched_context_uses_the_scaled_baselines_and_tells_the_server() -> None:
    from policy_dsl import load_policy

    settings = serving.Settings(context=32768)
    assert settings.policies == (serving.AKV, "standard-32k", "text-engineering-32k")
    assert all(load_policy(name).name == name for name in settings.policies)
    assert settings.server_options == ("--context", "32768", "--rope-scaling", "yarn")
    assert serving.Settings().server_options == () and serving.Settings().policies == serving.POLICIES
    short = serving.Settings(context=32768, text_engineering=False, concurrency=(1,))
    assert short.policies == (serving.AKV, "standard-32k")
    cells = [_cell(serving.AKV, 1, input_tok_s=300.0), _cell("standard-32k", 1)]
    assert [(r["baseline"], r["input_throughput"]) for r in serving.ratios(cells, short.policies)] == [
        ("standard-32k", 3.0)]
    streams = {"standard-32k": [_stream("standard-32k", (9000,), (9000,), (9000,))]}
    assert serving.standard_need(streams, short) == 9000
    with pytest.raises(SystemExit):
        serving.parse_args(["--context", "16384"])   # no baselines scaled to it


def _stream(policy: str, visible: tuple[int, ...], prompt: tuple[int, ...], cold: tuple[int, ...]
            ) -> serving.Stream:
    return serving.Stream(policy, "t", (), ("agent",) * len(visible), visible, prompt, cold)


def test_pool_is_smaller_than_standard_needs_but_holds_the_largest_request() -> None:
    streams = {serving.STANDARD: [_stream(serving.STANDARD, (1000, 6000), (1000, 6000), (1000, 6000))] * 8,
               serving.AKV: [_stream(serving.AKV, (1000, 3000), (1000, 9000), (1000, 15000))] * 8}
    settings = serving.Settings(streams=8, concurrency=(1, 4, 8), max_tokens=4)
    kv = serving.pool_size(streams, settings)
    assert serving.standard_need(streams, settings) == 8 * 6000
    assert 15000 + 4 <= kv < 8 * 6000
    assert serving.pool_size(streams, serving.Settings(kv_tokens=1234)) == 1234


def test_pool_grows_to_the_largest_request_even_past_standard_needs() -> None:
    streams = {serving.STANDARD: [_stream(serving.STANDARD, (6000,), (6000,), (6000,))],
               serving.AKV: [_stream(serving.AKV, (3000,), (9000,), (40000,))]}
    settings = serving.Settings(streams=1, concurrency=(1,), max_tokens=4)
    assert serving.pool_size(streams, settings) >= 40000 + 4


def test_salted_requests_differ_only_in_the_first_message_and_max_tokens() -> None:
    from sandbox.backends import BackendRequest

    request = BackendRequest(messages=({"role": "system", "content": "sys"}, {"role": "user", "content": "q"}),
                             drop_message={"1": [0]}, max_tokens=1)
    stream = serving.Stream(serving.AKV, "t", (request,), ("agent",), (1,), (2,), (2,))
    (sent,) = serving.salted(stream, "run-1", 3)
    assert sent.messages[0]["content"] == "[run-1] sys"
    assert sent.messages[1] is request.messages[1]
    assert sent.max_tokens == 3 and sent.drop_message == request.drop_message
    assert request.messages[0]["content"] == "sys"


def _run(scores: list[float], costs: list[float]) -> cost.PolicyRun:
    return cost.PolicyRun(tuple(f"t{i}" for i in range(len(scores))), np.array(scores, float),
                          np.array(costs, float), 0)


def test_compare_reports_the_cost_change_and_no_loss_for_equal_scores() -> None:
    settings = cost.Settings(resamples=500)
    akv = _run([1, 0, 1, 1], [0.6, 0.7, 0.5, 0.6])
    base = _run([1, 0, 1, 1], [1.0, 1.0, 1.0, 1.0])
    result = cost.compare(akv, base, cost.STANDARD, settings)
    assert result["cost_change"] == pytest.approx(-0.4)
    low, high = result["cost_change_ci"]
    assert low <= -0.4 <= high < 0
    assert result["score_difference"] == 0 and result["score_p_value"] == 1.0
    assert not result["significant_score_loss"]


def test_compare_flags_a_consistent_score_loss() -> None:
    settings = cost.Settings(resamples=2000)
    akv = _run([0.0] * 12, [0.5] * 12)
    base = _run([1.0] * 12, [1.0] * 12)
    result = cost.compare(akv, base, cost.STANDARD, settings)
    assert result["score_difference"] == -1.0
    assert result["score_p_value"] < 0.01
    assert result["significant_score_loss"]


def test_compare_refuses_unpaired_runs() -> None:
    akv = _run([1.0], [1.0])
    base = cost.PolicyRun(("other",), np.array([1.0]), np.array([1.0]), 0)
    with pytest.raises(ValueError, match="different tasks"):
        cost.compare(akv, base, cost.STANDARD, cost.Settings(resamples=100))


def test_pooled_concatenates_suites_in_the_same_order_for_every_policy() -> None:
    runs = {suite: {policy: _run([1.0, 0.0], [0.1, 0.2]) for policy in cost.POLICIES}
            for suite in ("a", "b")}
    pooled = cost.pooled(runs)
    assert set(pooled) == set(cost.POLICIES)
    assert len(pooled[cost.AKV].scores) == 4
    assert pooled[cost.AKV].task_ids == pooled[cost.STANDARD].task_ids


def test_replay_table_gives_wall_and_cpu_rates_and_both_verdicts() -> None:
    figures = {"trajectories": 3, "requests": 59, "prompt_tokens": 316_669, "repeat": 2,
               "target_requests_per_s": 10_000, "meets_target": False, "meets_target_per_cpu_s": True}
    for rate, (_, name) in zip((8_000, 6_000, 12_000), replay.PATHS):
        figures[f"{name}_requests_per_s"], figures[f"{name}_requests_per_cpu_s"] = rate, rate + 3_000
    lines = replay.render(figures).splitlines()
    assert lines[3].split()[-3:] == ["8,000", "11,000", "0.800"]
    assert lines[-1].endswith("missed per wall-clock second, met per CPU second")


def test_akv_bench_replay_hands_its_arguments_to_the_benchmark() -> None:
    from typer.testing import CliRunner

    from akv_cli.main import app

    result = CliRunner().invoke(app, ["bench", "replay", "--help"])
    assert result.exit_code == 0 and "--repeat" in result.stdout and "akv bench replay" in result.stdout
    result = CliRunner().invoke(app, ["bench", "replay", "--tasks", "0"])
    assert result.exit_code == 2 and "--tasks: expected a positive integer" in result.output


def _columns(**costs: list[float]) -> dict[str, headroom.Column]:
    ids = tuple(f"t{i}" for i in range(len(next(iter(costs.values())))))
    return {name.replace("_", "-"): headroom.Column(ids, (1.0,) * len(ids), tuple(c), 0) for name, c in costs.items()}


def test_headroom_gap_targets_and_verdicts_on_paired_columns() -> None:
    n = 12
    columns = _columns(full=[2.0] * n, standard_8k=[3.0] * n, text_engineering_8k=[2.5] * n,
                       expert_8k=[1.0 + 0.01 * i for i in range(n)], research=[0.8 + 0.01 * i for i in range(n)],
                       oracle=[0.5 + 0.01 * i for i in range(n)])
    check = {"same_actions": n, "tasks": n, "diverged": []}
    group = headroom.describe(columns, check, headroom.Settings(resamples=200))
    rows = {row["policy"]: row for row in group["policies"]}
    expert, oracle = sum(columns["expert-8k"].costs_usd), sum(columns["oracle"].costs_usd)
    assert group["expert_to_oracle_gap_percent"] == pytest.approx(100 * (1 - oracle / expert), abs=0.01)
    assert group["oracle_valid"] and group["oracle_same_score_as_full"]
    assert rows["expert-8k"]["verdict"] is None and rows["research"]["verdict"]["champion"]
    assert rows["oracle"]["verdict"]["eligible"] and not rows["oracle"]["verdict"]["champion"]
    assert rows["oracle"]["verdict"]["family"] == 1 and rows["research"]["verdict"]["family"] == 4
    assert headroom.targets(group, ["research"]) == {
        "oracle_25_percent_cheaper_at_same_score": True, "handwritten_non_window_beats_expert": True,
        "expert_cheaper_than_standard": True, "full_scores_highest": True}


def test_headroom_says_when_an_evaluated_policy_beats_the_oracle() -> None:
    n = 12
    columns = _columns(full=[2.0] * n, standard_8k=[3.0] * n, text_engineering_8k=[2.5] * n,
                       expert_8k=[1.0] * n, research=[0.4] * n, oracle=[0.5] * n)
    columns["full"] = headroom.Column(columns["full"].task_ids, (0.5,) * n, (0.3,) * n, 0)  # cheaper, worse score
    check = {"same_actions": n, "tasks": n, "diverged": []}
    group = headroom.describe(columns, check, headroom.Settings(resamples=200))
    assert group["oracle_beaten_by"] == ["research"] and not group["oracle_valid"]
    assert not headroom.targets(group, ["research"])["oracle_25_percent_cheaper_at_same_score"]
    group["targets"] = None
    figures = {"settings": {"suites": ["s"], "splits": ["heldout"], "alpha": 0.05, "notes": []},
               "groups": {"s/heldout": group}, "wall_s": 1.0}
    assert "NOT a ceiling: research is cheaper than the oracle at the same or a better score" in headroom.render(figures)
    assert json.loads(json.dumps(figures))["groups"]["s/heldout"]["oracle_beaten_by"] == ["research"]
    # At an equal cost, or with a lower score, nothing beats it.
    columns["research"] = columns["oracle"]
    assert headroom.describe(columns, check, headroom.Settings(resamples=200))["oracle_beaten_by"] == []


def test_headroom_without_use_records_reports_no_oracle_and_why() -> None:
    columns = _columns(full=[2.0] * 4, standard_8k=[3.0] * 4, text_engineering_8k=[2.5] * 4, expert_8k=[1.0] * 4)
    why = 'no use records (the exchange field "used"); regenerate them: akv run --suite s --policy full'
    check = {"same_actions": 0, "tasks": 0, "diverged": [], "unavailable": why}
    group = headroom.describe(columns, check, headroom.Settings(resamples=200))
    assert group["expert_to_oracle_gap_percent"] is None and not group["oracle_valid"]
    assert headroom.targets(group, [])["oracle_25_percent_cheaper_at_same_score"] is None
    group["targets"] = None
    text = headroom.render({"settings": {"suites": ["s"], "splits": ["heldout"], "alpha": 0.05, "notes": []},
                            "groups": {"s/heldout": group}, "wall_s": 1.0})
    assert f"[s/heldout] no oracle: {why}" in text


def test_headroom_refuses_columns_of_other_tasks() -> None:
    columns = _columns(full=[2.0] * 3, standard_8k=[3.0] * 3, text_engineering_8k=[2.5] * 3, expert_8k=[1.0] * 3)
    columns["full"] = headroom.Column(("a", "b", "c"), (1.0,) * 3, (2.0,) * 3, 0)
    with pytest.raises(ValueError, match="full ran other tasks than expert-8k"):
        headroom.describe(columns, {"same_actions": 0, "tasks": 0, "diverged": [], "unavailable": "-"},
                          headroom.Settings())


def test_headroom_runs_each_suites_own_hand_written_built_ins_unless_told() -> None:
    assert headroom.Settings().handwritten("localcomp") == ("research",)
    assert headroom.Settings().handwritten("localswe") == ("drop-settled",)
    assert headroom.Settings(policies=("a.akvp",)).handwritten("localswe") == ("a.akvp",)
    assert headroom.Settings().handwritten("another") == ()


def test_headroom_options_reach_its_settings_and_bad_ones_are_named() -> None:
    settings, as_json = headroom.parse_args(["--suites", "localswe", "--swe-limit", "0", "--seed", "1",
                                             "--workers", "2", "--json"])
    assert (settings.suites, settings.swe_limit, settings.seed, settings.workers, as_json) == (
        ("localswe",), None, 1, 2, True)
    with pytest.raises(SystemExit, match="--workers expects a positive number of processes, got 0"):
        headroom.parse_args(["--workers", "0"])


def test_the_llama_cpp_peer_is_found_in_another_venv_or_its_absence_explained(tmp_path) -> None:
    import importlib.util
    import sys

    from benchmarks.engine import import_llama_cpp, site_packages

    venv_site = tmp_path / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    venv_site.mkdir(parents=True)
    assert site_packages(tmp_path) == [venv_site]
    (venv_site / "llama_cpp").mkdir()
    assert site_packages(venv_site) == [venv_site]   # a site-packages folder given directly
    if importlib.util.find_spec("llama_cpp") is not None:
        pytest.skip("llama-cpp-python is installed in this environment")
    with pytest.raises(SystemExit, match=r"not found in .*nowhere.*never a dependency.*--llama-cpp VENV"):
        import_llama_cpp(str(tmp_path / "nowhere"))


def test_the_engine_benchmark_runs_the_parts_asked_for(monkeypatch, capsys) -> None:
    import sys

    from benchmarks.engine import PARTS, parse_args

    monkeypatch.setattr(sys, "argv", ["engine.py", "--parts", " decode , accuracy"])
    assert parse_args().parts == ["decode", "accuracy"]
    monkeypatch.setattr(sys, "argv", ["engine.py"])
    assert parse_args().parts == list(PARTS)
    monkeypatch.setattr(sys, "argv", ["engine.py", "--parts", "decode,serve"])
    with pytest.raises(SystemExit):
        parse_args()
    assert "--parts: expected some of decode, prefill, accuracy, attention, got decode, serve" in capsys.readouterr().err


def test_akv_bench_outside_a_checkout_says_in_one_line_what_it_needs(tmp_path) -> None:
    """An installed akv_cli has no benchmarks/ beside it (pyproject ships none): one clear line, exit 2."""
    import shutil
    import subprocess
    import sys
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    shipped = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert not any(p.startswith("benchmarks") for p in shipped["include"])
    shutil.copytree(root / "akv_cli", tmp_path / "akv_cli", ignore=shutil.ignore_patterns("__pycache__"))
    run = subprocess.run([sys.executable, "-c", "from akv_cli.main import app; app()", "bench", "cost"],
                         cwd=tmp_path, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.splitlines() == [
        "error: akv bench cost needs benchmarks/cost.py, which only the source checkout has (the installed "
        "package does not ship benchmarks/): run it from a clone installed with `pip install -e .`"]


def test_the_prefill_attention_benchmark_prints_both_parts_and_names_the_kernel_that_ran(capsys) -> None:
    """A tiny run of `benchmarks/prefill_attention.py`: both tables, the contenders agreeing (the kernel on torch's
    OpenMP threads and on its own pool bit for bit), a prefill shorter than FLASH_MIN_ROWS marked as SDPA on every
    side, and on the kernel once --flash-min-rows lets it in; bad shapes, parts and thresholds are named."""
    from akv_core.kernels import cpu_gemv
    from benchmarks import prefill_attention as bench

    if not cpu_gemv.available():
        pytest.skip(f"cpu_gemv: {cpu_gemv.why_unavailable()}")
    threads = torch.get_num_threads()
    bench.main(["--tokens", "40", "--continued", "20/90", "--prefill-tokens", "24", "--prefill-continued", "",
                "--rounds", "1", "--threads", "2"])
    out = capsys.readouterr().out
    table = out.split("one layer's causal attention")[1].split("float32 prefill")[0]
    rows = [line.split() for line in table.splitlines() if line[:2] in ("40", "20")]
    assert [row[0] for row in rows] == ["40", "20"] and all(float(row[-1]) < 1e-5 for row in rows)

    def forwards(text: str, label: str) -> dict[str, list[str]]:
        """The prefill table's rows for `label`, by contender: [s, tok/s, rounds, ratio, max |logit diff|]."""
        split = (re.split(r"\s{2,}", line.strip()) for line in text.split("float32 prefill")[-1].splitlines())
        return {cells[1]: cells[2:] for cells in split if cells[0] == label}

    prefill = forwards(out, "24 (all on SDPA)")
    assert list(prefill) == [bench.KERNEL, bench.OWN_POOL, bench.TORCH_ROWS, bench.SDPA]
    assert [float(prefill[name][-1]) for name in (bench.OWN_POOL, bench.SDPA)] == [0.0, 0.0]
    assert 0.0 < float(prefill[bench.TORCH_ROWS][-1]) < 1e-3   # torch's norms: the same to rounding
    assert torch.get_num_threads() == threads   # --threads 2 was the run's alone
    bench.main(["--parts", "prefill", "--prefill-tokens", "24", "--prefill-continued", "20/50",
                "--flash-min-rows", "22", "--rounds", "1", "--threads", "2"])
    out = capsys.readouterr().out
    moved, below = forwards(out, "24"), forwards(out, "20 after 30 (all on SDPA)")
    assert list(moved) == list(below) == [bench.KERNEL, bench.OWN_POOL, bench.TORCH_ROWS, bench.SDPA]
    assert 0.0 < float(moved[bench.SDPA][-1]) < 1e-3 and float(below[bench.SDPA][-1]) == 0.0
    assert float(moved[bench.OWN_POOL][-1]) == 0.0   # the kernel on either set of threads: the same bits
    for argv, message in ((["--continued", "90/20"], "--continued"), (["--parts", "decode"], "--parts: expected"),
                          (["--flash-min-rows", "0"], "--flash-min-rows: expected a count")):
        with pytest.raises(SystemExit):
            bench.main(argv)
        assert message in capsys.readouterr().err
