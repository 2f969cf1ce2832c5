"""Chunked prefill: a short request beside a long prefill, and what chunking costs, in one run.

    python benchmarks/chunked_prefill.py [--long-tokens 7500] [--short-tokens 16] [--chunk 512]
                                         [--throughput-tokens 2048] [--chunks 256,512,1024] [--rounds 3]
                                         [--head-only]

1. Head of line. An engine runs on its loop thread, as `akv serve` runs it. A long prompt is
   submitted; once two of its chunks have run, a short request is submitted, and its time to
   first token is measured: in seconds, and in units of the long prompt's chunk forwards (the
   median duration of the forwards that computed only its chunks). The same two requests run
   without chunking (whole prompts per step), the short one submitted after the same delay.
2. Throughput. A fresh prompt of `--throughput-tokens` is prefilled (max_tokens 1) whole and
   in chunks of each size, taking turns in every round so that load from other processes falls
   on all of them alike; the ratio is chunked over whole prefill tokens per second (process
   CPU time, steady on a shared machine; wall time printed beside it), the median over rounds.

One thread per phase for every contender (akv_core.threads would pick fewer on a busy machine).
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import `benchmarks` and the packages from this checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from akv_core.engine import DEFAULT_PREFILL_CHUNK, Engine
from benchmarks.common import format_table, ratio

THREADS = {"prefill": 1, "decode": 1}
WORDS = ("amber", "basalt", "cedar", "delta", "ember", "fjord", "granite", "harbor", "indigo", "juniper",
         "kelp", "lagoon", "meadow", "nickel", "orchid", "prairie", "quartz", "river", "saffron", "tundra")


def prompt_of(tokenizer: Any, tokens: int, tag: str) -> list[dict[str, str]]:
    """A one-message history of about `tokens` tokens; `tag` makes it share no prefix with others."""
    sentences = [f"{tag}."]
    message = [{"role": "user", "content": ""}]
    step = max(1, tokens // 200)
    while True:
        for _ in range(step):
            i = len(sentences)
            sentences.append(f"Note {i}: the {WORDS[i % 20]} {WORDS[(i * 7) % 20]} of site {i * 13 % 997} "
                             f"measured {i * 31 % 1000} units.")
        message[0]["content"] = " ".join(sentences)
        if len(tokenizer.render(message).token_ids) >= tokens:
            return message


@dataclass
class ForwardLog:
    """Start, end and token count of every forward the model runs (the engine's steps)."""

    spans: list[tuple[float, float, int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def wrap(self, model: Any) -> Any:
        forward = model.forward

        def timed(batch, kv):
            start = time.perf_counter()
            logits = forward(batch, kv)
            with self.lock:
                self.spans.append((start, time.perf_counter(), batch.input_ids.numel()))
            return logits

        model.forward = timed
        return forward


def head_of_line(model: Any, tokenizer: Any, long_tokens: int, short_tokens: int, chunk: int | None,
                 delay: float | None) -> dict[str, float]:
    """The short request's time to first token while the long prompt prefills; `delay` None: after two chunks."""
    long, short = prompt_of(tokenizer, long_tokens, "long"), prompt_of(tokenizer, short_tokens, "short")
    engine = Engine(model, tokenizer, long_tokens + short_tokens + 1024, 8, threads=THREADS, prefill_chunk=chunk)
    log = ForwardLog()
    original = log.wrap(model)
    stop = threading.Event()
    loop = threading.Thread(target=engine.run_forever, args=(stop,), daemon=True)
    loop.start()
    try:
        started, cpu = time.perf_counter(), time.process_time()
        long_handle = engine.submit(long, max_tokens=1)
        if delay is None:
            while len(log.spans) < 2:
                time.sleep(0.001)
            delay = log.spans[1][1] - started
        else:
            time.sleep(delay)
        submitted = time.perf_counter()
        short_handle = engine.submit(short, max_tokens=4)
        short_handle.events.get()
        first_token = time.perf_counter() - submitted
        long_handle.result()
        short_handle.result()
        finished, cpu = time.perf_counter() - started, time.process_time() - cpu
    finally:
        stop.set()
        loop.join()
        model.forward = original
    alone = [end - start for start, end, n in log.spans if chunk is not None and n >= chunk]
    return {"ttft_s": first_token, "delay_s": delay, "long_total_s": finished, "cpu_s": cpu,
            "chunk_s": statistics.median(alone) if alone else 0.0, "forwards": len(log.spans)}


def prefill_once(model: Any, tokenizer: Any, messages: list[dict[str, str]], chunk: int | None) -> tuple[float, float]:
    engine = Engine(model, tokenizer, len(tokenizer.render(messages).token_ids) + 8, 1, threads=THREADS,
                    prefill_chunk=chunk)
    wall, cpu = time.perf_counter(), time.process_time()
    engine.generate(messages, max_tokens=1)
    return time.perf_counter() - wall, time.process_time() - cpu


def throughput(model: Any, tokenizer: Any, tokens: int, chunks: list[int], rounds: int) -> dict[str, Any]:
    contenders: list[int | None] = [None, *chunks]
    cpu: dict[int | None, list[float]] = {c: [] for c in contenders}
    wall: dict[int | None, list[float]] = {c: [] for c in contenders}
    n = 0
    for round_index in range(rounds):
        order = contenders if round_index % 2 == 0 else contenders[::-1]
        for chunk in order:
            messages = prompt_of(tokenizer, tokens, f"round {round_index} chunk {chunk}")
            n = len(tokenizer.render(messages).token_ids)
            seconds_wall, seconds_cpu = prefill_once(model, tokenizer, messages, chunk)
            cpu[chunk].append(seconds_cpu)
            wall[chunk].append(seconds_wall)
    rows = []
    for chunk in contenders:
        per_round = [whole / mine for whole, mine in zip(cpu[None], cpu[chunk])]
        rows.append(["whole prompt" if chunk is None else f"chunks of {chunk}", n / statistics.median(cpu[chunk]),
                     n / statistics.median(wall[chunk]), round(statistics.median(per_round), 3)])
    return {"tokens": n, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long-tokens", type=int, default=7500)
    parser.add_argument("--short-tokens", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=DEFAULT_PREFILL_CHUNK)
    parser.add_argument("--throughput-tokens", type=int, default=2048)
    parser.add_argument("--chunks", default="256,512,1024")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--head-only", action="store_true", help="only the head-of-line measurement")
    args = parser.parse_args()
    torch.set_num_threads(1)
    base = Engine.from_pretrained("smollm2", device="cpu", kv_tokens=1)
    model, tokenizer = base.model, base.tokenizer
    prefill_once(model, tokenizer, prompt_of(tokenizer, 256, "warm-up"), None)

    chunked = head_of_line(model, tokenizer, args.long_tokens, args.short_tokens, args.chunk, None)
    whole = head_of_line(model, tokenizer, args.long_tokens, args.short_tokens, None, chunked["delay_s"])
    print(f"Head of line: a {args.short_tokens}-token request submitted {chunked['delay_s']:.1f} s into a "
          f"{args.long_tokens}-token prefill")
    print(format_table(
        ["prefill", "time to first token, s", "chunk forward, s", "TTFT in chunks", "both done, s",
         "both done, CPU s"],
        [[f"chunks of {args.chunk}", chunked["ttft_s"], chunked["chunk_s"],
          ratio(chunked["ttft_s"], chunked["chunk_s"]), chunked["long_total_s"], chunked["cpu_s"]],
         ["whole prompt", whole["ttft_s"], None, None, whole["long_total_s"], whole["cpu_s"]]]))
    print(f"TTFT chunked vs whole: {ratio(chunked['ttft_s'], whole['ttft_s'])}x "
          f"(target: within 3 chunks' time); CPU for both requests, whole vs chunked: "
          f"{ratio(whole['cpu_s'], chunked['cpu_s'])}x\n")
    if args.head_only:
        return

    result = throughput(model, tokenizer, args.throughput_tokens, [int(c) for c in args.chunks.split(",")],
                        args.rounds)
    print(f"Single-stream prefill of {result['tokens']} tokens, median of {args.rounds} rounds")
    print(format_table(["prefill", "tokens/s (CPU)", "tokens/s (wall)", "vs whole (CPU)"], result["rows"]))
    print("(target: chunked at least 0.9x of whole)")


if __name__ == "__main__":
    main()
