"""The forward pass against transformers on the same GGUF file, in fp32.

transformers dequantizes the GGUF and undoes llama.cpp's q/k permutation on its
own, so agreement here checks our loading, RoPE, attention over the slot pool,
and the prefix reuse the engine relies on.
"""
from __future__ import annotations

import pytest
import torch

from akv_core.model.batch import ForwardBatch, SeqAttention
from test_model_support import random_ids, smollm2, transformers_smollm2

pytestmark = pytest.mark.model
# fp32 on both sides; only the order of the sums differs where our prefill products run on oneDNN
# (akv_core.model.linear.OneDnnWeights; transformers' run on torch's MKL GEMM): measured up to 2.6e-4 on
# logits up to 36 (with AKV_ONEDNN=off: identical). Decode steps run on our own kernels.
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def model():
    return smollm2()


@pytest.fixture(scope="module")
def reference():
    return transformers_smollm2()


def reference_logits(reference, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return reference(torch.tensor([ids])).logits[0].float()


def prefill(model, kv, ids, slots, positions=None, prefix_slots=None, all_logits=True):
    """One sequence's new tokens `ids` written to `slots`, attending to `prefix_slots` first."""
    n = len(ids)
    prefix = prefix_slots if prefix_slots is not None else torch.empty(0, dtype=torch.long)
    start = prefix.numel()
    positions = positions if positions is not None else torch.arange(start, start + n)
    rows = torch.arange(n) if all_logits else torch.tensor([n - 1])
    batch = ForwardBatch(torch.tensor(ids), positions, slots,
                         [SeqAttention(0, n, torch.cat([prefix, slots]))], rows)
    return model.forward(batch, kv)


def test_prefill_and_20_greedy_steps_match_transformers(model, reference):
    ids = random_ids(300)
    kv = model.new_kv_buffers(400)
    # Slots deliberately scattered: the pool is addressed by slot, not by position.
    slots = torch.randperm(400, generator=torch.Generator().manual_seed(1))
    ours = [prefill(model, kv, ids, slots[:300])]
    generated = [int(ours[0][-1].argmax())]
    for step in range(19):
        n = 300 + step
        batch = ForwardBatch(torch.tensor([generated[-1]]), torch.tensor([n]), slots[n:n + 1],
                             [SeqAttention(0, 1, slots[:n + 1])], torch.tensor([0]))
        ours.append(model.forward(batch, kv))
        generated.append(int(ours[-1][0].argmax()))
    expected = reference_logits(reference, ids + generated[:-1])
    assert torch.cat(ours).shape == expected.shape
    assert (torch.cat(ours) - expected).abs().max() < TOLERANCE
    assert generated == expected[299:].argmax(-1).tolist()


def test_prefix_reuse_matches_a_fresh_run(model, reference):
    """A second sequence sharing 200 tokens reuses their slots and computes only its suffix."""
    shared, tail = random_ids(200, seed=2), random_ids(60, seed=3)
    kv = model.new_kv_buffers(300)
    prefill(model, kv, shared, torch.arange(200))
    logits = prefill(model, kv, tail, torch.arange(200, 260), prefix_slots=torch.arange(200))
    expected = reference_logits(reference, shared + tail)[200:]
    assert (logits - expected).abs().max() < TOLERANCE


def test_two_sequences_in_one_batch_equal_separate_runs(model):
    a, b = random_ids(40, seed=4), random_ids(25, seed=5)
    kv = model.new_kv_buffers(200)
    alone_a = prefill(model, kv, a, torch.arange(0, 40), all_logits=False)
    alone_b = prefill(model, kv, b, torch.arange(40, 65), all_logits=False)
    slots_a, slots_b = torch.arange(100, 140), torch.arange(140, 165)
    batch = ForwardBatch(torch.tensor(a + b), torch.cat([torch.arange(40), torch.arange(25)]),
                         torch.cat([slots_a, slots_b]),
                         [SeqAttention(0, 40, slots_a), SeqAttention(40, 25, slots_b)], torch.tensor([39, 64]))
    together = model.forward(batch, kv)
    assert torch.allclose(together[0], alone_a[0], atol=1e-5)
    assert torch.allclose(together[1], alone_b[0], atol=1e-5)


def test_long_prefill_in_chunks_matches_transformers(model, reference, monkeypatch):
    """Prefill longer than one attention chunk (each chunk sees keys up to its own end)."""
    import akv_core.model.llama as llama

    monkeypatch.setattr(llama, "PREFILL_CHUNK", 64)
    ids = random_ids(150, seed=6)
    kv = model.new_kv_buffers(200)
    prefill(model, kv, ids[:20], torch.arange(20))
    logits = prefill(model, kv, ids[20:], torch.arange(20, 150), prefix_slots=torch.arange(20))
    expected = reference_logits(reference, ids)[20:]
    assert (logits - expected).abs().max() < TOLERANCE


@pytest.mark.filterwarnings("ignore:fbgemm_linear_fp16_weight_fp32_activation is deprecated")
def test_mixed_precision_weights_stay_close_to_fp32(model):
    """bf16 weights for the prefill, fp16 (fbgemm) for decode steps, fp32 activations: logits near
    the exact ones and the same greedy tokens on a real chat prompt."""
    from akv_core.chat import ChatTokenizer

    ids = list(ChatTokenizer.from_model("smollm2").render(
        [{"role": "user", "content": "Name three primary colors."}]).token_ids)
    n = len(ids)
    runs = {}
    for name, m in (("exact", model), ("mixed", smollm2("mixed"))):
        kv = m.new_kv_buffers(n + 4)
        logits = [prefill(m, kv, ids, torch.arange(n))]
        tokens = [int(logits[0][-1].argmax())]
        for i in range(n, n + 3):
            batch = ForwardBatch(torch.tensor(tokens[-1:]), torch.tensor([i]), torch.tensor([i]),
                                 [SeqAttention(0, 1, torch.arange(i + 1))], torch.tensor([0]))
            logits.append(m.forward(batch, kv))
            tokens.append(int(logits[-1][0].argmax()))
        runs[name] = (torch.cat(logits), tokens)
    gap = (runs["exact"][0] - runs["mixed"][0]).abs()
    assert 0 < gap[:n].max() < 1.0      # bf16 prefill
    assert 0 < gap[n:].max() < 0.25     # fp16 decode on top of it
    assert runs["exact"][1] == runs["mixed"][1]
