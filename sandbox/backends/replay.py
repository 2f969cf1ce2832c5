"""The replay backend: the usage the server would report, computed without a model.

It renders each request with the model's chat tokenizer and runs it through
`akv_core.cache.simulator.CacheSimulator`, which is the engine's own planner, radix cache
and usage accounting minus the forward pass. Accounting therefore matches `akv serve`
by construction (the parity test checks it token for token). Replies carry no message:
only agents whose decisions do not depend on model text can run on replay.
"""
from __future__ import annotations

from akv_core.cache.kv_cache import KVCapacityError
from akv_core.cache.ops import OperationError
from akv_core.cache.simulator import CacheSimulator
from akv_core.chat import ChatTokenizer

from sandbox.backends import BackendError, BackendReply, BackendRequest
from sandbox.backends.tokens import shared_tokenizer
from sandbox.cost import Usage

# Matches the server's default pool so that eviction, if any, happens at the same point.
DEFAULT_KV_TOKENS = 1 << 20


class ReplayBackend:
    name = "replay"
    generates = False

    def __init__(self, kv_tokens: int = DEFAULT_KV_TOKENS, fresh_cache_per_task: bool = True,
                 tokenizer: ChatTokenizer | None = None) -> None:
        self._kv_tokens = kv_tokens
        self._fresh = fresh_cache_per_task
        self._tokenizer = tokenizer or shared_tokenizer()
        self._simulator = CacheSimulator(kv_tokens)

    def start_task(self) -> None:
        # A fresh cache per task makes a task's cost independent of which tasks ran before it,
        # which evolution needs to compare candidates on task subsets.
        if self._fresh:
            self._simulator = CacheSimulator(self._kv_tokens)

    def complete(self, request: BackendRequest) -> BackendReply:
        if request.drop_rule and any(m.get("reasoning_content") for m in request.messages):
            raise BackendError("replay cannot account a drop_rule over reasoning content; "
                               "use drop_message or a model backend")
        rendered = self._tokenizer.render(request.messages, list(request.tools) or None)
        try:
            usage = self._simulator.request(rendered, None if request.drop_rule else request.drop_message,
                                            request.reposition, max_tokens=request.max_tokens)
        except (OperationError, KVCapacityError) as err:  # what the server would answer with HTTP 400
            raise BackendError(f"the request was rejected: {err}") from err
        # Nothing is generated: the harness bills the agent's own message as output.
        return BackendReply(None, Usage.from_fields(usage), "replay")

    def close(self) -> None:
        """Nothing to release."""
