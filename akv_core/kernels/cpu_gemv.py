"""Fused int4 / int8 weight-only products (and fp32 ones) for decode steps on x86 CPUs, built at run time.

`cpu_gemv.c` multiplies a few fp32 rows (decode: one row per running sequence) by 4-bit group
weights (Q4_1) or int8 row weights, quantizing the rows per block of 32 to int8 as llama.cpp
does, so the weights meet them in integer SIMD and are read once for all rows. The weights are
held in the kernel's own layout (`pack_q4`, `pack_q8`: interleaved by groups of 8 output columns,
so that each unpacked register serves 8 columns and up to 4 rows). fp32 weights (`dense`) are read
as loaded, after the same prologues, so that a float32 model's decode step also runs as one call. torch's own
weight-only kernels dequantize every weight to bf16 on CPUs without AVX-512 and run several
times slower (`python benchmarks/engine.py --kernels`).

The kernel is compiled on first use with the C compiler found at run time (`$CC`, `cc`, `gcc` or
`clang`, with `-mavx2 -mfma`, never `-march=native`) into the data folder, keyed by the source,
the flags and the compiler, and loaded with ctypes. It is used only where torch reports AVX2 on
the running CPU (the CPU changes between machines, so nothing is decided at install); without
AVX2, without a compiler, or with `AKV_CPU_GEMV=off`, `available()` is False and the callers keep
torch's kernels.

Each call runs on `default_threads()` threads, torch's thread count, which `akv_core.threads.phase_threads`
sets for the forward pass: one rule for torch's operators and these kernels. The C library keeps a
pool of worker threads (started on first use, grown to the largest count asked for) and splits each
product's output columns and each attention's heads between them; results do not depend on the
thread count. ctypes releases the GIL for the whole call.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from akv_core.home import data_path

SOURCE = Path(__file__).with_name("cpu_gemv.c")
FLAGS = ("-O3", "-mavx2", "-mfma", "-fno-math-errno", "-std=c11", "-shared", "-fPIC", "-pthread")
BLOCK = 32
GROUP = 8   # output columns interleaved together (cpu_gemv.c's header)
SWITCH = "AKV_CPU_GEMV"  # "off": keep torch's kernels


def compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def why_unavailable() -> str | None:
    """None when the kernel can run here, else the reason (for benchmark headers and tests)."""
    if os.environ.get(SWITCH, "").lower() in ("off", "0", "no"):
        return f"{SWITCH}=off"
    if not getattr(torch.cpu, "_is_avx2_supported", lambda: False)():
        return "the CPU has no AVX2"
    if compiler() is None:
        return "no C compiler (cc, gcc or clang) on PATH"
    return _loaded()[1]


def available() -> bool:
    return why_unavailable() is None


def _first_lines(text: str, count: int = 3, width: int = 300) -> str:
    lines = [line.strip()[:width] for line in text.splitlines() if line.strip()]
    return " | ".join(lines[:count]) or "no message"


def _build(cc: str) -> tuple[Path | None, str | None]:
    """The compiled library (built now if missing), or None and why not (the compiler's first lines)."""
    source = SOURCE.read_bytes()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256(source + " ".join(FLAGS).encode() + version.encode()).hexdigest()[:16]
    target = data_path("kernels", f"cpu_gemv-{digest}.so")
    if target.exists():
        return target, None
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # rename: concurrent builds never clash
        built = Path(tmp) / target.name
        result = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(built), "-lm"], capture_output=True, text=True)
        if result.returncode != 0:
            return None, (f"akv_core/kernels/cpu_gemv.c could not be compiled by {cc} (exit {result.returncode}): "
                          + _first_lines(result.stderr or result.stdout))
        built.replace(target)
    return target, None


