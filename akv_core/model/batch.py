"""What one forward pass computes: new tokens, where their KV goes, and what each sequence may see.

The engine builds a `ForwardBatch` from its plan; the model only follows it.
Several sequences share one batch (continuous batching); each names the pool
slots its queries attend to, so drops (slots left out) and restores with
segment visibility (an explicit mask) are the same mechanism.
"""
from __future__ import annotations

from collections.abc import Callable
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


@dataclass(frozen=True)
class MassProbe:
    """The batch's sequences whose last row's attention weights are wanted (a reply token's query), and where each
    goes: report(sequence index, its visible slots, the weight that row put on each, summed over layers and heads).
    The C decode kernels add the weights up as they attend; other passes compute that one row's softmax again
    beside the attention (`Llama._add_last_row_weights`)."""

    seqs: frozenset[int]
    report: Callable[[int, Tensor, Tensor], None]
