"""What one forward pass computes: new tokens, where their KV goes, and what each sequence may see.

The engine builds a `ForwardBatch` from its plan; the model only follows it.
Several sequences share one batch (continuous batching); each names the pool
slots its queries attend to, so drops (slots left out) and restores with
segment visibility (an explicit mask) are the same mechanism.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass
class SeqAttention:
    """One sequence's rows in the batch and the KV it may attend to.

    `kv_slots` lists every pool slot these queries may see, including the slots
    this step writes. With `mask=None` all of `kv_slots` is visible except that
    the new tokens, which are the last `q_len` entries of `kv_slots` in order,
    see each other causally. An explicit `mask` [q_len, K] (True = may attend)
    replaces that rule entirely.
    """

    q_start: int
    q_len: int
    kv_slots: Tensor
    mask: Tensor | None = None


@dataclass
class ForwardBatch:
    """Tokens of one step for all sequences, concatenated in `seqs` order."""

    input_ids: Tensor      # [T]
    positions: Tensor      # [T] RoPE positions
    out_slots: Tensor      # [T] where each new token's K/V is written
    seqs: list[SeqAttention]
    logits_rows: Tensor    # [R] rows whose logits are returned
