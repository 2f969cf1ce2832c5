"""A step's forward as passes side by side: the requests of one step split into groups, each group
run as its own one-thread forward pass, at the same time as the others (akv_core.threads says how
many; the engine decides per step).

On a CPU a decode step of a few rows gains almost nothing from per-op threads (its products are
small, its attention one call per request, each op a fork and a join), and a prompt chunk only part
of what its matrix products would; two one-thread passes, each with its own share of the requests,
keep both cores busy for the whole step.

It is sound because within a step every request reads only K/V written before the step or by its
own rows, and writes only its own slots: a request that shares another's prefix is admitted once
those slots are published, after the step that computed them (akv_core.scheduler), and re-rotated
copies are written before the forward starts. So a request's rows compute the same in any group,
and the weights are only read. Passes run only where the model's kernels are safe from two threads
at once (`CausalLM.passes_safe`: torch's operators; not the fused C kernels, whose worker pool
serves one call at a time).

`split` groups the parts by their estimated cost, longest first into the lightest pass, and keeps
one pass when the split would not gain MIN_GAIN (one long prompt chunk beside a few decode rows
stays one pass, where its products use every idle core).
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import torch

from akv_core.threads import MAX_PASSES

T = TypeVar("T")

# Costs in units of one prompt row's work (SmolLM2-135M in float32 on one core, docs/benchmarks.md,
# "Passes side by side"): a prompt row about 3.5 ms; a decode step of one row about 61 ms and each
# further row about 15 ms, so a pass costs about 17 rows to start and a decode row about 4 more.
PASS_COST = 17.0
DECODE_ROW_COST = 4.0
# Attention reads every visible key: per decode row and key (the gathered K/V of 30 layers), and
# per prompt row and key (its scores and weighted values), in the same units.
DECODE_KEY_COST = 1.3e-3
PROMPT_KEY_COST = 2.5e-4
MIN_GAIN = 1.3   # a split must promise this much over one pass (which may use per-op threads)


def part_cost(rows: int, keys: int, decode: bool) -> float:
    """The estimated work of one request's rows in a step that attend to `keys` visible slots."""
    if decode:
        return DECODE_ROW_COST + DECODE_KEY_COST * keys
    return rows * (1.0 + PROMPT_KEY_COST * keys)


def split(costs: Sequence[float], passes: int) -> list[list[int]] | None:
    """The parts' indices per pass (each group in the parts' order), or None when one pass is as good."""
    if passes < 2 or len(costs) < 2:
        return None
    groups: list[list[int]] = [[] for _ in range(passes)]
    loads = [PASS_COST] * passes
    for index in sorted(range(len(costs)), key=lambda i: -costs[i]):
        lightest = min(range(passes), key=loads.__getitem__)
        groups[lightest].append(index)
        loads[lightest] += costs[index]
    if (PASS_COST + sum(costs)) / max(loads) < MIN_GAIN:
        return None
    return [sorted(group) for group in groups if group]


class SideBySide:
    """Runs passes at once: the first on the calling thread, each other on a worker thread of its own,
    every one of them on one torch thread."""

    def __init__(self, workers: int = 1) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="akv-pass",
                                        initializer=torch.set_num_threads, initargs=(1,))

    def run(self, passes: Sequence[Callable[[], T]]) -> list[T]:
        """Each pass's result, in order. A pass that raises raises here, once every pass has ended."""
        previous = torch.get_num_threads()
        torch.set_num_threads(1)
        futures: list[Future[T]] = [self._pool.submit(work) for work in passes[1:]]
        try:
            first = passes[0]()
        finally:
            for future in futures:   # never leave a pass running: the caller may run its parts again
                future.exception()
            torch.set_num_threads(previous)
        return [first, *(future.result() for future in futures)]

    def close(self) -> None:
        self._pool.shutdown(wait=True)


_shared: list[SideBySide] = []
_shared_lock = threading.Lock()


def shared() -> SideBySide:
    """The process's one runner (its worker threads serve every engine of the process)."""
    with _shared_lock:
        if not _shared:
            _shared.append(SideBySide(MAX_PASSES - 1))
        return _shared[0]
