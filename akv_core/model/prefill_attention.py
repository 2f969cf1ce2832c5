"""Causal attention of a prompt's new tokens in bf16 products, one block of queries at a time.

The prefill's bf16 path (`akv_core.model.prefill`) runs attention here when a sequence's new tokens see
every earlier listed slot and each other causally (no explicit mask, no probe). torch's CPU flash
attention runs a 2,048-token causal SDPA at about 64 GFLOPS on one AVX-512 core, in fp32 or bf16 alike,
which made attention most of a bf16 prefill. Here each block of queries meets its keys in two batched
bf16 GEMMs (the query heads that share a key head stacked into one matrix) with a softmax between them
(fp32 inside, bf16 in and out). A block's scores, `[heads, block, keys]` bf16, are the only buffer
that grows with the prompt: 9 heads x 128 queries x 8,192 keys is 19 MB, never `[heads, q, K]`.

Threads: the blocks are shared out whole among torch's thread count, each share computed on its own
thread with one torch thread. Six small torch calls per block, each a parallel region whose threads
meet at a barrier, stalled whenever another process held one of the cores (a 2,048-token layer took
650 ms on two busy cores against 44 ms on one); whole blocks per thread meet only once per layer.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor

# Queries per block: the scores of one block are [heads, BLOCK, keys] bf16.
BLOCK = 128

_pool: tuple[int, int, ThreadPoolExecutor] | None = None   # (process id, workers, pool)


def causal_attention_bf16(q: Tensor, keys: Tensor, values: Tensor, scale: float, block: int = BLOCK) -> Tensor:
    """q [n, H, D] against keys / values [K, Hk, D] (K >= n; H a multiple of Hk), query i seeing keys
    0 .. K - n + i: the new tokens are the last n keys. Returns [n, H, D] bf16."""
    n, heads, dim = q.shape
    total, kv_heads = keys.shape[0], keys.shape[1]
    if total < n or heads % kv_heads or keys.shape != values.shape or keys.shape[2] != dim:
        raise ValueError(f"causal_attention_bf16: q {tuple(q.shape)}, keys {tuple(keys.shape)}, values "
                         f"{tuple(values.shape)}: expected K >= n, H a multiple of Hk and matching shapes")
    group, prefix = heads // kv_heads, total - n
    # [Hk, group, n, D]: the query heads of one key head together, scaled before the rounding
    queries = (q * scale).to(torch.bfloat16).view(n, kv_heads, group, dim).permute(1, 2, 0, 3)
    k = keys.to(torch.bfloat16).transpose(0, 1)          # [Hk, K, D]
    v = values.to(torch.bfloat16).transpose(0, 1)
    out = torch.empty(n, kv_heads, group, dim, dtype=torch.bfloat16, device=q.device)
    hidden = torch.ones(block, block, dtype=torch.bool, device=q.device).triu_(1)   # a later key within the block

    def attend_blocks(starts: list[int]) -> None:
        for start in starts:
            stop = min(start + block, n)
            rows, visible = stop - start, prefix + stop
            scores = torch.bmm(queries[:, :, start:stop].reshape(kv_heads, group * rows, dim),
                               k[:, :visible].transpose(1, 2)).view(kv_heads, group, rows, visible)
            scores[..., prefix + start:].masked_fill_(hidden[:rows, :rows], float("-inf"))
            probs = torch.softmax(scores, dim=-1).view(kv_heads, group * rows, visible)
            out[start:stop] = torch.bmm(probs, v[:, :visible]).view(kv_heads, group, rows, dim).permute(2, 0, 1, 3)

    _share_out(attend_blocks, list(range(0, n, block)))
    return out.view(n, heads, dim)


Blocks = Callable[[list[int]], None]


def _share_out(work: Blocks, starts: list[int]) -> None:
    """`work(starts)` on this thread where torch runs one thread or there is one block; else each of torch's
    threads takes every t-th block, latest (dearest) first, on a worker thread with one torch thread and this
    thread's inference and grad modes (both are per thread)."""
    threads = torch.get_num_threads()
    if threads == 1 or len(starts) == 1:
        work(starts)
        return
    latest_first = starts[::-1]
    shares = [latest_first[i::threads] for i in range(min(threads, len(starts)))]
    modes = (torch.is_inference_mode_enabled(), torch.is_grad_enabled())
    try:
        for done in [_workers(threads).submit(_on_one_thread, work, share, *modes) for share in shares]:
            done.result()
    finally:
        torch.set_num_threads(threads)   # the workers set one: the count new threads start with is restored


def _on_one_thread(work: Blocks, share: list[int], inference: bool, grad: bool) -> None:
    torch.set_num_threads(1)   # this worker's own count (OpenMP keeps it per thread)
    with torch.inference_mode(inference), torch.set_grad_enabled(grad):
        work(share)


def _workers(count: int) -> ThreadPoolExecutor:
    """The pool of attention workers, made again in a forked child (its threads do not survive a fork) or to
    grow."""
    global _pool
    if _pool is None or _pool[0] != os.getpid() or _pool[1] < count:
        if _pool is not None and _pool[0] == os.getpid():
            _pool[2].shutdown(wait=False)
        _pool = (os.getpid(), count, ThreadPoolExecutor(count, thread_name_prefix="akv-attention"))
    return _pool[2]
