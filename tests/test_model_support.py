"""Shared by the model tests (it holds no tests itself): one SmolLM2 load and one transformers
reference per test session, since loading costs seconds on a shared two-core machine."""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def smollm2(precision: str = "float32"):
    from akv_core.model.loader import load_model

    torch.set_num_threads(1)  # the test machine is shared: one thread is fastest under load
    return load_model("smollm2", precision=precision)


@functools.lru_cache(maxsize=None)
def transformers_smollm2():
    """transformers' own model from the same GGUF file, fp32."""
    from akv_core.model.reference import transformers_reference

    return transformers_reference()


def random_ids(n: int, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (n,), generator=generator).tolist()
