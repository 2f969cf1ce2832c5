"""Fused int4 / int8 weight-only products (and fp32 ones) for decode steps on x86 CPUs, built at run time.

`cpu_gemv.c` multiplies a few fp32 rows (decode: one row per running sequence) by 4-bit group
weights (Q4_1) or int8 row weights, quantizing the rows per block of 32 to int8 as llama.cpp
does, so the weights meet them in integer SIMD and are read once for all rows. The weights are
held in the kernel's own layout (`pack_q4`, `pack_q8`: interleaved by groups of 8 output columns,
so that each unpacked register serves 8 columns and up to 4 rows). fp32 weights (`dense`) are read
as loaded, after the same prologues, so that a float32 model's decode step also runs as one call. torch's own
weight-only kernels dequantize every weight to bf16 on CPUs without AVX-512 and run several
times slower (`python benchmarks/engine.py --kernels`). One prefill kernel lives here too: a prompt's causal
attention in fp32 (`causal_attention`, a flash attention: no [heads, n, K] scores), which the float32 prefill
path runs instead of torch's SDPA (`python benchmarks/prefill_attention.py` times the two side by side).

The kernel is compiled on first use with the C compiler found at run time (`$CC`, `cc`, `gcc` or
`clang`, with `-mavx2 -mfma`, never `-march=native`) into the per-user kernel cache, keyed by the
source, the flags and the compiler, and loaded with ctypes once its folder's ownership and the file's
recorded SHA-256 are checked (`native_cache`). It is used only where torch reports AVX2 on the running
CPU (the CPU changes between machines, so nothing is decided at install); without AVX2, without a
compiler, with a library that fails those checks, or with `AKV_CPU_GEMV=off`, `available()` is False,
`refusal()` says why and what would fix it (`why_unavailable()`: the two in one line), and the callers keep
torch's kernels; `akv serve` names both in its start-up line, `/server_info` and `--check`.

C reads whatever the pointers it is given point at, so every wrapper here checks the shapes, dtypes,
contiguity, head counts and slot indices the C code relies on, and raises ValueError naming the argument.

Each call runs on `default_threads()` threads, which `akv_core.threads.phase_threads` sets for the forward
pass (`akv_core.threads.kernel_threads`; torch's own count outside one): one rule for torch's operators
and these kernels. The C library keeps a pool of worker threads (started on first use, grown to the largest
count asked for) and splits each product's output columns and each decode attention's heads between them. The
prefill kernels (`causal_attention`'s (key head, block of queries) units, and the rows of `rows_prologue` and
`rotate_and_store`, the norms, SwiGLU and RoPE around a float32 prefill's products) run on torch's own OpenMP
threads instead (`openmp_runtime()`), which are still spinning from the operator before them; the pool where
no OpenMP runtime is loaded, in a forked child, and within `own_pool()`. Results do not depend on the thread
count, nor on which threads ran them. ctypes releases the GIL for the whole call.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from akv_core.kernels import native_cache
from akv_core.threads import kernel_thread_count

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


@dataclass(frozen=True)
class Refusal:
    """Why the kernels do not run here, and what would make them run at the next start (None where nothing
    would: the CPU has no AVX2, or they were switched off on purpose)."""

    reason: str
    fix: str | None = None

    def __str__(self) -> str:
        return self.reason if self.fix is None else f"{self.reason}; fix: {self.fix}"


NO_COMPILER = Refusal("no C compiler (cc, gcc or clang) on PATH", "install one, or set CC to one")


def refusal() -> Refusal | None:
    """None when the kernel can run here, else why not and the fix."""
    if os.environ.get(SWITCH, "").lower() in ("off", "0", "no"):
        return Refusal(f"{SWITCH}=off")
    if not getattr(torch.cpu, "_is_avx2_supported", lambda: False)():
        return Refusal("the CPU has no AVX2")
    if compiler() is None:
        return NO_COMPILER
    return _loaded()[1]


def why_unavailable() -> str | None:
    """None when the kernel can run here, else the reason and its fix in one line (for benchmark headers and
    tests)."""
    found = refusal()
    return None if found is None else str(found)


def available() -> bool:
    return refusal() is None


def _first_lines(text: str, count: int = 3, width: int = 300) -> str:
    lines = [line.strip()[:width] for line in text.splitlines() if line.strip()]
    return " | ".join(lines[:count]) or "no message"


def library_name(cc: str) -> str:
    """The cached library's name, keyed by the source, the flags and the compiler's version: a change in any of
    them builds a new library instead of loading one built otherwise."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + version.encode()).hexdigest()[:16]
    return f"cpu_gemv-{digest}"


