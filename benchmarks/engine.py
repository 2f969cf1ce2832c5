"""The engine's model side against transformers on the same GGUF file, side by side in one run.

    python benchmarks/engine.py [--bursts 8] [--burst-steps 4] [--prefill-tokens 2048] [--rounds 3]

Prints decode ms/token and prefill tokens/s for transformers (fp32) and for our forward in
each weight precision (float32 exact; fp16; mixed = fp16 decode, bf16 prefill; activations
and KV always fp32), then decode attention time per step over a 6K-token history with 70%
of it dropped against nothing dropped. Contenders take turns (decode in short bursts,
prefill once per round), so that load from other processes falls on all of them alike.
Ratios compare process CPU time (steady on a shared machine, where wall time mostly
measures the wait for a core); wall times are printed too. A ratio is the median over
rounds of the per-round ratio. Both sides run under the same per-phase thread policy
(akv_core.threads).
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from akv_core.model.batch import ForwardBatch, SeqAttention
from akv_core.model.loader import load_model
from akv_core.model.reference import transformers_reference
from akv_core.threads import phase_threads


class Clock:
    """Wall time and this process's CPU time. On a shared machine the CPU time is the steadier
    measure of work (waiting for a core is not counted); with one thread per phase the two agree
    on an idle machine."""

    def __enter__(self) -> "Clock":
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


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


def summary(title: str, unit: str, clocks: dict[str, list[Clock]], scale: float, per_second) -> None:
    """Median CPU and wall time per contender, and the median of per-round CPU-time ratios."""
    print(title)
    base = clocks["transformers"]
    for name, values in clocks.items():
        cpu = statistics.median(c.cpu for c in values) * scale
        wall = statistics.median(c.wall for c in values) * scale
        ratio = statistics.median(b.cpu / v.cpu for b, v in zip(base, values))
        print(f"  {name:13s} {cpu:9.2f} {unit} cpu  {wall:9.2f} {unit} wall  {per_second(cpu):8.1f} tok/s"
              f"  {ratio:5.2f}x transformers")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decode-prompt", type=int, default=128)
    parser.add_argument("--bursts", type=int, default=8, help="decode rounds; each runs every contender")
    parser.add_argument("--burst-steps", type=int, default=4)
    parser.add_argument("--prefill-tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3, help="prefill rounds")
    parser.add_argument("--history", type=int, default=6144)
    args = parser.parse_args()

    hf = transformers_reference()
    ours = {name: load_model("smollm2", precision=name) for name in ("float32", "fp16", "mixed")}
    generator = torch.Generator().manual_seed(0)
    decode_prompt = torch.randint(100, 40000, (args.decode_prompt,), generator=generator)
    prefill_prompt = torch.randint(100, 40000, (args.prefill_tokens,), generator=generator)

    # Decode: short bursts in turn, so that load from other processes falls on every contender alike.
    with phase_threads("decode") as decode_threads:
        decoders = {"transformers": ReferenceDecoder(hf, decode_prompt)}
        decoders.update({name: OurDecoder(model, decode_prompt, args.bursts * args.burst_steps)
                         for name, model in ours.items()})
        decode = {name: [] for name in decoders}
        for _ in range(args.bursts):
            for name, decoder in decoders.items():
                with Clock() as clock:
                    for _ in range(args.burst_steps):
                        decoder.step()
                decode[name].append(clock)
    prefill = {name: [] for name in ("transformers", *ours)}
    for round_index in range(args.rounds):
        with phase_threads("prefill", args.prefill_tokens) as prefill_threads:
            prefill["transformers"].append(reference_prefill(hf, prefill_prompt))
            for name, model in ours.items():
                prefill[name].append(our_prefill(model, prefill_prompt))
        print(f"prefill round {round_index + 1}/{args.rounds} (cpu s): "
              + ", ".join(f"{k} {v[-1].cpu:.2f}" for k, v in prefill.items()), flush=True)

    summary(f"decode ({decode_threads} thread(s), {args.decode_prompt}-token prompt, {args.bursts} bursts of "
            f"{args.burst_steps} steps)", "ms/token", decode, 1e3 / args.burst_steps, lambda ms: 1e3 / ms)
    summary(f"prefill ({prefill_threads} thread(s), {args.prefill_tokens} tokens, {args.rounds} rounds)", "s",
            prefill, 1.0, lambda seconds: args.prefill_tokens / seconds)
    with phase_threads("decode"):
        full = attention_ms(ours["float32"], args.history, 1.0, 10)
        dropped = attention_ms(ours["float32"], args.history, 0.3, 10)
    print(f"decode attention over {args.history} slots, all layers, per step: none dropped {full:.2f} ms, "
          f"70% dropped {dropped:.2f} ms, {full / dropped:.2f}x faster")


if __name__ == "__main__":
    main()
