"""The engine's model side against transformers (and llama.cpp) on the same GGUF file, side by side in one run.

    python benchmarks/engine.py [--precisions float32,fp16,mixed,int8,int4] [--peer llama-cpp]
                                [--serve fp16,int4] [--bursts 8] [--burst-steps 4] [--prefill-tokens 512,2048,8192]
                                [--prefill-threads 2] [--rounds 3] [--parts decode,prefill,accuracy,attention]
    python benchmarks/engine.py --serve int4 --serve-only [--peer llama-cpp]
    python benchmarks/engine.py --kernels

Prints the CPU's units (`cpu_summary()`) and each precision's prefill path (`akv_core.model.prefill`:
bf16, int8 or float32 products of prompts; `AKV_PREFILL` overrides), decode ms/token and prefill
tokens/s at each `--prefill-tokens` length for transformers (fp32) and for our forward in each
weight precision (float32 exact; fp16; mixed, the same weights as fp16; int8 per row; int4 in groups
of 32, the GGUF's Q4_1 tensors as stored; the residual stream and KV always fp32), with ratios
against transformers and against float32, each precision's accuracy against float32 on the float32
path (greedy next-token agreement and KL divergence on a fixed prompt set, `akv_core.model.accuracy`;
float32 itself too where `AKV_PREFILL` moves it to another path),
then decode attention time per step over a 6K-token history with 70% of it dropped against
nothing dropped.

`--peer llama-cpp` adds llama-cpp-python on the very same GGUF file (built from source, never
a dependency: docs/benchmarks.md), decoding single-stream at 1 and 2 threads beside our
precisions at the same thread counts, and prefilling beside us. `--serve P,...` starts `akv
serve --precision P` (for each P in turn) and times 8 concurrent requests of 64 completion
tokens decoding together against llama.cpp's single stream at the same thread count (1 and 2), the
two interleaved round by round: the aggregate decode rate (the batch's completion tokens beyond
its first ones over the wall time beyond that of the same batch asking for 1 token: prefill and
HTTP subtracted) and, beside it, the end-to-end rate (prefill included); `--serve-only` runs
just these rows. `--kernels` times each matmul kernel on the model's shapes (the fused ones at
1 to 16 rows) and the fused decode step by part at 1 to 16 rows.

`--parts` runs only some of the measurements (default all; `--parts decode` for the decode tables
alone, a short run; `--serve` runs whatever the parts).

Contenders take turns (decode in short bursts, prefill once per round), so that load from
other processes falls on all of them alike; before each decode burst an untimed pause of
SETTLE_S lets the threads the previous contender left spinning go to sleep (llama.cpp's did
cost the burst after it a fifth of its speed on 2 threads). When every contender runs on one thread, ratios
compare process CPU time (steady on a shared machine, where wall time mostly measures the wait
for a core); with more threads they compare wall time (CPU time then counts every thread, and
llama.cpp's threads spin while they wait). A ratio is the median over rounds of the per-round
ratio. Both sides run under the same per-phase thread policy (akv_core.threads).
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import copy
import dataclasses
import functools
import json
import os
import statistics
import tempfile
import time
import urllib.request
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from akv_core.model.accuracy import Accuracy, accuracy, float32_probes, logits_along, prompt_ids
from akv_core.model.batch import ForwardBatch, SeqAttention
from akv_core.model.linear import PRECISIONS, cpu_summary
from akv_core.model.loader import load_model
from akv_core.model.locate import embedded_gguf
from akv_core.model.prefill import PREFILL_SWITCH
from akv_core.model.reference import transformers_reference
from akv_core.threads import phase_threads, torch_threads
from benchmarks.common import cpu_model

PEER = "llama.cpp"


class Clock:
    """Wall time and this process's CPU time. On a shared machine the CPU time is the steadier
    measure of work (waiting for a core is not counted); with one thread per phase the two agree
    on an idle machine."""

    def __enter__(self) -> "Clock":
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


class Decoder(Protocol):
    def step(self) -> None: ...


class ReferenceDecoder:
    """transformers' greedy decoding with its own KV cache, one token per `step()`."""

    @torch.inference_mode()
    def __init__(self, hf, prompt: torch.Tensor) -> None:
        self.hf = hf
        out = hf(prompt[None], use_cache=True, logits_to_keep=1)
        self.past, self.token = out.past_key_values, out.logits[0, -1].argmax()

    @torch.inference_mode()
    def step(self) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the keyword's deprecation notice, once per step
            out = self.hf(self.token.view(1, 1), past_key_values=self.past, use_cache=True)
        self.past, self.token = out.past_key_values, out.logits[0, -1].argmax()