def _compile(cc: str, output: Path) -> None:
    """cpu_gemv.c compiled into `output`; Unavailable with the compiler's first lines when it fails."""
    result = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(output), "-lm", "-ldl"], capture_output=True, text=True)
    if result.returncode != 0:
        raise native_cache.Unavailable(
            f"akv_core/kernels/cpu_gemv.c could not be compiled by {cc} (exit {result.returncode}): "
            + _first_lines(result.stderr or result.stdout), f"set CC to a compiler that takes {' '.join(FLAGS[1:3])}")


@functools.lru_cache(maxsize=1)
def _loaded() -> tuple[ctypes.CDLL | None, Refusal | None]:
    """The kernel library (built where missing, its digest checked: `native_cache`), or None and why not."""
    cc = compiler()
    if cc is None:
        return None, NO_COMPILER
    try:
        library = native_cache.load(library_name(cc), functools.partial(_compile, cc))
    except native_cache.Unavailable as error:
        return None, Refusal(str(error), error.fix)
    except OSError as error:  # a kernel folder that cannot be made or written, or a library that cannot be loaded
        return None, Refusal(f"akv_core/kernels/cpu_gemv.c could not be built or loaded: {error}",
                             f"set {native_cache.CACHE_ENV} to a folder of your own that can be written")
    i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    prologue = [ptr, i64, i64, ptr, f32, i32, i32]
    library.akv_q4_gemv.argtypes = [*prologue, ptr, ptr, ptr, i64, ptr, i64]
    library.akv_q8_gemv.argtypes = [*prologue, ptr, ptr, i64, ptr, i64]
    library.akv_decode_attention.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, f32, ptr,
                                             ptr, i64]
    library.akv_f32_gemv.argtypes = [ptr, i64, i64, ptr, i64, ptr, i64]
    library.akv_f32_product.argtypes = [*prologue, ptr, i64, ptr, i64]
    library.akv_causal_attention.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, i64, i64, i64, i64, f32, ptr,
                                             i64]
    for function in (library.akv_q4_gemv, library.akv_q8_gemv, library.akv_decode_attention, library.akv_max_rows,
                     library.akv_last_threads, library.akv_f32_gemv, library.akv_f32_product,
                     library.akv_causal_attention):
        function.restype = ctypes.c_int
    library.akv_rows_prologue.argtypes = [ptr, i64, i64, ptr, f32, i32, ptr, i64]
    library.akv_rows_prologue.restype = ctypes.c_int
    library.akv_rotate_and_store.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, i64]
    library.akv_rotate_and_store.restype = ctypes.c_int
    library.akv_openmp_runtime.restype = ctypes.c_char_p
    library.akv_use_openmp.argtypes = [i32]
    return library, None


def _library() -> ctypes.CDLL | None:
    return _loaded()[0]


def default_threads() -> int:
    """The thread count of the next call: inside `akv_core.threads.kernel_threads(n)`, n; else torch's
    (`akv_core.threads` sets both per forward pass)."""
    return kernel_thread_count() or torch.get_num_threads()


def openmp_runtime() -> str | None:
    """The file name of the OpenMP runtime torch loaded (libgomp, libomp or libiomp5), whose threads run the
    prefill kernels (see `cpu_gemv.c`: torch's threads spin after its operators, so a pool of our own started
    then shares their cores); None where none is loaded and the kernels' own pool runs them."""
    return _library().akv_openmp_runtime().decode() or None


