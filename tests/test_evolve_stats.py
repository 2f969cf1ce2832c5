"""Paired statistics and the Pareto front."""
from __future__ import annotations

import numpy as np
import pytest

from evolve.pareto import Point, dominates, pareto_front, rank_by_fronts
from evolve.stats import bootstrap_ci, compare_paired, sign_flip_p_value


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


def test_champion_rule_needs_front_saving_and_no_score_loss():
    from evolve.validation import verdict

    cheaper = compare_paired([0.8] * 16, [1.0] * 16)
    same_cost = compare_paired([1.0] * 16, [1.0] * 16)
    same_score = compare_paired([1.0] * 16, [1.0] * 16)
    worse_score = compare_paired([0.0] * 16, [1.0] * 16)
    assert verdict(cheaper, same_score, True, 0.05)[0]
    assert verdict(cheaper, same_score, False, 0.05) == (False, "dominated on held-out")
    assert "not significant" in verdict(same_cost, same_score, True, 0.05)[1]
    ok, why = verdict(cheaper, worse_score, True, 0.05)
    assert not ok and "score loss" in why
