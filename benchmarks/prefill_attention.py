"""A prompt's causal attention in fp32: `cpu_gemv`'s flash attention against torch's SDPA, side by side in one
run: `python benchmarks/prefill_attention.py`.

The kernel runs on torch's OpenMP threads (`cpu_gemv.openmp_runtime()`); it is also timed on the kernel library's
own thread pool (`cpu_gemv.own_pool()`), which shares the cores with torch's threads while they still spin after
the operator before it. Two parts, each alternating the contenders every round on the same inputs and thread count:

- `attention`: one layer's attention of the embedded model's shape (9 query heads, 3 key heads, head size 64)
  over a fresh prompt of each `--tokens` count, and over new tokens after a cached prefix (`--continued`,
  new / keys): `cpu_gemv.causal_attention` against `F.scaled_dot_product_attention(enable_gqa=True)`,
  causal for a fresh prompt and with the visibility mask after a prefix (as the engine's `attend` calls it),
  median milliseconds of `--rounds` rounds, and the largest difference of their outputs;
- `prefill`: the float32 model's whole forward on the float32 path (oneDNN's products) over a fresh prompt
  of each `--prefill-tokens` count and over new tokens after a cached prefix (`--prefill-continued`, an
  agent's next turn), with `CausalLM.prefill_attention` set to the C kernel and to torch's SDPA in turn
  (what `AKV_PREFILL_ATTENTION=sdpa` selects at load); median seconds, new tokens per second, and the
  largest difference of the logits of the last token; also with the norms, the MLP's SiLU(gate) * up and
  RoPE on torch's operators instead of `cpu_gemv.rows_prologue` and `cpu_gemv.rotate_and_store`
  (`CausalLM.row_kernels` off). Below `FLASH_MIN_ROWS` new tokens the model attends on SDPA whichever is
  set, and the row says so; `--flash-min-rows N` moves that threshold for the run (to measure where it
  belongs).

Ratios are a contender's time over the kernel's (above 1: the kernel is faster), the median of per-round ratios;
differences are against the kernel's results.
Wall time on `--threads` threads (torch's and the kernel's count alike).
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import `benchmarks` and the packages from this checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from akv_core.model.llama import FLASH_MIN_ROWS
from akv_core.model.llama import FP32_FLASH as KERNEL
from akv_core.model.llama import TORCH_SDPA as SDPA
from benchmarks.common import cpu_model, format_table

OWN_POOL = f"{KERNEL}, own pool"
TORCH_ROWS = f"{KERNEL}, torch's row ops"


def alternate(contenders: dict[str, Callable[[], Any]],
              rounds: int) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """Each contender once per round, in turn, after one untimed warm-up call each: (seconds per round, last
    result) by name."""
    results = {name: run() for name, run in contenders.items()}
    seconds: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, run in contenders.items():
            start = time.perf_counter()
            results[name] = run()
            seconds[name].append(time.perf_counter() - start)
    return seconds, results


def ratio_of_rounds(seconds: dict[str, list[float]], name: str = SDPA) -> float:
    """Median over rounds of `name`'s seconds over the kernel's."""
    return statistics.median(s / k for s, k in zip(seconds[name], seconds[KERNEL]))


def on_own_pool(run: Callable[[], Any]) -> Callable[[], Any]:
    """`run` with the prefill attention on the kernel library's own threads."""
    from akv_core.kernels import cpu_gemv

    def pooled() -> Any:
        with cpu_gemv.own_pool():
            return run()
    return pooled


def attention_rows(shapes: Sequence[tuple[int, int]], rounds: int) -> list[list[Any]]:
    """One row per (new tokens, keys): a fresh prompt where they are equal (SDPA with is_causal), else new tokens
    after a cached prefix (SDPA with the visibility mask, as the engine's `attend` hands it one)."""
    from akv_core.kernels import cpu_gemv

    heads, kv_heads, d = 9, 3, 64
    rows = []
    for n, total in shapes:
        generator = torch.Generator().manual_seed(n)
        q = torch.randn(n, heads, d, generator=generator)
        keys, values = (torch.randn(total, kv_heads, d, generator=generator) for _ in range(2))
        qt, kt, vt = (t.transpose(0, 1)[None] for t in (q, keys, values))
        mask = None if n == total else torch.ones(n, total, dtype=torch.bool).tril(total - n)
        kernel = lambda: cpu_gemv.causal_attention(q, keys, values, d ** -0.5)  # noqa: E731
        contenders = {
            KERNEL: kernel, OWN_POOL: on_own_pool(kernel),
            SDPA: lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, is_causal=mask is None,
                                                         scale=d ** -0.5, enable_gqa=True)[0].transpose(0, 1)}
        seconds, results = alternate(contenders, rounds)
        difference = max((results[KERNEL] - results[name]).abs().max().item() for name in (OWN_POOL, SDPA))
        rows.append([n if n == total else f"{n} after {total - n}",
                     *(f"{statistics.median(seconds[name]) * 1e3:.2f}" for name in (KERNEL, OWN_POOL, SDPA)),
                     *(f"{ratio_of_rounds(seconds, name):.2f}x" for name in (OWN_POOL, SDPA)), f"{difference:.1e}"])
        print(f"attention {rows[-1][0]} tokens done", flush=True)
    return rows


def shapes_of(fresh: str, continued: str) -> list[tuple[int, int]]:
    """--tokens "512,2048" and --continued "100/2000" -> [(512, 512), (2048, 2048), (100, 2000)]."""
    shapes = [(int(n), int(n)) for n in fresh.split(",") if n.strip()]
    for pair in (p for p in continued.split(",") if p.strip()):
        new, _, total = pair.partition("/")
        shapes.append((int(new), int(total)))
    if any(n < 1 or total < n for n, total in shapes):
        raise ValueError(f"each shape needs 1 <= new tokens <= keys, got {shapes}")
    return shapes


