"""Quantized projection weights for the CPU: int8 per output row, int4 in groups of 32 along a row.

What is stored:

* `Int8Linear`: q int8 [N, K] and a fp32 scale per row, weight = scale[n] * q[n, k] (symmetric,
  re-quantized at load from the dequantized weight).
* `Int4Linear`: `Int4Groups`, q in 0..15 and a fp32 scale and offset per group of 32 weights of a
  row, weight = scale * q + offset: llama.cpp's Q4_1 layout, so a Q4_0 / Q4_1 GGUF tensor is taken
  as stored (`GGUFFile.int4_groups`), any other weight is quantized at load (min / max per group).

Kernels: decode-sized inputs (<= `GEMV_ROWS` rows) go through torch's weight-only CPU kernels,
`aten::_weight_int8pack_mm` and `aten::_weight_int4pack_mm_for_cpu`, on bf16 activations (their
vectorized path; torch picks the AVX2 or AVX-512 code for the CPU it runs on). Larger inputs
(prefill) use a dense copy of the quantized weight (`linear.PrefillWeights`, as "mixed" does):
on an AVX2 CPU both weight-only kernels run a 512-row product about 2x slower than fp32's GEMM,
and dequantizing per call costs a prefill chunk of 512 tokens about 18%. fbgemm's dynamically
quantized int8 GEMM is faster than any of them, but its 7-bit activations cost SmolLM2 a KL
divergence of ~0.24 per token against float32 (docs/engine-model.md), so it is not used.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from akv_core.kernels import cpu_gemv
from akv_core.model.linear import GEMV_ROWS, PrefillWeights

INT4_GROUP = 32
# The weight-only kernel of each precision, looked up in the running torch (never assumed at install).
KERNELS = {"int8": "_weight_int8pack_mm", "int4": "_weight_int4pack_mm_for_cpu"}


def require_kernel(precision: str) -> None:
    """A ValueError naming the missing operator when this torch lacks `precision`'s CPU kernel."""
    name = KERNELS[precision]
    if not hasattr(torch.ops.aten, name):
        raise ValueError(f"precision {precision!r} needs torch's aten::{name} CPU kernel, which torch "
                         f"{torch.__version__} does not have; use float32, fp16 or mixed")


def quantize_int8_rows(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 per output row: (q int8 [N, K] in -127..127, scale fp32 [N])."""
    weight = weight.float()
    scale = weight.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    q = torch.round(weight / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


class _QuantizedLinear:
    """y = x W^T + b: decode-sized inputs through a weight-only kernel (`_decode`, bf16 in and out),
    larger ones through the dense prefill copy."""

    bias: Tensor | None
    prefill: PrefillWeights

    fused: bool   # decode through `cpu_gemv` (fp32 in and out), chosen at load where this CPU runs it

    def __call__(self, x: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
        """`out_dtype=torch.bfloat16` lets a bf16 product stay bf16 (for a following bf16 product)."""
        out_dtype = out_dtype if self.bias is None else None
        if x.shape[0] > GEMV_ROWS:
            y = self.prefill(x, out_dtype)
        elif self.fused:
            y = self.product(x)
        else:
            y = self._decode(x.to(torch.bfloat16).contiguous())
            y = y if out_dtype == torch.bfloat16 else y.float()
        return y if self.bias is None else y + self.bias

    def _decode(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def product(self, x: Tensor, prologue: cpu_gemv.Prologue = cpu_gemv.PLAIN, out: Tensor | None = None) -> Tensor:
        """The fused kernel (only where `fused`): h(x) times the weight, without the bias, into a new tensor
        or added into `out` (`cpu_gemv.Prologue`: RMSNorm / SwiGLU of the input on the way)."""
        raise NotImplementedError


class Int8Linear(_QuantizedLinear):
    """int8 weights, one scale per output row."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        _require_cpu(weight, "int8")
        self.bias, self.out_features = bias, weight.shape[0]
        q, self.scale = quantize_int8_rows(weight)
        self.fused = cpu_gemv.available() and weight.shape[1] % cpu_gemv.BLOCK == 0
        if self.fused:   # the fused kernel's own layout only (the weights are held once)
            self.kernel = cpu_gemv.pack_q8(q, self.scale)
        else:            # torch's kernel's
            self.q, self.scale_bf16 = q, self.scale.bfloat16()
        self.prefill = PrefillWeights(self.dequantize())

    def _decode(self, x: Tensor) -> Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.q, self.scale_bf16)

    def product(self, x: Tensor, prologue: cpu_gemv.Prologue = cpu_gemv.PLAIN, out: Tensor | None = None) -> Tensor:
        return cpu_gemv.gemv(x, self.kernel, prologue, out)

    def kernel_weights(self) -> cpu_gemv.Weights:
        return self.kernel

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        q = cpu_gemv.unpack_q8(self.kernel) if self.fused else self.q
        return q.to(dtype) * self.scale[:, None].to(dtype)