class OurDecoder:
    """Our forward over a slot pool, greedy, one token per `step()`."""

    def __init__(self, model, prompt: torch.Tensor, steps: int) -> None:
        self.model, n = model, prompt.numel()
        self.kv = model.new_kv_buffers(n + steps + 1)
        self.slots = torch.arange(n + steps + 1)
        logits = model.forward(ForwardBatch(prompt, self.slots[:n], self.slots[:n],
                                            [SeqAttention(0, n, self.slots[:n])], torch.tensor([n - 1])), self.kv)
        self.token, self.length = logits[0].argmax(), n

    def step(self) -> None:
        i, slot = self.length, self.slots[self.length:self.length + 1]
        logits = self.model.forward(ForwardBatch(self.token.view(1), slot, slot,
                                                 [SeqAttention(0, 1, self.slots[:i + 1])], torch.tensor([0])), self.kv)
        self.token, self.length = logits[0].argmax(), i + 1


class LlamaCppDecoder:
    """llama-cpp-python's greedy decoding on its own context, one token per `step()` (the argmax of the
    last row's logits, which llama.cpp's own greedy sampler reads)."""

    def __init__(self, llm: Any, prompt: torch.Tensor) -> None:
        import llama_cpp as api
        import numpy as np

        self.llm, self.api, self.np, self.vocab = llm, api, np, llm.n_vocab()
        llm.reset()
        llm.eval(prompt.tolist())
        self.token = self._greedy()

    def _greedy(self) -> int:
        row = self.api.llama_get_logits_ith(self.llm.ctx, -1)
        return int(self.np.ctypeslib.as_array(row, shape=(self.vocab,)).argmax())

    def step(self) -> None:
        self.llm.eval([self.token])
        self.token = self._greedy()


# Where llama-cpp-python lives when it is not in this environment: a virtual environment (or its
# site-packages folder) of the same Python, given by --llama-cpp or this variable.
LLAMA_CPP_ENV = "AKV_LLAMA_CPP"
LLAMA_CPP_BUILD = ("python3.11 -m venv VENV && CMAKE_ARGS=\"-DGGML_NATIVE=OFF -DGGML_AVX2=ON\" VENV/bin/pip install "
                   "--no-binary llama-cpp-python llama-cpp-python (add -DGGML_AVX512=ON where the CPU has AVX-512; "
                   "about 10 minutes on 2 cores), then pass --llama-cpp VENV")


def site_packages(where: Path) -> list[Path]:
    """`where` itself if it holds llama_cpp, else a virtual environment's site-packages of this Python."""
    if (where / "llama_cpp").is_dir():
        return [where]
    return sorted(where.glob(f"lib/python{sys.version_info.major}.{sys.version_info.minor}/site-packages"))


def import_llama_cpp(where: str | None) -> Any:
    """llama_cpp from this environment, else from `where` (a venv or site-packages folder), else a clear exit."""
    try:
        import llama_cpp
        return llama_cpp
    except ImportError:
        pass
    # Appended, not prepended: this environment's numpy stays the one in use.
    found = site_packages(Path(where).expanduser()) if where else []
    sys.path.extend(str(path) for path in found)
    try:
        import llama_cpp
        return llama_cpp
    except ImportError as err:
        looked = (f"in {where} (no llama_cpp package for Python {sys.version_info.major}.{sys.version_info.minor} "
                  f"there: {err})" if where else f"in this environment, and neither --llama-cpp nor ${LLAMA_CPP_ENV} "
                  "names another")
        raise SystemExit(f"--peer llama-cpp: llama-cpp-python was not found {looked}. It is a benchmark peer, never "
                         f"a dependency of this project; build it from source once: {LLAMA_CPP_BUILD} "
                         "(docs/benchmarks.md, Engine)") from None


def llama_cpp(threads: int, n_ctx: int, n_batch: int, where: str | None = None) -> Any:
    """llama-cpp-python on the embedded GGUF with `threads` for decode and prefill; a clear exit without it."""
    api = import_llama_cpp(where)
    return api.Llama(model_path=str(embedded_gguf()), n_ctx=n_ctx, n_batch=n_batch, n_threads=threads,
                     n_threads_batch=threads, verbose=False)


def llama_cpp_threads(llm: Any, threads: int) -> None:
    import llama_cpp

    llama_cpp.llama_set_n_threads(llm.ctx, threads, threads)


@torch.inference_mode()
def reference_prefill(hf, prompt: torch.Tensor) -> Clock:
    """Logits of the last row only, as transformers' generate() asks for."""
    with Clock() as clock:
        hf(prompt[None], use_cache=True, logits_to_keep=1)
    return clock


