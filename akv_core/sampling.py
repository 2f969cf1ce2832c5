"""Choosing the next token from logits: greedy at temperature 0, else temperature and top-p."""
from __future__ import annotations

import torch
from torch import Tensor


def sample(logits: Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """One token id from fp32 logits [vocab]; deterministic for a seeded `generator`."""
    if temperature <= 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = torch.where(before < top_p, sorted_probs, torch.zeros_like(sorted_probs))
        choice = torch.multinomial(sorted_probs, 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))
