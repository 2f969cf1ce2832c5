"""benchmarks/scale.py: the workers part on a real PostgreSQL with real `akv worker` processes, a small
workload; its ratios and table; bad arguments stop before anything starts."""
from __future__ import annotations

import pytest

from benchmarks import postgres, scale


@pytest.mark.slow
def test_one_and_two_workers_store_every_queued_evaluation_once(postgres_server) -> None:
    settings = scale.Settings(policies=("expert-8k", "full"), train_tasks=3, workers=(1, 2), parts=("workers",))
    cells = [scale._workers_level(postgres.fresh_database(postgres_server), n, settings, lambda _t: None)
             for n in settings.workers]
    assert [c["evaluations"] for c in cells] == [6, 6]  # 2 policies x 3 tasks, none lost, none twice
    assert [len(c["per_worker"]) for c in cells] == [1, 2] and [sum(c["per_worker"]) for c in cells] == [6, 6]
    figures = {"workers": cells, "cpu_ceiling_before": 1.9, "cpu_ceiling_after": 1.8}
    figures["ratios"] = scale.ratios(figures)
    expected = round(cells[1]["evaluations_per_s"] / cells[0]["evaluations_per_s"], 3)
    per_cpu = round(cells[0]["worker_cpu_ms_per_evaluation"] / cells[1]["worker_cpu_ms_per_evaluation"], 3)
    assert all(c["cpu_s"]["workers"] > 0 and c["cpu_s"]["postgres"] > 0 for c in cells)  # read from /proc
    assert figures["ratios"] == {"workers 2 vs 1 (evaluations/s)": expected,
                                 "workers 2 vs 1 (evaluations per worker CPU s)": per_cpu}
    assert f"workers 2 vs 1 (evaluations/s): {expected}x" in scale.render(figures)


@pytest.mark.parametrize("argv, expected", [
    (["--parts", "gpu"], "unknown part 'gpu'"),
    (["--workers", "1,0"], "--workers: expected positive integers"),
    (["--concurrency", "one"], "--concurrency: expected positive integers"),
    (["--rounds", "0"], "--rounds: expected a positive integer"),
])
def test_bad_arguments_are_one_line(argv, expected, capsys) -> None:
    with pytest.raises(SystemExit):
        scale.parse_args(argv)
    assert expected in capsys.readouterr().err


def test_concurrency_ratios_and_the_prefill_ceiling() -> None:
    """tasks/s of each level against concurrency 1, and the ceiling: concurrency 1's wall over the seconds a
    level's server spent in passes with prompt rows (what batching could reach if nothing else cost)."""
    def cell(level: int, wall: float, prefill_s: float, decode_s: float) -> dict:
        return {"concurrency": level, "tasks": 8, "requests": 8, "errors": 0, "wall_s": wall,
                "tasks_per_s": round(8 / wall, 4), "server_cpu_s_per_task": wall / 4, "load_1min": 1.0,
                "server_pass_s": {"prefill": prefill_s, "decode": decode_s},
                "per_request": {"computed_prompt_tokens": 200.0, "cached_prompt_tokens": 330.0,
                                "completion_tokens": 23.5, "decoded_by_server": 23.5, "seconds": 1.0}}

    figures = {"llm": [cell(1, 10.0, 3.0, 6.5), cell(8, 5.0, 2.5, 1.5)]}
    figures["ratios"] = scale.ratios(figures)
    assert figures["ratios"]["llm concurrency 8 vs 1 (tasks/s)"] == 2.0
    assert figures["ratios"]["llm concurrency 8 vs 1, ceiling (the level's prefill passes alone)"] == 4.0
    assert not any("concurrency 1 vs 1" in name for name in figures["ratios"])
    table = scale.render(figures)
    assert "prefill passes s" in table and "decode passes s" in table
    assert "llm concurrency 8 vs 1, ceiling (the level's prefill passes alone): 4.0x" in table
