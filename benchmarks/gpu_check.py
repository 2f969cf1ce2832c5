"""The GPU path in one short run: Triton kernels, the engine's logits, decode attention with drops.

    python benchmarks/gpu_check.py [--history 6144] [--steps 50] [--prompt-tokens 512]

On a machine with a CUDA GPU it prints one table:
- the Triton re-rotation kernel (Repos) and the Triton decode-attention kernel against their torch
  references, on CUDA tensors of the embedded model's own shapes and RoPE (max abs error);
- the engine's forward on CUDA (fp32) against transformers on the same GGUF file (max abs logit
  difference over a prompt, and whether the greedy tokens agree);
- decode attention time per step over `--history` slots, all layers, with nothing dropped and with
  70% dropped, timed with CUDA events, and their ratio.
Without a GPU (or without Triton) it says so and exits 0: nothing here can run on a CPU, where
tests/test_kernels_triton.py runs the same kernels under Triton's interpreter instead.
"""
from __future__ import annotations

import argparse
import sys

import torch

KEPT_FRACTION = 0.3          # 70% of the history dropped
KERNEL_TOLERANCE = 1e-4      # fp32 kernels against fp32 references
LOGIT_TOLERANCE = 1e-2       # the engine (fp32) against transformers (fp32): different kernels, same math


def gpu_missing() -> str | None:
    """Why the check cannot run here, or None."""
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible to torch (torch.cuda.is_available() is False)"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed (pip install triton; it ships with CUDA builds of torch)"
    return None


def kernel_rows(model) -> list[tuple[str, str, str]]:
    from akv_core.kernels.decode_attention import _decode_triton, decode_attention_reference
    from akv_core.kernels.reposition import _rerotate_triton

    c, device = model.config, torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(0)
    keys = torch.randn(4096, c.num_kv_heads, c.head_dim, generator=g, device=device)
    src = torch.randperm(4096, generator=g, device=device)[:1024]
    old = torch.randint(1024, 8192, (1024,), generator=g, device=device)
    new = torch.arange(1024, device=device)
    got = _rerotate_triton(keys, model.rope, src, old, new)
    repos_error = (got - model.rope.rerotate(keys[src], old, new)).abs().max().item()
    q = torch.randn(c.num_heads, c.head_dim, generator=g, device=device)
    values = torch.randn_like(keys)
    slots = torch.randperm(4096, generator=g, device=device)[:2867].sort().values
    scale = c.head_dim ** -0.5
    attend = _decode_triton(q, keys, values, slots, scale)
    attend_error = (attend - decode_attention_reference(q, keys, values, slots, scale)).abs().max().item()
    return [row("Triton re-rotation vs torch", f"max abs error {repos_error:.2e}", repos_error <= KERNEL_TOLERANCE),
            row("Triton decode attention vs torch", f"max abs error {attend_error:.2e}",
                attend_error <= KERNEL_TOLERANCE)]


@torch.inference_mode()
def logits_row(model, prompt_tokens: int) -> tuple[str, str, str]:
    from akv_core.model.batch import ForwardBatch, SeqAttention
    from akv_core.model.reference import transformers_reference

    prompt = torch.randint(100, 40000, (prompt_tokens,), generator=torch.Generator().manual_seed(1)).cuda()
    slots = torch.arange(prompt_tokens, device="cuda")
    ours = model.forward(ForwardBatch(prompt, slots, slots, [SeqAttention(0, prompt_tokens, slots)], slots),
                         model.new_kv_buffers(prompt_tokens))
    reference = transformers_reference().cuda()(prompt[None]).logits[0].float()
    error = (ours - reference).abs().max().item()
    agree = (ours.argmax(-1) == reference.argmax(-1)).float().mean().item()
    return row(f"engine logits vs transformers ({prompt_tokens} tokens)",
               f"max abs diff {error:.2e}, greedy tokens agree {agree:.1%}", error <= LOGIT_TOLERANCE)


def attention_ms(model, history: int, kept_fraction: float, steps: int) -> float:
    """Decode attention over the kept slots, all layers, one query: median ms per step (CUDA events)."""
    c = model.config
    g = torch.Generator(device="cuda").manual_seed(0)
    kv = model.new_kv_buffers(history)
    for layer in range(c.num_layers):
        kv.k[layer].normal_(generator=g)
        kv.v[layer].normal_(generator=g)
    kept = torch.randperm(history, generator=g, device="cuda")[:int(history * kept_fraction)].sort().values
    q = torch.randn(1, c.num_heads, c.head_dim, generator=g, device="cuda")
    times = []
    for _ in range(steps + 3):  # the first steps compile and warm the kernel
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for layer in range(c.num_layers):
            model.attend(layer, 0, q, kv, kept, None)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times[3:])[len(times[3:]) // 2]


def row(check: str, measured: str, ok: bool) -> tuple[str, str, str]:
    return check, measured, "pass" if ok else "FAIL"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--history", type=int, default=6144)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    args = parser.parse_args()
    missing = gpu_missing()
    if missing:
        print(f"gpu_check: nothing to check on this machine: {missing}.\n"
              "Run it on a machine with a CUDA GPU (docs/gpu.md). On a CPU, the Triton kernels are checked "
              "against torch under Triton's interpreter by tests/test_kernels_triton.py.")
        return 0
    from akv_core.model.loader import load_model

    model = load_model("smollm2", device="cuda")
    rows = kernel_rows(model) + [logits_row(model, args.prompt_tokens)]
    full = attention_ms(model, args.history, 1.0, args.steps)
    dropped = attention_ms(model, args.history, KEPT_FRACTION, args.steps)
    rows.append(row(f"decode attention, {args.history} slots, all layers",
                    f"none dropped {full:.3f} ms, 70% dropped {dropped:.3f} ms: {full / dropped:.2f}x", True))
    width = max(len(r[0]) for r in rows)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for check, measured, verdict in rows:
        print(f"{check:<{width}}  {verdict:<4}  {measured}")
    return 0 if all(r[2] == "pass" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
