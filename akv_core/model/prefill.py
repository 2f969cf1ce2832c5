"""Products of prefill-sized inputs (more than `GEMV_ROWS` rows), and the path that picks their kernel for
the CPU the process runs on.

Three paths, one per kind of unit a CPU may have (asked of torch at run time, never decided at install):

* `bf16`: the inputs rounded to bf16, a bf16 copy of the weight packed once at load into oneDNN's
  blocked layout (AVX512-BF16's `vdpbf16ps` or AMX tiles; sums in fp32, outputs rounded to bf16).
  Memory: 2 bytes per weight, whatever the weights are stored in.
* `int8`: each input row quantized to int8 with its own scale (absmax / 127), the weight int8 with one
  scale per output channel, `torch._int_mm` (oneDNN, VNNI's `vpdpbusd` or AMX-INT8; exact int32 sums).
  Memory: 1 byte per weight (an int8 layer's own values; others quantized once at load).
* `float32`: fp32 inputs and sums; float32 weights on a packed fp32 copy (`OneDnnWeights`, 4 bytes per
  weight) where oneDNN runs, fp16 weights on fbgemm's kernel as stored, int8 / int4 weights dequantized
  once, at load, into such a packed copy (none with `AKV_ONEDNN=off`: dequantized per call).

`auto` (the default) is float32 for float32 weights, the exact reference; for the reduced precisions it
is bf16 where the CPU multiplies bf16 natively, else float32. int8 runs only when forced: quantizing each
activation row to int8 misses the accuracy bounds on SmolLM2 (KL 0.08 nats per prompt token against
float32, 89% greedy agreement; bf16 0.0007 and 100%: docs/engine-model.md, "Prefill paths").
`AKV_PREFILL` forces a path for every precision. A forced bf16 on a CPU without native bf16 runs (torch
emulates bf16 products, several times slower than fp32) and says so in its name; a forced int8 on a CPU
without VNNI or AMX is refused. Decode-sized inputs never come here.

A prompt's causal attention follows the path (`CausalLM.prefill_attention`): bf16 blocks on the bf16 path
(`akv_core.model.prefill_attention`), fp32 flash attention in C on the float32 one
(`akv_core.kernels.cpu_gemv.causal_attention`, where the C kernels run), else torch's SDPA;
`AKV_PREFILL_ATTENTION=sdpa` forces SDPA.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

PREFILL_SWITCH = "AKV_PREFILL"
PREFILL_CHOICES = ("auto", "bf16", "int8", "float32")
# "off": prefill products stay on torch's own GEMMs (F.linear) instead of oneDNN's packed ones.
ONEDNN_SWITCH = "AKV_ONEDNN"
# "sdpa": a prompt's causal attention on torch's SDPA on every path, instead of the path's own blockwise kernel
# (bf16 blocks on the bf16 path, `cpu_gemv`'s fp32 flash attention on the float32 one).
ATTENTION_SWITCH = "AKV_PREFILL_ATTENTION"
ATTENTION_CHOICES = ("auto", "sdpa")
# The row count oneDNN lays a packed weight out for (a prefill chunk's; any count runs on it).
ONEDNN_ROWS_HINT = 512


@functools.lru_cache(maxsize=1)
def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX). Without it bf16 matmuls are
    emulated and run several times slower than fp32 ones (6.5x on a 512-token prefill of an AVX2 EPYC)."""
    return _has("_is_avx512_bf16_supported") or _has("_is_amx_tile_supported")


@functools.lru_cache(maxsize=1)
def native_int8() -> bool:
    """Whether this CPU multiplies int8 pairs into int32 sums in hardware (AVX512-VNNI or AMX-INT8)."""
    return _has("_is_vnni_supported") or _has("_is_amx_tile_supported")


def _has(probe: str) -> bool:
    """A `torch.cpu` capability probe, False where this torch lacks it."""
    return bool(getattr(torch.cpu, probe, lambda: False)())


