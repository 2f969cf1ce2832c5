"""Dense projection weights (y = x W^T + b) in float32, fp16 or mixed precision, and the CPU facts
that choose between kernels at run time.

Activations stay fp32 whatever the weights are stored in, except inside a prefill product on the bf16
or int8 path (`akv_core.model.prefill`). The quantized precisions (int8, int4) live in
`akv_core.model.quantized` and share the `Projection` call contract defined here.
"""
from __future__ import annotations

import warnings
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from akv_core.kernels import cpu_gemv
from akv_core.model.precisions import DENSE_PRECISIONS, PRECISIONS  # noqa: F401  (PRECISIONS: re-exported)
from akv_core.model.prefill import (ONEDNN_ROWS_HINT, ONEDNN_SWITCH, Bf16Weights, OneDnnWeights,  # noqa: F401
                                    PrefillPath, PrefillProduct, low_precision_weights, native_bf16,
                                    onednn_linear_ops as _onednn_linear_ops, prefill_path)

# Matmuls with at most this many rows are decode steps (one row per running sequence); larger
# ones are prefill. Reduced precisions pick their kernel by this.
GEMV_ROWS = 16


class Projection(Protocol):
    """What a transformer block calls: fp32 in, fp32 out (bf16 when `out_dtype` asks and it is free)."""

    out_features: int

    def __call__(self, x: Tensor, out_dtype: torch.dtype | None = None) -> Tensor: ...


def cpu_summary() -> str:
    """The vector extensions that decide the kernels, as torch sees them (for benchmark headers)."""
    cpu = torch.cpu
    names = {"AVX2": "_is_avx2_supported", "AVX-512": "_is_avx512_supported",
             "AVX512-VNNI": "_is_vnni_supported", "AVX512-BF16": "_is_avx512_bf16_supported",
             "AMX": "_is_amx_tile_supported"}
    present = [name for name, probe in names.items() if getattr(cpu, probe, lambda: False)()]
    return ", ".join(present) or "no AVX2"


class Linear:
    """Dense weights. "float32" multiplies the fp32 weight as loaded (exact: the weights are not rounded;
    decode steps on cpu_gemv's kernels). "fp16" stores it in fp16 and decodes on fbgemm's fp16-weight /
    fp32-activation kernel: half the bytes of a memory-bound decode step, logits within a few hundredths
    of fp32. "mixed" is the same weights; it used to differ from "fp16" only by a bf16 prefill copy, which
    every precision now takes where the CPU multiplies bf16 natively.

    Prefill-sized inputs (more than `GEMV_ROWS` rows) go the model's prefill path (`prefill.prefill_path`):
    bf16 or int8 on a copy made here at load (2 or 1 bytes per weight); on the float32 path, float32
    weights on oneDNN's packed fp32 copy where it runs (4 bytes per weight), fp16 weights on fbgemm's
    kernel as stored (no copy).
    """

    def __init__(self, weight: Tensor, bias: Tensor | None = None, precision: str = "float32",
                 prefill_rows: bool = True) -> None:
        """`prefill_rows=False`: a projection that rarely sees prefill-sized inputs (the output projection, which
        only the sampled rows reach, and every row of a teacher-forced scoring pass): no copy made at load; float32
        weights get oneDNN's packed copy on the first input of more than GEMV_ROWS rows (a scoring pass, or that
        many requests sampling in one step; for SmolLM2's output projection 113 MB)."""
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
        self.prefill_path: PrefillPath | None = (prefill_path(precision, weight.device, native_bf16()) if prefill_rows
                                                 else None)
        self.prefill = self._prefill_weights(weight, bias, precision)
        # Prefill-sized float32 products on the float32 path: oneDNN where it runs (faster than torch's GEMM).
        on_float32 = self.prefill_path is not None and self.prefill_path.kind == "float32"
        self.onednn = OneDnnWeights.pack(weight, bias) if precision == "float32" and on_float32 else None
        self._pack_on_demand = precision == "float32" and not prefill_rows

    def _prefill_weights(self, weight: Tensor, bias: Tensor | None, precision: str) -> PrefillProduct | None:
        """The bf16 / int8 copy of the prefill path; on a GPU, mixed's bf16 copy; else None."""
        if self.prefill_path is None:
            return None
        if self.prefill_path.kind == "device":
            return Bf16Weights(weight, bias) if precision == "mixed" else None
        return low_precision_weights(self.prefill_path, weight, bias)

    def __call__(self, x: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
        """`out_dtype=torch.bfloat16` lets a bf16 product stay bf16 (for a following bf16 product)."""
        if x.shape[0] > GEMV_ROWS:
            if self.prefill is not None:
                return self.prefill(x, out_dtype)
            if self._pack_on_demand:
                self._pack_on_demand, self.onednn = False, OneDnnWeights.pack(self.weight, self.bias)
            if self.onednn is not None and x.dim() == 2:
                return self.onednn(x)
        if self.weight is not None:
            if self.dense_rows and x.dim() == 2 and 1 <= x.shape[0] <= GEMV_ROWS and x.dtype == torch.float32:
                y = cpu_gemv.dense_gemv(x, self.weight)
                return y if self.bias is None else y.add_(self.bias)
            return F.linear(x, self.weight, self.bias)
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
