"""Paired statistics over tasks.

Every policy runs the same tasks with the same agent, backend and seed, so per-task differences
are paired: a task's own difficulty, which dwarfs policy effects, cancels out of each delta.
Here: percentile bootstrap intervals (of a mean, of a mean delta, of a relative change of
means, of the share of a cost gap closed), the paired sign-flip permutation test (two-sided
or one-sided), Holm-Bonferroni adjustment and the non-inferiority bound. The champion rule
built on them is `akv_stats.champion`.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import Literal, Mapping, Sequence

import numpy as np

EXACT_LIMIT = 14  # up to 2**14 sign patterns are enumerated; above that, Monte Carlo

Alternative = Literal["two-sided", "less"]


@dataclass(frozen=True)
class PairedComparison:
    n: int
    mean_delta: float  # mean(candidate - baseline)
    ci_low: float
    ci_high: float
    p_value: float  # two-sided, paired sign-flip permutation test
    baseline_mean: float

    @property
    def percent(self) -> float:
        """The mean delta as a percentage of the baseline's mean (0 when the baseline is 0)."""
        return 100.0 * self.mean_delta / self.baseline_mean if self.baseline_mean else 0.0

    def significant(self, alpha: float) -> bool:
        return self.p_value < alpha and not (self.ci_low <= 0.0 <= self.ci_high)

    def as_dict(self) -> dict[str, float]:
        return {"n": self.n, "mean_delta": self.mean_delta, "ci_low": self.ci_low, "ci_high": self.ci_high,
                "p_value": self.p_value, "baseline_mean": self.baseline_mean, "percent": self.percent}


def resample_indices(n: int, resamples: int, seed: int) -> np.ndarray:
    """[resamples, n] bootstrap draws of task indices; paired statistics reuse one draw for every column."""
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def percentile_interval(samples: np.ndarray, confidence: float = 0.95) -> tuple[float, float]:
    """The central `confidence` percentile interval of bootstrap samples."""
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(samples, [tail, 1.0 - tail])
    return float(low), float(high)


def percentile(values: Sequence[float], q: float, *, nearest_below: bool = False) -> float:
    """The q-th percentile (q in 0..100) of `values`: linear between the two nearest ranks, or with
    `nearest_below` the value at the lower of those ranks itself (one that occurred); 0.0 for no values."""
    if not len(values):
        return 0.0
    if nearest_below:
        return sorted(values)[int(q / 100 * (len(values) - 1))]
    return float(np.percentile(np.asarray(values, dtype=float), q))


