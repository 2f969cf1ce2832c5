"""Shared by the model tests (it holds no tests itself): one SmolLM2 load and one transformers
reference per test session, since loading costs seconds on a shared two-core machine."""
from __future__ import annotations

import functools
import os
import warnings

import torch


@functools.lru_cache(maxsize=None)
def smollm2(precision: str = "float32"):
    from akv_core.model.loader import load_model

    torch.set_num_threads(1)  # the test machine is shared: one thread is fastest under load
    return load_model("smollm2", precision=precision)


@functools.lru_cache(maxsize=None)
def transformers_smollm2():
    """transformers' own model from the same GGUF file, fp32."""
    os.environ.setdefault("TQDM_DISABLE", "1")
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    from akv_core.model.locate import embedded_gguf

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    path = embedded_gguf()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def random_ids(n: int, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (n,), generator=generator).tolist()
