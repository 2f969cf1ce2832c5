"""Quantized projection weights for the CPU: int8 per output row, int4 in groups of 32 along a row.

What is stored:

* `Int8Linear`: q int8 [N, K] and a fp32 scale per row, weight = scale[n] * q[n, k] (symmetric,
  re-quantized at load from the dequantized weight).
* `Int4Linear`: `Int4Groups`, q in 0..15 and a fp32 scale and offset per group of 32 weights of a
  row, weight = scale * q + offset: llama.cpp's Q4_1 layout, so a Q4_0 / Q4_1 GGUF tensor is taken
  as stored (`GGUFFile.int4_groups`), any other weight is quantized at load (min / max per group).

Kernels: decode-sized inputs (<= `GEMV_ROWS` rows) go through the fused kernels of `cpu_gemv` where they
run, else torch's weight-only CPU kernels, `aten::_weight_int8pack_mm` and
`aten::_weight_int4pack_mm_for_cpu`, on bf16 activations. Larger inputs (prefill) take the model's prefill
path (`akv_core.model.prefill`), whose weights are made once at load: on the bf16 path a bf16 copy packed
for oneDNN (2 bytes per weight: for int4, four times its own 4-bit weights); on the int8 path int8 weights
per output channel (1 byte per weight; int8's own values, int4's re-quantized); on the float32 path a
packed fp32 copy of the dequantized weights (4 bytes per weight; with `AKV_ONEDNN=off` none, the weights
dequantized on each call for torch's GEMM: `DequantizedFloat32`).
torch's weight-only kernels are not used for prefill: on an AVX-512 EPYC they run a 2,048-row product
at about 100 GFLOPS on one core against 450 for oneDNN's bf16 and 850 for `torch._int_mm`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from akv_core.kernels import cpu_gemv
from akv_core.model.linear import GEMV_ROWS
from akv_core.model.prefill import (Bf16Weights, Int8Weights, OneDnnWeights, PrefillPath, PrefillProduct,
                                    low_precision_weights, onednn_on, prefill_path, quantize_int8_rows)

INT4_GROUP = 32
# The weight-only kernel of each precision, looked up in the running torch (never assumed at install).
KERNELS = {"int8": "_weight_int8pack_mm", "int4": "_weight_int4pack_mm_for_cpu"}


def require_kernel(precision: str) -> None:
    """A ValueError naming the missing operator when this torch lacks `precision`'s CPU kernel."""
    name = KERNELS[precision]
    if not hasattr(torch.ops.aten, name):
        raise ValueError(f"precision {precision!r} needs torch's aten::{name} CPU kernel, which torch "
                         f"{torch.__version__} does not have; use float32, fp16 or mixed")


class _QuantizedLinear:
    """y = x W^T + b: decode-sized inputs through the fused kernel (`product`) or a weight-only kernel
    (`_decode`, bf16 in and out), larger ones through the prefill path's weights (`prefill`)."""

    bias: Tensor | None
    prefill: PrefillProduct
    prefill_path: PrefillPath

    fused: bool   # decode through `cpu_gemv` (fp32 in and out), chosen at load where this CPU runs it

    def __call__(self, x: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
        """`out_dtype=torch.bfloat16` lets a bf16 product stay bf16 (for a following bf16 product)."""
        if x.shape[0] > GEMV_ROWS:
            return self.prefill(x, out_dtype)
        out_dtype = out_dtype if self.bias is None else None
        if self.fused:
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
        self.prefill_path = prefill_path("int8")
        if self.prefill_path.kind == "int8":   # the very values the decode kernels hold
            self.prefill = Int8Weights(q, self.scale, bias)
        elif self.prefill_path.kind == "bf16":   # |q| <= 127 is exact in bf16: the scales stay fp32
            self.prefill = Bf16Weights(q, bias, self.scale)
        else:
            self.prefill = DequantizedFloat32(self.dequantize, bias)

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
        self.prefill_path = prefill_path("int4")
        if self.prefill_path.kind == "float32":
            self.prefill = DequantizedFloat32(groups.dequantize, bias)
        else:
            self.prefill = low_precision_weights(self.prefill_path, groups.dequantize(), bias)

    def _decode(self, x: Tensor) -> Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, INT4_GROUP, self.scale_zeros)

    def product(self, x: Tensor, prologue: cpu_gemv.Prologue = cpu_gemv.PLAIN, out: Tensor | None = None) -> Tensor:
        return cpu_gemv.gemv(x, self.kernel, prologue, out)

    def kernel_weights(self) -> cpu_gemv.Weights:
        return self.kernel


class DequantizedFloat32:
    """The float32 path's product for quantized weights (a CPU without native bf16, or `AKV_PREFILL=float32`).
    Where oneDNN runs, the weights are dequantized once, at load, into a packed fp32 copy (`OneDnnWeights`,
    4 bytes per weight, as the bf16 path's copy is made at load), so a prefill runs the very products of a
    float32 model: dequantizing on every call and letting oneDNN lay the plain weight out each time ran the
    2,048-token prefill 7-8% slower than float32 (AVX2: docs/benchmarks.md, "Prefill paths"). With
    `AKV_ONEDNN=off` no copy is kept: the weights are dequantized on each call for torch's GEMM."""

    bf16 = False

    def __init__(self, dequantize: Callable[[], Tensor], bias: Tensor | None) -> None:
        self.dequantize, self.bias = dequantize, bias
        self.packed = OneDnnWeights.pack(dequantize().contiguous(), bias) if onednn_on() else None

    def __call__(self, x: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
        if self.packed is not None:
            return self.packed(x)
        return F.linear(x.float(), self.dequantize(), self.bias)


def _require_cpu(tensor: Tensor, precision: str) -> None:
    if tensor.device.type != "cpu":
        raise ValueError(f"precision {precision!r} runs on the CPU only (torch's int8 / int4 CPU kernels); "
                         f"on {tensor.device.type} use float32 or fp16")