@contextmanager
def own_pool() -> Iterator[None]:
    """Within: the prefill kernels (attention, `rows_prologue`, `rotate_and_store`) run on the library's own
    thread pool even where torch's OpenMP runtime was found (to time the two side by side; results are the same).
    Process-wide, and OpenMP is back on afterwards: not for concurrent callers."""
    _library().akv_use_openmp(0)
    try:
        yield
    finally:
        _library().akv_use_openmp(1)


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

    def __post_init__(self) -> None:
        """Every product reads exactly these sizes from these pointers (cpu_gemv.c's header), so they are checked
        here, once: the fields are frozen, and `gemv` / `DecodeStack` take only Weights."""
        if self.bits not in (4, 8, 32) or self.n < 1 or self.k < BLOCK or self.k % BLOCK:
            raise ValueError(f"cpu_gemv.Weights: bits 4, 8 or 32 and k a positive multiple of {BLOCK}, got bits "
                             f"{self.bits}, n {self.n}, k {self.k}")
        columns, blocks = -(-self.n // GROUP) * GROUP, self.k // BLOCK   # columns padded to whole groups
        expected = {4: (("weight", torch.uint8, columns * self.k // 2), ("scale", torch.float32, columns * blocks),
                        ("offset", torch.float32, columns * blocks)),
                    8: (("weight", torch.int8, columns * self.k), ("scale", torch.float32, columns)),
                    32: (("weight", torch.float32, self.n * self.k),)}[self.bits]
        for name, dtype, numel in expected:
            t = getattr(self, name)
            if t is None or t.dtype != dtype or t.numel() != numel or not t.is_contiguous() or not t.is_cpu:
                got = "None" if t is None else f"{t.dtype} {tuple(t.shape)}"
                raise ValueError(f"cpu_gemv.Weights: {name} must be a contiguous CPU {dtype} tensor of {numel} "
                                 f"entries for bits {self.bits}, n {self.n}, k {self.k}; got {got}")


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


def _f32(t: Tensor) -> bool:
    """Whether C can read t as packed fp32 from its data pointer."""
    return t.dtype == torch.float32 and t.is_contiguous() and t.is_cpu


def _inputs(x: Tensor, prologue: Prologue) -> tuple[Tensor, int]:
    """x as contiguous fp32 and the product's K, checked (C reads M rows of K, or 2K with glu, and K norm weights)."""
    if not x.is_cpu:
        raise ValueError(f"cpu_gemv: x must be a CPU tensor, got one on {x.device}")
    x = x.float().contiguous()
    k = x.shape[-1] // 2 if prologue.glu else x.shape[-1]
    if x.dim() != 2 or k % BLOCK or not 0 <= x.shape[0] <= max_rows() or (prologue.glu and x.shape[1] != 2 * k):
        raise ValueError(f"cpu_gemv: x must be [0..{max_rows()}, K] with K a multiple of {BLOCK}"
                         f"{' (2K with glu)' if prologue.glu else ''}, got {tuple(x.shape)}")
    if prologue.norm is not None and (not _f32(prologue.norm) or prologue.norm.numel() != k):
        raise ValueError(f"cpu_gemv: the norm weight must be contiguous fp32 [{k}]")
    return x, k


def _output(rows: int, n: int, out: Tensor | None) -> Tensor:
    if out is None:
        return torch.empty(rows, n)
    if out.shape != (rows, n) or not _f32(out):
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
    if weight.shape[1] != k or k % 8 or not 1 <= m_rows <= max_rows() or not _f32(weight) or not x.is_cpu:
        raise ValueError(f"cpu_gemv.dense_gemv: x {tuple(x.shape)} and a contiguous weight {tuple(weight.shape)} with "
                         f"K a multiple of 8 and 1 to {max_rows()} rows")
    x = x.contiguous()
    y = torch.empty(m_rows, weight.shape[0])
    status = _library().akv_f32_gemv(x.data_ptr(), m_rows, k, weight.data_ptr(), weight.shape[0], y.data_ptr(),
                                     threads or default_threads())
    if status:
        raise ValueError(f"cpu_gemv: akv_f32_gemv refused its arguments ({status})")
    return y


def _check_heads(where: str, heads: int, kv_heads: int, head_dim: int, rotary: int) -> None:
    """C divides by kv_heads, shares each KV head among heads / kv_heads query heads, reads D floats per head
    in steps of 8, and rotates `rotary` dims of a head through a 512-float buffer: these must hold first."""
    if kv_heads < 1 or heads < kv_heads or heads % kv_heads:
        raise ValueError(f"{where}: heads ({heads}) must be a positive multiple of kv_heads ({kv_heads})")
    if head_dim < 8 or head_dim % 8:
        raise ValueError(f"{where}: head_dim must be a positive multiple of 8, got {head_dim}")
    if not 0 <= rotary <= min(head_dim, 512):
        raise ValueError(f"{where}: rotary (cos / signed_sin's width) must be 0..{min(head_dim, 512)}, got {rotary}")


def _check_pools(where: str, pools: tuple[tuple[str, list[Tensor]], ...], count: int, kv_heads: int,
                 head_dim: int) -> int:
    """The pools' slot count, once each pool is checked to be the [slots, Hkv, D] fp32 block C indexes (one
    shape test per pool: C reads a slot's Hkv * D floats at slot * Hkv * D, in every pool alike)."""
    shape = None
    for name, tensors in pools:
        if len(tensors) != count:
            raise ValueError(f"{where}: {name} must hold {count} pool(s), got {len(tensors)}")
        for t in tensors:
            shape = shape or (t.shape[0] if t.dim() == 3 else -1, kv_heads, head_dim)
            if t.shape != shape or t.dtype != torch.float32 or not t.is_contiguous() or not t.is_cpu:
                raise ValueError(f"{where}: {name} must be contiguous fp32 CPU pools of one shape [slots, kv_heads "
                                 f"{kv_heads}, head_dim {head_dim}], got {tuple(t.shape)} {t.dtype}")
    return shape[0] if shape else 0


def _int64(name: str, t: Tensor, where: str) -> Tensor:
    """t as the packed int64 vector C reads (itself when it already is one, as the model's are)."""
    if t.dtype == torch.int64 and t.dim() == 1 and t.is_contiguous() and t.is_cpu:
        return t
    if t.is_floating_point() or t.is_complex() or not t.is_cpu:
        raise ValueError(f"{where}: {name} must be an integer CPU tensor, got {t.dtype} on {t.device}")
    return t.to(torch.int64).contiguous().reshape(-1)


def _slot_lists(where: str, out_slots: Tensor, slots: Tensor, offsets: Tensor, rows: int,
                pool_slots: int) -> list[Tensor]:
    """out_slots [M], slots and offsets [M + 1] as the int64 vectors C reads, checked so that C writes and reads
    only pool slots 0..pool_slots - 1 and only entries of `slots`. out_slots and offsets hold one number per
    sequence (short lists: their min / max and sorted() cost a microsecond); offsets rising from 0 to len(slots)
    keeps every sequence's range inside `slots` and the scores buffer; slots, the long one, takes one aminmax."""
    out_slots, slots, offsets = (_int64("out_slots", out_slots, where), _int64("slots", slots, where),
                                 _int64("offsets", offsets, where))
    written, bounds = out_slots.tolist(), offsets.tolist()
    if len(written) != rows:
        raise ValueError(f"{where}: out_slots must hold one slot per row ({rows}), got {len(written)}")
    if len(bounds) != rows + 1 or bounds[0] != 0 or bounds[-1] != slots.numel() or bounds != sorted(bounds):
        raise ValueError(f"{where}: offsets must be {rows + 1} numbers rising from 0 to len(slots) "
                         f"({slots.numel()}), got {bounds[:8]}{'...' if len(bounds) > 8 else ''}")
    ranges = [("out_slots", min(written), max(written))] if written else []
    if slots.numel():
        ranges.append(("slots", *(int(v) for v in torch.aminmax(slots))))
    for name, low, high in ranges:
        if low < 0 or high >= pool_slots:
            raise ValueError(f"{where}: {name} holds slot {low if low < 0 else high}, outside the pool's "
                             f"{pool_slots} slots")
    return [out_slots, slots, offsets]


def _check_rotation(where: str, qkv: Tensor, heads: int, kv_heads: int, cos: Tensor, signed_sin: Tensor,
                    k_pool: Tensor, v_pool: Tensor) -> int:
    """The pools' slot count, once qkv [M, (H + 2 Hkv) D], cos / signed sin [M, rotary] and the pools are what C
    rotates in place and writes the new K/V from."""
    d, rows = k_pool.shape[-1], qkv.shape[0]
    if not _f32(qkv) or qkv.dim() != 2:
        raise ValueError(f"{where}: qkv must be a contiguous fp32 CPU [M, (H + 2 Hkv) D], got {tuple(qkv.shape)}")
    _check_heads(where, heads, kv_heads, d, cos.shape[-1])
    if qkv.shape[1] != (heads + 2 * kv_heads) * d:
        raise ValueError(f"{where}: qkv's width {qkv.shape[1]} is not (heads {heads} + 2 x kv_heads {kv_heads}) x "
                         f"head_dim {d}")
    for name, t in (("cos", cos), ("signed_sin", signed_sin)):
        if not _f32(t) or t.shape != (rows, cos.shape[-1]):
            raise ValueError(f"{where}: {name} must be contiguous fp32 [{rows}, rotary], got {tuple(t.shape)}")
    return _check_pools(where, (("k_pool", [k_pool]), ("v_pool", [v_pool])), 1, kv_heads, d)


def rotate_and_store(qkv: Tensor, heads: int, kv_heads: int, cos: Tensor, signed_sin: Tensor, k_pool: Tensor,
                     v_pool: Tensor, out_slots: Tensor, threads: int | None = None) -> None:
    """A prompt's rows (row m of qkv [M, (H + 2 Hkv) D], fp32, contiguous): q and k rotated by cos / signed sin
    [M, rotary] in qkv itself, row m's K/V written to pool slot out_slots[m] (pools [slots, Hkv, D] fp32); the
    rows shared between `threads` threads (default `default_threads()`). What `decode_attention` does before it
    attends, for the rows a prefill then attends over with `causal_attention`."""
    where = "cpu_gemv.rotate_and_store"
    pool_slots = _check_rotation(where, qkv, heads, kv_heads, cos, signed_sin, k_pool, v_pool)
    out_slots = _int64("out_slots", out_slots, where)
    if out_slots.numel() != qkv.shape[0] or not out_slots.numel():
        raise ValueError(f"{where}: out_slots must hold one slot per row ({qkv.shape[0]}), got {out_slots.numel()}")
    low, high = (int(v) for v in torch.aminmax(out_slots))
    if low < 0 or high >= pool_slots:
        raise ValueError(f"{where}: out_slots holds slot {low if low < 0 else high}, outside the pool's {pool_slots} "
                         "slots")
    status = _library().akv_rotate_and_store(qkv.data_ptr(), qkv.shape[0], heads, kv_heads, k_pool.shape[-1],
                                             cos.shape[-1], cos.data_ptr(), signed_sin.data_ptr(), k_pool.data_ptr(),
                                             v_pool.data_ptr(), out_slots.data_ptr(), threads or default_threads())
    if status:
        raise ValueError(f"cpu_gemv: akv_rotate_and_store refused its arguments ({status})")


def decode_attention(qkv: Tensor, heads: int, kv_heads: int, cos: Tensor, signed_sin: Tensor, k_pool: Tensor,
                     v_pool: Tensor, out_slots: Tensor, slots: Tensor, offsets: Tensor, scale: float,
                     threads: int | None = None, mass: Tensor | None = None) -> Tensor:
    """One new token per sequence (row m of qkv [M, (H + 2 Hkv) D], fp32, contiguous): q and k rotated by
    cos / signed sin [M, rotary] (in qkv itself), the token's K/V written to pool slot out_slots[m] (pools
    [slots, Hkv, D] fp32), and attention over sequence m's visible slots slots[offsets[m]:offsets[m + 1]]
    (int64) read in place -> [M, H D], on `threads` threads (default `default_threads()`). With `mass`
    (`attention_mass_buffer`), each row's attention weights are added into it."""
    where = "cpu_gemv.decode_attention"
    d, rows = k_pool.shape[-1], qkv.shape[0]
    pool_slots = _check_rotation(where, qkv, heads, kv_heads, cos, signed_sin, k_pool, v_pool)
    indices = _slot_lists(where, out_slots, slots, offsets, rows, pool_slots)
    out = torch.empty(rows, heads * d)
    status = _library().akv_decode_attention(qkv.data_ptr(), rows, heads, kv_heads, d, cos.shape[-1],
                                             cos.data_ptr(), signed_sin.data_ptr(), k_pool.data_ptr(),
                                             v_pool.data_ptr(), *(t.data_ptr() for t in indices), scale,
                                             out.data_ptr(), _mass_pointer(where, mass, heads, indices[1]),
                                             threads or default_threads())
    if status:
        raise MemoryError(f"cpu_gemv: akv_decode_attention failed ({status})")
    return out


def _rows_of_heads(where: str, name: str, t: Tensor, heads: int, d: int) -> Tensor:
    """t [rows, heads, D] as C reads it: fp32 on the CPU, each row's heads packed (row stride free); else a
    contiguous copy."""
    if t.dim() != 3 or t.shape[1:] != (heads, d) or not t.is_cpu:
        raise ValueError(f"{where}: {name} must be a CPU tensor [rows, {heads}, {d}], got {tuple(t.shape)} on {t.device}")
    if t.dtype != torch.float32 or t.stride(2) != 1 or t.stride(1) != d:
        t = t.float().contiguous()
    return t


def causal_attention(q: Tensor, keys: Tensor, values: Tensor, scale: float, threads: int | None = None) -> Tensor:
    """q [n, H, D] against keys / values [K, Hkv, D] (K >= n, H a multiple of Hkv, D a multiple of 16 up to 256),
    query i seeing keys 0 .. K - n + i (the new tokens are the last n keys): a prompt's causal attention in fp32,
    one flash-attention pass (no [H, n, K] scores) -> [n, H, D] fp32, on `threads` threads (default
    `default_threads()`). Rows may be views with any row stride (q a slice of the rotated q/k)."""
    where = "cpu_gemv.causal_attention"
    if q.dim() != 3 or keys.dim() != 3:
        raise ValueError(f"{where}: q [n, H, D] and keys [K, Hkv, D], got {tuple(q.shape)} and {tuple(keys.shape)}")
    n, heads, d = q.shape
    total, kv_heads = keys.shape[0], keys.shape[1]
    _check_heads(where, heads, kv_heads, d, 0)
    if d % 16 or d > 256 or total < n or n < 1 or values.shape != keys.shape or keys.shape[2] != d:
        raise ValueError(f"{where}: q {tuple(q.shape)}, keys {tuple(keys.shape)}, values {tuple(values.shape)}: "
                         "expected 1 <= n <= K, matching key and value shapes, D a multiple of 16 up to 256")
    q, keys, values = (_rows_of_heads(where, name, t, h, d) for name, t, h in
                       (("q", q, heads), ("keys", keys, kv_heads), ("values", values, kv_heads)))
    out = torch.empty(n, heads, d)
    status = _library().akv_causal_attention(q.data_ptr(), q.stride(0), keys.data_ptr(), keys.stride(0),
                                             values.data_ptr(), values.stride(0), n, total, heads, kv_heads, d,
                                             scale, out.data_ptr(), threads or default_threads())
    if status:
        raise MemoryError(f"cpu_gemv: akv_causal_attention failed ({status})")
    return out


def rows_prologue(x: Tensor, norm: Tensor | None = None, eps: float = 0.0, glu: bool = False,
                  threads: int | None = None) -> Tensor:
    """The small operation before a prefill product, one pass over the rows: RMSNorm(x) * norm (x [M, K]), or with
    `glu` SiLU(gate) * up of x [M, 2K] = [gate | up] (then the norm too, if given) -> [M, K] fp32 contiguous, K a
    multiple of 16. Sums in fp32 as the model's `rms_norm`, in another order (the same results to rounding)."""
    where = "cpu_gemv.rows_prologue"
    if x.dim() != 2 or x.device.type != "cpu":
        raise ValueError(f"{where}: x must be a CPU tensor [M, K], got {tuple(x.shape)} on {x.device}")
    x = x.float().contiguous()
    k = x.shape[1] // 2 if glu else x.shape[1]
    if k < 16 or k % 16 or (glu and x.shape[1] % 2) or x.shape[0] < 1:
        raise ValueError(f"{where}: expected at least one row and K a multiple of 16 (x [M, 2K] with glu), "
                         f"got x {tuple(x.shape)}")
    if norm is not None:
        if norm.shape != (k,):
            raise ValueError(f"{where}: norm must have shape ({k},), got {tuple(norm.shape)}")
        norm = norm.float().contiguous()
    out = torch.empty(x.shape[0], k)
    status = _library().akv_rows_prologue(x.data_ptr(), x.shape[0], k, None if norm is None else norm.data_ptr(),
                                          eps, int(glu), out.data_ptr(), threads or default_threads())
    if status:
        raise ValueError(f"cpu_gemv: akv_rows_prologue refused x {tuple(x.shape)} ({status})")
    return out


def attention_mass_buffer(heads: int, slots: Tensor) -> Tensor:
    """Zeros for the attention weights of a decode call's rows (`decode_attention`, `DecodeStack`): head h of
    row m over its slots at [offsets[m] * heads + h * count_m, + count_m); `row_masses` reads them back."""
    return torch.zeros(heads * slots.numel(), dtype=torch.float32)


def row_masses(mass: Tensor, heads: int, offsets: Tensor) -> list[Tensor]:
    """Per row of the call, the weights its queries put on each of its slots, summed over heads (and the
    call's layers): row m's [count_m], aligned with slots[offsets[m]:offsets[m + 1]]."""
    bounds = offsets.tolist()
    return [mass[heads * lo:heads * hi].view(heads, hi - lo).sum(dim=0) for lo, hi in zip(bounds, bounds[1:])]


def _mass_pointer(where: str, mass: Tensor | None, heads: int, slots: Tensor) -> int | None:
    if mass is None:
        return None
    if not _f32(mass) or mass.numel() != heads * slots.numel():
        raise ValueError(f"{where}: mass must be contiguous fp32 CPU of heads x len(slots) = "
                         f"{heads * slots.numel()} entries, got {tuple(mass.shape)} {mass.dtype}")
    return mass.data_ptr()


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


def _check_layer(index: int, layer: Layer, heads: int, kv_heads: int, head_dim: int, hidden: int,
                 inner: int) -> None:
    """C sizes its qkv, attention and gate/up buffers from layer 0 and the head counts, and chains every layer's
    products through them and the residual stream [M, hidden]: each layer must have exactly these shapes."""
    q_width, attended = (heads + 2 * kv_heads) * head_dim, heads * head_dim
    for name, w, n, k in (("qkv", layer.qkv, q_width, hidden), ("o", layer.o, hidden, attended),
                          ("gate_up", layer.gate_up, 2 * inner, hidden), ("down", layer.down, hidden, inner)):
        if not isinstance(w, Weights) or (w.n, w.k) != (n, k):
            got = f"[{w.n}, {w.k}]" if isinstance(w, Weights) else type(w).__name__
            raise ValueError(f"DecodeStack: layer {index}'s {name} must be Weights [{n}, {k}] for heads {heads}, "
                             f"kv_heads {kv_heads}, head_dim {head_dim}, got {got}")
    for name, t, numel in (("attn_norm", layer.attn_norm, hidden), ("mlp_norm", layer.mlp_norm, hidden),
                           ("qkv_bias", layer.qkv_bias, q_width)):
        if t is not None and (t.numel() != numel or not t.is_cpu):
            raise ValueError(f"DecodeStack: layer {index}'s {name} must be a CPU tensor of {numel} entries, got "
                             f"{tuple(t.shape)} on {t.device}")


class DecodeStack:
    """A whole decode step through every layer in one call (`akv_decode_layers`), the residual stream
    updated in place: no tensor operation and no Python between the embedding and the final norm."""

    def __init__(self, layers: list[Layer], heads: int, kv_heads: int, head_dim: int, rotary_dim: int,
                 eps: float) -> None:
        _check_heads("DecodeStack", heads, kv_heads, head_dim, rotary_dim)
        self.hidden = layers[0].qkv.k if layers else 0
        for index, layer in enumerate(layers):
            _check_layer(index, layer, heads, kv_heads, head_dim, self.hidden, layers[0].down.k)
        self.heads, self.kv_heads, self.head_dim, self.rotary_dim, self.eps = heads, kv_heads, head_dim, rotary_dim, eps
        self._dims = (heads, kv_heads, head_dim, rotary_dim)   # as checked: what the calls pass to C
        self._held = [t.contiguous() for layer in layers for t in (layer.attn_norm, layer.mlp_norm, layer.qkv_bias)
                      if t is not None]   # kept alive: the structures below hold raw pointers
        self._layers = (_Layer * len(layers))(*(self._layer(layer) for layer in layers))
        function = _library().akv_decode_layers
        i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
        function.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, f32, ptr, ptr, ptr, ptr, ptr, f32, ptr,
                             i64]
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

    def _check(self, x: Tensor, cos: Tensor, signed_sin: Tensor, k_pools: list[Tensor], v_pools: list[Tensor]) -> int:
        """The pools' slot count, once x, cos / signed_sin and the pools are checked against what C reads."""
        rows, (_, kv_heads, head_dim, rotary) = x.shape[0], self._dims
        if not _f32(x) or x.dim() != 2 or x.shape[1] != self.hidden or not 1 <= rows <= max_rows():
            raise ValueError(f"DecodeStack: x must be contiguous fp32 CPU [1..{max_rows()}, {self.hidden}], got "
                             f"{tuple(x.shape)} {x.dtype}")
        for name, t in (("cos", cos), ("signed_sin", signed_sin)):
            if not _f32(t) or t.shape != (rows, rotary):
                raise ValueError(f"DecodeStack: {name} must be contiguous fp32 [{rows}, {rotary}], got "
                                 f"{tuple(t.shape)}")
        return _check_pools("DecodeStack", (("k_pools", k_pools), ("v_pools", v_pools)), len(self._layers),
                            kv_heads, head_dim)

    def __call__(self, x: Tensor, cos: Tensor, signed_sin: Tensor, k_pools: list[Tensor], v_pools: list[Tensor],
                 out_slots: Tensor, slots: Tensor, offsets: Tensor, scale: float, threads: int | None = None,
                 mass: Tensor | None = None) -> None:
        """x [M, hidden] fp32 contiguous (changed in place); cos / signed sin [M, rotary]; one pool per layer;
        on `threads` threads (default `default_threads()`). With `mass` (`attention_mass_buffer`), each row's
        attention weights in every layer are added into it."""
        pool_slots = self._check(x, cos, signed_sin, k_pools, v_pools)
        indices = _slot_lists("DecodeStack", out_slots, slots, offsets, x.shape[0], pool_slots)
        count = len(self._layers)
        pools = [(ctypes.c_void_p * count)(*(t.data_ptr() for t in p)) for p in (k_pools, v_pools)]
        status = self._function(self._layers, count, *pools, x.data_ptr(), x.shape[0], *self._dims, self.eps,
                                cos.data_ptr(), signed_sin.data_ptr(), *(t.data_ptr() for t in indices), scale,
                                _mass_pointer("DecodeStack", mass, self.heads, indices[1]), threads or default_threads())
        if status:
            raise MemoryError(f"cpu_gemv: akv_decode_layers failed ({status})")
