"""Decode steps of several requests on the CPU, measured side by side in one run: `python benchmarks/passes.py`.

1. **The float32 decode step** of SmolLM2 at 1, 4 and 8 rows (one per sequence, each attending to its
   own `context` slots), one thread: the dense kernels (`cpu_gemv.dense_gemv` for every projection,
   `cpu_gemv.decode_attention` once per layer) against torch's operators alone (F.linear, one SDPA call
   per sequence and layer), in alternating rounds. Median wall ms per step.
2. **Passes side by side.** `requests` chat requests served together by one engine, in one pass per
   step and in up to two passes side by side (`akv_core.passes`), the prefill on 2 threads in both,
   in alternating rounds on the same engine weights. Wall seconds per round (the same prompts and
   tokens every round, greedy), and the ratio.

The ratios come from rounds measured one after another in this one run, on the same machine.
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
from collections.abc import Sequence
from typing import Any

import torch

from benchmarks.common import format_table, ratio

SYSTEM = {"role": "system", "content": "You are a careful research assistant. Answer briefly, cite the tool "
          "results you used, and say so plainly when the tools found nothing useful. " * 6}


def _decode_batch(model: Any, rows: int, context: int, kv: Any) -> Any:
    from akv_core.model.batch import ForwardBatch, SeqAttention

    seqs = [SeqAttention(m, 1, torch.arange(m * context, (m + 1) * context), None) for m in range(rows)]
    return ForwardBatch(torch.randint(100, 40000, (rows,), generator=torch.Generator().manual_seed(rows)),
                        torch.full((rows,), context - 1), torch.tensor([(m + 1) * context - 1 for m in range(rows)]),
                        seqs, torch.arange(rows))


def _on_torch(model: Any, on: bool) -> None:
    """Route the float32 model through torch's operators alone (on) or back through the kernels."""
    for p in [p for w in model.layers for p in (w.qkv, w.o, w.gate_up, w.down)] + [model.lm_head]:
        p.dense_rows = not on
    model._attention_kernel = not on


def measure_steps(rows_tried: Sequence[int], context: int, rounds: int, repeats: int) -> list[dict[str, Any]]:
    from akv_core.model.loader import load_model

    model = load_model("smollm2")
    kv = model.new_kv_buffers(max(rows_tried) * context)
    times: dict[tuple[int, str], list[float]] = {}
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(rounds):
            for rows in rows_tried:
                batch = _decode_batch(model, rows, context, kv)
                for path in ("kernels", "torch"):
                    _on_torch(model, path == "torch")
                    model.forward(batch, kv)
                    for _ in range(repeats):
                        started = time.perf_counter()
                        model.forward(batch, kv)
                        times.setdefault((rows, path), []).append(time.perf_counter() - started)
    finally:
        _on_torch(model, False)
        torch.set_num_threads(previous)
    return [{"rows": rows, "kernels_ms": round(statistics.median(times[rows, "kernels"]) * 1e3, 1),
             "torch_ms": round(statistics.median(times[rows, "torch"]) * 1e3, 1)} for rows in rows_tried]


def measure_passes(requests: int, max_tokens: int, rounds: int) -> list[dict[str, Any]]:
    from akv_core.chat import ChatTokenizer
    from akv_core.engine import Engine
    from akv_core.model.loader import load_model

    model, tokenizer = load_model("smollm2"), ChatTokenizer.from_model("smollm2")
    histories = [[SYSTEM, {"role": "user", "content": f"Question {i}: what do the sources say about topic {i}? "
                           + "Give the dates, the places and the people involved, and how they connect. " * 4}]
                 for i in range(requests)]
    walls: dict[int, list[float]] = {1: [], 2: []}
    for round_index in range(rounds + 1):   # the first round warms both up and is not counted
        for count in (1, 2):
            engine = Engine(model, tokenizer, 16_384, requests, threads={"prefill": 2, "decode": 1, "passes": count})
            handles = [engine.submit(h, max_tokens=max_tokens) for h in histories]
            started = time.perf_counter()
            while not all(handle.done for handle in handles):
                engine.step()
            if round_index:
                walls[count].append(time.perf_counter() - started)
            tokens = sum(len(handle.result().token_ids) for handle in handles)
    return [{"passes": count, "wall_s": round(statistics.median(walls[count]), 2), "tokens": tokens,
             "tokens_per_s": round(tokens / statistics.median(walls[count]), 1)} for count in (1, 2)]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,8")
    parser.add_argument("--context", type=int, default=600, help="visible slots per sequence in the step table")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"{os.cpu_count()} cores, torch {torch.__version__}; load average {os.getloadavg()[0]:.2f} at the start",
          flush=True)
    steps = measure_steps([int(r) for r in args.rows.split(",")], args.context, args.rounds, 5)
    print(f"float32 decode step, 1 thread, {args.context} visible slots per sequence, median ms:")
    print(format_table(["rows", "kernels ms", "torch's operators ms", "ratio"],
                       [[s["rows"], s["kernels_ms"], s["torch_ms"], ratio(s["torch_ms"], s["kernels_ms"])]
                        for s in steps]))
    served = measure_passes(args.requests, args.max_tokens, args.rounds)
    print(f"{args.requests} requests served together, up to {args.max_tokens} tokens each, median of {args.rounds} rounds:")
    print(format_table(["passes", "wall s", "tokens", "tokens/s"],
                       [[s["passes"], s["wall_s"], s["tokens"], s["tokens_per_s"]] for s in served]))
    print("ratios, measured side by side in this run:")
    for s in steps:
        print(f"  float32 decode step of {s['rows']} rows, kernels vs torch's operators: "
              f"{ratio(s['torch_ms'], s['kernels_ms'])}x")
    print(f"  {args.requests} requests, two passes side by side vs one: {ratio(served[0]['wall_s'], served[1]['wall_s'])}x")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