def our_prefill(model, prompt: torch.Tensor) -> Clock:
    n = prompt.numel()
    kv = model.new_kv_buffers(n)
    slots = torch.arange(n)
    with Clock() as clock:
        model.forward(ForwardBatch(prompt, slots, slots, [SeqAttention(0, n, slots)], torch.tensor([n - 1])), kv)
    return clock


def peer_prefill(llm: Any, prompt: torch.Tensor) -> Clock:
    ids = prompt.tolist()
    llm.reset()
    with Clock() as clock:
        llm.eval(ids)
    return clock


def attention_ms(model, history: int, kept_fraction: float, steps: int) -> float:
    """Decode attention (gather visible K/V + attend) summed over all layers, ms per step."""
    c = model.config
    generator = torch.Generator().manual_seed(0)
    kv = model.new_kv_buffers(history)
    for layer in range(c.num_layers):
        kv.k[layer].normal_(generator=generator)
        kv.v[layer].normal_(generator=generator)
    kept = torch.randperm(history, generator=generator)[:int(history * kept_fraction)].sort().values
    q = torch.randn(1, c.num_heads, c.head_dim, generator=generator)
    times = []
    for _ in range(steps):
        with Clock() as clock:
            for layer in range(c.num_layers):
                model.attend(layer, 0, q, kv, kept, None)
        times.append(clock.cpu)
    return statistics.median(times) * 1e3


# A pause before each burst, untimed: threads the previous contender left spinning (llama.cpp's, OpenMP's,
# the fused kernels' pool) are asleep when the next one starts, as they would be were it running alone.
SETTLE_S = 0.05


def decode_bursts(decoders: dict[str, Decoder], bursts: int, steps: int) -> dict[str, list[Clock]]:
    """Every decoder in turn, `steps` tokens per burst, `bursts` times."""
    clocks: dict[str, list[Clock]] = {name: [] for name in decoders}
    for _ in range(bursts):
        for name, decoder in decoders.items():
            time.sleep(SETTLE_S)
            with Clock() as clock:
                for _ in range(steps):
                    decoder.step()
            clocks[name].append(clock)
    return clocks


def summary(title: str, unit: str, clocks: dict[str, list[Clock]], scale: float, per_second: Callable[[float], float],
            threads: int, baselines: tuple[str, ...] = ("transformers", PEER)) -> None:
    """Median CPU and wall time per contender and the median per-round ratio against each baseline present
    (CPU time on one thread, wall time on more: see the module docstring)."""
    measure = "cpu" if threads == 1 else "wall"
    print(f"{title}; ratios by {measure} time")
    baselines = tuple(name for name in baselines if name in clocks)
    for name, values in clocks.items():
        cpu = statistics.median(c.cpu for c in values) * scale
        wall = statistics.median(c.wall for c in values) * scale
        ratios = "".join(f"  {statistics.median(getattr(b, measure) / getattr(v, measure) for b, v in zip(clocks[base], values)):5.2f}x {base}"
                         for base in baselines)
        rate = per_second(cpu if threads == 1 else wall)
        print(f"  {name:13s} {cpu:9.2f} {unit} cpu  {wall:9.2f} {unit} wall  {rate:8.1f} tok/s{ratios}")


def prefill_rounds(hf, ours: dict[str, Any], llm: Any | None, tokens: int, rounds: int, threads: int | None) -> None:
    """Each contender prefills one `tokens`-token prompt per round, in turn; then the summary with ratios against
    transformers and float32 (a bf16 / int8 path beside the exact one). Threads: `threads`, else the engine's
    policy for a prefill (the idle cores)."""
    prompt = torch.randint(100, 40000, (tokens,), generator=torch.Generator().manual_seed(tokens))
    clocks: dict[str, list[Clock]] = {name: [] for name in ("transformers", *ours, *([PEER] if llm else []))}
    for round_index in range(rounds):
        with (torch_threads(threads) if threads else phase_threads("prefill", tokens)) as used:
            clocks["transformers"].append(reference_prefill(hf, prompt))
            for name, model in ours.items():
                clocks[name].append(our_prefill(model, prompt))
            if llm is not None:
                llama_cpp_threads(llm, used)
                clocks[PEER].append(peer_prefill(llm, prompt))
        print(f"prefill {tokens} tokens, round {round_index + 1}/{rounds} ({used} thread(s); cpu s / wall s): "
              + ", ".join(f"{k} {v[-1].cpu:.2f} / {v[-1].wall:.2f}" for k, v in clocks.items()), flush=True)
    summary(f"prefill ({used} thread(s), {tokens} tokens, {rounds} rounds; load average {os.getloadavg()[0]:.2f} "
            "after)", "s", clocks, 1.0, lambda seconds: tokens / seconds, used, ("transformers", "float32", PEER))


