"""Paired statistics (akv_stats.paired), the champion rule (akv_stats.champion), and the Pareto front."""
from __future__ import annotations

import numpy as np
import pytest

from akv_stats.champion import champion_rule
from akv_stats.paired import (bootstrap_ci, compare_paired, gap_closed, holm_bonferroni, non_inferiority_bound,
                              percentile, relative_change_ci, sign_flip_p_value)
from evolve.pareto import Point, dominates, pareto_front, rank_by_fronts


def test_exact_sign_flip_p_value_for_all_positive_deltas():
    # 5 positive deltas: only the all-plus and all-minus sign patterns are as extreme.
    assert sign_flip_p_value([1, 2, 3, 4, 5]) == pytest.approx(2 / 32)


def test_zero_deltas_carry_no_evidence():
    assert sign_flip_p_value([0, 0, 0]) == 1.0
    assert compare_paired([0.5, 0.5], [0.5, 0.5]).p_value == 1.0


def test_monte_carlo_test_separates_an_effect_from_noise():
    rng = np.random.default_rng(1)
    noise = rng.normal(0, 1, 60)
    shifted = noise * 0.2 - 1.0
    assert sign_flip_p_value(shifted, permutations=2000) < 0.01
    symmetric = np.concatenate([noise[:30], -noise[:30]])
    assert sign_flip_p_value(symmetric, permutations=2000) > 0.5


def test_bootstrap_ci_brackets_the_mean_and_shrinks_with_more_data():
    rng = np.random.default_rng(2)
    small = rng.normal(3, 1, 10)
    big = rng.normal(3, 1, 400)
    lo_s, hi_s = bootstrap_ci(small, 1000)
    lo_b, hi_b = bootstrap_ci(big, 1000)
    assert lo_s <= small.mean() <= hi_s and lo_b <= big.mean() <= hi_b
    assert hi_b - lo_b < hi_s - lo_s


def test_paired_comparison_reports_percent_of_the_baseline():
    cmp = compare_paired([0.8] * 20, [1.0] * 20)
    assert cmp.mean_delta == pytest.approx(-0.2)
    assert cmp.percent == pytest.approx(-20.0)
    assert cmp.significant(0.05)
    with pytest.raises(ValueError):
        compare_paired([1, 2], [1])


def test_pairing_removes_task_difficulty():
    # Tasks differ wildly in cost, the candidate always saves 1%: only a paired test sees it.
    base = np.array([1.0, 100.0, 5.0, 50.0, 2.0, 80.0, 9.0, 30.0, 3.0, 60.0, 7.0, 40.0, 4.0, 90.0, 6.0, 20.0])
    cmp = compare_paired(base * 0.99, base)
    assert cmp.significant(0.05) and cmp.ci_high < 0


def test_pareto_front_and_ranking():
    a, b, c, d = Point(1, 0.9, 2.0), Point(2, 0.5, 1.0), Point(3, 0.5, 1.5), Point(4, 0.9, 2.0)
    assert dominates(b, c) and not dominates(a, b) and not dominates(a, d)
    assert [p.policy_id for p in pareto_front([a, b, c, d])] == [1, 4, 2]
    assert [p.policy_id for p in rank_by_fronts([c, a, b])] == [1, 2, 3]


def test_one_sided_p_value_counts_only_the_cheaper_tail():
    # 5 negative deltas: only the all-minus pattern is as low; the reverse direction is certain.
    assert sign_flip_p_value([-1, -2, -3, -4, -5], alternative="less") == pytest.approx(1 / 32)
    assert sign_flip_p_value([1, 2, 3, 4, 5], alternative="less") == pytest.approx(1.0)


def test_holm_multiplies_the_smallest_p_by_the_family_size_and_stays_monotone():
    adjusted = holm_bonferroni({"a": 0.01, "b": 0.04, "c": 0.03, "d": 0.5})
    assert adjusted == pytest.approx({"a": 0.04, "c": 0.09, "b": 0.09, "d": 0.5})
    assert holm_bonferroni({"x": 0.4, "y": 0.9}) == pytest.approx({"x": 0.8, "y": 0.9})


def test_relative_change_interval_brackets_the_change_of_means():
    base = np.array([1.0, 2.0, 4.0, 8.0] * 5)
    low, high = relative_change_ci(base * 0.7, base, resamples=500)
    assert low == pytest.approx(-0.3) and high == pytest.approx(-0.3)
    noisy = base * np.array([0.6, 0.8] * 10)
    low, high = relative_change_ci(noisy, base, resamples=500)
    assert low < noisy.mean() / base.mean() - 1 < high < 0


def test_non_inferiority_bound_is_below_the_mean_and_zero_for_equal_scores():
    assert non_inferiority_bound([0.0] * 30) == 0.0
    deltas = np.random.default_rng(3).normal(-0.01, 0.05, 40)
    assert non_inferiority_bound(deltas) < deltas.mean()


def _results(scores, costs):
    return list(zip(scores, costs))


EXPERT_COSTS = np.array([0.004, 0.006, 0.005, 0.009, 0.003, 0.007, 0.005, 0.008, 0.004, 0.006, 0.005, 0.007])


