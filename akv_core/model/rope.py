"""Rotary position embeddings, and moving stored keys to new positions (Repos).

Keys live in the KV pool already rotated at the position they were written
with. A reposition re-rotates them: un-rotate with the old angle, then rotate
with the new one, in fp32. Two separate rotations rather than one delta
rotation, so a key moved from its birth position lands on exactly the value
`apply` would have produced there up to fp32 rounding; rows whose position does
not change are copied bit for bit. Only the first `rotary_dim` dims of a head
rotate (partial rotary models); the rest pass through untouched.

Angles follow transformers: `pos * inv_freq` in fp32, halves layout
(rotate_half), cos/sin scaled by the yarn attention factor where one applies.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from akv_core.model.config import ModelConfig, RopeScaling


def inverse_frequencies(theta: float, rotary_dim: int, scaling: RopeScaling,
                        context_length: int) -> tuple[Tensor, float]:
    """`inv_freq` [rotary_dim/2] and the cos/sin scale for a scaling rule."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling.kind == "default":
        return inv_freq, 1.0
    if scaling.kind == "linear":
        return inv_freq / scaling.factor, 1.0
    if scaling.kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if scaling.kind == "yarn":
        return _yarn(theta, rotary_dim, scaling, context_length)
    raise ValueError(f"rope scaling {scaling.kind!r} is not supported (expected default, linear, llama3 or yarn)")


def _llama3(inv_freq: Tensor, s: RopeScaling) -> Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth blend between."""
    old_context = s.original_context_length or 8192
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / s.low_freq_factor, inv_freq / s.factor, inv_freq)
    smooth = (old_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < old_context / s.high_freq_factor) * ~(wavelen > old_context / s.low_freq_factor)
    return torch.where(medium, blended, scaled)


def _yarn(theta: float, dim: int, s: RopeScaling, context_length: int) -> tuple[Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, scale attention by `attention_factor`."""
    original = s.original_context_length or context_length
    factor = s.factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s.attention_factor
    if attention is None:
        attention = mscale(factor, s.mscale) / mscale(factor, s.mscale_all_dim) \
            if s.mscale and s.mscale_all_dim else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the ramp needs a non-empty interval
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolate = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention)


class Rope:
    """RoPE of one model: angles for positions, applied to [n, heads, head_dim] tensors."""

    def __init__(self, config: ModelConfig, device: str | torch.device = "cpu") -> None:
        self.rotary_dim = config.rotary_dim
        self.head_dim = config.head_dim
        inv_freq, self.attention_scaling = inverse_frequencies(
            config.rope_theta, config.rotary_dim, config.rope_scaling, config.context_length)
        self.inv_freq = inv_freq.to(device)
        # A table for the usual positions; computed exactly as on the fly, so both agree bit for bit.
        cos, sin = self._angles(torch.arange(config.context_length, device=device), self.attention_scaling)
        self._cos_table, self._sin_table = cos, sin

    def _angles(self, positions: Tensor, scale: float) -> tuple[Tensor, Tensor]:
        """cos and signed sin [n, rotary_dim]: the sin of the first half negated, so that a rotation
        is `x * cos + roll(x, half) * signed_sin` (the rotate-half rule in three kernels, not five)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and signed sin [n, 1, rotary_dim] for `positions` [n], including the attention scale."""
        if positions.numel() and int(positions.max()) < self._cos_table.shape[0] and int(positions.min()) >= 0:
            return self._cos_table[positions][:, None, :], self._sin_table[positions][:, None, :]
        cos, sin = self._angles(positions, self.attention_scaling)
        return cos[:, None, :], sin[:, None, :]

    def rotate(self, x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
        """x [n, heads, head_dim] rotated by precomputed angles (rotary dims only)."""
        half = self.rotary_dim // 2
        if self.rotary_dim == self.head_dim:
            return (x * cos).add_(x.roll(half, dims=-1).mul_(signed_sin))
        rot, rest = x[..., :self.rotary_dim], x[..., self.rotary_dim:]
        return torch.cat(((rot * cos).add_(rot.roll(half, dims=-1).mul_(signed_sin)), rest), dim=-1)

    def apply(self, x: Tensor, positions: Tensor) -> Tensor:
        """Rotate x [n, heads, head_dim] to `positions` [n]."""
        cos, sin = self.cos_sin(positions)
        return self.rotate(x.float(), cos, sin).to(x.dtype)

    def unapply(self, x: Tensor, positions: Tensor) -> Tensor:
        """Undo `apply`: rotate back by the angle of `positions` (and divide out the attention scale)."""
        cos, sin = self._angles(positions, 1.0 / self.attention_scaling if self.attention_scaling != 1.0 else 1.0)
        return self.rotate(x.float(), cos[:, None, :], -sin[:, None, :]).to(x.dtype)

    def rerotate(self, keys: Tensor, old_positions: Tensor, new_positions: Tensor) -> Tensor:
        """Keys [n, kv_heads, head_dim] stored at `old_positions`, moved to `new_positions`.

        Un-rotate with the old angle, rotate with the new one (fp32). The attention
        scale is a common factor of both and stays in the key as it was.
        """
        old_positions = old_positions.to(keys.device)
        new_positions = new_positions.to(keys.device)
        x = keys.float()
        cos_old, sin_old = self._angles(old_positions, 1.0)
        cos_new, sin_new = self._angles(new_positions, 1.0)
        x = self.rotate(x, cos_old[:, None, :], -sin_old[:, None, :])
        x = self.rotate(x, cos_new[:, None, :], sin_new[:, None, :]).to(keys.dtype)
        unchanged = (old_positions == new_positions)[:, None, None]
        return torch.where(unchanged, keys, x)
