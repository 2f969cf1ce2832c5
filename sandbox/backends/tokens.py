"""The one chat tokenizer the sandbox counts and renders with.

The policy counts tokens with it on every backend, so a policy's decisions do not depend on
which backend serves the requests; the replay backend renders with it. One instance per model
for the whole process: its per-message memo is what makes repeated rendering cheap.
"""
from __future__ import annotations

from functools import lru_cache

from akv_core.chat import ChatTokenizer


@lru_cache(maxsize=4)
def shared_tokenizer(model: str = "smollm2") -> ChatTokenizer:
    return ChatTokenizer.from_model(model)
