"""float32 decode steps on the CPU, measured side by side in one run: `python benchmarks/dense_decode.py`.

SmolLM2's float32 decode step at 1, 4 and 8 rows (one per sequence, each attending to its own
`context` slots) on 1 and 2 threads, three ways in alternating rounds: the whole step in one
`cpu_gemv.DecodeStack` call (fp32 products of the weights as loaded, norms, SwiGLU, RoPE and
attention: the engine's path), the same kernels layer by layer (`cpu_gemv.dense_gemv` for every
projection, `cpu_gemv.decode_attention` once per layer, torch's small operations between them), and
torch's operators alone (F.linear, one SDPA call per sequence and layer). Median wall ms per step.

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


PATHS = ("fused", "layers", "torch")


def _route(model: Any, path: str) -> None:
    """Route the float32 model's decode step: "fused" (one DecodeStack call), "layers" (the dense products and the
    attention kernel, layer by layer between torch's small operations) or "torch" (torch's operators alone)."""
    for p in [p for w in model.layers for p in (w.qkv, w.o, w.gate_up, w.down)] + [model.lm_head]:
        p.dense_rows = path != "torch"
    model._attention_kernel = path != "torch"
    model.fused_decode = path == "fused"


def measure_steps(rows_tried: Sequence[int], threads_tried: Sequence[int], context: int, rounds: int,
                  repeats: int) -> list[dict[str, Any]]:
    from akv_core.model.loader import load_model
    from akv_core.threads import torch_threads
    from benchmarks.engine import _decode_batch

    model = load_model("smollm2")
    generator = torch.Generator().manual_seed(0)
    steps = {rows: _decode_batch(model, rows, context, generator) for rows in rows_tried}
    times: dict[tuple[int, int, str], list[float]] = {}
    try:
        for _ in range(rounds):
            for threads in threads_tried:
                with torch_threads(threads):
                    for rows, (batch, kv) in steps.items():
                        for path in PATHS:
                            _route(model, path)
                            model.forward(batch, kv)
                            for _ in range(repeats):
                                started = time.perf_counter()
                                model.forward(batch, kv)
                                times.setdefault((threads, rows, path), []).append(time.perf_counter() - started)
    finally:
        _route(model, "fused")
    return [{"threads": threads, "rows": rows,
             **{f"{path}_ms": round(statistics.median(times[threads, rows, path]) * 1e3, 1) for path in PATHS}}
            for threads in threads_tried for rows in rows_tried]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,8")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--context", type=int, default=600, help="visible slots per sequence")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"{os.cpu_count()} cores, torch {torch.__version__}; load average {os.getloadavg()[0]:.2f} at the start",
          flush=True)
    steps = measure_steps([int(r) for r in args.rows.split(",")], [int(t) for t in args.threads.split(",")],
                          args.context, args.rounds, 5)
    print(f"float32 decode step, {args.context} visible slots per sequence, median ms of {args.rounds} x 5 steps:")
    print(format_table(["threads", "rows", "one call ms", "layer by layer ms", "torch's operators ms",
                        "one call vs layers", "one call vs torch"],
                       [[s["threads"], s["rows"], s["fused_ms"], s["layers_ms"], s["torch_ms"],
                         ratio(s["layers_ms"], s["fused_ms"]), ratio(s["torch_ms"], s["fused_ms"])] for s in steps]))
    print("ratios, measured side by side in this run:")
    for s in steps:
        print(f"  float32 decode step of {s['rows']} rows on {s['threads']} thread(s), one call vs layer by layer: "
              f"{ratio(s['layers_ms'], s['fused_ms'])}x; vs torch's operators: {ratio(s['torch_ms'], s['fused_ms'])}x")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
