"""Sampling parameters: OpenAI's ranges, and numerically safe sampling for every accepted value."""
from __future__ import annotations

import math

import pytest
import torch

from akv_core.sampling import check_sampling, generator_for, sample

LOGITS = torch.tensor([1.0, 3.0, 2.5, -4.0, 3.0 - 1e-6])


@pytest.mark.parametrize("temperature", [1e-40, 1e-30, 5e-324, 1e-7])
def test_a_tiny_temperature_samples_the_most_likely_token(temperature: float) -> None:
    # Dividing the raw logits by 1e-40 gives inf, and softmax(inf - inf) NaN.
    for seed in range(20):
        assert sample(LOGITS, temperature, 1.0, generator_for(seed)) == 1


def test_top_p_zero_keeps_the_most_likely_token_and_top_p_one_keeps_all() -> None:
    assert {sample(LOGITS, 1.0, 0.0, generator_for(seed)) for seed in range(20)} == {1}
    assert len({sample(LOGITS, 2.0, 1.0, generator_for(seed)) for seed in range(200)}) >= 4


def test_large_logits_and_the_widest_range_stay_finite() -> None:
    huge = torch.tensor([3e38, -3e38, 3e38, 0.0])
    assert {sample(huge, 2.0, 1.0, generator_for(seed)) for seed in range(20)} <= {0, 2}
    assert sample(huge, 0.0, 1.0, None) == 0


def test_sampling_follows_the_distribution_and_never_draws_an_impossible_token() -> None:
    """4,000 draws of one seeded generator: each token's share within 4 standard deviations of its
    probability, the tokens of probability zero (logit -inf) never drawn, and the same seed the same draws."""
    logits = torch.tensor([0.0, -math.inf, math.log(3.0), -math.inf, math.log(0.5)])
    probs = torch.softmax(logits.double(), -1)
    generator = generator_for(5)
    draws = torch.tensor([sample(logits, 1.0, 1.0, generator) for _ in range(4000)])
    counts = torch.bincount(draws, minlength=5).double()
    assert counts[1] == counts[3] == 0
    assert ((counts / 4000 - probs).abs() <= 4 * (probs * (1 - probs) / 4000).sqrt()).all(), counts
    again = generator_for(5)
    assert [sample(logits, 1.0, 1.0, again) for _ in range(50)] == draws[:50].tolist()


def test_logits_that_are_not_numbers_fail_loudly() -> None:
    with pytest.raises(FloatingPointError):
        sample(torch.tensor([0.0, math.nan]), 1.0, 1.0, generator_for(1))


@pytest.mark.parametrize(("temperature", "top_p", "seed", "field"), [
    (-0.1, 1.0, None, "temperature"), (2.01, 1.0, None, "temperature"), (math.nan, 1.0, None, "temperature"),
    (math.inf, 1.0, None, "temperature"), ("1", 1.0, None, "temperature"), (True, 1.0, None, "temperature"),
    (1.0, -0.01, None, "top_p"), (1.0, 1.5, None, "top_p"), (1.0, math.nan, None, "top_p"),
    (1.0, 1.0, 2**64, "seed"), (1.0, 1.0, 2**63, "seed"), (1.0, 1.0, -2**63 - 1, "seed"), (1.0, 1.0, 1.5, "seed"),
])
def test_values_outside_openai_ranges_are_refused_naming_the_field(temperature, top_p, seed, field) -> None:
    with pytest.raises(ValueError, match=f"^{field}: "):
        check_sampling(temperature, top_p, seed)


def test_the_edges_of_the_ranges_are_accepted_and_seeds_are_reproducible() -> None:
    for temperature, top_p, seed in [(0, 0, -2**63), (2, 1, 2**63 - 1), (0.0, 1.0, None), (1e-40, 1e-9, 0)]:
        check_sampling(temperature, top_p, seed)
    draws = [[sample(LOGITS, 1.5, 0.95, g) for _ in range(8)] for g in (generator_for(-5), generator_for(-5))]
    assert draws[0] == draws[1]