def float32_reference(loaded: Any | None) -> Any:
    """float32 weights on the float32 prefill path, the exact reference: `loaded` where it is that, else a fresh
    load (`AKV_PREFILL` may have put the benchmark's float32 on another path, to measure it)."""
    if loaded is not None and loaded.prefill_path.kind == "float32":
        return loaded
    with _environment({PREFILL_SWITCH: "float32"}):
        return load_model("smollm2")


def print_accuracy(name: str, result: Accuracy) -> None:
    for phase in ("prefill", "decode"):
        a = getattr(result, phase)
        print(f"  {name:8s} {phase:7s} {a.positions:4d} positions  greedy token = float32's {a.top1 * 100:6.2f}%"
              f"  KL mean {a.kl_mean:.5f}  max {a.kl_max:.4f} nats")


def serve_rounds(precision: str, llm: Any | None, prompt: torch.Tensor, rounds: int, streams: int,
                 max_tokens: int, threads: int = 1) -> None:
    """`akv serve --precision P` with `threads` decode and prefill threads: `streams` requests at once, decoding
    together, against llama.cpp's single stream of `max_tokens` tokens on as many threads, in turn per round.

    Each round sends the batch twice, on prompts of the same length: once asking for 1 completion token
    (the prefills, their first tokens and the HTTP exchanges) and once for `max_tokens`. The aggregate
    decode rate is the extra completion tokens of the second over its extra wall time: what the server
    decodes per second once every stream is decoding. The end-to-end rate (completion tokens over the
    second batch's whole wall time, prefill included) is printed beside it."""
    from benchmarks.serving import akv_server

    kv_tokens = streams * (256 + max_tokens)
    env = dict(os.environ, AKV_DECODE_THREADS=str(threads), AKV_PREFILL_THREADS=str(threads))
    with tempfile.TemporaryDirectory() as tmp, _environment(env), \
            akv_server(kv_tokens, streams, Path(tmp), ["--precision", precision]) as url:
        _chat(url, "Say hello.", 2, 0)  # warm-up: the first request pays for lazy initialisation
        decode, whole, theirs = [], [], []
        for round_index in range(rounds):
            first_tokens, first_wall = _concurrent(url, streams, 1, salt=2 * round_index)
            tokens, wall = _concurrent(url, streams, max_tokens, salt=2 * round_index + 1)
            decode.append((tokens - first_tokens) / (wall - first_wall))
            whole.append(tokens / wall)
            if llm is not None:
                llama_cpp_threads(llm, threads)
                decoder = LlamaCppDecoder(llm, prompt)
                with Clock() as clock:
                    for _ in range(max_tokens):
                        decoder.step()
                theirs.append(max_tokens / clock.wall)
            print(f"serve round {round_index + 1}/{rounds} (load {os.getloadavg()[0]:.2f}): akv serve {streams} streams "
                  f"decode {decode[-1]:.1f} tok/s, end to end {whole[-1]:.1f} tok/s (prefill {first_wall:.2f} s of "
                  f"{wall:.2f} s)" + (f"; {PEER} 1 stream {theirs[-1]:.1f} tok/s" if theirs else ""), flush=True)
    line = (f"akv serve --precision {precision}, {streams} concurrent requests of {max_tokens} tokens, {threads} "
            f"thread(s): "
            f"aggregate decode {statistics.median(decode):.1f} completion tok/s (end to end, prefill included: "
            f"{statistics.median(whole):.1f})")
    if theirs:
        ratio = statistics.median(o / t for o, t in zip(decode, theirs))
        ratio_whole = statistics.median(o / t for o, t in zip(whole, theirs))
        line += (f"; {PEER} single stream, {threads} thread(s): {statistics.median(theirs):.1f} tok/s; decode {ratio:.2f}x "
                 f"{PEER} (end to end {ratio_whole:.2f}x)")
    print(line)


@contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    """The server subprocess inherits os.environ: set it for the duration."""
    previous = dict(os.environ)
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(previous)


def _chat(url: str, text: str, max_tokens: int, seed: int) -> int:
    body = {"model": "smollm2", "max_tokens": max_tokens, "temperature": 0.8, "seed": seed,
            "messages": [{"role": "user", "content": text}]}
    request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return int(json.load(response)["usage"]["completion_tokens"])


