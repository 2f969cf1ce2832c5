"""How many CPU threads each phase of a forward pass gets.

One rule for torch's operators and the fused C kernels (`akv_core.kernels.cpu_gemv`, which run on
torch's thread count): the engine wraps each forward pass in `phase_threads(...)`.

- Decode through torch's operators: 1 thread. Measured on a 2-core machine with SmolLM2-135M
  (docs/engine-model.md): a chain of small products bound by memory bandwidth and per-op overhead,
  where a second thread only adds synchronisation.
- Decode on the C kernels (`kernels=True`: the model's fused decode step in one C call, on int8,
  int4 or float32 weights, or the same kernels layer by layer; each product's columns split across a
  pool of spinning threads): the idle cores, at most KERNEL_DECODE_MAX_THREADS. On idle cores 2
  threads beat 1 (docs/benchmarks.md: a float32 step 27-32% faster); on busy
  ones a thread waiting for a core stalls every barrier of the step, and 1 thread is faster.
- Prefill (64 new tokens or more): the idle cores; compute-bound matrix-matrix work gains from each
  idle core, but OpenMP threads spinning against other processes make a pass several times slower.

The idle cores are the cores less what is busy with other work: over the last BUSY_WINDOW_S
seconds, the machine's busy CPU time (/proc/stat, steal included) less what this process spent in
its own forward passes. The engine runs one step at a time, so its last pass never competes with
its next; everything else does, this process's other threads (agents or a client in the same
process, the HTTP side) included. Where /proc/stat is missing, the 1-minute load average stands in.
AKV_DECODE_THREADS / AKV_PREFILL_THREADS override.
"""
from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch

DECODE_THREADS = 1
# The decode kernels split products of a few hundred columns: measured up to 2 threads; beyond a few,
# each thread's share is too small to pay for the barriers (a judgement, not a measurement).
KERNEL_DECODE_MAX_THREADS = 4
# Below this many new tokens a forward pass is decode-like: more threads do not pay off.
PREFILL_MIN_TOKENS = 64
BUSY_WINDOW_S = 2.0    # how far back the busy CPU time is averaged
SAMPLE_EVERY_S = 0.25  # at most one /proc/stat reading per this many seconds
PROC_STAT = "/proc/stat"
TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def averaged(previous: float, rate: float, elapsed: float, window: float = BUSY_WINDOW_S) -> float:
    """An average decaying with time constant `window`, after `elapsed` seconds at `rate`."""
    return previous + (1.0 - math.exp(-elapsed / window)) * (rate - previous)


def idle_of(cores: int, busy_elsewhere: float) -> int:
    """Cores free for this process's next pass when `busy_elsewhere` cores' worth of other work runs (rounded)."""
    return max(1, min(cores, int(cores - max(0.0, busy_elsewhere) + 0.5)))


def machine_busy_s(stat_text: str) -> float | None:
    """The CPU seconds all cores have been busy since boot, from /proc/stat's text (None if unreadable)."""
    for line in stat_text.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            ticks = [int(v) for v in fields[1:9]] + [0] * 8   # user nice system idle iowait irq softirq steal
            return (sum(ticks[0:3]) + sum(ticks[5:8])) / TICKS_PER_S
    return None


class BusyMeter:
    """Cores' worth of CPU busy with work other than this process's forward passes, recently."""

    def __init__(self, stat_path: str = PROC_STAT, clock: Callable[[], float] = time.monotonic) -> None:
        self._path = stat_path
        self._clock = clock
        self._lock = threading.Lock()
        self._forward_s = 0.0          # CPU seconds of this process inside forward passes
        self._last: tuple[float, float, float] | None = None   # (wall, machine busy, forward) at the last sample
        self._busy = 0.0
        self._samples = 0

    def add_forward(self, cpu_s: float) -> None:
        with self._lock:
            self._forward_s += cpu_s

    def _read(self) -> float | None:
        try:
            with open(self._path, encoding="ascii") as stat:
                return machine_busy_s(stat.read())
        except (OSError, ValueError):
            return None

    def busy_elsewhere(self) -> float | None:
        """The averaged figure, or None until two readings SAMPLE_EVERY_S apart exist (or without /proc)."""
        with self._lock:
            now = self._clock()
            if self._last is not None and now - self._last[0] < SAMPLE_EVERY_S:
                return self._busy if self._samples else None
            machine = self._read()
            if machine is None:
                return None
            if self._last is not None:
                elapsed = now - self._last[0]
                rate = ((machine - self._last[1]) - (self._forward_s - self._last[2])) / elapsed
                self._busy = max(0.0, rate) if not self._samples else averaged(self._busy, max(0.0, rate), elapsed)
                self._samples += 1
            self._last = (now, machine, self._forward_s)
            return self._busy if self._samples else None


METER = BusyMeter()


def _env_threads(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def idle_cores() -> int:
    """Cores not busy with other work (the module's docstring says how that is judged)."""
    cores = os.cpu_count() or 1
    busy = METER.busy_elsewhere()
    if busy is None:
        try:
            busy = os.getloadavg()[0]
        except OSError:  # no load average on this platform
            return cores
    return idle_of(cores, busy)


def threads_for(phase: str, new_tokens: int = 1, kernels: bool = False) -> int:
    """The thread count for a forward pass of `new_tokens` in `phase` ("decode" or "prefill"); `kernels`: a
    decode step runs on the C kernels."""
    if phase not in ("decode", "prefill"):
        raise ValueError(f"phase must be 'decode' or 'prefill', got {phase!r}")
    if phase == "decode" or new_tokens < PREFILL_MIN_TOKENS:
        chosen = _env_threads("AKV_DECODE_THREADS")
        if chosen is not None:
            return chosen
        return min(idle_cores(), KERNEL_DECODE_MAX_THREADS) if kernels else DECODE_THREADS
    return _env_threads("AKV_PREFILL_THREADS") or idle_cores()


@contextmanager
def forward_cpu(meter: BusyMeter = METER) -> Iterator[None]:
    """Count the body's CPU time (the whole process's) as this process's forward passes."""
    started = time.process_time()
    try:
        yield
    finally:
        meter.add_forward(time.process_time() - started)


_calls = threading.local()


def kernel_thread_count() -> int | None:
    """The C kernels' thread count set by `kernel_threads` for this Python thread, or None outside one."""
    return getattr(_calls, "threads", None)


@contextmanager
def kernel_threads(count: int) -> Iterator[None]:
    """This Python thread's C kernel calls (`akv_core.kernels.cpu_gemv`) run on `count` threads in the body,
    whatever torch's count."""
    previous = kernel_thread_count()
    _calls.threads = count
    try:
        yield
    finally:
        _calls.threads = previous


@contextmanager
def torch_threads(count: int) -> Iterator[int]:
    """Run the body with torch's thread count at `count` (what `as` binds), restoring the previous count
    afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield count
    finally:
        torch.set_num_threads(previous)


@contextmanager
def phase_threads(phase: str, new_tokens: int = 1, kernels: bool = False) -> Iterator[int]:
    """Run the body (a forward pass) with the phase's thread count, restoring the previous count afterwards. On
    the C kernels (`kernels`) the count is theirs and torch's small operators around them run on one thread:
    OpenMP threads spin for a while after a parallel region, on the cores the kernels' threads then wait for
    (docs/benchmarks.md, "torch's operators on one thread around the kernels")."""
    chosen = threads_for(phase, new_tokens, kernels)
    with torch_threads(1 if kernels else chosen), (kernel_threads(chosen) if kernels else nullcontext()), \
            forward_cpu():
        yield chosen
