"""The weight precisions a model can be loaded in, without torch (the CLI and configs check names here).

The residual stream and the KV pool stay float32 in every precision; the matmul weights differ, and
the products of prompts may run in bf16 (the prefill path, `akv_core.model.prefill`; docs/engine-model.md).
int8 and int4 run on the CPU only.
"""
from __future__ import annotations

PRECISIONS = ("float32", "fp16", "mixed", "int8", "int4")
DENSE_PRECISIONS = ("float32", "fp16", "mixed")
CPU_ONLY_PRECISIONS = ("int8", "int4")


def check_precision(value: str, field: str = "precision") -> str:
    """`value` if it names a precision; a ValueError naming `field` and the choices otherwise."""
    if value not in PRECISIONS:
        raise ValueError(f"{field}: expected one of {', '.join(PRECISIONS)}, got {value!r}")
    return value