def _concurrent(url: str, streams: int, max_tokens: int, salt: int) -> tuple[int, float]:
    """(completion tokens, wall seconds) of `streams` long-answer requests sent at once."""
    from benchmarks.common import at_once

    counts = [0] * streams

    def worker(i: int) -> None:
        counts[i] = _chat(url, f"Write a long story about a lighthouse keeper, chapter {salt * streams + i + 1}.",
                          max_tokens, seed=salt * streams + i)

    wall = at_once([functools.partial(worker, i) for i in range(streams)], name="request")
    return sum(counts), wall


class DynamicInt8:
    """fbgemm's dynamically quantized int8 GEMM: int8 weights per row, each call's input quantized to 7-bit
    uint8 per tensor. The fastest CPU product here, measured for its accuracy and never used by the engine."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        from akv_core.model.quantized import quantize_int8_rows

        q, scale = quantize_int8_rows(weight)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # quantized tensors are marked deprecated; the kernel is not
            quantized = torch._make_per_channel_quantized_tensor(q, scale.double(),
                                                                torch.zeros(q.shape[0], dtype=torch.long), 0)
        self.packed, self.bias, self.out_features = torch.ops.quantized.linear_prepack(quantized, None), bias, q.shape[0]

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        y = torch.ops.quantized.linear_dynamic(x.float().contiguous(), self.packed, True)
        return y if self.bias is None else y + self.bias


def dynamic_int8_model(exact: Any) -> Any:
    """The float32 model with every projection, the output one included, on `DynamicInt8`."""
    model = copy.copy(exact)
    model.layers = [dataclasses.replace(layer, **{name: DynamicInt8(getattr(layer, name).weight, getattr(layer, name).bias)
                                                  for name in ("qkv", "o", "gate_up", "down")})
                    for layer in exact.layers]
    model.lm_head = DynamicInt8(exact.lm_head.weight)
    return model


KERNEL_SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
KERNEL_ROWS = (1, 2, 4, 8, 16)     # one call of a fused kernel takes at most 16 rows
STEP_ROWS = (*KERNEL_ROWS, 32)     # beyond 16 the fused step makes several calls


def kernel_table(repeats: int = 20) -> None:
    """Every CPU matmul kernel torch offers for these precisions, on SmolLM2's projection shapes, one thread:
    median CPU microseconds per product (weights stay in cache except lm_head's)."""
    from akv_core.model.linear import Linear
    from akv_core.model.quantized import Int4Groups, Int4Linear, Int8Linear, quantize_int8_rows, torch_int4_pack

    kernels = {"fp32 (MKL)": lambda w: Linear(w), "fp16 (fbgemm)": lambda w: Linear(w, None, "fp16"),
               "bf16": lambda w: (lambda x, b=w.bfloat16(): torch.nn.functional.linear(x.bfloat16(), b)),
               "int8 weight-only": lambda w: (lambda x, q=quantize_int8_rows(w): torch.ops.aten._weight_int8pack_mm(
                   x.bfloat16(), q[0], q[1].bfloat16())),
               "int4 weight-only": lambda w: (lambda x, packed=torch_int4_pack(Int4Groups.quantize(w)):
                                              torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), packed[0], 32,
                                                                                         packed[1])),
               "int8 dynamic (fbgemm)": DynamicInt8}
    from akv_core.kernels import cpu_gemv

    if cpu_gemv.available():  # ours, decode-sized inputs only (at most 16 rows)
        kernels["int8 fused (cpu_gemv)"] = lambda w: Int8Linear(w).product
        kernels["int4 fused (cpu_gemv)"] = lambda w: Int4Linear(Int4Groups.quantize(w)).product
    rows_tried = (1, 8, 512)
    print(f"kernels, 1 thread, median CPU us per product ({', '.join(f'{r} rows' for r in rows_tried)}; the fused "
          f"ones at {', '.join(map(str, KERNEL_ROWS))} rows):")
    generator = torch.Generator().manual_seed(0)
    with torch_threads(1):
        for shape_name, (n, k) in KERNEL_SHAPES.items():
            weight = torch.randn(n, k, generator=generator) * 0.05
            for kernel_name, make in kernels.items():
                product = make(weight)
                cells = []
                fused = "fused" in kernel_name
                for rows in KERNEL_ROWS if fused else rows_tried[:2] if shape_name == "lm_head" else rows_tried:
                    x = torch.randn(rows, k, generator=generator)
                    product(x)
                    times = []
                    for _ in range(repeats if rows < 512 else 3):
                        with Clock() as clock:
                            product(x)
                        times.append(clock.cpu)
                    cells.append(f"{statistics.median(times) * 1e6:10.1f}")
                print(f"  {shape_name:8s} {n:5d}x{k:<5d} {kernel_name:22s}" + "".join(cells), flush=True)


