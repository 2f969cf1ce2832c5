"""How many CPU threads each phase of a forward pass gets.

One rule for torch's operators and the fused C kernels (`akv_core.kernels.cpu_gemv`, which run on
torch's thread count): the engine wraps each forward pass in `phase_threads(...)`.

- Decode through torch's operators: 1 thread. Measured on a 2-core machine with SmolLM2-135M
  (docs/engine-model.md): a chain of small products bound by memory bandwidth and per-op overhead,
  where a second thread only adds synchronisation.
- Decode through the fused kernels (`fused=True`: the model's int8 / int4 decode step in one C
  call, each product's columns split across a pool of spinning threads): the idle cores, at most
  FUSED_DECODE_MAX_THREADS. On idle cores 2 threads beat 1 (docs/benchmarks.md); on busy ones a
  thread waiting for a core stalls every barrier of the step, and 1 thread is faster.
- Prefill (64 new tokens or more): the idle cores; compute-bound matrix-matrix work gains from each
  idle core, but OpenMP threads spinning against other processes make a pass several times slower.

The idle cores are the cores minus the 1-minute load average. For the fused decode step this
process's own recent CPU use is not counted as load: a server's own decode threads would otherwise
push it down to 1 thread as soon as it is busy. Prefill keeps counting it: OpenMP threads lose
badly to any other running thread, this process's (agents, a client in the same process) included.
AKV_DECODE_THREADS / AKV_PREFILL_THREADS override.
"""
from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

DECODE_THREADS = 1
# The fused decode kernels split products of a few hundred columns: measured up to 2 threads; beyond
# a few, each thread's share is too small to pay for the barriers (a judgement, not a measurement).
FUSED_DECODE_MAX_THREADS = 4
# Below this many new tokens a forward pass is decode-like: more threads do not pay off.
PREFILL_MIN_TOKENS = 64
LOAD_WINDOW_S = 60.0   # the kernel's 1-minute load average decays with this time constant

_own = {"wall": time.monotonic(), "cpu": time.process_time(), "load": 0.0}


def _env_threads(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def own_load() -> float:
    """This process's CPU use (cores' worth), averaged over the load average's window."""
    wall, cpu = time.monotonic(), time.process_time()
    elapsed = wall - _own["wall"]
    if elapsed >= 0.5:   # a cheap reading per forward pass, an update at most twice a second
        _own.update(wall=wall, cpu=cpu, load=averaged(_own["load"], (cpu - _own["cpu"]) / elapsed, elapsed))
    return _own["load"]


def averaged(previous: float, rate: float, elapsed: float) -> float:
    """An average decaying as the kernel's load average does, after `elapsed` seconds at `rate`."""
    return previous + (1.0 - math.exp(-elapsed / LOAD_WINDOW_S)) * (rate - previous)


def idle_of(cores: int, load: float, own: float) -> int:
    """Cores not busy with other processes' work: `load` less this process's `own` share, rounded."""
    return max(1, min(cores, int(cores - max(0.0, load - own) + 0.5)))


def idle_cores(discount_own: bool = False) -> int:
    """Cores not busy with other work, judged by the 1-minute load average; with `discount_own`, this
    process's own recent CPU use is not counted as load."""
    cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except OSError:  # no load average on this platform
        return cores
    return idle_of(cores, load, own_load() if discount_own else 0.0)


def threads_for(phase: str, new_tokens: int = 1, fused: bool = False) -> int:
    """The thread count for a forward pass of `new_tokens` in `phase` ("decode" or "prefill"); `fused`: a
    decode step runs on the fused C kernels."""
    if phase not in ("decode", "prefill"):
        raise ValueError(f"phase must be 'decode' or 'prefill', got {phase!r}")
    if phase == "decode" or new_tokens < PREFILL_MIN_TOKENS:
        chosen = _env_threads("AKV_DECODE_THREADS")
        if chosen is not None:
            return chosen
        return min(idle_cores(discount_own=True), FUSED_DECODE_MAX_THREADS) if fused else DECODE_THREADS
    return _env_threads("AKV_PREFILL_THREADS") or idle_cores()


@contextmanager
def phase_threads(phase: str, new_tokens: int = 1, fused: bool = False) -> Iterator[int]:
    """Run the body with the phase's thread count, restoring the previous count afterwards."""
    previous = torch.get_num_threads()
    chosen = threads_for(phase, new_tokens, fused)
    torch.set_num_threads(chosen)
    try:
        yield chosen
    finally:
        torch.set_num_threads(previous)
