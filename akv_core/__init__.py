"""akv_core: an AKV serving engine (Append / Drop / Repos over an operation-aware radix cache).

Heavy modules (torch) load lazily so that light users (the replay simulator,
the CLI) can import the tokenizer and the cache bookkeeping quickly.
"""
from __future__ import annotations

from typing import Any

__all__ = ["Engine"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from akv_core.engine import Engine

        return Engine
    raise AttributeError(f"module 'akv_core' has no attribute {name!r}")
