"""The champion rule: which candidate policy, if any, replaces the expert.

Evolution's validation and the benchmarks share this one decision: a candidate must be cheaper
than the expert (a one-sided paired sign-flip test, Holm-adjusted over every candidate judged
together) and no worse in score than a margin (a one-sided bootstrap lower bound); of those that
pass both, the cheapest wins. The tests and intervals it uses are `akv_stats.paired`'s.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from akv_stats.paired import holm_bonferroni, non_inferiority_bound, sign_flip_p_value

DEFAULT_MARGIN = 0.02  # score points (0..1 scale) a candidate may lose and still be non-inferior
# The units a score can be judged in: the 0..1 score shown as points (x100), or a trace set's likelihood
# fidelity, a mean log-likelihood change per reply token (sandbox/traces/likelihood.py).
POINTS, NATS_PER_TOKEN = "points", "nats/token"


@dataclass(frozen=True)
class Verdict:
    """The champion rule's finding for one candidate against the expert."""

    name: str
    n: int
    cost_delta: float  # mean(candidate - expert) cost per task
    cost_percent: float  # ... as a percentage of the expert's mean cost
    cost_p: float  # one-sided sign-flip p of "cheaper than the expert"
    cost_p_holm: float  # Holm-adjusted across every candidate judged together
    score_delta: float  # mean(candidate - expert) score
    score_low: float  # one-sided (1 - alpha) bootstrap lower bound of score_delta
    cheaper: bool
    non_inferior: bool
    champion: bool
    family: int  # candidates judged together (the Holm family)
    margin: float
    alpha: float
    score_unit: str = POINTS  # the unit of score_delta, score_low and margin: POINTS or NATS_PER_TOKEN
    reference: str = "the expert"  # what the candidate was judged against, as the reason names it

    @property
    def eligible(self) -> bool:
        return self.cheaper and self.non_inferior

    @property
    def reason(self) -> str:
        """One sentence a user can check against the numbers."""
        cost = (f"cost {self.cost_percent:+.1f}% vs {self.reference} (one-sided p={self.cost_p:.3g}, Holm-adjusted "
                f"over {self.family} finalist{'s' if self.family != 1 else ''}: {self.cost_p_holm:.3g})")
        if self.score_unit == NATS_PER_TOKEN:
            score = (f"log-likelihood {self.score_delta:+.4f} nats/token, lower bound {self.score_low:+.4f} "
                     f"vs margin -{self.margin:.4f}")
        else:
            score = (f"score {100 * self.score_delta:+.1f} points, lower bound {100 * self.score_low:+.1f} "
                     f"vs margin -{100 * self.margin:.1f}")
        if not self.cheaper:
            return f"not significantly cheaper than {self.reference}: {cost}; {score}"
        if not self.non_inferior:
            return f"score may be worse than {self.reference}'s by more than the margin: {score}; {cost}"
        return f"cheaper than {self.reference}, score non-inferior: {cost}; {score}"

    def as_dict(self) -> dict[str, Any]:
        return {"n": self.n, "cost_delta": self.cost_delta, "cost_percent": self.cost_percent,
                "cost_p": self.cost_p, "cost_p_holm": self.cost_p_holm, "score_delta": self.score_delta,
                "score_low": self.score_low, "cheaper": self.cheaper, "non_inferior": self.non_inferior,
                "champion": self.champion, "family": self.family, "margin": self.margin, "alpha": self.alpha,
                "score_unit": self.score_unit}


ScoreCost = tuple[float, float]


def champion_rule(candidates: Mapping[str, Sequence[ScoreCost]], expert: Sequence[ScoreCost],
                  margin: float = DEFAULT_MARGIN, alpha: float = 0.05, resamples: int = 2000,
                  permutations: int = 10000, seed: int = 0, score_unit: str = POINTS,
                  reference: str = "the expert") -> dict[str, Verdict]:
    """Judge every candidate against the expert on the same tasks, in the same order.

    Cost: a one-sided paired sign-flip test that the candidate is cheaper, Holm-Bonferroni
    adjusted over all candidates judged together. Score: non-inferiority, the one-sided
    (1 - alpha) bootstrap lower bound of the mean score difference must lie above -margin.
    A candidate passing both is eligible; the eligible one with the lowest mean cost (then the
    highest mean score, then the earlier name by `name_order`) is the champion. At most one
    verdict has champion=True. `score_unit` names the scores' unit (POINTS: 0..1 scores; NATS_PER_TOKEN:
    likelihood changes), which `margin` shares and the verdicts' reasons print; `reference` names what
    `expert` holds in those reasons (a refining proxy also judges candidates against its live policy).
    """
    if margin < 0:
        raise ValueError(f"margin must be >= 0, got {margin}")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha}")
    ref_score, ref_cost = _columns(expert)
    found: dict[str, dict[str, Any]] = {}
    for name, rows in candidates.items():
        score, cost = _columns(rows)
        if score.shape != ref_score.shape:
            raise ValueError(f"{name}: {score.size} tasks against the expert's {ref_score.size}; "
                             "the rule compares the same tasks")
        cost_d, score_d = cost - ref_cost, score - ref_score
        found[name] = {"n": int(cost_d.size), "cost_delta": _mean(cost_d),
                       "cost_percent": 100.0 * _mean(cost_d) / _mean(ref_cost) if _mean(ref_cost) else 0.0,
                       "cost_p": sign_flip_p_value(cost_d, permutations, seed, alternative="less"),
                       "score_delta": _mean(score_d),
                       "score_low": non_inferiority_bound(score_d, alpha, resamples, seed),
                       "mean_cost": _mean(cost), "mean_score": _mean(score)}
    holm = holm_bonferroni({name: f["cost_p"] for name, f in found.items()})
    eligible = []
    for name, f in found.items():
        f["cheaper"] = f["cost_delta"] < 0 and holm[name] < alpha
        f["non_inferior"] = f["score_low"] > -margin
        if f["cheaper"] and f["non_inferior"]:
            eligible.append((f["mean_cost"], -f["mean_score"], name_order(name), name))
    champion = min(eligible)[-1] if eligible else None
    return {name: Verdict(name, f["n"], f["cost_delta"], f["cost_percent"], f["cost_p"], holm[name],
                          f["score_delta"], f["score_low"], f["cheaper"], f["non_inferior"], name == champion,
                          len(found), margin, alpha, score_unit, reference)
            for name, f in found.items()}


def name_order(name: str) -> tuple[int, int, str]:
    """Sort key of a candidate name: policy ids by number, before any other name, which sort as text.

    Evolution names candidates by policy id; compared as text "17" would precede "5", and a
    later identical child would win a tie against its parent. By number the earlier policy wins.
    """
    return (0, int(name), "") if name.isdecimal() else (1, 0, name)


def _columns(rows: Sequence[ScoreCost]) -> tuple[np.ndarray, np.ndarray]:
    data = np.asarray(rows, dtype=float).reshape(-1, 2)
    return data[:, 0], data[:, 1]


def _mean(values: np.ndarray) -> float:
    return float(values.mean()) if values.size else 0.0