@dataclass(frozen=True)
class Int4Groups:
    """4-bit weights [N, K] with a scale and an offset per group of `INT4_GROUP` along each row:
    weight = scale * q + offset. `q` holds two values per byte (even k in the low nibble)."""

    nibbles: Tensor   # uint8 [N, K // 2]
    scale: Tensor     # fp32 [N, K // INT4_GROUP]
    offset: Tensor    # fp32 [N, K // INT4_GROUP]

    @staticmethod
    def from_values(q: Tensor, scale: Tensor, offset: Tensor) -> Int4Groups:
        """From q (integers in 0..15) [N, K] and the per-group scale and offset [N, K / 32]."""
        if q.shape[1] % INT4_GROUP or scale.shape != (q.shape[0], q.shape[1] // INT4_GROUP) \
                or offset.shape != scale.shape:
            raise ValueError(f"int4 groups: q {tuple(q.shape)} needs scale and offset of shape "
                             f"({q.shape[0]}, {q.shape[1] // INT4_GROUP}); got {tuple(scale.shape)}, {tuple(offset.shape)}")
        q = q.to(torch.uint8)
        return Int4Groups(q[:, 0::2] | (q[:, 1::2] << 4), scale.float().contiguous(), offset.float().contiguous())

    @staticmethod
    def quantize(weight: Tensor) -> Int4Groups:
        """Asymmetric 4-bit per group (as llama.cpp's Q4_1): the group's minimum and range / 15."""
        n, k = weight.shape
        if k % INT4_GROUP:
            raise ValueError(f"int4 needs rows whose length is a multiple of {INT4_GROUP}, got {k}")
        groups = weight.float().reshape(n, k // INT4_GROUP, INT4_GROUP)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scale = ((high - low) / 15.0).clamp_min(1e-12)
        q = torch.round((groups - low[..., None]) / scale[..., None]).clamp_(0, 15)
        return Int4Groups.from_values(q.reshape(n, k), scale, low)

    @staticmethod
    def cat(parts: list[Int4Groups]) -> Int4Groups:
        """Row-wise concatenation (fused projections such as q/k/v)."""
        return Int4Groups(*(torch.cat([getattr(p, f) for p in parts]) for f in ("nibbles", "scale", "offset")))

    def values(self) -> Tensor:
        """q as integers in 0..15, uint8 [N, K]."""
        return torch.stack((self.nibbles & 15, self.nibbles >> 4), dim=-1).reshape(self.nibbles.shape[0], -1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        n, k = self.nibbles.shape[0], self.nibbles.shape[1] * 2
        q = self.values().reshape(n, k // INT4_GROUP, INT4_GROUP).to(dtype)
        return torch.addcmul(self.offset[..., None].to(dtype), q, self.scale[..., None].to(dtype)).reshape(n, k)


def torch_int4_pack(groups: Int4Groups) -> tuple[Tensor, Tensor]:
    """The weight and scales as torch's `_weight_int4pack_mm_for_cpu` takes them: it computes (q - 8) * scale
    + zero, with bf16 scales and zeros [K / 32, N, 2]."""
    zero = groups.offset + 8.0 * groups.scale
    scale_zeros = torch.stack((groups.scale, zero), dim=-1).transpose(0, 1).contiguous().bfloat16()
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(groups.values().to(torch.int32), 1), scale_zeros


class Int4Linear(_QuantizedLinear):
    """int4 weights in groups of 32."""

    def __init__(self, groups: Int4Groups, bias: Tensor | None = None) -> None:
        _require_cpu(groups.nibbles, "int4")
        self.groups, self.bias, self.out_features = groups, bias, groups.nibbles.shape[0]
        self.fused = cpu_gemv.available()
        if self.fused:  # the fused kernel's own layout; torch's packing is not made
            self.kernel = cpu_gemv.pack_q4(groups.values(), groups.scale, groups.offset)
        else:
            self.packed, self.scale_zeros = torch_int4_pack(groups)
        self.prefill = PrefillWeights(groups.dequantize())

    def _decode(self, x: Tensor) -> Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, INT4_GROUP, self.scale_zeros)

    def product(self, x: Tensor, prologue: cpu_gemv.Prologue = cpu_gemv.PLAIN, out: Tensor | None = None) -> Tensor:
        return cpu_gemv.gemv(x, self.kernel, prologue, out)

    def kernel_weights(self) -> cpu_gemv.Weights:
        return self.kernel


def _require_cpu(tensor: Tensor, precision: str) -> None:
    if tensor.device.type != "cpu":
        raise ValueError(f"precision {precision!r} runs on the CPU only (torch's int8 / int4 CPU kernels); "
                         f"on {tensor.device.type} use float32 or fp16")
