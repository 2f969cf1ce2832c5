"""The in-process backend: the `Engine` serves each request without HTTP.

Requests of all tasks share the engine's radix cache, as they would share a server's.
"""
from __future__ import annotations

from typing import Any

from sandbox.backends import BackendError, BackendReply, BackendRequest
from sandbox.cost import Usage


class EmbeddedBackend:
    name = "embedded"
    generates = True

    def __init__(self, model: str = "smollm2") -> None:
        from akv_core import Engine  # torch loads only when this backend is chosen

        try:
            self._engine: Any = Engine.from_pretrained(model)
        except (FileNotFoundError, ValueError) as err:
            raise ValueError(f"cannot load model {model!r}: {err}") from err

    def start_task(self) -> None:
        """Nothing to reset: the engine's cache is shared across tasks."""

    def complete(self, request: BackendRequest) -> BackendReply:
        fields = request.api_fields()
        try:
            generation = self._engine.generate(
                list(request.messages),
                drop_message=fields.get("drop_message"),
                reposition=fields.get("reposition"),
                tools=list(request.tools) or None,
                max_tokens=request.max_tokens,
                temperature=request.temperature,
                seed=request.seed,
            )
        except ValueError as err:  # the engine's rejection of a request (too long, bad operations)
            raise BackendError(f"the embedded engine rejected the request: {err}") from err
        message = {"role": "assistant", "content": generation.text}
        tool_calls = getattr(generation, "tool_calls", None)
        if tool_calls:
            message["tool_calls"] = list(tool_calls)
        return BackendReply(message, Usage.from_fields(generation.usage), generation.finish_reason)

    def close(self) -> None:
        close = getattr(self._engine, "close", None)
        if close is not None:
            close()
