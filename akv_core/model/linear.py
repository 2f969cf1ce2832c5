"""Dense projection weights (y = x W^T + b) in float32, fp16 or mixed precision, and the CPU facts
that choose between kernels at run time.

Activations stay fp32 whatever the weights are stored in. The quantized precisions (int8, int4)
live in `akv_core.model.quantized` and share the `Projection` call contract defined here.
"""
from __future__ import annotations

import functools
import os
import warnings
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from akv_core.kernels import cpu_gemv
from akv_core.model.precisions import DENSE_PRECISIONS, PRECISIONS  # noqa: F401  (PRECISIONS: re-exported)

# Matmuls with at most this many rows are decode steps (one row per running sequence); larger
# ones are prefill. Reduced precisions pick their kernel by this.
GEMV_ROWS = 16
# "off": float32 prefill products stay on torch's F.linear instead of oneDNN's (`OneDnnWeights`).
ONEDNN_SWITCH = "AKV_ONEDNN"
# The row count oneDNN lays a packed weight out for (a prefill chunk's; any count runs on it).
ONEDNN_ROWS_HINT = 512


class Projection(Protocol):
    """What a transformer block calls: fp32 in, fp32 out (bf16 when `out_dtype` asks and it is free)."""

    out_features: int

    def __call__(self, x: Tensor, out_dtype: torch.dtype | None = None) -> Tensor: ...