def quantize_int8_rows(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 per output row: (q int8 [N, K] in -127..127, scale fp32 [N])."""
    weight = weight.float()
    scale = weight.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    q = torch.round(weight / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


@dataclass(frozen=True)
class PrefillPath:
    """The kernel family of a model's prefill products and the unit that runs it."""

    kind: str   # one of "bf16", "int8", "float32"; "device" on a GPU
    unit: str   # "AVX512-BF16", "AMX", "AVX512-VNNI", "oneDNN", "emulated: ...", ...

    def __str__(self) -> str:
        return f"{self.kind} ({self.unit})"


def attention_switch() -> str:
    """`AKV_PREFILL_ATTENTION` ("auto" when unset); a ValueError naming it and its choices for another value."""
    value = os.environ.get(ATTENTION_SWITCH, "auto").strip().lower() or "auto"
    if value not in ATTENTION_CHOICES:
        raise ValueError(f"{ATTENTION_SWITCH}: expected one of {', '.join(ATTENTION_CHOICES)}, got "
                         f"{os.environ[ATTENTION_SWITCH]!r}")
    return value


def prefill_path(precision: str, device: torch.device | str = "cpu", bf16: bool | None = None) -> PrefillPath:
    """The path for weights of `precision` on `device`: `AKV_PREFILL` if set, else `auto` (module docstring).
    `bf16`: whether the CPU multiplies bf16 natively (default: `native_bf16()`). A ValueError naming the
    variable and its choices for an unknown value or an int8 this CPU lacks."""
    bf16 = native_bf16() if bf16 is None else bf16
    value = os.environ.get(PREFILL_SWITCH, "auto").strip().lower() or "auto"
    if value not in PREFILL_CHOICES:
        raise ValueError(f"{PREFILL_SWITCH}: expected one of {', '.join(PREFILL_CHOICES)}, got "
                         f"{os.environ[PREFILL_SWITCH]!r}")
    if torch.device(device).type != "cpu":
        return PrefillPath("device", f"{torch.device(device).type}: the weights' own kernels")
    if value == "auto":   # int8 only when forced: its per-row activations miss the accuracy bounds
        value = "bf16" if precision != "float32" and bf16 else "float32"
    if value == "bf16":
        unit = "AMX" if _has("_is_amx_tile_supported") else "AVX512-BF16"
        return PrefillPath("bf16", unit if bf16 else "emulated: this CPU has no AVX512-BF16 or AMX")
    if value == "int8":
        if not native_int8() or not hasattr(torch, "_int_mm"):
            raise ValueError(f"{PREFILL_SWITCH}=int8: this CPU has no AVX512-VNNI or AMX for int8 products (or "
                             f"torch {torch.__version__} lacks torch._int_mm); expected one of auto, bf16, float32")
        return PrefillPath("int8", "AMX" if _has("_is_amx_tile_supported") else "AVX512-VNNI")
    if precision in ("fp16", "mixed"):
        return PrefillPath("float32", "fbgemm, fp16 weights")
    if precision in ("int8", "int4"):
        return PrefillPath("float32", "dequantized into a packed fp32 copy, oneDNN" if onednn_on()
                           else "weights dequantized per call, torch's GEMM")
    return PrefillPath("float32", "oneDNN" if onednn_on() else "torch's GEMM")


class PrefillProduct(Protocol):
    """y = x W^T (+ b) for prefill-sized x; bf16 out when `out_dtype` asks and it is free, else fp32."""

    def __call__(self, x: Tensor, out_dtype: torch.dtype | None = None) -> Tensor: ...


class Bf16Weights:
    """A bf16 copy of a weight (2 bytes per weight), packed for oneDNN where it runs, else plain for torch's
    bf16 GEMM. Inputs are rounded to bf16; the sums run in fp32 and each output is rounded to bf16 once.
    With `scale` (one per output channel) the weight is `weight * scale`: int8 values are exact in bf16, so
    an int8 layer's weights are multiplied as held and only the outputs are scaled (in fp32)."""

    bf16 = True   # whether the inputs are rounded to bf16 (each prefill product says)

    def __init__(self, weight: Tensor, bias: Tensor | None = None, scale: Tensor | None = None) -> None:
        self.bias = None if bias is None else bias.float()
        self.scale = None if scale is None else scale.float()
        plain = weight.to(torch.bfloat16).contiguous()
        packed = _onednn_layout(plain)
        self.packed = packed is not None
        self.weight = plain if packed is None else packed

    def __call__(self, x: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
        x = x.to(torch.bfloat16).contiguous()
        if self.packed:
            y = torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")
        else:
            y = F.linear(x, self.weight)
        if self.scale is not None:
            y = y.float().mul_(self.scale)
        if self.bias is not None:
            return y.float().add_(self.bias)
        return y if out_dtype == torch.bfloat16 else y.float()


class Int8Weights:
    """int8 weights with one fp32 scale per output channel (1 byte per weight), multiplied by the input
    quantized per row (its own absmax / 127) in `torch._int_mm`: exact int32 sums, scaled back in fp32."""

    bf16 = False

    def __init__(self, q: Tensor, scale: Tensor, bias: Tensor | None = None) -> None:
        if q.dtype != torch.int8 or scale.shape != (q.shape[0],):
            raise ValueError(f"Int8Weights: q int8 [N, K] and a scale [N], got {q.dtype} {tuple(q.shape)}, "
                             f"{tuple(scale.shape)}")
        self.q, self.scale = q.contiguous(), scale.float().contiguous()
        self.bias = None if bias is None else bias.float()

    @classmethod
    def quantize(cls, weight: Tensor, bias: Tensor | None = None) -> Int8Weights:
        """Symmetric int8 per output channel (`quantize_int8_rows`)."""
        return cls(*quantize_int8_rows(weight), bias)

    def __call__(self, x: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
        x = x.float()
        step = x.abs().amax(dim=1, keepdim=True).clamp_min_(1e-30).div_(127.0)
        xq = torch.round(x / step).to(torch.int8)
        y = torch._int_mm(xq, self.q.t()).float().mul_(step).mul_(self.scale)
        return y if self.bias is None else y.add_(self.bias)


class OneDnnWeights:
    """A float32 weight packed once into oneDNN's blocked layout, for prefill-sized products.

    Still float32 throughout (only the order of the sums differs from torch's F.linear, whose fp32
    GEMM on x86 is MKL's). Measured on a 2-core AVX-512 EPYC: prefill 1.09-1.18x faster, docs/benchmarks.md
    "oneDNN prefill"; the cost is a second copy of the weight (4 bytes per weight: the decode kernels read
    the weight as loaded)."""

    bf16 = False

    def __init__(self, packed: Tensor, bias: Tensor | None) -> None:
        self.packed = packed
        self.bias = bias

    @classmethod
    def pack(cls, weight: Tensor, bias: Tensor | None) -> OneDnnWeights | None:
        """The packed weight, or None where oneDNN's fp32 product is not to be had (not a contiguous fp32
        CPU weight, a torch without oneDNN or its linear ops, or `AKV_ONEDNN=off`)."""
        packed = _onednn_layout(weight) if weight.dtype == torch.float32 else None
        return None if packed is None else cls(packed, bias)

    def __call__(self, x: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.float().contiguous(), self.packed, self.bias, "none", [], "")


def _onednn_layout(weight: Tensor) -> Tensor | None:
    """`weight` in oneDNN's blocked layout for prefill-sized products; None where oneDNN is off, the weight
    is not a contiguous CPU tensor, or this oneDNN build cannot lay out its shape (torch's GEMM stays)."""
    if weight.device.type != "cpu" or not weight.is_contiguous() or not onednn_on():
        return None
    if weight.dtype == torch.bfloat16 and not onednn_bf16_ops():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_ROWS_HINT)
    except RuntimeError:
        return None


def onednn_on() -> bool:
    """Whether prefill products run on oneDNN: its linear ops work here and `AKV_ONEDNN` is not "off"."""
    return os.environ.get(ONEDNN_SWITCH, "on") != "off" and onednn_linear_ops()


@functools.lru_cache(maxsize=1)
def onednn_linear_ops() -> bool:
    """Whether this torch carries oneDNN with its packed-linear ops (x86 builds do) and they agree with F.linear
    on a small fp32 product (checked once: a build whose ops misbehave is not used)."""
    ops = torch.ops.mkldnn
    if not (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise")):
        return False
    return _agrees(torch.float32, 1e-4)


@functools.lru_cache(maxsize=1)
def onednn_bf16_ops() -> bool:
    """Whether oneDNN's packed-linear ops also agree with F.linear on a small bf16 product (a CPU without native
    bf16, or a oneDNN held to an older instruction set, may lack them: bf16 weights then stay plain)."""
    return onednn_linear_ops() and _agrees(torch.bfloat16, 2e-2)


def _agrees(dtype: torch.dtype, tolerance: float) -> bool:
    ops = torch.ops.mkldnn
    try:
        generator = torch.Generator().manual_seed(0)
        x, w = (t.to(dtype) for t in (torch.randn(32, 64, generator=generator), torch.randn(24, 64, generator=generator)))
        y = ops._linear_pointwise(x, ops._reorder_linear_weight(w, 32), None, "none", [], "")
        return bool(torch.allclose(y.float(), F.linear(x, w).float(), rtol=tolerance, atol=tolerance))
    except RuntimeError:
        return False


def low_precision_weights(path: PrefillPath, weight: Tensor, bias: Tensor | None = None) -> PrefillProduct | None:
    """The bf16 or int8 prefill weights of a dense `weight` on `path`; None on the float32 path (the caller's
    own fp32 product runs) and on a GPU."""
    if path.kind == "bf16":
        return Bf16Weights(weight, bias)
    if path.kind == "int8":
        return Int8Weights.quantize(weight, bias)
    return None
