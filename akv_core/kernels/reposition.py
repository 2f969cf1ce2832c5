"""Repos on the KV pool: re-rotate kept keys from their old to their new positions, values untouched.

The math is `Rope.rerotate`'s: un-rotate with the old angle, rotate with the new one, in fp32,
rotary dims only, rows whose position does not change copied bit for bit. Results go through a
scratch buffer and are scattered afterwards, so source and destination slots may overlap (an
in-place compaction of a sequence).
"""
from __future__ import annotations

import torch
from torch import Tensor

from akv_core.kernels import triton_usable
from akv_core.model.kv_buffers import KVBuffers
from akv_core.model.rope import Rope

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU engine does not need Triton
    triton = None


def reposition(kv: KVBuffers, rope: Rope, src: Tensor, dst: Tensor, old_positions: Tensor,
               new_positions: Tensor) -> None:
    """Move the K/V of slots `src` to slots `dst` in every layer, keys re-rotated old -> new position."""
    src, dst = src.to(kv.device, torch.long), dst.to(kv.device, torch.long)
    old_positions, new_positions = old_positions.to(kv.device), new_positions.to(kv.device)
    if not (src.numel() == dst.numel() == old_positions.numel() == new_positions.numel()):
        raise ValueError("reposition needs src, dst, old_positions and new_positions of equal length")
    for layer in range(kv.num_layers):
        keys = rerotate_slots(kv.k[layer], rope, src, old_positions, new_positions)
        values = kv.v[layer].index_select(0, src)
        kv.k[layer].index_copy_(0, dst, keys)
        kv.v[layer].index_copy_(0, dst, values)


def rerotate_slots(keys: Tensor, rope: Rope, src: Tensor, old_positions: Tensor, new_positions: Tensor) -> Tensor:
    """The keys of slots `src` of one layer's buffer [S, Hkv, D], moved old -> new: [n, Hkv, D]."""
    if src.numel() == 0:
        return keys[:0].clone()
    if triton is not None and triton_usable(keys):
        return _rerotate_triton(keys, rope, src, old_positions, new_positions)
    return rope.rerotate(keys.index_select(0, src), old_positions, new_positions)


def _rerotate_triton(keys: Tensor, rope: Rope, src: Tensor, old: Tensor, new: Tensor) -> Tensor:
    n, heads, dim = src.numel(), keys.shape[1], keys.shape[2]
    out = torch.empty((n, heads, dim), dtype=keys.dtype, device=keys.device)
    half = rope.rotary_dim // 2
    _rerotate_kernel[(n, heads)](
        keys, out, src, old.to(torch.int64), new.to(torch.int64), rope.inv_freq.to(keys.device, torch.float32),
        keys.stride(0), keys.stride(1), out.stride(0), out.stride(1),
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half), PASS=dim - 2 * half,
        BLOCK_PASS=triton.next_power_of_2(max(dim - 2 * half, 1)))
    return out


if triton is not None:
    @triton.jit
    def _rerotate_kernel(keys, out, src, old, new, inv_freq, k_row, k_head, o_row, o_head,
                         HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, PASS: tl.constexpr,
                         BLOCK_PASS: tl.constexpr):
        row = tl.program_id(0)
        head = tl.program_id(1)
        slot = tl.load(src + row)
        p_old = tl.load(old + row)
        p_new = tl.load(new + row)
        d = tl.arange(0, BLOCK_HALF)
        live = d < HALF
        base = keys + slot * k_row + head * k_head
        x1 = tl.load(base + d, mask=live, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF + d, mask=live, other=0.0).to(tl.float32)
        freq = tl.load(inv_freq + d, mask=live, other=0.0)
        a_old = p_old.to(tl.float32) * freq
        a_new = p_new.to(tl.float32) * freq
        c_old, s_old = tl.cos(a_old), tl.sin(a_old)
        c_new, s_new = tl.cos(a_new), tl.sin(a_new)
        # Un-rotate with the old angle, then rotate with the new one (never one delta rotation).
        y1 = x1 * c_old + x2 * s_old
        y2 = x2 * c_old - x1 * s_old
        z1 = y1 * c_new - y2 * s_new
        z2 = y2 * c_new + y1 * s_new
        same = p_old == p_new
        z1 = tl.where(same, x1, z1)
        z2 = tl.where(same, x2, z2)
        target = out + row * o_row + head * o_head
        tl.store(target + d, z1.to(out.dtype.element_ty), mask=live)
        tl.store(target + HALF + d, z2.to(out.dtype.element_ty), mask=live)
        if PASS > 0:  # dims past the rotary ones are copied untouched
            e = tl.arange(0, BLOCK_PASS)
            rest = e < PASS
            tl.store(target + 2 * HALF + e, tl.load(base + 2 * HALF + e, mask=rest), mask=rest)
