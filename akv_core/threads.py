"""How many CPU threads each phase of a forward pass gets.

Measured on a 2-core machine with SmolLM2-135M (docs/engine-model.md):
decode is a chain of small matrix-vector products bound by memory bandwidth
and per-op overhead, so one thread is fastest; prefill is compute-bound
matrix-matrix work, so it gains from every idle core. When the cores are
already busy (load average near the core count), extra OpenMP threads spin
against other processes and a prefill becomes several times slower, so
prefill falls back to one thread then. The engine wraps each forward pass in
`phase_threads(...)`. AKV_DECODE_THREADS / AKV_PREFILL_THREADS override.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

DECODE_THREADS = 1
# Below this many new tokens a forward pass is decode-like: more threads do not pay off.
PREFILL_MIN_TOKENS = 64


def _env_threads(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def idle_cores() -> int:
    """Cores not busy with other work, judged by the 1-minute load average."""
    cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except OSError:  # no load average on this platform
        return cores
    return max(1, int(cores - load + 0.5))


def threads_for(phase: str, new_tokens: int = 1) -> int:
    """The thread count for a forward pass of `new_tokens` in `phase` ("decode" or "prefill")."""
    if phase not in ("decode", "prefill"):
        raise ValueError(f"phase must be 'decode' or 'prefill', got {phase!r}")
    if phase == "decode" or new_tokens < PREFILL_MIN_TOKENS:
        return _env_threads("AKV_DECODE_THREADS") or DECODE_THREADS
    return _env_threads("AKV_PREFILL_THREADS") or idle_cores()


@contextmanager
def phase_threads(phase: str, new_tokens: int = 1) -> Iterator[int]:
    """Run the body with the phase's thread count, restoring the previous count afterwards."""
    previous = torch.get_num_threads()
    chosen = threads_for(phase, new_tokens)
    torch.set_num_threads(chosen)
    try:
        yield chosen
    finally:
        torch.set_num_threads(previous)
