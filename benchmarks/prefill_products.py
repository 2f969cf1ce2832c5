"""float32 prefill on oneDNN's packed products against torch's GEMM, side by side in one run:
`python benchmarks/prefill_products.py`.

The engine (embedded SmolLM2, float32, CPU, threads as the engine chooses them) prefills the same
prompts with its projections on oneDNN's packed weights (`akv_core.model.linear.OneDnnWeights`, the
default where oneDNN runs) and on torch's F.linear (as with `AKV_ONEDNN=off`), alternating the two
every round. Three shapes:

- `fresh`: one prompt of about 530 tokens on an empty cache;
- `after prefix`: about 200 new tokens after a cached 330-token system prompt;
- `8 sharing`: 8 such requests at once (one computes the shared prompt, the others reuse it), each
  sampling one token: the prefill of `benchmarks/scale.py`'s llm part at concurrency 8.

Median wall seconds of the rounds; the ratio is torch's over oneDNN's.
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import `benchmarks` and the packages from this checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from benchmarks.common import format_table, ratio

WORDS = ("the quick brown fox jumps over a lazy dog while research agents read many long documents about "
         "caches keys values and positions").split()


def _text(words: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _use_onednn(engine: Any, packed: list[Any], on: bool) -> None:
    projections = [p for w in engine.model.layers for p in (w.qkv, w.o, w.gate_up, w.down)]
    for projection, weights in zip(projections, packed):
        projection.onednn = weights if on else None


def _shapes(engine: Any) -> dict[str, Callable[[], float]]:
    rng = random.Random(0)
    system, question = _text(300, rng), _text(180, rng)
    requests = [[{"role": "system", "content": system}, {"role": "user", "content": _text(180, rng)}]
                for _ in range(8)]

    def timed(run: Callable[[], None], before: Callable[[], None] = lambda: None) -> float:
        engine.clear_cache()
        before()
        started = time.perf_counter()
        run()
        return time.perf_counter() - started

    def one(messages: list[dict]) -> None:
        engine.generate(messages, max_tokens=1)

    def together() -> None:
        handles = [engine.submit(messages, max_tokens=1) for messages in requests]
        while not all(handle.done for handle in handles):
            engine.step()

    prefix = [{"role": "system", "content": system}, {"role": "user", "content": "hello"}]
    return {"fresh": lambda: timed(lambda: one([{"role": "user", "content": system + " " + question}])),
            "after prefix": lambda: timed(lambda: one([prefix[0], {"role": "user", "content": question}]),
                                          before=lambda: one(prefix)),
            "8 sharing": lambda: timed(together)}


def measure(rounds: int) -> list[dict[str, Any]]:
    from akv_core.engine import Engine

    engine = Engine.from_pretrained("smollm2", device="cpu", kv_tokens=16_384)
    packed = [p.onednn for w in engine.model.layers for p in (w.qkv, w.o, w.gate_up, w.down)]
    if any(p is None for p in packed):
        raise SystemExit("oneDNN's packed products are not in use here (AKV_ONEDNN=off, or a torch without them)")
    shapes = _shapes(engine)
    times: dict[tuple[str, bool], list[float]] = {}
    try:
        for on in (True, False):   # untimed: each path's first call sets up its kernels
            _use_onednn(engine, packed, on)
            for run in shapes.values():
                run()
        for index in range(rounds):
            for on in ((True, False) if index % 2 == 0 else (False, True)):
                _use_onednn(engine, packed, on)
                for name, run in shapes.items():
                    times.setdefault((name, on), []).append(run())
    finally:
        _use_onednn(engine, packed, True)
    return [{"shape": name, "onednn_s": round(statistics.median(times[name, True]), 3),
             "torch_s": round(statistics.median(times[name, False]), 3)} for name in shapes]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds: expected a positive integer, got {args.rounds}")
    print(f"{os.cpu_count()} cores, torch {torch.__version__}; load average {os.getloadavg()[0]:.2f} at the start",
          flush=True)
    cells = measure(args.rounds)
    print(f"float32 prefill, median s of {args.rounds} alternating rounds:")
    print(format_table(["shape", "oneDNN s", "torch's F.linear s", "ratio"],
                       [[c["shape"], c["onednn_s"], c["torch_s"], ratio(c["torch_s"], c["onednn_s"])] for c in cells]))
    print("ratios, measured side by side in this run:")
    for c in cells:
        print(f"  float32 prefill, {c['shape']}, oneDNN vs torch's F.linear: {ratio(c['torch_s'], c['onednn_s'])}x")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
