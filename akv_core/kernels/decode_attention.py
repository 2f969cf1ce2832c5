"""Decode attention over a list of visible slots: one new query per head, keys gathered by slot.

Dropped slots are simply not in the list, so neither their memory traffic nor their compute is
paid; with 70% of a long history dropped a decode step reads 30% of its KV. The Triton kernel
streams the listed slots in blocks with an online softmax (one program per query head, grouped
query heads share their KV head); the torch fallback gathers and calls SDPA.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from akv_core.kernels import triton_usable

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU engine does not need Triton
    triton = None


def decode_attention(q: Tensor, k_buffer: Tensor, v_buffer: Tensor, slots: Tensor, scale: float) -> Tensor:
    """q [H, D] against K/V buffers [S, Hkv, D] at `slots` [K]: the attention output [H, D]."""
    if slots.numel() == 0:
        raise ValueError("decode_attention needs at least one visible slot")
    if triton is not None and triton_usable(q):
        return _decode_triton(q, k_buffer, v_buffer, slots, scale)
    return decode_attention_reference(q, k_buffer, v_buffer, slots, scale)


def decode_attention_reference(q: Tensor, k_buffer: Tensor, v_buffer: Tensor, slots: Tensor, scale: float) -> Tensor:
    keys = k_buffer.index_select(0, slots).transpose(0, 1)[None]
    values = v_buffer.index_select(0, slots).transpose(0, 1)[None]
    out = F.scaled_dot_product_attention(q[None, :, None, :].to(keys.dtype), keys, values, scale=scale,
                                         enable_gqa=True)
    return out[0, :, 0, :].to(q.dtype)


def _decode_triton(q: Tensor, k_buffer: Tensor, v_buffer: Tensor, slots: Tensor, scale: float) -> Tensor:
    heads, dim = q.shape
    group = heads // k_buffer.shape[1]
    out = torch.empty_like(q, dtype=torch.float32)
    block_k = 64 if slots.numel() >= 64 else triton.next_power_of_2(slots.numel())
    _decode_kernel[(heads,)](
        q.contiguous(), k_buffer, v_buffer, slots.to(torch.int64).contiguous(), out, slots.numel(), float(scale),
        k_buffer.stride(0), k_buffer.stride(1), GROUP=group, DIM=dim, BLOCK_D=triton.next_power_of_2(dim),
        BLOCK_K=block_k)
    return out.to(q.dtype)


if triton is not None:
    @triton.jit
    def _decode_kernel(q, k_buffer, v_buffer, slots, out, num_slots, scale, s_row, s_head,
                       GROUP: tl.constexpr, DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr):
        head = tl.program_id(0)
        kv_head = head // GROUP
        d = tl.arange(0, BLOCK_D)
        d_live = d < DIM
        query = tl.load(q + head * DIM + d, mask=d_live, other=0.0).to(tl.float32)
        best = tl.full((), float("-inf"), tl.float32)
        total = tl.full((), 0.0, tl.float32)
        acc = tl.zeros((BLOCK_D,), tl.float32)
        for start in range(0, num_slots, BLOCK_K):
            k_index = start + tl.arange(0, BLOCK_K)
            k_live = k_index < num_slots
            slot = tl.load(slots + k_index, mask=k_live, other=0)
            offsets = slot[:, None] * s_row + kv_head * s_head + d[None, :]
            both = k_live[:, None] & d_live[None, :]
            keys = tl.load(k_buffer + offsets, mask=both, other=0.0).to(tl.float32)
            scores = tl.sum(keys * query[None, :], axis=1) * scale
            scores = tl.where(k_live, scores, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, axis=0))
            correction = tl.exp(best - new_best)
            weights = tl.exp(scores - new_best)
            values = tl.load(v_buffer + offsets, mask=both, other=0.0).to(tl.float32)
            acc = acc * correction + tl.sum(weights[:, None] * values, axis=0)
            total = total * correction + tl.sum(weights, axis=0)
            best = new_best
        tl.store(out + head * DIM + d, acc / total, mask=d_live)
