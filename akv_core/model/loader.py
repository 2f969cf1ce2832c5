"""Loading weights into a `CausalLM`: GGUF files (dequantized once, or 4-bit tensors kept as stored for
int4) and Hugging Face safetensors folders.

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
from akv_core.model.linear import Linear, Projection
from akv_core.model.llama import CausalLM, LayerWeights
from akv_core.model.locate import EMBEDDED_NAME, locate
from akv_core.model.precisions import CPU_ONLY_PRECISIONS, check_precision
from akv_core.model.quantized import Int4Groups, Int4Linear, Int8Linear, require_kernel
from akv_core.model.stretch import stretch

Fetch = Callable[[str], Tensor | None]
FetchInt4 = Callable[[str], Int4Groups | None]


def load_model(name_or_path: str = EMBEDDED_NAME, device: str = "cpu", dtype: torch.dtype = torch.float32,
               precision: str = "float32", context_length: int | None = None,
               rope_scaling: str | None = None) -> CausalLM:
    """Load `smollm2`, a `.gguf` file or a safetensors folder.

    `dtype` is the activations' and the KV pool's; `precision` the matmul weights': "float32" (exact, the
    reference), "fp16" (fp16 weights; about twice as fast a decode on a CPU), "mixed" (fp16 weights for
    decode, bf16 for prefill where the CPU has native bf16), "int8" (int8 per row) or "int4" (4-bit in
    groups of 32, a GGUF's Q4_0 / Q4_1 tensors as stored; the output projection int8). int8 and int4 run
    on the CPU only. See docs/engine-model.md.

    `context_length` and `rope_scaling` ("yarn", "yarn:4", "linear:4", "none") serve the model at another
    context, past its trained one with its RoPE scaled (`akv_core.model.stretch`); None keeps the file's.
    """
    check_precision(precision)
    if precision in CPU_ONLY_PRECISIONS:
        if torch.device(device).type != "cpu":
            raise ValueError(f"precision {precision!r} runs on the CPU only (torch's int8 / int4 CPU kernels); "
                             f"on {device} use float32, fp16 or mixed")
        require_kernel(precision)
    files = locate(name_or_path)
    if files.kind == "gguf":
        config, fetch, fetch_int4 = _open_gguf(files.path)
    else:
        (config, fetch), fetch_int4 = _open_hf(files.path), None
    config = stretch(config, context_length, rope_scaling)
    return _assemble(config, fetch, fetch_int4, device, dtype, precision)


def model_config(name_or_path: str = EMBEDDED_NAME) -> ModelConfig:
    """The model's config as its files give it, without loading the weights (a GGUF's header only)."""
    files = locate(name_or_path)
    if files.kind == "gguf":
        gguf = GGUFFile(files.path)
        return config_from_gguf(gguf.meta, has_output_weight="output.weight" in gguf.tensors)
    return config_from_hf(json.loads((files.path / "config.json").read_text(encoding="utf-8")))


def _assemble(config: ModelConfig, fetch: Fetch, fetch_int4: FetchInt4 | None, device: str, dtype: torch.dtype,
              precision: str) -> CausalLM:
    def need(name: str) -> Tensor:
        tensor = fetch(name)
        if tensor is None:
            raise ValueError(f"model weights lack tensor {name!r}")
        return tensor.to(device=device, dtype=dtype).contiguous()

    def maybe(name: str) -> Tensor | None:
        tensor = fetch(name)
        return None if tensor is None else tensor.to(device=device, dtype=dtype).contiguous()

    def projection(names: list[str], bias: Tensor | None = None) -> Projection:
        """One (fused) projection in the chosen precision; int4 keeps a file's 4-bit groups as stored."""
        if precision == "int4":
            stored = [fetch_int4(name) for name in names] if fetch_int4 is not None else [None]
            if all(groups is not None for groups in stored):
                return Int4Linear(Int4Groups.cat(stored), bias)
            return Int4Linear(Int4Groups.quantize(torch.cat([need(name) for name in names])), bias)
        weight = torch.cat([need(name) for name in names])
        return Int8Linear(weight, bias) if precision == "int8" else Linear(weight, bias, precision)

    layers = []
    for i in range(config.num_layers):
        p = f"layers.{i}."
        bias = [maybe(p + n + ".bias") for n in ("q", "k", "v")]
        layers.append(LayerWeights(
            attn_norm=need(p + "attn_norm"),
            qkv=projection([p + n for n in ("q", "k", "v")],
                           torch.cat(bias) if all(b is not None for b in bias) else None),
            q_norm=maybe(p + "q_norm") if config.qk_norm else None,
            k_norm=maybe(p + "k_norm") if config.qk_norm else None,
            o=projection([p + "o"]), mlp_norm=need(p + "mlp_norm"),
            gate_up=projection([p + "gate", p + "up"]), down=projection([p + "down"])))
    embed = need("embed")
    head = embed if config.tie_embeddings else need("lm_head")
    # The output projection stays 8-bit in int4, as llama.cpp's files keep it (Q8_0 or better).
    # Only the sampled rows reach it (a few per step): it needs no prefill-sized kernel.
    lm_head = Int8Linear(head) if precision in ("int8", "int4") else Linear(head, None, precision, prefill_rows=False)
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


def _open_gguf(path: Path) -> tuple[ModelConfig, Fetch, FetchInt4]:
    gguf = GGUFFile(path)
    config = config_from_gguf(gguf.meta, has_output_weight="output.weight" in gguf.tensors)

    def gguf_name(name: str) -> str:
        if name.startswith("layers."):
            _, layer, part = name.split(".", 2)
            return f"blk.{layer}.{_GGUF_LAYER[part]}"
        return _GGUF_NAMES[name]

    def in_hf_order(tensor: Tensor, name: str) -> Tensor:
        """Rows of Llama's q/k back in Hugging Face order (per-row group scales move with their rows)."""
        if config.architecture == "llama" and name.endswith((".q", ".k")):
            return _unpermute(tensor, config.num_heads if name.endswith(".q") else config.num_kv_heads)
        return tensor

    def fetch(name: str) -> Tensor | None:
        if gguf_name(name) not in gguf.tensors:
            return None
        return in_hf_order(torch.from_numpy(np.array(gguf.array(gguf_name(name)))), name)  # a copy: mapped read-only

    def fetch_int4(name: str) -> Int4Groups | None:
        stored = gguf.int4_groups(gguf_name(name)) if gguf_name(name) in gguf.tensors else None
        if stored is None:
            return None
        q, scale, offset = (in_hf_order(torch.from_numpy(np.array(a)), name) for a in stored)
        return Int4Groups.from_values(q, scale, offset)

    return config, fetch, fetch_int4


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