def prefill_rows(shapes: Sequence[tuple[int, int]], rounds: int, min_rows: int = FLASH_MIN_ROWS) -> list[list[Any]]:
    """Per (new tokens, keys): the float32 model's forward over the new tokens, after a cached prefix of the
    rest (computed once, untimed) where there is one, with each attention in turn; the kernel from `min_rows`
    new tokens."""
    from akv_core.model.batch import ForwardBatch, SeqAttention
    from akv_core.model.loader import load_model

    model = load_model("smollm2")
    if model.prefill_attention != KERNEL:
        raise SystemExit(f"the float32 model's prompts attend on {model.prefill_attention!r} here, not {KERNEL!r} "
                         f"(prefill path {model.prefill_path}; AKV_PREFILL / AKV_PREFILL_ATTENTION set?)")
    model.flash_min_rows, row_kernels = min_rows, model.row_kernels
    rows = []
    for n, total in shapes:
        ids = torch.randint(100, 40000, (total,), generator=torch.Generator().manual_seed(total))
        kv, prefix = model.new_kv_buffers(total), total - n
        if prefix:
            slots = torch.arange(prefix)
            model.forward(ForwardBatch(ids[:prefix], slots, slots, [SeqAttention(0, prefix, slots)],
                                       torch.tensor([prefix - 1])), kv)
        new, visible = torch.arange(prefix, total), torch.arange(total)
        batch = ForwardBatch(ids[prefix:], new, new, [SeqAttention(0, n, visible)], torch.tensor([n - 1]))

        def forward(attention: str, row_kernels: bool = row_kernels) -> torch.Tensor:
            model.prefill_attention, model.row_kernels = attention, row_kernels
            return model.forward(batch, kv)

        contenders = {KERNEL: lambda: forward(KERNEL), OWN_POOL: on_own_pool(lambda: forward(KERNEL)),
                      **({TORCH_ROWS: lambda: forward(KERNEL, False)} if row_kernels else {}),
                      SDPA: lambda: forward(SDPA)}
        seconds, results = alternate(contenders, rounds)
        model.prefill_attention, model.row_kernels = KERNEL, row_kernels
        label: int | str = n if n == total else f"{n} after {prefix}"
        if n < min_rows:
            label = f"{label} (all on SDPA)"
        medians = {name: statistics.median(seconds[name]) for name in contenders}
        rows += [[label, name, f"{medians[name]:.3f}", f"{n / medians[name]:.0f}",
                  " ".join(f"{s:.3f}" for s in seconds[name]), f"{ratio_of_rounds(seconds, name):.2f}x",
                  f"{(results[KERNEL] - results[name]).abs().max().item():.1e}"] for name in contenders]
        print(f"prefill {label} tokens done", flush=True)
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="attention,prefill", help="attention, prefill or both (default)")
    parser.add_argument("--tokens", default="64,128,512,2048,8192", help="fresh prompts of the attention part")
    parser.add_argument("--continued", default="100/2000,300/4000",
                        help="new tokens / keys after a cached prefix, in the attention part")
    parser.add_argument("--prefill-tokens", default="2048", help="fresh prompts of the prefill part")
    parser.add_argument("--prefill-continued", default="600/3000",
                        help="new tokens / keys after a cached prefix, in the prefill part")
    parser.add_argument("--flash-min-rows", type=int, default=FLASH_MIN_ROWS,
                        help=f"the prefill part's kernel from this many new tokens (default: the engine's, "
                             f"{FLASH_MIN_ROWS})")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    parts = {part.strip() for part in args.parts.split(",") if part.strip()}
    if args.flash_min_rows < 1:
        parser.error(f"--flash-min-rows: expected a count of at least 1, got {args.flash_min_rows}")
    if not parts or parts - {"attention", "prefill"}:
        parser.error(f"--parts: expected attention, prefill or both, got {args.parts!r}")
    try:
        shapes = shapes_of(args.tokens, args.continued)
        prefill_shapes = shapes_of(args.prefill_tokens, args.prefill_continued)
    except ValueError as err:
        parser.error(f"--tokens, --continued, --prefill-tokens, --prefill-continued: expected counts like "
                     f"512,2048 and new/keys pairs like 100/2000 ({err})")
    from akv_core.kernels import cpu_gemv
    from akv_core.model.linear import cpu_summary
    from akv_core.threads import torch_threads

    if not cpu_gemv.available():
        raise SystemExit(f"cpu_gemv cannot run here: {cpu_gemv.why_unavailable()}")
    print(f"{cpu_model()} ({cpu_summary()}), {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{args.threads} thread(s); the kernel on {cpu_gemv.openmp_runtime() or 'its own pool (no OpenMP runtime)'}"
          f"; load average {os.getloadavg()[0]:.2f} at the start", flush=True)
    with torch_threads(args.threads), torch.inference_mode():   # the caller's count back afterwards
        if "attention" in parts:
            rows = attention_rows(shapes, args.rounds)
            print(f"\none layer's causal attention, 9 / 3 heads of 64, median ms of {args.rounds} rounds")
            print(format_table(["tokens", "kernel ms", "own pool ms", "SDPA ms", "own pool / kernel", "SDPA / kernel",
                                "max |diff|"], rows))
        if "prefill" in parts:
            rows = prefill_rows(prefill_shapes, args.rounds, args.flash_min_rows)
            print(f"\nfloat32 prefill (the model's whole forward over the new tokens), median s of {args.rounds} "
                  "rounds")
            print(format_table(["tokens", "forward", "s", "tok/s", "rounds (s)", "s / kernel's",
                                "max |logit diff|"], rows))
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
