"""The KV pool's tensors: one key and one value tensor per layer, addressed by slot.

Only storage lives here. Which slot belongs to whom (free list, ref counts)
is bookkeeping in `akv_core.cache`, which never imports torch.
Keys are stored after RoPE, rotated at the position they were written with;
a reposition re-rotates them in place (see `Rope.rerotate`).
"""
from __future__ import annotations

import torch
from torch import Tensor


class KVBuffers:
    """Per-layer K and V tensors of shape [num_slots, num_kv_heads, head_dim]."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be at least 1, got {num_slots}")
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_slots, num_kv_heads, head_dim)
        self.k: list[Tensor] = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v: list[Tensor] = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def copy_slots(self, src: Tensor, dst: Tensor) -> None:
        """Copy K and V of slots `src` into slots `dst` in every layer (src is read before dst is written)."""
        src = torch.as_tensor(src, dtype=torch.long, device=self.device)
        dst = torch.as_tensor(dst, dtype=torch.long, device=self.device)
        if src.shape != dst.shape:
            raise ValueError(f"copy_slots needs src and dst of equal length, got {src.numel()} and {dst.numel()}")
        for layer in range(self.num_layers):
            self.k[layer][dst] = self.k[layer][src]
            self.v[layer][dst] = self.v[layer][src]

    def nbytes(self) -> int:
        """Memory held by all K and V tensors."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
