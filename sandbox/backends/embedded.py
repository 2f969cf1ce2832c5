"""The in-process backend: the `Engine` serves each request without HTTP.

Each task starts from an empty cache, as on the replay backend, so a task's usage does not
depend on which tasks ran before it (they would otherwise share the cached system prompt and
tool definitions). `fresh_cache_per_task=False` keeps one cache across tasks, as a server does.
"""
from __future__ import annotations

from typing import Any

from sandbox.backends import BackendError, BackendReply, BackendRequest
from sandbox.cost import Usage


class EmbeddedBackend:
    name = "embedded"
    generates = True
    parallel = "none"  # each task clears the engine's cache: tasks beside each other would clear it under one another

    def __init__(self, model: str = "smollm2", kv_tokens: int | None = None,
                 fresh_cache_per_task: bool = True, precision: str = "float32") -> None:
        """`precision`: the weights' (`akv_core.model.loader.load_model`); float32 is exact."""
        from akv_core import Engine  # torch loads only when this backend is chosen

        self.fresh_cache_per_task = fresh_cache_per_task   # may change between tasks (one engine, both modes)
        try:
            self._engine: Any = Engine.from_pretrained(model, kv_tokens=kv_tokens, precision=precision)
        except (FileNotFoundError, ValueError) as err:
            raise ValueError(f"cannot load model {model!r}: {err}") from err

    @property
    def kv_tokens(self) -> int:
        """The engine's KV pool, in slots (the replay backend takes the same number for parity)."""
        return int(self._engine.cache.allocator.total)

    def start_task(self) -> None:
        if self.fresh_cache_per_task:
            self._engine.clear_cache()

    def complete(self, request: BackendRequest) -> BackendReply:
        fields = request.cache_operations()
        try:
            generation = self._engine.generate(
                list(fields.prompt or request.messages),
                drop_message=fields.drop_message,
                reposition=list(fields.reposition) or None,
                tools=list(request.tools) or None,
                max_tokens=request.max_tokens,
                temperature=request.temperature,
                seed=request.seed,
                thinking_drop=fields.thinking_drop,
                text_drop=fields.text_drop,
            )
        except (ValueError, RuntimeError) as err:  # a request the engine refused or could not finish
            raise BackendError(f"the embedded engine could not serve the request: {err}") from err
        return BackendReply(self._message(generation.text, bool(request.tools)), Usage.from_fields(generation.usage),
                            generation.finish_reason)

    def _message(self, text: str, parse_calls: bool) -> dict[str, Any]:
        """The generated text as an assistant message, tool calls parsed as the server parses them."""
        if not parse_calls:
            return {"role": "assistant", "content": text}
        reply = self._engine.tokenizer.parse_reply(text)
        message: dict[str, Any] = {"role": "assistant", "content": reply.content}
        if reply.tool_calls:
            message["tool_calls"] = [dict(call) for call in reply.tool_calls]
        return message

    def close(self) -> None:
        close = getattr(self._engine, "close", None)
        if close is not None:
            close()
