"""Visibility: masks, dropped slots and the attention probe on the real SmolLM2 weights."""
from __future__ import annotations

import pytest
import torch

from akv_core.model.batch import ForwardBatch, SeqAttention
from test_model_support import smollm2

pytestmark = pytest.mark.model

# Three segments of one history, prefilled into slots 0..44; then a 5-token query.
A, B, C = torch.arange(0, 20), torch.arange(20, 35), torch.arange(35, 45)
D = torch.arange(45, 50)


@pytest.fixture(scope="module")
def model():
    return smollm2()


@pytest.fixture(scope="module")
def history(model):
    ids = torch.randint(100, 40000, (50,), generator=torch.Generator().manual_seed(7))
    kv = model.new_kv_buffers(64)
    slots = torch.cat([A, B, C])
    model.forward(ForwardBatch(ids[:45], torch.arange(45), slots, [SeqAttention(0, 45, slots)],
                               torch.tensor([44])), kv)
    return ids, kv


def query(model, kv, ids, kv_slots, mask=None):
    """The 5 tokens of D at positions 45..49, written to D's slots, logits for every row."""
    batch = ForwardBatch(ids[45:], torch.arange(45, 50), D, [SeqAttention(0, 5, kv_slots, mask)], torch.arange(5))
    return model.forward(batch, kv)


def mask_hiding(kv_slots: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """Causal among the 5 new tokens (the last entries), every other slot visible unless hidden."""
    k = kv_slots.numel()
    mask = torch.ones(5, k, dtype=torch.bool)
    mask[:, k - 5:] = torch.ones(5, 5, dtype=torch.bool).tril()
    mask[:, torch.isin(kv_slots, hidden)] = False
    return mask


def test_explicit_causal_mask_equals_the_default(model, history):
    ids, kv = history
    slots = torch.cat([A, B, C, D])
    assert torch.allclose(query(model, kv, ids, slots, mask_hiding(slots, torch.empty(0))),
                          query(model, kv, ids, slots), atol=1e-5)


def test_masking_a_segment_equals_leaving_its_slots_out(model, history):
    ids, kv = history
    everything = torch.cat([A, B, C, D])
    masked = query(model, kv, ids, everything, mask_hiding(everything, B))
    dropped = query(model, kv, ids, torch.cat([A, C, D]))
    full = query(model, kv, ids, everything)
    assert torch.allclose(masked, dropped, atol=1e-4)
    assert (masked - full).abs().max() > 1e-2  # the drop really changes what the model sees


def test_segment_masks_in_one_prefill_equal_computing_segments_apart(model):
    """A restore recomputes C as it was first computed: after B had been dropped (C never saw B)."""
    ids = torch.randint(100, 40000, (45,), generator=torch.Generator().manual_seed(8))
    kv = model.new_kv_buffers(128)
    slots = torch.cat([A, B, C])
    mask = torch.ones(45, 45, dtype=torch.bool).tril()
    mask[35:, 20:35] = False
    together = model.forward(ForwardBatch(ids, torch.arange(45), slots, [SeqAttention(0, 45, slots, mask)],
                                          torch.arange(35, 45)), kv)
    apart_slots = torch.cat([A + 64, C + 64])
    model.forward(ForwardBatch(ids[:20], torch.arange(20), A + 64, [SeqAttention(0, 20, A + 64)],
                               torch.tensor([19])), kv)
    apart = model.forward(ForwardBatch(ids[35:], torch.arange(35, 45), C + 64, [SeqAttention(0, 10, apart_slots)],
                                       torch.arange(10)), kv)
    assert torch.allclose(together, apart, atol=1e-4)
    assert torch.allclose(kv.k[29][C], kv.k[29][C + 64], atol=1e-4)


def test_probe_sees_zero_weight_on_dropped_slots(model, history):
    ids, kv = history
    everything = torch.cat([A, B, C, D])
    seen = []
    model.attention_probe = lambda layer, seq, slots, probs: seen.append((layer, seq, slots.clone(), probs.clone()))
    try:
        probed = query(model, kv, ids, everything, mask_hiding(everything, B))
        omitted = query(model, kv, ids, torch.cat([A, C, D]))
    finally:
        model.attention_probe = None
    assert len(seen) == 2 * model.config.num_layers
    hidden = torch.isin(everything, B)
    for layer, seq, slots, probs in seen[:model.config.num_layers]:
        assert probs.shape == (5, model.config.num_heads, everything.numel())
        assert torch.equal(slots, everything)
        assert torch.all(probs[:, :, hidden] == 0)
        assert torch.allclose(probs.sum(-1), torch.ones(5, model.config.num_heads))
    for _, _, slots, _ in seen[model.config.num_layers:]:
        assert not torch.isin(slots, B).any()  # omitted slots are never even read
    # The probe's explicit softmax computes the same attention as the fast path.
    assert torch.allclose(probed, query(model, kv, ids, everything, mask_hiding(everything, B)), atol=1e-4)
    assert torch.allclose(omitted, probed, atol=1e-4)


def test_batch_shape_errors_name_what_was_expected(model):
    kv = model.new_kv_buffers(8)
    bad = ForwardBatch(torch.tensor([1, 2]), torch.arange(2), torch.arange(2),
                       [SeqAttention(0, 1, torch.arange(1))], torch.tensor([0]))
    with pytest.raises(ValueError, match="q_len must add up"):
        model.forward(bad, kv)
