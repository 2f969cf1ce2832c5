"""Serving a model past the context it was trained on: a longer context with its RoPE scaled.

A scaling is written `KIND` or `KIND:FACTOR` (`yarn`, `yarn:4`, `linear:4`; `none` keeps the
model's RoPE). Without a factor it is the new context over the trained one; without a context
the context is the trained one times the factor. The trained context becomes the scaling's
`original_context_length`, as in a Hugging Face config's `rope_scaling` block. No torch here:
the CLI checks a setting before it loads anything.
"""
from __future__ import annotations

import math
from dataclasses import replace

from akv_core.model.config import ModelConfig, RopeScaling

STRETCH_KINDS = ("yarn", "linear")
SCALING_FIELD = "rope_scaling"
CONTEXT_FIELD = "context_length"


def parse_rope_scaling(text: str, field: str = SCALING_FIELD) -> tuple[str, float | None]:
    """(kind, factor or None) of `KIND[:FACTOR]`; "none" is ("default", None). ValueError naming `field`."""
    kind, _, factor_text = text.strip().lower().partition(":")
    expected = f"expected {', '.join(STRETCH_KINDS)} or none, optionally with a factor (yarn:4)"
    if kind in ("none", "default"):
        if factor_text:
            raise ValueError(f"{field}: {text!r} takes no factor ({expected})")
        return "default", None
    if kind not in STRETCH_KINDS:
        raise ValueError(f"{field}: unknown scaling {kind!r} in {text!r}; {expected}")
    if not factor_text:
        return kind, None
    try:
        factor = float(factor_text)
    except ValueError:
        raise ValueError(f"{field}: the factor in {text!r} is not a number; {expected}") from None
    if not math.isfinite(factor) or factor <= 1.0:
        raise ValueError(f"{field}: the factor in {text!r} must be a number above 1 (it stretches the context)")
    return kind, factor


def stretch(config: ModelConfig, context_length: int | None = None, rope_scaling: str | None = None,
            fields: tuple[str, str] = (CONTEXT_FIELD, SCALING_FIELD)) -> ModelConfig:
    """`config` served at `context_length` with `rope_scaling` (both None: unchanged).

    A context beyond the trained one needs a scaling that covers it; a model whose file already
    scales its RoPE is not scaled again. `fields` name the two settings in errors (the CLI passes
    its option names).
    """
    context_field, scaling_field = fields
    if context_length is not None and (isinstance(context_length, bool) or not isinstance(context_length, int)
                                       or context_length < 1):
        raise ValueError(f"{context_field}: expected a positive number of tokens, got {context_length!r}")
    kind, factor = parse_rope_scaling(rope_scaling, scaling_field) if rope_scaling is not None else ("default", None)
    trained = config.context_length
    if kind == "default":
        if context_length is not None and context_length > trained:
            raise ValueError(f"{context_field}: {context_length} is beyond the model's trained context of "
                             f"{trained} tokens; stretch it with {scaling_field} yarn (or linear)")
        return config if context_length is None else replace(config, context_length=context_length)
    if config.rope_scaling.kind != "default":
        raise ValueError(f"{scaling_field}: the model already scales its RoPE ({config.rope_scaling.kind} "
                         f"x{config.rope_scaling.factor:g}); it is served at its own context of {trained}")
    if factor is None:
        if context_length is None or context_length <= trained:
            raise ValueError(f"{scaling_field}: {rope_scaling!r} without a factor needs a {context_field} "
                             f"beyond the trained {trained} tokens (or write {kind}:FACTOR)")
        factor = context_length / trained
    stretched = int(trained * factor)
    if context_length is None:
        context_length = stretched
    elif context_length > stretched:
        raise ValueError(f"{scaling_field}: {kind}:{factor:g} stretches the trained {trained} tokens to "
                         f"{stretched}, fewer than {context_field} {context_length}")
    scaling = RopeScaling(kind=kind, factor=factor, original_context_length=trained)
    return replace(config, context_length=context_length, rope_scaling=scaling)
