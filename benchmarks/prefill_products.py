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

Median wall seconds of the rounds; the ratio is torch's over oneDNN's. The products alone, too: each
of the model's projection shapes at 200 and 512 rows, in GFLOPS (one product repeated, its weight hot
in the caches), on the same thread count as a prefill. Beside them, what the packed copies cost in
memory: the resident memory of a fresh process after loading the model and one prefill, with and
without them (`AKV_ONEDNN=off`). `--memory` prints only the resident memory of each precision on each
prefill path (`AKV_PREFILL`), after the load and after a prefill.
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
import subprocess
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


# A fresh process: the resident memory (MB) after loading the model, then after one 512-token prefill (the
# packed copies' pages are resident only once a prefill has read them).
RESIDENT = """
import re, sys, torch
from akv_core.model.batch import ForwardBatch, SeqAttention
from akv_core.model.loader import load_model
def resident():
    return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) / 1024
model = load_model("smollm2", precision=sys.argv[1])
loaded, n = resident(), 512
ids, slots = torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(0)), torch.arange(n)
batch = ForwardBatch(ids, slots, slots, [SeqAttention(0, n, slots)], torch.tensor([n - 1]))
model.forward(batch, model.new_kv_buffers(n))
print(round(loaded, 1), round(resident(), 1))
"""


def resident_mb(precision: str = "float32", **env: str) -> tuple[float, float] | None:
    """A fresh process's resident memory (MB) after loading the model at `precision` with `env` set, and after
    one 512-token prefill; None without /proc."""
    if not Path("/proc/self/status").exists():
        return None
    out = subprocess.run([sys.executable, "-c", RESIDENT, precision], env={**os.environ, **env}, capture_output=True,
                         text=True, check=True, cwd=Path(__file__).resolve().parents[1])
    loaded, prefilled = out.stdout.split()[-2:]
    return float(loaded), float(prefilled)


def memory_table() -> list[list[Any]]:
    """Resident MB after a load and after a prefill, for each prefill path (`AKV_PREFILL`) and precision."""
    rows = []
    for precision in ("float32", "fp16", "int8", "int4"):
        cells: list[Any] = [precision]
        for path in ("bf16", "int8", "float32"):
            try:
                measured = resident_mb(precision, AKV_PREFILL=path)
            except subprocess.CalledProcessError as error:   # e.g. a forced int8 this CPU lacks: its message
                said = error.stderr.strip().splitlines() or [f"exit status {error.returncode}"]
                cells.append(f"refused: {said[-1][:60]}")
                continue
            cells.append("no /proc" if measured is None else f"{measured[0]:.0f} / {measured[1]:.0f}")
        rows.append(cells)
    return rows


def measure_products(rounds: int, repeats: int = 10) -> list[dict[str, Any]]:
    """GFLOPS of the model's projection shapes (qkv, gate_up, down: out x in) at 200 and 512 rows."""
    from akv_core.model.linear import OneDnnWeights
    from akv_core.threads import threads_for

    generator = torch.Generator().manual_seed(0)
    shapes = {"qkv": (960, 576), "gate_up": (3072, 576), "down": (576, 1536)}
    cells = []
    previous = torch.get_num_threads()
    torch.set_num_threads(threads_for("prefill", 512))
    try:
        for rows in (200, 512):
            for name, (n, k) in shapes.items():
                x, w = torch.randn(rows, k, generator=generator), torch.randn(n, k, generator=generator)
                packed = OneDnnWeights.pack(w, None)
                paths = {"onednn": lambda: packed(x), "torch": lambda: torch.nn.functional.linear(x, w)}
                times: dict[str, list[float]] = {path: [] for path in paths}
                for index in range(rounds + 1):   # the first round untimed
                    for path, run in paths.items():
                        started = time.perf_counter()
                        for _ in range(repeats):
                            run()
                        if index:
                            times[path].append((time.perf_counter() - started) / repeats)
                flops = 2 * rows * n * k
                cells.append({"rows": rows, "product": f"{name} {n}x{k}",
                              **{f"{path}_gflops": round(flops / statistics.median(t) / 1e9, 1)
                                 for path, t in times.items()}})
    finally:
        torch.set_num_threads(previous)
    return cells


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--memory", action="store_true",
                        help="only the resident memory of each precision on each prefill path (AKV_PREFILL)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds: expected a positive integer, got {args.rounds}")
    print(f"{os.cpu_count()} cores, torch {torch.__version__}; load average {os.getloadavg()[0]:.2f} at the start",
          flush=True)
    if args.memory:
        print("resident MB of a fresh process after loading the model / after one 512-token prefill:")
        print(format_table(["precision", "bf16 path", "int8 path", "float32 path"], memory_table()))
        return
    cells = measure(args.rounds)
    print(f"float32 prefill, median s of {args.rounds} alternating rounds:")
    print(format_table(["shape", "oneDNN s", "torch's F.linear s", "ratio"],
                       [[c["shape"], c["onednn_s"], c["torch_s"], ratio(c["torch_s"], c["onednn_s"])] for c in cells]))
    print("ratios, measured side by side in this run:")
    for c in cells:
        print(f"  float32 prefill, {c['shape']}, oneDNN vs torch's F.linear: {ratio(c['torch_s'], c['onednn_s'])}x")
    products = measure_products(args.rounds)
    print(f"the products alone, GFLOPS (median of {args.rounds} rounds of 10):")
    print(format_table(["rows", "product (out x in)", "oneDNN GFLOPS", "torch's F.linear GFLOPS", "ratio"],
                       [[c["rows"], c["product"], c["onednn_gflops"], c["torch_gflops"],
                         ratio(c["onednn_gflops"], c["torch_gflops"])] for c in products]))
    with_copies, without = resident_mb(AKV_ONEDNN="on"), resident_mb(AKV_ONEDNN="off")
    if with_copies is not None and without is not None:
        print(f"resident memory after loading the model and one 512-token prefill: {with_copies[1]} MB with the "
              f"packed copies, {without[1]} MB without (AKV_ONEDNN=off): +{round(with_copies[1] - without[1], 1)} MB")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
