"""Paired statistics over held-out tasks: bootstrap CIs of mean deltas and a sign-flip test.

Every policy runs the same held-out tasks with the same agent, backend and seed, so the
per-task differences are paired: the task's own difficulty cancels out of each delta.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import Sequence

import numpy as np

EXACT_LIMIT = 14  # up to 2**14 sign patterns are enumerated; above that, Monte Carlo


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


def bootstrap_ci(deltas: Sequence[float], resamples: int = 2000, confidence: float = 0.95,
                 seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `deltas`."""
    d = np.asarray(deltas, dtype=float)
    if d.size == 0:
        return 0.0, 0.0
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, d.size, size=(resamples, d.size))
    means = d[idx].mean(axis=1)
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return float(low), float(high)


def sign_flip_p_value(deltas: Sequence[float], permutations: int = 10000, seed: int = 0) -> float:
    """Two-sided p-value of H0 "the deltas are symmetric around 0".

    Under H0 each paired delta is as likely to have either sign, so the null distribution
    of the mean comes from flipping signs. Small samples are enumerated exactly.
    """
    d = np.asarray(deltas, dtype=float)
    d = d[d != 0.0]  # zero deltas carry no sign information
    if d.size == 0:
        return 1.0
    observed = abs(d.mean())
    if d.size <= EXACT_LIMIT:
        signs = np.array(list(product((1.0, -1.0), repeat=d.size)))
    else:
        rng = np.random.default_rng(seed)
        signs = rng.choice((1.0, -1.0), size=(permutations, d.size))
    null = np.abs((signs * d).mean(axis=1))
    extreme = int(np.sum(null >= observed - 1e-12))
    if d.size <= EXACT_LIMIT:
        return extreme / len(signs)
    return (extreme + 1) / (permutations + 1)  # the observed pattern counts as one draw


def compare_paired(candidate: Sequence[float], baseline: Sequence[float], resamples: int = 2000,
                   permutations: int = 10000, seed: int = 0) -> PairedComparison:
    """Compare two equally long, task-aligned sequences (candidate minus baseline)."""
    c = np.asarray(candidate, dtype=float)
    b = np.asarray(baseline, dtype=float)
    if c.shape != b.shape:
        raise ValueError(f"paired samples differ in length: {c.size} vs {b.size}")
    deltas = c - b
    low, high = bootstrap_ci(deltas, resamples, seed=seed)
    p = sign_flip_p_value(deltas, permutations, seed=seed)
    mean = float(deltas.mean()) if deltas.size else 0.0
    return PairedComparison(int(deltas.size), mean, low, high, p, float(b.mean()) if b.size else 0.0)
