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


@functools.lru_cache(maxsize=None)
def engine_parts():
    """The embedded model and its chat tokenizer, once per session, for the engines the tests build."""
    from akv_core.chat import ChatTokenizer

    return smollm2(), ChatTokenizer.from_model("smollm2")


def release_models() -> None:
    """Forget the loaded models (tests/conftest.py calls it after each test file): a test process that
    kept every precision, the reference and their engines for the whole session would hold several GB,
    and two of them outgrow the machine."""
    for cached in (smollm2, transformers_smollm2, engine_parts):
        cached.cache_clear()


def run_together(engine, handles: list) -> None:
    """Step `engine` until every handle is done, checking the cache's invariants after each step."""
    while not all(handle.done for handle in handles):
        engine.step()
        engine.check_integrity()


def random_ids(n: int, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (n,), generator=generator).tolist()


# A history whose last question only its second message answers.
SECRET = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "The secret code of the blue door is 4721."},
    {"role": "user", "content": "I had pasta for lunch today."},
    {"role": "user", "content": "What is the secret code of the blue door?"},
]


# An earlier assistant turn thought about the secret; only its reasoning holds it.
THOUGHT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Please keep the code of the blue door in mind."},
    {"role": "assistant", "reasoning_content": "The secret code of the blue door is 4721.",
     "content": "Understood, I will keep it in mind."},
    {"role": "user", "content": "What is the secret code of the blue door?"},
]