def bootstrap_ci(values: Sequence[float], resamples: int = 2000, confidence: float = 0.95,
                 seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `values`."""
    d = np.asarray(values, dtype=float)
    if d.size == 0:
        return 0.0, 0.0
    return percentile_interval(d[resample_indices(d.size, resamples, seed)].mean(axis=1), confidence)


def relative_change_ci(candidate: Sequence[float], baseline: Sequence[float], resamples: int = 2000,
                       confidence: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Paired bootstrap interval of mean(candidate) / mean(baseline) - 1 (same task draws for both)."""
    c, b = _paired(candidate, baseline)
    if c.size == 0:
        return 0.0, 0.0
    draws = resample_indices(c.size, resamples, seed)
    base = b[draws].mean(axis=1)
    change = np.divide(c[draws].mean(axis=1), base, out=np.ones_like(base), where=base != 0) - 1.0
    return percentile_interval(change, confidence)


def gap_closed(reference: Sequence[float], candidate: Sequence[float], bound: Sequence[float],
               resamples: int = 2000, confidence: float = 0.95,
               seed: int = 0) -> tuple[float, tuple[float, float]] | None:
    """The share of the reference-to-bound cost gap a candidate closes, and its bootstrap interval.

    mean(reference - candidate) / mean(reference - bound), all three paired on the same tasks:
    0 is the reference's cost, 1 the bound's (the hindsight oracle's, the cheapest schedule of
    the recorded actions). A ratio of two paired means, so its interval is `relative_change_ci`'s
    of the per-task savings, plus one (a draw with no gap at all counts as closed, its convention
    for a zero baseline). None when the bound is not cheaper than the reference on average:
    there is no gap to close.
    """
    r, c = _paired(reference, candidate)
    _, b = _paired(reference, bound)
    saved, gap = r - c, r - b
    if gap.size == 0 or gap.mean() <= 0:
        return None
    low, high = relative_change_ci(saved, gap, resamples, confidence, seed)
    return float(saved.mean() / gap.mean()), (low + 1.0, high + 1.0)


def sign_flip_p_value(deltas: Sequence[float], permutations: int = 10000, seed: int = 0,
                      alternative: Alternative = "two-sided") -> float:
    """p-value of H0 "the deltas are symmetric around 0".

    Under H0 each paired delta is as likely to have either sign, so the null distribution of
    the mean comes from flipping signs. "two-sided" asks whether the mean differs from 0;
    "less" whether it is below 0 (one-sided). Small samples are enumerated exactly; zero
    deltas carry no sign information and are left out.
    """
    d = np.asarray(deltas, dtype=float)
    d = d[d != 0.0]
    if d.size == 0:
        return 1.0
    exact = d.size <= EXACT_LIMIT
    if exact:
        signs = np.array(list(product((1.0, -1.0), repeat=d.size)))
    else:
        signs = np.random.default_rng(seed).choice((1.0, -1.0), size=(permutations, d.size))
    null = (signs * d).mean(axis=1)
    if alternative == "less":
        extreme = int(np.sum(null <= d.mean() + 1e-12))
    else:
        extreme = int(np.sum(np.abs(null) >= abs(d.mean()) - 1e-12))
    if exact:
        return extreme / len(signs)
    return (extreme + 1) / (permutations + 1)  # the observed pattern counts as one draw


def compare_paired(candidate: Sequence[float], baseline: Sequence[float], resamples: int = 2000,
                   permutations: int = 10000, seed: int = 0) -> PairedComparison:
    """Compare two equally long, task-aligned sequences (candidate minus baseline), two-sided."""
    c, b = _paired(candidate, baseline)
    deltas = c - b
    low, high = bootstrap_ci(deltas, resamples, seed=seed)
    p = sign_flip_p_value(deltas, permutations, seed=seed)
    mean = float(deltas.mean()) if deltas.size else 0.0
    return PairedComparison(int(deltas.size), mean, low, high, p, float(b.mean()) if b.size else 0.0)


def holm_bonferroni(p_values: Mapping[str, float]) -> dict[str, float]:
    """Holm's step-down adjusted p-values: reject H_i at level alpha iff adjusted p_i < alpha.

    The smallest p is multiplied by m, the next by m - 1, ...; the adjusted values are made
    monotone (never smaller than an earlier one) and capped at 1. This controls the chance of
    any false rejection across the whole family at alpha, whatever the dependence.
    """
    order = sorted(p_values, key=lambda k: (p_values[k], k))
    m, running, adjusted = len(order), 0.0, {}
    for rank, key in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[key]))
        adjusted[key] = running
    return adjusted


def non_inferiority_bound(deltas: Sequence[float], alpha: float = 0.05, resamples: int = 2000,
                          seed: int = 0) -> float:
    """The one-sided (1 - alpha) lower bound of the mean delta: the alpha-quantile of bootstrap means."""
    d = np.asarray(deltas, dtype=float)
    if d.size == 0:
        return 0.0
    means = d[resample_indices(d.size, resamples, seed)].mean(axis=1)
    return float(np.quantile(means, alpha))


def _paired(candidate: Sequence[float], baseline: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    c, b = np.asarray(candidate, dtype=float), np.asarray(baseline, dtype=float)
    if c.shape != b.shape:
        raise ValueError(f"paired samples differ in length: {c.size} vs {b.size}")
    return c, b
