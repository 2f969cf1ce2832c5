"""The Triton kernels, run on the CPU by Triton's interpreter, against their torch references.

TRITON_INTERPRET must be set before triton is imported, so the comparisons run in a fresh
interpreter process; shapes are small because the interpreter executes every lane in numpy.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from akv_core.kernels.decode_attention import decode_attention, decode_attention_reference
from akv_core.kernels.reposition import reposition
from akv_core.model.config import config_from_hf
from akv_core.model.kv_buffers import KVBuffers
from akv_core.model.rope import Rope

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import torch
    from akv_core.kernels.decode_attention import _decode_triton, decode_attention_reference
    from akv_core.kernels.reposition import _rerotate_triton
    from akv_core.model.config import config_from_hf
    from akv_core.model.rope import Rope

    g = torch.Generator().manual_seed(0)
    for partial in (1.0, 0.5):
        config = config_from_hf({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1,
                                 "hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 2,
                                 "num_key_value_heads": 2, "vocab_size": 10, "max_position_embeddings": 512,
                                 "rope_theta": 10000.0, "partial_rotary_factor": partial})
        rope = Rope(config)
        keys = torch.randn(24, 2, 32, generator=g)
        src = torch.tensor([3, 7, 8, 20, 21, 5])
        old = torch.tensor([300, 301, 302, 303, 304, 5])
        new = torch.tensor([0, 1, 2, 3, 4, 5])
        got = _rerotate_triton(keys, rope, src, old, new)
        want = rope.rerotate(keys[src], old, new)
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
        assert torch.equal(got[-1], keys[5])  # unchanged position: bit for bit
    k_buffer = torch.randn(50, 2, 16, generator=g)
    v_buffer = torch.randn(50, 2, 16, generator=g)
    q = torch.randn(4, 16, generator=g)
    for slots in (torch.tensor([0, 3, 4, 9, 17, 18, 40]), torch.arange(0, 50, 1)[torch.randperm(50, generator=g)][:37]):
        got = _decode_triton(q, k_buffer, v_buffer, slots, 0.25)
        want = decode_attention_reference(q, k_buffer, v_buffer, slots, 0.25)
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    print("kernels match")
""")


def test_triton_kernels_match_torch_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "kernels match"


def test_reposition_moves_keys_and_values_with_overlapping_slots():
    config = config_from_hf({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64,
                             "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1,
                             "vocab_size": 10, "max_position_embeddings": 512})
    rope = Rope(config)
    kv = KVBuffers(2, 10, 1, 32)
    g = torch.Generator().manual_seed(1)
    raw = torch.randn(10, 1, 32, generator=g)
    for layer in range(2):
        kv.k[layer].copy_(rope.apply(raw, torch.arange(10)))
        kv.v[layer].copy_(torch.randn(10, 1, 32, generator=g))
    values_before = kv.v[1].clone()
    # Compact slots 4..9 (positions 4..9) down onto slots 1..6 (positions 1..6): sources overlap targets.
    reposition(kv, rope, torch.arange(4, 10), torch.arange(1, 7), torch.arange(4, 10), torch.arange(1, 7))
    assert torch.allclose(kv.k[1][1:7], rope.apply(raw[4:10], torch.arange(1, 7)), atol=2e-6)
    assert torch.equal(kv.v[1][1:7], values_before[4:10])
    assert torch.equal(kv.k[0][0], rope.apply(raw[:1], torch.tensor([0]))[0])  # untouched slot


def test_decode_attention_fallback_reads_only_listed_slots():
    g = torch.Generator().manual_seed(2)
    k_buffer, v_buffer = torch.randn(30, 1, 8, generator=g), torch.randn(30, 1, 8, generator=g)
    q = torch.randn(2, 8, generator=g)
    slots = torch.tensor([1, 5, 9])
    before = decode_attention(q, k_buffer, v_buffer, slots, 0.5)
    k_buffer[[0, 2, 3, 4]] = float("nan")  # garbage in unlisted slots changes nothing
    assert torch.equal(decode_attention(q, k_buffer, v_buffer, slots, 0.5), before)
    weights = torch.softmax((q @ k_buffer[slots, 0].T) * 0.5, -1)
    assert torch.allclose(before, weights @ v_buffer[slots, 0], atol=1e-6)