@functools.lru_cache(maxsize=1)
def _loaded() -> tuple[ctypes.CDLL | None, str | None]:
    """The kernel library, or None and why it is missing."""
    cc = compiler()
    if cc is None:
        return None, "no C compiler (cc, gcc or clang) on PATH"
    try:
        target, reason = _build(cc)
        if target is None:
            return None, reason
        library = ctypes.CDLL(str(target))
    except OSError as error:  # a data folder that cannot be written, or a library that cannot be loaded
        return None, f"akv_core/kernels/cpu_gemv.c could not be built or loaded: {error}"
    i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    prologue = [ptr, i64, i64, ptr, f32, i32, i32]
    library.akv_q4_gemv.argtypes = [*prologue, ptr, ptr, ptr, i64, ptr, i64]
    library.akv_q8_gemv.argtypes = [*prologue, ptr, ptr, i64, ptr, i64]
    library.akv_decode_attention.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, f32, ptr,
                                             i64]
    library.akv_f32_gemv.argtypes = [ptr, i64, i64, ptr, i64, ptr, i64]
    library.akv_f32_product.argtypes = [*prologue, ptr, i64, ptr, i64]
    for function in (library.akv_q4_gemv, library.akv_q8_gemv, library.akv_decode_attention, library.akv_max_rows,
                     library.akv_last_threads, library.akv_f32_gemv, library.akv_f32_product):
        function.restype = ctypes.c_int
    return library, None


def _library() -> ctypes.CDLL | None:
    return _loaded()[0]


def default_threads() -> int:
    """The thread count of the next call: torch's (`akv_core.threads.phase_threads` sets it per forward pass)."""
    return torch.get_num_threads()


def last_threads() -> int:
    """How many threads this Python thread's last kernel call ran on (fewer than asked while another thread's
    call holds the pool)."""
    return _library().akv_last_threads()


def max_rows() -> int:
    return _library().akv_max_rows()


@dataclass(frozen=True)
class Weights:
    """One projection in the kernel's layout (`pack_q4`, `pack_q8`, `dense`; cpu_gemv.c's header): `bits` 4
    (the interleaved nibbles, scale and offset [groups, K / 32, 8]), 8 (interleaved int8, scale [groups * 8],
    no offset) or 32 (the fp32 weight [N, K] as loaded, no scale or offset), for N output columns of K inputs."""

    bits: int
    weight: Tensor
    scale: Tensor | None
    offset: Tensor | None
    n: int
    k: int


def _whole_groups(t: Tensor) -> Tensor:
    """t [N, ...] padded with zero rows to a whole number of groups of 8 columns."""
    pad = -t.shape[0] % GROUP
    return torch.cat((t, t.new_zeros(pad, *t.shape[1:]))) if pad else t


def _check_shapes(n: int, k: int, *named: tuple[str, Tensor, tuple[int, ...]]) -> None:
    if k % BLOCK:
        raise ValueError(f"cpu_gemv: the weights' rows must be a multiple of {BLOCK} long, got {k}")
    for name, tensor, shape in named:
        if tuple(tensor.shape) != shape:
            raise ValueError(f"cpu_gemv: {name} must be {shape} for weights [{n}, {k}], got {tuple(tensor.shape)}")


