"""`akv bench search`: the grid, the regret arithmetic, and a small real run of two mixes."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from akv_cli.main import app
from benchmarks.search import STRUCTURE, evaluations_until, grid, reached, regret_curve
from test_bench_runs import _costs_in_usd

SMALL = """mode kv
on each tool_response: drop role tool keep last 4 in 4..5
reposition every 1 in 1..2 drops
"""


def test_the_grid_is_every_point_of_the_tunable_ranges():
    points = grid(STRUCTURE)
    assert len(points) == 6 * 6 and len({text for _values, text in points}) == 36
    assert {tuple(v.values()) for v, _t in points} == {(a, k) for a in range(1, 7) for k in range(3, 9)}
    with pytest.raises(ValueError, match="no tunable number"):
        grid("mode kv\nreposition never\n")
    with pytest.raises(ValueError, match="--structure"):
        grid("mode kv\non each tool_response: drop role tool keep last 4 in 1..\n")


def test_regret_is_measured_against_the_grid_optimum_at_the_score_threshold():
    step = lambda score, cost: SimpleNamespace(score=score, cost=cost)  # noqa: E731
    steps = [step(None, None), step(0.5, 1.0), step(1.0, 3.0), step(1.0, 2.0), step(1.0, 1.9)]
    curve = regret_curve(steps, (1.0, 4.0), 0.98, 2.0, 6)
    assert curve == [100.0, 100.0, 100.0, 50.0, 0.0, -5.0, -5.0]  # a cheap low score never counts
    assert reached(curve, 6) == 4
    assert regret_curve([], (0.0, 1.0), 0.98, 2.0, 2) == [None, None, None] and reached([None, None, None], 2) == 3


def test_evaluations_to_reach_leave_out_duplicates_and_rejections():
    steps = [SimpleNamespace(status=s) for s in ("evaluated", "duplicate", "rejected", "pruned", "evaluated")]
    assert evaluations_until(steps, 5, 6) == 3 and evaluations_until(steps, 2, 6) == 1
    assert evaluations_until(steps, 7, 6) == 7  # never reached: budget + 1


@pytest.mark.slow
def test_bench_search_prints_regret_curves_of_two_mixes(tmp_path):
    structure = tmp_path / "small.akvp"
    structure.write_text(SMALL)
    result = CliRunner().invoke(app, ["bench", "search", "--tasks", "1", "--budget", "3", "--repeats", "1",
                                      "--mixes", "random,tpe", "--structure", str(structure), "--json"])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.output.strip().splitlines()[-1])
    assert figures["grid"]["points"] == 4 and set(figures["mixes"]) == {"random", "tpe"}
    _costs_in_usd(figures)  # the unit convention of every benchmark's JSON
    for mix in figures["mixes"].values():
        (run,) = mix["runs"]
        assert len(run["curve"]) == 4 and run["evaluated"] + run["duplicates"] + run["rejected"] == 3
        assert run["reached_evaluations"] <= run["reached"]
    refused = CliRunner().invoke(app, ["bench", "search", "--mixes", "random,best"])
    assert refused.exit_code == 2 and refused.output.startswith("error: --mixes: unknown mix 'best'")
