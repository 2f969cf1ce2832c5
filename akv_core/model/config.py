"""The shape of a decoder-only transformer, read from GGUF metadata or a Hugging Face config.json."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE frequencies are stretched beyond the training context ("default" means not at all)."""

    kind: str = "default"                 # default | linear | llama3 | yarn
    factor: float = 1.0
    original_context_length: int | None = None
    low_freq_factor: float = 1.0          # llama3
    high_freq_factor: float = 4.0         # llama3
    beta_fast: float = 32.0               # yarn
    beta_slow: float = 1.0                # yarn
    attention_factor: float | None = None  # yarn: scales cos/sin; derived from factor when absent
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    """Everything the forward pass needs to know about the architecture."""

    architecture: str                     # llama | qwen2 | qwen3
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    rms_norm_eps: float
    rope_theta: float
    rotary_dim: int                       # the leading dims of a head that rotate; the rest pass through
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    qkv_bias: bool = False                # Qwen2
    qk_norm: bool = False                 # Qwen3: RMSNorm per head on q and k before RoPE
    tie_embeddings: bool = False


SUPPORTED_HF = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                "MistralForCausalLM": "llama"}


def config_from_gguf(meta: dict[str, Any], has_output_weight: bool) -> ModelConfig:
    """A config from GGUF metadata (`{arch}.block_count` and friends)."""
    arch = meta["general.architecture"]
    if arch not in ("llama", "qwen2", "qwen3"):
        raise ValueError(f"GGUF architecture {arch!r} is not supported (expected llama, qwen2 or qwen3)")

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    heads = get("attention.head_count")
    head_dim = get("attention.key_length") or get("embedding_length") // heads
    scaling = RopeScaling()
    kind = get("rope.scaling.type")
    if kind in ("linear", "yarn"):
        scaling = RopeScaling(kind=kind, factor=float(get("rope.scaling.factor", 1.0)),
                              original_context_length=get("rope.scaling.original_context_length"))
    return ModelConfig(
        architecture=arch, num_layers=get("block_count"), hidden_size=get("embedding_length"),
        intermediate_size=get("feed_forward_length"), num_heads=heads,
        num_kv_heads=get("attention.head_count_kv", heads), head_dim=head_dim,
        vocab_size=get("vocab_size") or meta.get("tokenizer.ggml.tokens"),
        context_length=get("context_length"), rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)), rotary_dim=get("rope.dimension_count") or head_dim,
        rope_scaling=scaling, qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3",
        tie_embeddings=not has_output_weight)


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """A config from a Hugging Face config.json (Llama, Qwen2, Qwen3 dense)."""
    names = cfg.get("architectures") or []
    arch = next((SUPPORTED_HF[n] for n in names if n in SUPPORTED_HF), None)
    if arch is None:
        raise ValueError(f"config.json architectures {names} not supported (expected one of {sorted(SUPPORTED_HF)})")
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = dict(cfg.get("rope_scaling") or {})
    rope.update(cfg.get("rope_parameters") or {})  # transformers 5 spells it rope_parameters
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    return ModelConfig(
        architecture=arch, num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads, head_dim=head_dim, vocab_size=cfg["vocab_size"],
        context_length=cfg.get("max_position_embeddings", 4096), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta, rotary_dim=int(head_dim * partial), rope_scaling=_hf_scaling(rope, cfg),
        qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)), qk_norm=arch == "qwen3",
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)))


def _hf_scaling(rope: dict[str, Any], cfg: dict[str, Any]) -> RopeScaling:
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind == "default":
        return RopeScaling()
    if kind not in ("linear", "llama3", "yarn"):
        raise ValueError(f"rope scaling {kind!r} is not supported (expected default, linear, llama3 or yarn)")
    original = rope.get("original_max_position_embeddings")
    return RopeScaling(
        kind=kind, factor=float(rope.get("factor", 1.0)), original_context_length=original,
        low_freq_factor=float(rope.get("low_freq_factor", 1.0)), high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        beta_fast=float(rope.get("beta_fast") or 32.0), beta_slow=float(rope.get("beta_slow") or 1.0),
        attention_factor=rope.get("attention_factor"), mscale=rope.get("mscale"),
        mscale_all_dim=rope.get("mscale_all_dim"), truncate=bool(rope.get("truncate", True)))
