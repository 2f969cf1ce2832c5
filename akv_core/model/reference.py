"""transformers' own model from the embedded GGUF file: the reference of the correctness tests
and the engine benchmark, never the engine (it needs the `transformers` and `accelerate`
packages of the dev extra)."""
from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from akv_core.model.locate import embedded_gguf


def transformers_reference() -> Any:
    """The embedded SmolLM2 as transformers loads it from the same GGUF file, fp32, in eval mode."""
    os.environ.setdefault("TQDM_DISABLE", "1")   # the GGUF conversion's progress bar
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    path = embedded_gguf()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