def decode_step_table(precision: str = "int4", context: int = 128, repeats: int = 10) -> None:
    """The fused decode step of `precision` at 1..16 rows (one per sequence, each attending to its own
    `context` slots), one thread: median CPU ms of the whole forward, of its parts (the layers' one C call,
    the attention within it timed alone, the output projection) and what is left (Python, the embedding),
    the tokens per second the step gives, and the same forward on torch's kernels (`AKV_CPU_GEMV=off`)."""
    from akv_core.kernels import cpu_gemv

    model = load_model("smollm2", precision=precision)
    if not model.fused_decode:
        print(f"decode step: {precision} does not take the fused path here ({cpu_gemv.why_unavailable()})")
        return
    with _environment({cpu_gemv.SWITCH: "off"}):
        on_torch = load_model("smollm2", precision=precision)
    generator = torch.Generator().manual_seed(0)
    print(f"decode step, {precision}, 1 thread, {context} context slots per sequence, median CPU ms per step:")
    print("  rows   forward   layers (attention)   lm_head   rest    tok/s   ms/row   torch's kernels: ms   tok/s")
    with torch_threads(1):
        for rows in STEP_ROWS:
            batch, kv = _decode_batch(model, rows, context, generator)
            ms = _fused_parts(model, batch, kv, repeats)
            ms["attention"] = statistics.median(_attention_alone(model, kv, batch, repeats)[1:]) * 1e3
            torch_ms = statistics.median(_forward_times(on_torch, batch, kv, repeats)[1:]) * 1e3
            rest = ms["forward"] - ms["layers"] - ms["lm_head"]
            print(f"  {rows:4d} {ms['forward']:9.2f} {ms['layers']:8.2f} ({ms['attention']:6.2f}) {ms['lm_head']:12.2f} "
                  f"{rest:6.2f} {rows * 1e3 / ms['forward']:8.1f} {ms['forward'] / rows:8.2f} {torch_ms:21.2f} "
                  f"{rows * 1e3 / torch_ms:7.1f}", flush=True)


def _decode_batch(model, rows: int, context: int, generator: torch.Generator) -> tuple[ForwardBatch, Any]:
    """One decode row per sequence, each sequence attending to its own `context` random K/V slots and its new one."""
    kv = model.new_kv_buffers(rows * (context + 1))
    for layer in range(model.config.num_layers):
        kv.k[layer].normal_(generator=generator)
        kv.v[layer].normal_(generator=generator)
    slots = torch.arange(rows * (context + 1)).view(rows, context + 1)
    seqs = [SeqAttention(m, 1, slots[m]) for m in range(rows)]
    return ForwardBatch(torch.randint(100, 40000, (rows,), generator=generator), torch.full((rows,), context),
                        slots[:, -1].contiguous(), seqs, torch.arange(rows)), kv


def _forward_times(model, batch: ForwardBatch, kv, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats + 1):
        with Clock() as clock:
            model.forward(batch, kv)
        times.append(clock.cpu)
    return times


def _fused_parts(model, batch: ForwardBatch, kv, repeats: int) -> dict[str, float]:
    """Median CPU ms of the fused forward, of its layers' C call and of its output projection."""
    from akv_core.kernels import cpu_gemv

    timed: dict[str, list[float]] = {"layers": [0.0] * (repeats + 1), "lm_head": [0.0] * (repeats + 1)}
    stack_call, head = cpu_gemv.DecodeStack.__call__, model.lm_head.product
    done = [0]   # forwards finished: a forward's calls add up in its own entry

    def layers(self, *args, **kwargs):
        with Clock() as clock:
            stack_call(self, *args, **kwargs)
        timed["layers"][done[0]] += clock.cpu

    def lm_head(*args, **kwargs):
        with Clock() as clock:
            out = head(*args, **kwargs)
        timed["lm_head"][done[0]] += clock.cpu
        return out

    cpu_gemv.DecodeStack.__call__, model.lm_head.product = layers, lm_head
    try:
        timed["forward"] = []
        for _ in range(repeats + 1):
            timed["forward"].extend(_forward_times(model, batch, kv, 0))
            done[0] += 1
    finally:
        cpu_gemv.DecodeStack.__call__ = stack_call
        del model.lm_head.product
    return {name: statistics.median(values[1:]) * 1e3 for name, values in timed.items()}


