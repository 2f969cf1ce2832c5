"""`akv bench evolve`: the per-arm and paired arithmetic on made-up runs, refused settings, and a small real run."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from akv_cli.main import app
from benchmarks.evolve_arms import Settings, measure, pairs, render, smallest_p
from test_bench_runs import _costs_in_usd


class MadeUpRunner:
    """Runs nothing: each (arm, seed) gets the cost change given, a champion when it is below -5%."""

    def __init__(self, changes: dict[str, list[float]]) -> None:
        self.changes, self.asked = changes, []

    def check(self, settings: Settings) -> None:
        pass

    def run(self, arm, proposers, seed, settings) -> dict:
        self.asked.append((arm, tuple(proposers), seed))
        change = self.changes[arm][seed]
        champion = change < -5
        return {"champion": champion, "chosen": {"policy_id": 7, "proposer": proposers[0], "verdict": "-"},
                "cost_change_pct": change, "score_change_points": -0.5,
                "champion_cost_change_pct": change if champion else 0.0, "cost_usd": 0.01, "expert_cost_usd": 0.012,
                "fates": {p: {"pruned": 2, "evaluated": 1} for p in proposers}, "wall_s": 1.0}

    def close(self) -> None:
        pass


def test_mix_is_paired_with_random_and_reflect_by_seed():
    changes = {"mix": [-20.0, -18.0, -25.0, -15.0, -22.0, -19.0], "random": [0.0, -3.0, 0.0, -1.0, 0.0, 0.0],
               "reflect": [-21.0, -17.0, -24.0, -16.0, -20.0, -20.0]}
    runner = MadeUpRunner(changes)
    figures = measure(Settings(seeds=6, budget=4, arms=("mix", "random", "reflect")), runner=runner)
    assert runner.asked[:3] == [("mix", ("reflect", "optuna", "mutate"), 0), ("random", ("random",), 0),
                                ("reflect", ("reflect",), 0)]  # seed-major, mix without llm
    assert len(figures["rows"]) == 18
    mix = figures["arms"]["mix"]
    assert mix["cost_change_pct"] == pytest.approx(sum(changes["mix"]) / 6)
    assert mix["ci_low"] <= mix["cost_change_pct"] <= mix["ci_high"] and mix["champions"] == 6
    assert mix["fates"]["optuna"] == {"pending": 0, "rejected": 0, "duplicate": 0, "pruned": 12, "evaluated": 6}
    assert figures["arms"]["random"]["champion_cost_change_pct"] == 0.0  # no champion: the expert stays
    versus_random = figures["paired"]["mix-random"]["cost_change_pct"]
    assert versus_random["mean_delta"] == pytest.approx((sum(changes["mix"]) - sum(changes["random"])) / 6)
    assert versus_random["p_value"] == pytest.approx(smallest_p(6)) == pytest.approx(2 / 64)
    assert figures["paired"]["mix-reflect"]["cost_change_pct"]["p_value"] > 0.05
    assert "mix beats random" in figures["verdict"] and "mix does not beat reflect" in figures["verdict"]
    text = render(figures)
    assert "mix - random" in text and text.splitlines()[-1].startswith("verdict: ")
    assert "reflect, optuna, mutate" in text


def test_five_seeds_are_said_to_be_too_few_for_significance():
    changes = {"mix": [-10.0] * 5, "random": [0.0] * 5}
    figures = measure(Settings(seeds=5, arms=("mix", "random")), runner=MadeUpRunner(changes))
    assert "mix does not beat random" in figures["verdict"] and "5 seeds cannot reach p < 0.05" in figures["verdict"]


def test_without_mix_every_arm_is_paired_with_random():
    assert pairs(("random", "mutate", "optuna")) == [("mutate", "random"), ("optuna", "random")]
    assert pairs(("mix", "random", "reflect", "optuna")) == [("mix", "random"), ("mix", "reflect")]
    assert pairs(("mutate",)) == []


@pytest.mark.parametrize(("args", "words"), [
    (["--budget", "0"], "error: --budget: expected at least 1"),
    (["--seeds", "0"], "error: --seeds: expected at least 1"),
    (["--arms", "mix,best"], "error: --arms: unknown arm 'best'"),
    (["--suite", "nosuch"], "error: --suite: unknown suite 'nosuch'"),
    (["--subset-size", "60", "--train-limit", "100"], "error: --suite: localcomp has 48 train tasks"),
])
def test_settings_that_cannot_run_end_with_one_error_line_and_exit_2(args, words):
    result = CliRunner().invoke(app, ["bench", "evolve", *args])
    assert result.exit_code == 2 and result.output.startswith(words), result.output
    assert "Traceback" not in result.output


@pytest.mark.slow
def test_bench_evolve_runs_two_arms_for_two_seeds_end_to_end():
    # slow (about 30 s): 2 x 2 small runs of the real loop, validation included
    result = CliRunner().invoke(app, ["bench", "evolve", "--seeds", "2", "--budget", "3", "--arms", "random,mutate",
                                      "--train-limit", "4", "--subset-size", "2", "--heldout-limit", "6", "--json"])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.output.strip().splitlines()[-1])
    _costs_in_usd(figures)
    assert [(r["arm"], r["seed"]) for r in figures["rows"]] == [("random", 0), ("mutate", 0), ("random", 1),
                                                                 ("mutate", 1)]
    for row in figures["rows"]:
        assert isinstance(row["cost_change_pct"], float) and isinstance(row["score_change_points"], float)
        assert sum(sum(counts.values()) for counts in row["fates"].values()) == 3  # the budget, every fate counted
        assert row["champion_cost_change_pct"] == (row["cost_change_pct"] if row["champion"] else 0.0)
        assert row["chosen"] is not None or (row["cost_change_pct"] == 0.0 and not row["champion"])
    assert set(figures["arms"]) == {"random", "mutate"} and all(a["seeds"] == 2 for a in figures["arms"].values())
    paired = figures["paired"]["mutate-random"]
    assert paired["seeds"] == 2 and isinstance(paired["cost_change_pct"]["mean_delta"], float)
