"""Choosing the next token from logits: greedy at temperature 0, else temperature and top-p.

Every accepted value is numerically safe: the logits are shifted so that the largest is 0
before they are divided by the temperature (in float64, where any positive temperature is
nonzero), so a tiny temperature drives the others to -inf (the greedy limit) and never makes
inf - inf = NaN; top-p always keeps the most probable token.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
from torch import Tensor

# OpenAI's ranges, checked by the engine and the server alike.
TEMPERATURE_RANGE = (0.0, 2.0)
TOP_P_RANGE = (0.0, 1.0)
SEED_RANGE = (-2**63, 2**63 - 1)   # a signed 64-bit integer
TOP_LOGPROBS_MAX = 20              # OpenAI's limit on `top_logprobs`


def check_sampling(temperature: float, top_p: float, seed: int | None = None) -> None:
    """Raise ValueError naming the field unless each value is inside OpenAI's range."""
    for field, value, (low, high) in (("temperature", temperature, TEMPERATURE_RANGE),
                                      ("top_p", top_p, TOP_P_RANGE)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) \
                or not low <= value <= high:
            raise ValueError(f"{field}: must be a number from {low:g} to {high:g}, got {value!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                             or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]):
        raise ValueError(f"seed: must be an integer from -2**63 to 2**63 - 1, got {seed!r}")


def generator_for(seed: int | None) -> torch.Generator:
    """The CPU generator a request samples with: seeded, or from the OS's randomness."""
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little")
    return torch.Generator().manual_seed(seed % 2**64)   # torch takes an unsigned 64-bit seed


def sample(logits: Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """One token id from fp32 logits [vocab]; deterministic for a seeded `generator`."""
    if temperature <= 0.0:
        return int(torch.argmax(logits))
    logits = logits.double()   # any positive float temperature is a nonzero float64
    probs = torch.softmax((logits - logits.max()) / temperature, dim=-1)
    if not math.isfinite(float(probs.sum())):   # a NaN anywhere (softmax of inf - inf or of NaN) spreads to it
        raise FloatingPointError("the model's logits are not finite numbers")
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        keep = before < top_p
        keep[0] = True
        return int(order[_draw(torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs)), generator)])
    return _draw(probs, generator)


def _draw(weights: Tensor, generator: torch.Generator | None) -> int:
    """An index drawn with probability proportional to `weights` (float64, non-negative, some positive): one
    uniform number against their running sum. torch.multinomial draws an exponential number per entry,
    about 1.7 ms for a 49K vocabulary on one core, which 8 streams would pay every decode step."""
    cumulative = torch.cumsum(weights, dim=-1)
    u = torch.rand((), dtype=torch.float64, generator=generator) * cumulative[-1]
    return min(int(torch.searchsorted(cumulative, u, right=True)), weights.numel() - 1)


@dataclass(frozen=True)
class TokenLogprob:
    """The sampled token's natural-log probability and the `top` most likely tokens' (id, logprob),
    most likely first: what OpenAI's `logprobs` / `top_logprobs` report for one generated token."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def check_top_logprobs(top_logprobs: int | None) -> None:
    """ValueError naming the field unless `top_logprobs` is None or an integer from 0 to TOP_LOGPROBS_MAX."""
    if top_logprobs is not None and (isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int)
                                     or not 0 <= top_logprobs <= TOP_LOGPROBS_MAX):
        raise ValueError(f"top_logprobs: must be an integer from 0 to {TOP_LOGPROBS_MAX}, got {top_logprobs!r}")


def log_probs(logits: Tensor) -> Tensor:
    """The model's log-distribution over the vocabulary from one fp32 logits row (a new tensor).

    Taken before a grammar masks the row and before temperature and top-p reshape it, as OpenAI
    and vLLM report them: the model's own probabilities, whatever was allowed or drawn.
    """
    return torch.log_softmax(logits.double(), dim=-1)


def token_logprob(log_dist: Tensor, token: int, top: int) -> TokenLogprob:
    """The entry of `token` in `log_dist` (from `log_probs`), with the `top` most likely tokens."""
    best = ()
    if top > 0:
        values, ids = torch.topk(log_dist, min(top, log_dist.numel()))
        best = tuple(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token, float(log_dist[token]), best)
