"""How close a reduced-precision model's next-token distributions are to float32's, on fixed prompts.

Each probe is a chat prompt rendered with the model's template plus float32's own greedy
continuation of it. Both models read the same tokens (teacher forcing): the prompt in one
prefill, the continuation one decode step at a time, so every position is compared, the
prompt's through the prefill kernels and the continuation's through the decode kernels.
Reported per phase: the share of positions whose greedy token equals float32's, and the KL
divergence KL(float32 || model) of the next-token distribution, in nats.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from akv_core.model.batch import ForwardBatch, SeqAttention
from akv_core.model.llama import CausalLM

PROMPTS = (
    "Name three primary colors.",
    "Write a Python function that returns the factorial of n.",
    "What is the capital of France, and what river runs through it?",
    "Explain in two sentences why the sky is blue.",
    "Translate 'good morning, how are you?' into Spanish.",
    "List the steps to boil an egg.",
    "What is 17 multiplied by 23? Show your working.",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
)
DECODE_TOKENS = 16


@dataclass(frozen=True)
class Probe:
    """A prompt's token ids followed by float32's greedy continuation."""

    ids: tuple[int, ...]
    prompt_len: int


@dataclass(frozen=True)
class Agreement:
    positions: int
    top1: float      # share of positions whose greedy next token equals float32's
    kl_mean: float   # mean KL(float32 || model) per position, nats
    kl_max: float


@dataclass(frozen=True)
class Accuracy:
    prefill: Agreement
    decode: Agreement


def prompt_ids(name_or_path: str = "smollm2", prompts: Sequence[str] = PROMPTS) -> list[list[int]]:
    """The prompts as single user messages in the model's chat template, generation header included."""
    from akv_core.chat import ChatTokenizer

    tokenizer = ChatTokenizer.from_model(name_or_path)
    return [list(tokenizer.render([{"role": "user", "content": text}]).token_ids) for text in prompts]


def float32_probes(reference: CausalLM, prompts: Sequence[list[int]], decode_tokens: int = DECODE_TOKENS) -> list[Probe]:
    """Each prompt extended by the reference model's greedy continuation (`decode_tokens` tokens)."""
    probes = []
    for prompt in prompts:
        ids = list(prompt)
        kv = reference.new_kv_buffers(len(ids) + decode_tokens)
        logits = _prefill(reference, kv, ids)[-1:]
        for _ in range(decode_tokens):
            ids.append(int(logits[0].argmax()))
            logits = _decode(reference, kv, ids)
        probes.append(Probe(tuple(ids), len(prompt)))
    return probes


def logits_along(model: CausalLM, probe: Probe) -> Tensor:
    """fp32 logits predicting tokens 1..n of the probe: the prompt's rows from one prefill, then one
    decode step per continuation token (the last token is only predicted, never fed)."""
    ids = list(probe.ids)
    kv = model.new_kv_buffers(len(ids))
    rows = [_prefill(model, kv, ids[:probe.prompt_len])]
    rows += [_decode(model, kv, ids[:i + 1]) for i in range(probe.prompt_len, len(ids) - 1)]
    return torch.cat(rows)


def accuracy(model: CausalLM, probes: Sequence[Probe], reference_logits: Sequence[Tensor]) -> Accuracy:
    """`model` against float32's `logits_along` each probe, split into prefill and decode positions."""
    phases: dict[str, list[tuple[Tensor, Tensor]]] = {"prefill": [], "decode": []}
    for probe, theirs in zip(probes, reference_logits, strict=True):
        ours = logits_along(model, probe)
        cut = probe.prompt_len   # rows < cut came from the prefill (the last of them predicts the first decode input)
        phases["prefill"].append((ours[:cut], theirs[:cut]))
        phases["decode"].append((ours[cut:], theirs[cut:]))
    return Accuracy(*(agreement(torch.cat([o for o, _ in pairs]), torch.cat([t for _, t in pairs]))
                      for pairs in phases.values()))


def agreement(logits: Tensor, reference_logits: Tensor) -> Agreement:
    """Top-1 agreement and KL(reference || model) over rows of next-token logits."""
    log_p = torch.log_softmax(reference_logits.double(), dim=-1)
    log_q = torch.log_softmax(logits.double(), dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(dim=-1)
    top1 = (logits.argmax(dim=-1) == reference_logits.argmax(dim=-1)).double().mean()
    return Agreement(int(kl.numel()), float(top1), float(kl.mean()), float(kl.max()))


def _prefill(model: CausalLM, kv, ids: list[int]) -> Tensor:
    n = len(ids)
    slots = torch.arange(n)
    return model.forward(ForwardBatch(torch.tensor(ids), slots, slots, [SeqAttention(0, n, slots)],
                                      torch.arange(n)), kv)


def _decode(model: CausalLM, kv, ids: list[int]) -> Tensor:
    """Feed the last of `ids` (the earlier ones are in `kv`, slot = position) and return its logits."""
    i = len(ids) - 1
    slot = torch.tensor([i])
    return model.forward(ForwardBatch(torch.tensor(ids[-1:]), slot, slot, [SeqAttention(0, 1, torch.arange(i + 1))],
                                      torch.tensor([0])), kv)
