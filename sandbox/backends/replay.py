"""The replay backend: the usage the server would report, computed without a model.

It renders each request with the model's chat tokenizer and runs it through
`akv_core.cache.simulator.CacheSimulator`, which is the engine's own planner, radix cache
and usage accounting minus the forward pass. Accounting therefore matches `akv serve`
by construction (the parity test checks it token for token). Replies carry no message:
only agents whose decisions do not depend on model text can run on replay.

Evolution scores many candidate policies on the same tasks, and their trajectories share
prefixes (every request before the first decision that differs). With a fresh cache per
task, a request's usage is a function of the task's requests so far, so `TaskPrefixMemo`
looks it up by a digest chained over them and the simulator runs only on a miss.
"""
from __future__ import annotations

import hashlib
import json
from array import array
from functools import partial
from typing import Callable

from akv_core.cache.kv_cache import KVCapacityError
from akv_core.cache.ops import OperationError
from akv_core.cache.simulator import CacheSimulator
from akv_core.chat import ChatTokenizer, Rendered

from sandbox.backends.base import BackendError, BackendReply, BackendRequest, CacheOperations
from sandbox.backends.tokens import shared_tokenizer
from sandbox.runs.cost import ReportedUsage

# A pool no suite task fills, so a policy's cost is not a pool's evictions. To compare with an engine
# or a server request for request, give it the same pool (`EmbeddedBackend.kv_tokens`).
DEFAULT_KV_TOKENS = 1 << 20


class TaskPrefixMemo:
    """Usage of a request keyed by a digest of its task's requests up to and including it."""

    def __init__(self, capacity: int = 500_000) -> None:
        self._capacity = capacity
        self._usage: dict[bytes, ReportedUsage] = {}
        self.hits = self.misses = 0

    def get(self, key: bytes) -> ReportedUsage | None:
        usage = self._usage.get(key)
        if usage is None:
            self.misses += 1
        else:
            self.hits += 1
        return usage

    def put(self, key: bytes, usage: ReportedUsage) -> None:
        if len(self._usage) >= self._capacity:
            self._usage.clear()  # bounded memory; a cleared memo only costs recomputation
        self._usage[key] = usage


SHARED_MEMO = TaskPrefixMemo()

_Operations = tuple[CacheOperations, int]  # the request's cache fields, max_tokens


class ReplayBackend:
    name = "replay"
    generates = False
    parallel = "processes"  # CPU-bound Python: threads would take turns on the interpreter lock

    def __init__(self, kv_tokens: int = DEFAULT_KV_TOKENS, fresh_cache_per_task: bool = True,
                 tokenizer: ChatTokenizer | None = None, memo: TaskPrefixMemo | None = SHARED_MEMO) -> None:
        self._kv_tokens = kv_tokens
        self._fresh = fresh_cache_per_task
        self._tokenizer = tokenizer or shared_tokenizer()
        self._simulator = CacheSimulator(kv_tokens)
        # The memo is exact only when each task starts from an empty cache.
        self._memo = memo if fresh_cache_per_task else None
        self._chain = str(kv_tokens).encode()
        self._pending: list[tuple[Rendered, _Operations]] = []

    def start_task(self) -> None:
        # A fresh cache per task makes a task's cost independent of which tasks ran before it,
        # which evolution needs to compare candidates on task subsets.
        if self._fresh:
            self._simulator = CacheSimulator(self._kv_tokens)
            self._chain = str(self._kv_tokens).encode()
            self._pending = []

    def complete(self, request: BackendRequest) -> BackendReply:
        fields = request.cache_operations()
        rendered = self._tokenizer.render(fields.prompt or request.messages, list(request.tools) or None)
        operations = (fields, request.max_tokens)
        if self._memo is None:
            usage = self._account(rendered, operations)
        else:
            self._chain = _chained(self._chain, rendered, operations)
            usage = self._memo.get(self._chain)
            if usage is None:
                self._catch_up()
                usage = self._account(rendered, operations)
                self._memo.put(self._chain, usage)
            else:  # the simulator skips it for now; a later miss needs its state
                self._pending.append((rendered, operations))
        # Nothing is generated: the harness bills the agent's own message as output.
        return BackendReply(None, usage, "replay")

    def _catch_up(self) -> None:
        """Play the requests served from the memo into the simulator, so it holds the task's state."""
        for rendered, operations in self._pending:
            self._account(rendered, operations)
        self._pending = []

    def _account(self, rendered: Rendered, operations: _Operations) -> ReportedUsage:
        fields, max_tokens = operations
        try:
            usage = self._simulator.request(rendered, fields.drop_message, fields.reposition, max_tokens=max_tokens,
                                            thinking_drop=fields.thinking_drop, text_drop=fields.text_drop)
        except (OperationError, KVCapacityError) as err:  # what the server would answer with HTTP 400
            raise BackendError(f"the request was rejected: {err}") from err
        return ReportedUsage.from_fields(usage)

    def reopen(self) -> Callable[[], ReplayBackend]:
        """A maker of an equal backend for a process lane (its own simulator and prefix memo)."""
        return partial(ReplayBackend, self._kv_tokens, self._fresh)

    def close(self) -> None:
        """Nothing to release."""


def _chained(previous: bytes, rendered: Rendered, operations: _Operations) -> bytes:
    """A digest of the task's requests so far: tokens, message and reasoning spans, cache operations."""
    digest = hashlib.blake2b(previous, digest_size=16)
    digest.update(rendered.token_array)
    digest.update(array("i", [i for span in rendered.spans for i in span]))
    digest.update(json.dumps(rendered.reasoning_spans).encode())
    fields, max_tokens = operations
    digest.update(json.dumps([fields.drop_message or {}, list(fields.reposition), fields.thinking_drop, max_tokens],
                             sort_keys=True).encode())
    if fields.text_drop is not None:   # its characters, which the tokens and spans above do not show
        digest.update(repr(fields.text_drop).encode())
    return digest.digest()
