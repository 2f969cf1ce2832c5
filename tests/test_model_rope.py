"""RoPE and Repos: re-rotated keys equal keys computed at the new position, unchanged rows stay bit-exact."""
from __future__ import annotations

import pytest
import torch

from akv_core.model.batch import ForwardBatch, SeqAttention
from akv_core.model.config import ModelConfig, RopeScaling, config_from_hf
from akv_core.model.rope import Rope
from test_model_support import smollm2

SCALINGS = {
    "default": {},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 1024},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
}


def hf_style_config(rope: dict, partial: float = 1.0) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1, "hidden_size": 128,
            "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 100,
            "max_position_embeddings": 4096, "rope_parameters": {"rope_theta": 10000.0, **rope},
            "partial_rotary_factor": partial}


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_rotation_matches_transformers(kind):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    raw = hf_style_config(SCALINGS[kind])
    rope = Rope(config_from_hf(raw))
    reference = LlamaRotaryEmbedding(LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"}))
    assert torch.equal(rope.inv_freq, reference.inv_freq)
    assert rope.attention_scaling == pytest.approx(reference.attention_scaling)
    x = torch.randn(1, 2, 50, 64, generator=torch.Generator().manual_seed(0))   # [batch, heads, n, D]
    positions = torch.arange(3000, 3050)
    cos, sin = reference(x, positions[None])
    expected, _ = apply_rotary_pos_emb(x, x, cos, sin)
    ours = rope.apply(x[0].transpose(0, 1), positions).transpose(0, 1)[None]
    assert torch.allclose(ours, expected, atol=1e-6)


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_rerotate_lands_on_the_key_computed_at_the_new_position(kind):
    rope = Rope(config_from_hf(hf_style_config(SCALINGS[kind])))
    raw = torch.randn(40, 1, 64, generator=torch.Generator().manual_seed(1))
    old, new = torch.arange(1000, 1040), torch.arange(40)
    moved = rope.rerotate(rope.apply(raw, old), old, new)
    assert torch.allclose(moved, rope.apply(raw, new), atol=2e-6)
    assert torch.allclose(rope.unapply(rope.apply(raw, old), old), raw, atol=2e-6)


def test_unchanged_positions_are_bit_identical_and_fifty_moves_do_not_drift():
    rope = Rope(config_from_hf(hf_style_config({})))
    raw = torch.randn(30, 1, 64, generator=torch.Generator().manual_seed(2))
    birth = torch.arange(5000, 5030)
    keys = rope.apply(raw, birth)
    assert torch.equal(rope.rerotate(keys, birth, birth), keys)
    mixed = birth.clone()
    mixed[::2] -= 7
    partly = rope.rerotate(keys, birth, mixed)
    assert torch.equal(partly[1::2], keys[1::2]) and not torch.equal(partly[::2], keys[::2])
    # Fifty successive repositions (each one closing a gap of 100) against one move from birth.
    chained, here = keys, birth
    for _ in range(50):
        chained, here = rope.rerotate(chained, here, here - 100), here - 100
    once = rope.rerotate(keys, birth, here)
    assert torch.allclose(chained, once, atol=5e-5)
    assert torch.allclose(once, rope.apply(raw, here), atol=2e-6)


def test_only_rotary_dims_rotate():
    rope = Rope(config_from_hf(hf_style_config({}, partial=0.5)))
    assert rope.rotary_dim == 32
    keys = torch.randn(10, 1, 64, generator=torch.Generator().manual_seed(3))
    moved = rope.rerotate(keys, torch.arange(100, 110), torch.arange(10))
    assert torch.equal(moved[..., 32:], keys[..., 32:])
    assert not torch.allclose(moved[..., :32], keys[..., :32])


def test_unknown_scaling_is_refused_with_its_name():
    with pytest.raises(ValueError, match="'dynamic' is not supported"):
        config_from_hf(hf_style_config({"rope_type": "dynamic", "factor": 2.0}))
    config = ModelConfig("llama", 1, 64, 128, 1, 1, 64, 10, 128, 1e-6, 1e4, 64, RopeScaling(kind="weird"))
    with pytest.raises(ValueError, match="weird"):
        Rope(config)


@pytest.mark.model
def test_repositioned_smollm2_keys_equal_keys_the_model_writes_there():
    """Layer-0 keys depend only on the token and its position: the model's own K at the new position
    is the reference for a re-rotated one."""
    model = smollm2()
    kv = model.new_kv_buffers(100)
    ids = torch.randint(100, 40000, (30,), generator=torch.Generator().manual_seed(4))
    for slots, positions in ((torch.arange(30), torch.arange(700, 730)), (torch.arange(50, 80), torch.arange(30))):
        model.forward(ForwardBatch(ids, positions, slots, [SeqAttention(0, 30, slots)], torch.tensor([29])), kv)
    moved = model.rope.rerotate(kv.k[0][:30], torch.arange(700, 730), torch.arange(30))
    assert torch.allclose(moved, kv.k[0][50:80], atol=1e-5 * float(kv.k[0][50:80].abs().max()))
    assert torch.equal(model.rope.rerotate(kv.k[0][:30], torch.arange(700, 730), torch.arange(700, 730)), kv.k[0][:30])