def _attention_alone(model, kv, batch: ForwardBatch, repeats: int) -> list[float]:
    """CPU seconds of the fused attention of every layer over the batch's slots (RoPE, K/V write, attention, on
    random q/k/v rows), less the same calls over no slots (what calling the kernel 30 times from Python costs)."""
    from akv_core.kernels import cpu_gemv

    c = model.config
    rows = len(batch.seqs)
    width = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    cos, sin = (t.reshape(rows, -1).contiguous() for t in model.rope.cos_sin(batch.positions))
    slots = torch.cat([seq.kv_slots for seq in batch.seqs])
    offsets = torch.tensor([0, *(seq.kv_slots.numel() for seq in batch.seqs)]).cumsum(0)
    times = []
    for _ in range(repeats + 1):
        qkv = torch.randn(rows, width)
        clocks = []
        for visible in (offsets, torch.zeros_like(offsets)):
            with Clock() as clock:
                for layer in range(c.num_layers):
                    cpu_gemv.decode_attention(qkv, c.num_heads, c.num_kv_heads, cos, sin, kv.k[layer], kv.v[layer],
                                              batch.out_slots, slots, visible, model._scale)
            clocks.append(clock.cpu)
        times.append(clocks[0] - clocks[1])
    return times


PARTS = ("decode", "prefill", "accuracy", "attention")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help="ours, comma-separated")
    parser.add_argument("--kernels", action="store_true", help="only time each matmul kernel on the model's shapes")
    parser.add_argument("--peer", choices=("llama-cpp",), help="also measure llama-cpp-python on the same GGUF")
    parser.add_argument("--llama-cpp", default=os.environ.get(LLAMA_CPP_ENV), metavar="VENV",
                        help=f"a virtual environment (or site-packages folder) holding llama-cpp-python, when this "
                        f"one has none (default ${LLAMA_CPP_ENV})")
    parser.add_argument("--serve", default="", help="precisions (comma-separated) to also time 8 concurrent "
                        "requests on akv serve with")
    parser.add_argument("--serve-streams", type=int, default=8)
    parser.add_argument("--serve-tokens", type=int, default=64, help="completion tokens per request")
    parser.add_argument("--serve-rounds", type=int, default=3)
    parser.add_argument("--serve-threads", default="1,2", help="thread counts of the serve rows (the server's and "
                        "llama.cpp's alike), comma-separated")
    parser.add_argument("--serve-only", action="store_true", help="only the --serve rows (and llama.cpp's single "
                        "stream beside them with --peer)")
    parser.add_argument("--decode-prompt", type=int, default=128)
    parser.add_argument("--bursts", type=int, default=8, help="decode rounds; each runs every contender")
    parser.add_argument("--burst-steps", type=int, default=4)
    parser.add_argument("--prefill-tokens", default="512,2048,8192", help="prompt lengths, comma-separated")
    parser.add_argument("--prefill-threads", type=int, default=None, help="threads for every prefill (default: "
                        "the engine's policy, the idle cores)")
    parser.add_argument("--rounds", type=int, default=3, help="prefill rounds")
    parser.add_argument("--history", type=int, default=6144)
    parser.add_argument("--parts", default=",".join(PARTS), help="measurements to run, comma-separated")
    args = parser.parse_args()
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    try:
        args.prefill_tokens = [int(t) for t in args.prefill_tokens.split(",") if t.strip()]
    except ValueError:
        parser.error(f"--prefill-tokens: expected prompt lengths such as 512,2048, got {args.prefill_tokens!r}")
    if not args.prefill_tokens or min(args.prefill_tokens) <= 16:
        parser.error("--prefill-tokens: at least one length, each more than 16 tokens (a prefill-sized product)")
    try:
        args.serve_threads = [int(t) for t in args.serve_threads.split(",") if t.strip()]
    except ValueError:
        parser.error(f"--serve-threads: expected thread counts such as 1,2, got {args.serve_threads!r}")
    if not args.serve_threads or min(args.serve_threads) < 1:
        parser.error("--serve-threads: at least one thread count, each 1 or more")
    if not args.parts or set(args.parts) - set(PARTS):
        parser.error(f"--parts: expected some of {', '.join(PARTS)}, got {', '.join(args.parts) or 'none'}")
    for option in ("precisions", "serve"):
        chosen = [p.strip() for p in getattr(args, option).split(",") if p.strip()]
        unknown = [p for p in chosen if p not in PRECISIONS]
        if unknown:
            parser.error(f"--{option}: unknown {', '.join(unknown)} (expected some of {', '.join(PRECISIONS)})")
        setattr(args, option, chosen)
    return args


def serve(args: argparse.Namespace, llm: Any | None, prompt: torch.Tensor) -> None:
    for precision in args.serve:
        for threads in args.serve_threads:
            serve_rounds(precision, llm, prompt, args.serve_rounds, args.serve_streams, args.serve_tokens, threads)