def test_a_candidate_equal_to_the_expert_is_never_crowned():
    expert = _results([1.0] * 12, EXPERT_COSTS)
    verdict = champion_rule({"copy": expert}, expert)["copy"]
    assert verdict.cost_p == 1.0 and not verdict.cheaper and verdict.non_inferior
    assert not verdict.champion and "not significantly cheaper" in verdict.reason
    # Equal but for one task a hair cheaper: one sign, no evidence.
    nudged = _results([1.0] * 12, EXPERT_COSTS - np.eye(12)[0] * 1e-6)
    assert not champion_rule({"nudged": nudged}, expert)["nudged"].champion


def test_a_candidate_cheaper_on_every_task_at_equal_score_is_crowned():
    expert = _results([1.0, 0.0, 1.0] * 4, EXPERT_COSTS)
    verdicts = champion_rule({"cheap": _results([1.0, 0.0, 1.0] * 4, EXPERT_COSTS * 0.97),
                              "copy": expert}, expert)
    assert verdicts["cheap"].champion and verdicts["cheap"].cost_p_holm < 0.05
    assert verdicts["cheap"].cost_percent == pytest.approx(-3.0)
    assert not verdicts["copy"].champion and sum(v.champion for v in verdicts.values()) == 1


def test_a_score_loss_beyond_the_margin_blocks_a_cheaper_candidate():
    expert = _results([1.0] * 12, EXPERT_COSTS)
    lossy = _results([1.0] * 9 + [0.0] * 3, EXPERT_COSTS * 0.5)  # 25 points lower on average
    verdict = champion_rule({"lossy": lossy}, expert)["lossy"]
    assert verdict.cheaper and not verdict.non_inferior and not verdict.champion
    assert "worse than the expert's by more than the margin" in verdict.reason
    # A wide enough margin accepts the same loss: the margin is the user's stated tolerance.
    assert champion_rule({"lossy": lossy}, expert, margin=0.5)["lossy"].champion


def test_with_five_finalists_a_chance_winner_is_held_back_by_holm():
    # Five candidates whose cost differs from the expert's by symmetric noise only; by chance one of
    # them looks cheaper (raw one-sided p = 0.013 < 0.05). Alone it would be crowned; among five, not.
    noise = np.random.default_rng(1).normal(0.0, 0.01, size=(5, 12))
    base = 0.5 + EXPERT_COSTS
    expert = _results([1.0] * 12, base)
    family = {f"c{i}": _results([1.0] * 12, base + noise[i]) for i in range(5)}
    verdicts = champion_rule(family, expert)
    lucky = min(verdicts.values(), key=lambda v: v.cost_p)
    assert lucky.cost_p < 0.05 <= lucky.cost_p_holm and lucky.family == 5
    assert not any(v.champion for v in verdicts.values())
    alone = champion_rule({lucky.name: family[lucky.name]}, expert)[lucky.name]
    assert alone.cost_p == lucky.cost_p and alone.champion


def test_champion_rule_refuses_unpaired_results_and_bad_settings():
    expert = _results([1.0] * 4, [1.0] * 4)
    with pytest.raises(ValueError, match="same tasks"):
        champion_rule({"short": expert[:3]}, expert)
    with pytest.raises(ValueError, match="margin"):
        champion_rule({"x": expert}, expert, margin=-0.01)
    with pytest.raises(ValueError, match="alpha"):
        champion_rule({"x": expert}, expert, alpha=1.0)


def test_identical_eligible_twins_crown_the_earlier_policy_by_numeric_id():
    # Policy 17 is a later identical copy of policy 5: same scores, same costs. As strings "17" < "5",
    # but the parent (the lower id) must win, whatever order the candidates come in.
    expert = _results([1.0, 0.0, 1.0] * 4, EXPERT_COSTS)
    twin = _results([1.0, 0.0, 1.0] * 4, EXPERT_COSTS * 0.9)
    for order in (("17", "5"), ("5", "17")):
        verdicts = champion_rule({name: twin for name in order}, expert)
        assert verdicts["5"].champion and not verdicts["17"].champion
    verdicts = champion_rule({"9": twin, "10": twin, "expert-copy": twin}, expert)
    assert [name for name, v in verdicts.items() if v.champion] == ["9"]


def test_gap_closed_is_the_share_of_the_reference_to_bound_saving_with_a_paired_interval():
    expert = np.array([4.0, 2.0, 8.0, 6.0] * 5)
    oracle = expert * 0.5
    share, (low, high) = gap_closed(expert, expert * 0.8, oracle, resamples=500)
    assert share == pytest.approx(0.4) and low == pytest.approx(0.4) and high == pytest.approx(0.4)
    noisy = expert * np.array([0.7, 0.9] * 10)
    share, (low, high) = gap_closed(expert, noisy, oracle, resamples=500)
    assert share == pytest.approx((expert - noisy).mean() / (expert - oracle).mean()) and low < share < high
    assert gap_closed(expert, noisy, expert * 1.1) is None  # the bound is no cheaper: no gap to close
    with pytest.raises(ValueError):
        gap_closed(expert, noisy[:3], oracle)


def test_percentile_interpolates_or_takes_the_value_at_the_lower_rank() -> None:
    values = [40, 10, 30, 20]
    assert percentile(values, 50) == 25.0 and percentile(values, 90) == pytest.approx(37.0)
    assert percentile(values, 50, nearest_below=True) == 20 and percentile(values, 90, nearest_below=True) == 30
    assert percentile([], 90) == 0.0 and percentile([], 90, nearest_below=True) == 0.0
