"""Loading weights into a `CausalLM`: GGUF files (dequantized once) and Hugging Face safetensors folders.

llama.cpp's converter permutes the rows of Llama's q/k projections so that
its interleaved RoPE applies; we permute them back, so GGUF and safetensors
models share one (rotate-half) RoPE and reproduce transformers' logits.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from akv_core.model.config import ModelConfig, config_from_gguf, config_from_hf
from akv_core.model.gguf_file import GGUFFile
from akv_core.model.llama import PRECISIONS, CausalLM, LayerWeights, Linear
from akv_core.model.locate import EMBEDDED_NAME, locate

Fetch = Callable[[str], Tensor | None]


def load_model(name_or_path: str = EMBEDDED_NAME, device: str = "cpu", dtype: torch.dtype = torch.float32,
               precision: str = "float32") -> CausalLM:
    """Load `smollm2`, a `.gguf` file or a safetensors folder.

    `dtype` is the activations' and the KV pool's; `precision` the matmul weights': "float32" (exact, the
    reference), "fp16" (fp16 weights; about twice as fast a decode on a CPU) or "mixed" (fp16 weights
    for decode, bf16 for prefill; also a faster prefill). See docs/engine-model.md.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    files = locate(name_or_path)
    if files.kind == "gguf":
        config, fetch = _open_gguf(files.path)
    else:
        config, fetch = _open_hf(files.path)
    return _assemble(config, fetch, device, dtype, precision)


def _assemble(config: ModelConfig, fetch: Fetch, device: str, dtype: torch.dtype, precision: str) -> CausalLM:
    def need(name: str) -> Tensor:
        tensor = fetch(name)
        if tensor is None:
            raise ValueError(f"model weights lack tensor {name!r}")
        return tensor.to(device=device, dtype=dtype).contiguous()

    def maybe(name: str) -> Tensor | None:
        tensor = fetch(name)
        return None if tensor is None else tensor.to(device=device, dtype=dtype).contiguous()

    layers = []
    for i in range(config.num_layers):
        p = f"layers.{i}."
        bias = [maybe(p + n + ".bias") for n in ("q", "k", "v")]
        layers.append(LayerWeights(
            attn_norm=need(p + "attn_norm"),
            qkv=Linear(torch.cat([need(p + n) for n in ("q", "k", "v")]),
                       torch.cat(bias) if all(b is not None for b in bias) else None, precision),
            q_norm=maybe(p + "q_norm") if config.qk_norm else None,
            k_norm=maybe(p + "k_norm") if config.qk_norm else None,
            o=Linear(need(p + "o"), None, precision), mlp_norm=need(p + "mlp_norm"),
            gate_up=Linear(torch.cat([need(p + "gate"), need(p + "up")]), None, precision),
            down=Linear(need(p + "down"), None, precision)))
    embed = need("embed")
    lm_head = Linear(embed if config.tie_embeddings else need("lm_head"), None, precision)
    return CausalLM(config, embed, layers, need("final_norm"), lm_head, dtype=dtype, device=device)


# -- GGUF ------------------------------------------------------------------------------------

_GGUF_NAMES = {"embed": "token_embd.weight", "final_norm": "output_norm.weight", "lm_head": "output.weight"}
_GGUF_LAYER = {"attn_norm": "attn_norm.weight", "q": "attn_q.weight", "k": "attn_k.weight", "v": "attn_v.weight",
               "q.bias": "attn_q.bias", "k.bias": "attn_k.bias", "v.bias": "attn_v.bias",
               "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight", "o": "attn_output.weight",
               "mlp_norm": "ffn_norm.weight", "gate": "ffn_gate.weight", "up": "ffn_up.weight",
               "down": "ffn_down.weight"}


def _unpermute(w: Tensor, heads: int) -> Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved pairs back to two halves per head)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _open_gguf(path: Path) -> tuple[ModelConfig, Fetch]:
    gguf = GGUFFile(path)
    config = config_from_gguf(gguf.meta, has_output_weight="output.weight" in gguf.tensors)

    def fetch(name: str) -> Tensor | None:
        if name.startswith("layers."):
            _, layer, part = name.split(".", 2)
            gguf_name = f"blk.{layer}.{_GGUF_LAYER[part]}"
        else:
            gguf_name = _GGUF_NAMES[name]
        if gguf_name not in gguf.tensors:
            return None
        tensor = torch.from_numpy(np.array(gguf.array(gguf_name)))  # a copy: the file is mapped read-only
        if config.architecture == "llama" and name.endswith((".q", ".k")):
            heads = config.num_heads if name.endswith(".q") else config.num_kv_heads
            tensor = _unpermute(tensor, heads)
        return tensor

    return config, fetch


# -- Hugging Face safetensors -------------------------------------------------------------------

_HF_LAYER = {"attn_norm": "input_layernorm.weight", "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight",
             "v": "self_attn.v_proj.weight", "q.bias": "self_attn.q_proj.bias", "k.bias": "self_attn.k_proj.bias",
             "v.bias": "self_attn.v_proj.bias", "q_norm": "self_attn.q_norm.weight",
             "k_norm": "self_attn.k_norm.weight", "o": "self_attn.o_proj.weight",
             "mlp_norm": "post_attention_layernorm.weight", "gate": "mlp.gate_proj.weight",
             "up": "mlp.up_proj.weight", "down": "mlp.down_proj.weight"}
_HF_NAMES = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}


def _open_hf(folder: Path) -> tuple[ModelConfig, Fetch]:
    from safetensors import safe_open

    config = config_from_hf(json.loads((folder / "config.json").read_text(encoding="utf-8")))
    where: dict[str, Path] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            where.update({key: file for key in handle.keys()})

    def fetch(name: str) -> Tensor | None:
        if name.startswith("layers."):
            _, layer, part = name.split(".", 2)
            key = f"model.layers.{layer}.{_HF_LAYER[part]}"
        else:
            key = _HF_NAMES[name]
        if key not in where:
            return None
        with safe_open(str(where[key]), framework="pt") as handle:
            return handle.get_tensor(key).float()

    return config, fetch
