"""The engine's model side against transformers on the same GGUF file, side by side in one run.

    python benchmarks/engine.py [--decode-steps 32] [--prefill-tokens 2048] [--rounds 3]

Prints decode ms/token and prefill tokens/s for transformers (fp32) and our forward in
each weight precision (float32 exact; fp16; mixed = fp16 decode, bf16 prefill; always
fp32 activations and KV), plus
decode attention time per step over a 6K-token history with 70% of it dropped
against nothing dropped. Rounds alternate between the contenders so that load from
other processes falls on all of them alike; each figure is the median over rounds.
Both sides run under the same thread policy (akv_core.threads) per phase.
"""
from __future__ import annotations

import os

os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF conversion progress bar

import argparse
import statistics
import time
import warnings

import torch

from akv_core.model.batch import ForwardBatch, SeqAttention
from akv_core.model.loader import load_model
from akv_core.model.locate import embedded_gguf
from akv_core.threads import phase_threads


def load_reference():
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    path = embedded_gguf()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@torch.inference_mode()
def reference_decode(hf, prompt: torch.Tensor, steps: int) -> float:
    """ms per generated token, greedy, transformers' own KV cache."""
    out = hf(prompt[None], use_cache=True, logits_to_keep=1)
    past, token = out.past_key_values, out.logits[0, -1].argmax()
    start = time.perf_counter()
    for _ in range(steps):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the keyword's deprecation notice, once per step
            out = hf(token.view(1, 1), past_key_values=past, use_cache=True)
        past, token = out.past_key_values, out.logits[0, -1].argmax()
    return (time.perf_counter() - start) / steps * 1e3


def our_decode(model, prompt: torch.Tensor, steps: int) -> float:
    n = prompt.numel()
    kv = model.new_kv_buffers(n + steps + 1)
    slots = torch.arange(n + steps + 1)
    logits = model.forward(ForwardBatch(prompt, slots[:n], slots[:n], [SeqAttention(0, n, slots[:n])],
                                        torch.tensor([n - 1])), kv)
    token = logits[0].argmax()
    start = time.perf_counter()
    for i in range(n, n + steps):
        logits = model.forward(ForwardBatch(token.view(1), slots[i:i + 1], slots[i:i + 1],
                                            [SeqAttention(0, 1, slots[:i + 1])], torch.tensor([0])), kv)
        token = logits[0].argmax()
    return (time.perf_counter() - start) / steps * 1e3


@torch.inference_mode()
def reference_prefill(hf, prompt: torch.Tensor) -> float:
    """seconds; logits of the last row only, as transformers' generate() asks for."""
    start = time.perf_counter()
    hf(prompt[None], use_cache=True, logits_to_keep=1)
    return time.perf_counter() - start


def our_prefill(model, prompt: torch.Tensor) -> float:
    n = prompt.numel()
    kv = model.new_kv_buffers(n)
    slots = torch.arange(n)
    start = time.perf_counter()
    model.forward(ForwardBatch(prompt, slots, slots, [SeqAttention(0, n, slots)], torch.tensor([n - 1])), kv)
    return time.perf_counter() - start


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
        start = time.perf_counter()
        for layer in range(c.num_layers):
            model.attend(layer, 0, q, kv, kept, None)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--decode-prompt", type=int, default=128)
    parser.add_argument("--prefill-tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--history", type=int, default=6144)
    args = parser.parse_args()

    hf = load_reference()
    ours = {name: load_model("smollm2", precision=name) for name in ("float32", "fp16", "mixed")}
    generator = torch.Generator().manual_seed(0)
    decode_prompt = torch.randint(100, 40000, (args.decode_prompt,), generator=generator)
    prefill_prompt = torch.randint(100, 40000, (args.prefill_tokens,), generator=generator)

    decode = {name: [] for name in ("transformers", *ours)}
    prefill = {name: [] for name in ("transformers", *ours)}
    for round_index in range(args.rounds):
        with phase_threads("decode") as threads:
            decode["transformers"].append(reference_decode(hf, decode_prompt, args.decode_steps))
            for name, model in ours.items():
                decode[name].append(our_decode(model, decode_prompt, args.decode_steps))
        with phase_threads("prefill", args.prefill_tokens) as prefill_threads:
            prefill["transformers"].append(reference_prefill(hf, prefill_prompt))
            for name, model in ours.items():
                prefill[name].append(our_prefill(model, prefill_prompt))
        print(f"round {round_index + 1}/{args.rounds}: decode ms/token "
              + ", ".join(f"{k} {v[-1]:.1f}" for k, v in decode.items())
              + "; prefill s " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in prefill.items()), flush=True)

    print(f"\ndecode ({threads} thread(s), {args.decode_prompt}-token prompt, {args.decode_steps} steps, median)")
    base = statistics.median(decode["transformers"])
    for name, values in decode.items():
        ms = statistics.median(values)
        print(f"  {name:13s} {ms:8.1f} ms/token  {1e3 / ms:7.1f} tok/s  {base / ms:5.2f}x transformers")
    print(f"prefill ({prefill_threads} thread(s), {args.prefill_tokens} tokens, median)")
    base = statistics.median(prefill["transformers"])
    for name, values in prefill.items():
        seconds = statistics.median(values)
        print(f"  {name:13s} {seconds:8.2f} s  {args.prefill_tokens / seconds:9.1f} tok/s  "
              f"{base / seconds:5.2f}x transformers")
    with phase_threads("decode"):
        full = attention_ms(ours["float32"], args.history, 1.0, 10)
        dropped = attention_ms(ours["float32"], args.history, 0.3, 10)
    print(f"decode attention over {args.history} slots, all layers, per step: none dropped {full:.2f} ms, "
          f"70% dropped {dropped:.2f} ms, {full / dropped:.2f}x faster")


if __name__ == "__main__":
    main()
