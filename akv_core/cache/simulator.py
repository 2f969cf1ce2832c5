"""The engine's cache bookkeeping without a model: usage for replayed requests.

Each request runs the engine's own steps (validate, key, plan, check, admit,
release with the prompt inserted) minus the tensor work, one request at a time,
so usage and evictions agree token for token with a server that serves the
same requests one after another with the same pool size and max_tokens.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from akv_core.cache.key import RenderedPrompt, build_key
from akv_core.cache.kv_cache import KVCache, KVCapacityError, PoolStats
from akv_core.cache.ops import validate_operations
from akv_core.cache.text_drop import TextDrop
from akv_core.cache.usage import Usage


class CacheSimulator:
    """A KV pool of `kv_tokens` slots and its radix cache, driven by rendered requests."""

    def __init__(self, kv_tokens: int) -> None:
        self.cache = KVCache(kv_tokens)

    def request(self, rendered: RenderedPrompt, drop_message: Mapping[Any, Any] | None = None,
                reposition: Sequence[Any] | None = None, completion_tokens: int = 0,
                max_tokens: int = 0, thinking_drop: bool = False, text_drop: TextDrop | None = None) -> Usage:
        """Serve one request's prompt; `max_tokens` reserves decode slots as the engine does.

        `text_drop` is a parsed text_drop / keep_text_drop rule (akv_core.cache.text_drop) of
        the history `rendered` is. Raises OperationError for invalid operations and
        KVCapacityError for a prompt the pool can never hold.
        """
        operations = validate_operations(len(rendered.spans), drop_message, reposition, thinking_drop, text_drop)
        plan = self.cache.plan(build_key(rendered, operations), max_tokens)
        if not self.cache.can_admit(plan, max_tokens):
            self.cache.check_fits(plan, max_tokens)
            raise KVCapacityError("messages: the prompt does not fit the KV pool")  # unreachable when alone
        lease = self.cache.admit(plan, max_tokens)
        self.cache.release(lease, keep_prompt=True)
        return plan.usage.with_completion(completion_tokens)

    def stats(self) -> PoolStats:
        return self.cache.stats()

    def check_integrity(self) -> None:
        self.cache.check_integrity()