def main() -> None:
    args = parse_args()
    from akv_core.kernels import cpu_gemv

    fused = cpu_gemv.why_unavailable()
    print(f"{cpu_model()} ({cpu_summary()}), {os.cpu_count()} cores, torch {torch.__version__}; "
          f"load average {os.getloadavg()[0]:.2f} at the start; int8 / int4 decode on "
          + ("the fused C kernels (akv_core.kernels.cpu_gemv)" if fused is None else f"torch's kernels ({fused})"),
          flush=True)
    if args.kernels:
        kernel_table()
        if cpu_gemv.available():
            for precision in ("int4", "int8", "float32"):
                decode_step_table(precision)
        return
    if args.peer:
        import_llama_cpp(args.llama_cpp)  # before minutes of loading: its absence is explained at once
    if args.serve_only:
        if not args.serve:
            raise SystemExit("--serve-only: name the precisions to serve with --serve (e.g. --serve int4)")
        n_ctx = args.decode_prompt + args.serve_tokens + 1
        llm = llama_cpp(1, n_ctx, n_ctx, args.llama_cpp) if args.peer else None
        decode_prompt = torch.randint(100, 40000, (args.decode_prompt,), generator=torch.Generator().manual_seed(0))
        serve(args, llm, decode_prompt)
        print(f"load average {os.getloadavg()[0]:.2f} at the end")
        return
    hf = transformers_reference()
    ours = {name: load_model("smollm2", precision=name) for name in args.precisions}
    print("prefill paths (akv_core.model.prefill; AKV_PREFILL overrides): "
          + ", ".join(f"{name} {model.prefill_path}" for name, model in ours.items()), flush=True)
    n_ctx = max(*args.prefill_tokens, args.decode_prompt + args.bursts * args.burst_steps + 1,
                args.decode_prompt + args.serve_tokens + 1)
    llm = llama_cpp(1, n_ctx, max(args.prefill_tokens), args.llama_cpp) if args.peer else None
    generator = torch.Generator().manual_seed(0)
    decode_prompt = torch.randint(100, 40000, (args.decode_prompt,), generator=generator)
    steps = args.bursts * args.burst_steps

    # Decode: short bursts in turn, so that load from other processes falls on every contender alike.
    for threads in ((1, 2) if llm is not None else (1,)) if "decode" in args.parts else ():
        with torch_threads(threads):
            decoders: dict[str, Decoder] = {"transformers": ReferenceDecoder(hf, decode_prompt)} if threads == 1 else {}
            decoders.update({name: OurDecoder(model, decode_prompt, steps) for name, model in ours.items()})
            if llm is not None:
                llama_cpp_threads(llm, threads)
                decoders[PEER] = LlamaCppDecoder(llm, decode_prompt)
            decode = decode_bursts(decoders, args.bursts, args.burst_steps)
        summary(f"decode ({threads} thread(s), {args.decode_prompt}-token prompt, {args.bursts} bursts of "
                f"{args.burst_steps} steps; load average {os.getloadavg()[0]:.2f} after)", "ms/token", decode, 1e3 / args.burst_steps, lambda ms: 1e3 / ms, threads)

    for tokens in args.prefill_tokens if "prefill" in args.parts else ():
        prefill_rounds(hf, ours, llm, tokens, args.rounds, args.prefill_threads)

    exact = float32_reference(ours.get("float32")) if "accuracy" in args.parts else None
    reduced = [name for name, model in ours.items() if model is not exact]
    if reduced and exact is not None:
        with phase_threads("decode"):
            probes = float32_probes(exact, prompt_ids())
            reference_logits = [logits_along(exact, probe) for probe in probes]
            print(f"accuracy against float32 (on the float32 path): {len(probes)} chat prompts, each with float32's "
                  "greedy continuation")
            for name in reduced:
                print_accuracy(name, accuracy(ours[name], probes, reference_logits))
            # fbgemm's dynamic int8 GEMM, the fastest CPU product: why no precision uses it.
            print_accuracy("int8-dyn", accuracy(dynamic_int8_model(exact), probes, reference_logits))
            print("  (int8-dyn: fbgemm's dynamically quantized int8 GEMM, 7-bit activations; measured, not used)")

    if "attention" in args.parts:
        with phase_threads("decode"):
            attention_model = next(iter(ours.values()))
            full = attention_ms(attention_model, args.history, 1.0, 10)
            dropped = attention_ms(attention_model, args.history, 0.3, 10)
        print(f"decode attention over {args.history} slots, all layers, per step: none dropped {full:.2f} ms, "
              f"70% dropped {dropped:.2f} ms, {full / dropped:.2f}x faster")

    serve(args, llm, decode_prompt)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