def pack_q4(values: Tensor, scale: Tensor, offset: Tensor) -> Weights:
    """4-bit weights q [N, K] in 0..15 with scale and offset [N, K / 32] (w = scale * q + offset) in the
    kernel's layout: per group of 8 columns and block of 32, 4 registers whose byte 4c + t holds column c's
    weights 4j + t (low nibble) and 16 + 4j + t (high nibble) of the block; scales likewise per group."""
    n, k = values.shape
    _check_shapes(n, k, ("scale", scale, (n, k // BLOCK)), ("offset", offset, (n, k // BLOCK)))
    v = _whole_groups(values.to(torch.uint8)).reshape(-1, GROUP, k // BLOCK, 2, 4, 4)   # [G, c, b, half, j, t]
    packed = (v[:, :, :, 0] | (v[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4)              # [G, b, j, c, t]

    def grouped(t: Tensor) -> Tensor:                                                    # [G, b, c]
        return _whole_groups(t.float()).reshape(-1, GROUP, k // BLOCK).transpose(1, 2).contiguous()

    return Weights(4, packed.contiguous().reshape(-1, k // 2), grouped(scale), grouped(offset), n, k)


def pack_q8(q: Tensor, scale: Tensor) -> Weights:
    """int8 weights q [N, K] with a scale per column [N] in the kernel's layout: per group of 8 columns and
    block of 32, 8 registers whose byte 4c + t holds column c's weight 4j + t of the block."""
    n, k = q.shape
    _check_shapes(n, k, ("scale", scale, (n,)))
    v = _whole_groups(q.to(torch.int8)).reshape(-1, GROUP, k // BLOCK, 8, 4)              # [G, c, b, j, t]
    return Weights(8, v.permute(0, 2, 3, 1, 4).contiguous().reshape(-1, k), _whole_groups(scale.float()).contiguous(),
                   None, n, k)


def dense(weight: Tensor) -> Weights:
    """An fp32 weight [N, K] as loaded (contiguous, row-major, K a multiple of 32) for the fused products: the
    same prologues as the packed ones, the product in fp32 (each output its row's own chain of FMAs, as
    `dense_gemv`). The weight is referenced, not copied."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(f"cpu_gemv.dense: a contiguous fp32 weight [N, K], got {tuple(weight.shape)} {weight.dtype}")
    n, k = weight.shape
    _check_shapes(n, k)
    return Weights(32, weight, None, None, n, k)


def unpack_q8(weights: Weights) -> Tensor:
    """The int8 weights q [N, K] back from `pack_q8`'s layout."""
    n, k = weights.n, weights.k
    v = weights.weight.reshape(-1, k // BLOCK, 8, GROUP, 4)                                   # [G, b, j, c, t]
    return v.permute(0, 3, 1, 2, 4).reshape(-1, k)[:n].contiguous()


@dataclass(frozen=True)
class Prologue:
    """What happens to the input rows x before the product (fused into their quantization): with `glu`,
    x [M, 2K] is the MLP's gate and up halves and becomes SiLU(gate) * up; with `norm` (fp32 [K]),
    RMSNorm(h) * norm with `eps`."""

    norm: Tensor | None = None
    eps: float = 0.0
    glu: bool = False


PLAIN = Prologue()


def _inputs(x: Tensor, prologue: Prologue) -> tuple[Tensor, int]:
    """x as contiguous fp32 and the product's K, checked."""
    x = x.float().contiguous()
    k = x.shape[-1] // 2 if prologue.glu else x.shape[-1]
    if x.dim() != 2 or k % BLOCK or not 0 <= x.shape[0] <= max_rows() or (prologue.glu and x.shape[1] != 2 * k):
        raise ValueError(f"cpu_gemv: x must be [0..{max_rows()}, K] with K a multiple of {BLOCK}"
                         f"{' (2K with glu)' if prologue.glu else ''}, got {tuple(x.shape)}")
    if prologue.norm is not None and (prologue.norm.dtype != torch.float32 or prologue.norm.numel() != k):
        raise ValueError(f"cpu_gemv: the norm weight must be fp32 [{k}]")
    return x, k


def _output(rows: int, n: int, out: Tensor | None) -> Tensor:
    if out is None:
        return torch.empty(rows, n)
    if out.shape != (rows, n) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"cpu_gemv: out must be contiguous fp32 [{rows}, {n}], got {tuple(out.shape)} {out.dtype}")
    return out


def gemv(x: Tensor, weights: Weights, prologue: Prologue = PLAIN, out: Tensor | None = None,
         threads: int | None = None) -> Tensor:
    """h(x) [M, K] times the weights (`pack_q4` / `pack_q8` / `dense`) -> [M, N] fp32, written to a new tensor or
    added into `out`, on `threads` threads (default `default_threads()`)."""
    x, k = _inputs(x, prologue)
    if k != weights.k:
        raise ValueError(f"cpu_gemv: x has {k} inputs per row, the weights take {weights.k}")
    y = _output(x.shape[0], weights.n, out)
    if x.shape[0] == 0:  # a pass that asks for no logits
        return y
    library = _library()
    function, tensors = {4: (library.akv_q4_gemv, (weights.weight, weights.scale, weights.offset)),
                         8: (library.akv_q8_gemv, (weights.weight, weights.scale)),
                         32: (library.akv_f32_product, (weights.weight,))}[weights.bits]
    norm = prologue.norm.data_ptr() if prologue.norm is not None else None
    status = function(x.data_ptr(), x.shape[0], k, norm, prologue.eps, int(prologue.glu), int(out is not None),
                      *(t.data_ptr() for t in tensors), weights.n, y.data_ptr(), threads or default_threads())
    if status:
        raise MemoryError(f"cpu_gemv: {function.__name__} failed ({status})")
    return y


def dense_gemv(x: Tensor, weight: Tensor, threads: int | None = None) -> Tensor:
    """x [M, K] times the fp32 weight [N, K] (as loaded, row-major) transposed -> a new [M, N] fp32 tensor, for
    M up to `max_rows()` and K a multiple of 8, on `threads` threads (default `default_threads()`). Each
    output is its row's own sum over k, whatever M: a row's result does not depend on the rows beside it."""
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or x.dim() != 2 or weight.dim() != 2:
        raise ValueError("cpu_gemv.dense_gemv: fp32 x [M, K] and weight [N, K]")
    m_rows, k = x.shape
    if weight.shape[1] != k or k % 8 or not 1 <= m_rows <= max_rows() or not weight.is_contiguous():
        raise ValueError(f"cpu_gemv.dense_gemv: x {tuple(x.shape)} and a contiguous weight {tuple(weight.shape)} with "
                         f"K a multiple of 8 and 1 to {max_rows()} rows")
    x = x.contiguous()
    y = torch.empty(m_rows, weight.shape[0])
    status = _library().akv_f32_gemv(x.data_ptr(), m_rows, k, weight.data_ptr(), weight.shape[0], y.data_ptr(),
                                     threads or default_threads())
    if status:
        raise ValueError(f"cpu_gemv: akv_f32_gemv refused its arguments ({status})")
    return y


def decode_attention(qkv: Tensor, heads: int, kv_heads: int, cos: Tensor, signed_sin: Tensor, k_pool: Tensor,
                     v_pool: Tensor, out_slots: Tensor, slots: Tensor, offsets: Tensor, scale: float,
                     threads: int | None = None) -> Tensor:
    """One new token per sequence (row m of qkv [M, (H + 2 Hkv) D], fp32, contiguous): q and k rotated by
    cos / signed sin [M, rotary] (in qkv itself), the token's K/V written to pool slot out_slots[m] (pools
    [slots, Hkv, D] fp32), and attention over sequence m's visible slots slots[offsets[m]:offsets[m + 1]]
    (int64) read in place -> [M, H D], on `threads` threads (default `default_threads()`)."""
    m_rows, d = qkv.shape[0], k_pool.shape[-1]
    tensors = (qkv, cos, signed_sin, k_pool, v_pool)
    if any(t.dtype != torch.float32 or not t.is_contiguous() for t in tensors) or d % 8 \
            or qkv.shape[1] != (heads + 2 * kv_heads) * d or cos.shape[0] != m_rows:
        raise ValueError("cpu_gemv.decode_attention: contiguous fp32 tensors of matching shapes, head_dim a multiple of 8")
    indices = [t.to(torch.int64).contiguous() for t in (out_slots, slots, offsets)]
    out = torch.empty(m_rows, heads * d)
    status = _library().akv_decode_attention(qkv.data_ptr(), m_rows, heads, kv_heads, d, cos.shape[-1],
                                             cos.data_ptr(), signed_sin.data_ptr(), k_pool.data_ptr(),
                                             v_pool.data_ptr(), *(t.data_ptr() for t in indices), scale,
                                             out.data_ptr(), threads or default_threads())
    if status:
        raise MemoryError(f"cpu_gemv: akv_decode_attention failed ({status})")
    return out


@dataclass(frozen=True)
class Layer:
    """One transformer block for `DecodeStack`: its norms (fp32), the qkv bias if any, four projections."""

    attn_norm: Tensor
    mlp_norm: Tensor
    qkv_bias: Tensor | None
    qkv: Weights
    o: Weights
    gate_up: Weights
    down: Weights


class _Projection(ctypes.Structure):
    _fields_ = [("bits", ctypes.c_int64), ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("w", ctypes.c_void_p),
                ("scale", ctypes.c_void_p), ("offset", ctypes.c_void_p)]


class _Layer(ctypes.Structure):
    _fields_ = [("attn_norm", ctypes.c_void_p), ("mlp_norm", ctypes.c_void_p), ("qkv_bias", ctypes.c_void_p),
                ("qkv", _Projection), ("o", _Projection), ("gate_up", _Projection), ("down", _Projection)]


def _pointer(tensor: Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


class DecodeStack:
    """A whole decode step through every layer in one call (`akv_decode_layers`), the residual stream
    updated in place: no tensor operation and no Python between the embedding and the final norm."""

    def __init__(self, layers: list[Layer], heads: int, kv_heads: int, head_dim: int, rotary_dim: int,
                 eps: float) -> None:
        self.heads, self.kv_heads, self.head_dim, self.rotary_dim, self.eps = heads, kv_heads, head_dim, rotary_dim, eps
        self._held = [t.contiguous() for layer in layers for t in (layer.attn_norm, layer.mlp_norm, layer.qkv_bias)
                      if t is not None]   # kept alive: the structures below hold raw pointers
        self._layers = (_Layer * len(layers))(*(self._layer(layer) for layer in layers))
        function = _library().akv_decode_layers
        i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
        function.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, f32, ptr, ptr, ptr, ptr, ptr, f32, i64]
        function.restype = ctypes.c_int
        self._function = function

    def _layer(self, layer: Layer) -> _Layer:
        def held(t: Tensor | None) -> int | None:
            if t is None:
                return None
            t = t.float().contiguous()
            self._held.append(t)
            return t.data_ptr()

        def projection(w: Weights) -> _Projection:
            self._held.extend(t for t in (w.weight, w.scale, w.offset) if t is not None)
            return _Projection(w.bits, w.n, w.k, w.weight.data_ptr(), _pointer(w.scale), _pointer(w.offset))

        return _Layer(held(layer.attn_norm), held(layer.mlp_norm), held(layer.qkv_bias),
                      *(projection(w) for w in (layer.qkv, layer.o, layer.gate_up, layer.down)))

    def __call__(self, x: Tensor, cos: Tensor, signed_sin: Tensor, k_pools: list[Tensor], v_pools: list[Tensor],
                 out_slots: Tensor, slots: Tensor, offsets: Tensor, scale: float, threads: int | None = None) -> None:
        """x [M, hidden] fp32 contiguous (changed in place); cos / signed sin [M, rotary]; one pool per layer;
        on `threads` threads (default `default_threads()`)."""
        count = len(self._layers)
        if len(k_pools) != count or x.dtype != torch.float32 or not x.is_contiguous() or not 1 <= x.shape[0] <= max_rows():
            raise ValueError(f"DecodeStack: x must be contiguous fp32 [1..{max_rows()}, hidden] and pools given "
                             f"for all {count} layers")
        pools = [(ctypes.c_void_p * count)(*(t.data_ptr() for t in p)) for p in (k_pools, v_pools)]
        indices = [t.to(torch.int64).contiguous() for t in (out_slots, slots, offsets)]
        status = self._function(self._layers, count, *pools, x.data_ptr(), x.shape[0], self.heads, self.kv_heads,
                                self.head_dim, self.rotary_dim, self.eps, cos.data_ptr(), signed_sin.data_ptr(),
                                *(t.data_ptr() for t in indices), scale, threads or default_threads())
        if status:
            raise MemoryError(f"cpu_gemv: akv_decode_layers failed ({status})")