@functools.lru_cache(maxsize=1)
def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX). Without it bf16 matmuls are
    emulated and run several times slower than fp32 ones (6.5x on a 512-token prefill of an AVX2 EPYC)."""
    cpu = torch.cpu
    return bool(getattr(cpu, "_is_avx512_bf16_supported", lambda: False)()
                or getattr(cpu, "_is_amx_tile_supported", lambda: False)())


def cpu_summary() -> str:
    """The vector extensions that decide the kernels, as torch sees them (for benchmark headers)."""
    cpu = torch.cpu
    names = {"AVX2": "_is_avx2_supported", "AVX-512": "_is_avx512_supported",
             "AVX512-VNNI": "_is_vnni_supported", "AVX512-BF16": "_is_avx512_bf16_supported",
             "AMX": "_is_amx_tile_supported"}
    present = [name for name, probe in names.items() if getattr(cpu, probe, lambda: False)()]
    return ", ".join(present) or "no AVX2"


class PrefillWeights:
    """A dense copy of a weight for prefill-sized products, in this CPU's fastest dense kernel: bf16 where
    the CPU multiplies bf16 natively (and on GPUs), else fbgemm's fp16 kernel, which runs a 512-row
    product as fast as fp32's GEMM on AVX2 with half the bytes."""

    def __init__(self, weight: Tensor) -> None:
        self.bf16 = weight.device.type != "cpu" or native_bf16()
        self.weight = weight.bfloat16() if self.bf16 else _pack_fp16(weight)

    def __call__(self, x: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
        if not self.bf16:
            return _fp16_linear(x, self.weight)
        y = F.linear(x.to(torch.bfloat16), self.weight)
        return y if out_dtype == torch.bfloat16 else y.float()


class OneDnnWeights:
    """A float32 weight packed once into oneDNN's blocked layout, for prefill-sized products.

    Still float32 throughout (only the order of the sums differs from torch's F.linear, whose fp32
    GEMM on x86 is MKL's). Measured on a 2-core AVX-512 EPYC: prefill 1.09-1.18x faster, docs/benchmarks.md
    "oneDNN prefill"; the cost is a second copy of the weight (the decode kernels read the weight as loaded)."""

    def __init__(self, packed: Tensor, bias: Tensor | None) -> None:
        self.packed = packed
        self.bias = bias

    @classmethod
    def pack(cls, weight: Tensor, bias: Tensor | None) -> OneDnnWeights | None:
        """The packed weight, or None where oneDNN's fp32 product is not to be had (not a contiguous fp32
        CPU weight, a torch without oneDNN or its linear ops, or `AKV_ONEDNN=off`)."""
        if (os.environ.get(ONEDNN_SWITCH, "on") == "off" or weight.device.type != "cpu"
                or weight.dtype != torch.float32 or not weight.is_contiguous() or not _onednn_linear_ops()):
            return None
        try:
            return cls(torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_ROWS_HINT), bias)
        except RuntimeError:   # a oneDNN build that cannot lay out this shape: torch's kernel stays
            return None

    def __call__(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")


@functools.lru_cache(maxsize=1)
def _onednn_linear_ops() -> bool:
    """Whether this torch carries oneDNN with its packed-linear ops (x86 builds do) and they agree with F.linear
    on a small product (checked once: a build whose ops misbehave is not used)."""
    ops = torch.ops.mkldnn
    if not (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise")):
        return False
    try:
        generator = torch.Generator().manual_seed(0)
        x, w = torch.randn(32, 64, generator=generator), torch.randn(24, 64, generator=generator)
        y = ops._linear_pointwise(x, ops._reorder_linear_weight(w, 32), None, "none", [], "")
        return bool(torch.allclose(y, F.linear(x, w), rtol=1e-4, atol=1e-4))
    except RuntimeError:
        return False


class Linear:
    """Dense weights. "float32" multiplies the fp32 weight as loaded (exact: the weights are not rounded;
    prefill products on oneDNN's packed fp32 copy where it runs, decode steps on cpu_gemv's kernels).
    "fp16" stores it in fp16 and uses fbgemm's fp16-weight / fp32-activation kernel: half the bytes of a
    memory-bound decode step, a tuned kernel, logits within a few hundredths of fp32. "mixed" adds a bf16
    copy for prefill-sized inputs where the CPU multiplies bf16 natively (faster than fp32 there, at a
    coarser rounding: logits within ~0.5); on other CPUs it is the same as "fp16", whose kernel prefills
    as fast as fp32's.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None = None, precision: str = "float32",
                 prefill_rows: bool = True) -> None:
        """`prefill_rows=False`: a projection that never sees prefill-sized inputs (the output projection,
        which only the sampled rows reach): no copy for them."""
        if precision not in DENSE_PRECISIONS:
            raise ValueError(f"precision must be one of {DENSE_PRECISIONS}, got {precision!r}")
        self.bias = bias
        self.out_features = weight.shape[0]
        self.weight = weight if precision == "float32" else None
        # A few rows (a decode step) go through cpu_gemv's dense kernel where it runs: torch's sgemm is much
        # slower on a few rows (docs/benchmarks.md, "Dense float32 decode").
        self.dense_rows = (precision == "float32" and weight.device.type == "cpu" and weight.dtype == torch.float32
                           and weight.is_contiguous() and weight.shape[1] % 8 == 0 and cpu_gemv.available())
        # Joins a decode step fused into one C call (`CausalLM._decode_fused`; the weight as loaded, `cpu_gemv.dense`).
        self.fused = self.dense_rows and weight.shape[1] % cpu_gemv.BLOCK == 0
        self.packed = _pack_fp16(weight) if precision in ("fp16", "mixed") else None
        bf16 = precision == "mixed" and (weight.device.type != "cpu" or native_bf16())
        self.prefill = PrefillWeights(weight) if bf16 else None
        # Prefill-sized float32 products on oneDNN where it runs (faster than torch's GEMM: OneDnnWeights).
        self.onednn = OneDnnWeights.pack(weight, bias) if precision == "float32" and prefill_rows else None

    def __call__(self, x: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
        """`out_dtype=torch.bfloat16` lets a bf16 product stay bf16 (for a following bf16 product)."""
        if self.weight is not None:
            if self.dense_rows and x.dim() == 2 and 1 <= x.shape[0] <= GEMV_ROWS and x.dtype == torch.float32:
                y = cpu_gemv.dense_gemv(x, self.weight)
                return y if self.bias is None else y.add_(self.bias)
            if self.onednn is not None and x.dim() == 2 and x.shape[0] > GEMV_ROWS and x.dtype == torch.float32:
                return self.onednn(x)
            return F.linear(x, self.weight, self.bias)
        if self.prefill is not None and x.shape[0] > GEMV_ROWS:
            y = self.prefill(x, out_dtype if self.bias is None else None)
        else:
            y = _fp16_linear(x, self.packed)
        return y if self.bias is None else y + self.bias

    def kernel_weights(self) -> cpu_gemv.Weights:
        """The float32 weight for the fused decode kernels (only where `fused`)."""
        return cpu_gemv.dense(self.weight)

    def product(self, x: Tensor, prologue: cpu_gemv.Prologue = cpu_gemv.PLAIN, out: Tensor | None = None) -> Tensor:
        """The fused kernel (only where `fused`): h(x) times the weight, without the bias, into a new tensor or
        added into `out` (`cpu_gemv.Prologue`: RMSNorm / SwiGLU of the input on the way)."""
        return cpu_gemv.gemv(x, self.kernel_weights(), prologue, out)


# fbgemm's fp16 ops are marked deprecated but present; `_pack_fp16` falls back when they go away.
warnings.filterwarnings("ignore", message=r"fbgemm_.* is deprecated")


def _pack_fp16(weight: Tensor) -> Tensor:
    """fbgemm's packed fp16 weight where this torch has the kernel (x86 CPU), else a plain fp16 copy."""
    if weight.device.type == "cpu" and hasattr(torch, "fbgemm_linear_fp16_weight_fp32_activation"):
        with warnings.catch_warnings():  # at load time only; the filter above covers the calls
            warnings.simplefilter("ignore")
            return torch.fbgemm_pack_gemm_matrix_fp16(weight.float().contiguous())
    return weight.half()


def _fp16_linear(x: Tensor, packed: Tensor) -> Tensor:
    if packed.dtype == torch.float16:
        return F.linear(x.half(), packed).to(x.dtype)
    return torch.fbgemm_linear_fp16_weight_fp32_activation(x.float().contiguous(), packed, None).to(x.dtype)
