"""The in-process backend: the `Engine` serves each request without HTTP.

Each task starts from an empty cache, as on the replay backend, so a task's usage does not
depend on which tasks ran before it (they would otherwise share the cached system prompt and
tool definitions). `fresh_cache_per_task=False` keeps one cache across tasks, as a server does.
A request's `tool_choice` of `required` or a named function is kept as the server keeps it: the
reply is decoded under the tool-call grammar (`akv_core.constrain.tool_call_grammar`). A request
that asks for `attribution` gets the reply's attention mass per message of its history, and
`score_reply` scores a recorded reply teacher-forced (the likelihood fidelity of a trace set).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from sandbox.backends.base import BackendError, BackendReply, BackendRequest, ReplyTooLong
from sandbox.runs.cost import ReportedUsage


class EmbeddedBackend:
    name = "embedded"
    generates = True
    parallel = "none"  # each task clears the engine's cache: tasks beside each other would clear it under one another
    attributes = True  # answers BackendRequest.attribution

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
        tools, grammar = forced_call(request.tools, request.tool_choice)
        # A keep_text_drop renders another history than the request's messages: its masses would name
        # messages the request does not have, so it gets none.
        attribution = request.attribution and fields.prompt is None
        try:
            generation = self._engine.generate(
                list(fields.prompt or request.messages),
                drop_message=fields.drop_message,
                reposition=list(fields.reposition) or None,
                tools=tools,
                max_tokens=request.max_tokens,
                temperature=request.temperature,
                seed=request.seed,
                thinking_drop=fields.thinking_drop,
                text_drop=fields.text_drop,
                grammar=grammar,
                attribution=attribution,
            )
        except (ValueError, RuntimeError) as err:  # a request the engine refused or could not finish
            raise BackendError(f"the embedded engine could not serve the request: {err}") from err
        return BackendReply(self._message(generation.text, bool(request.tools)),
                            ReportedUsage.from_fields(generation.usage), generation.finish_reason,
                            attribution=generation.attribution)

    def score_reply(self, request: BackendRequest, reply: Mapping[str, Any]) -> tuple[float, ...]:
        """Each token's natural-log probability in the recorded assistant message `reply` after the request's
        history under its cache fields, teacher-forced (`Engine.score_continuation`), without the end-of-turn
        token (as a server scores an open final message). ReplyTooLong past the model's context or KV pool."""
        from akv_core.cache.kv_cache import KVCapacityError
        from akv_core.continuation import ContextLengthExceeded

        fields = request.cache_operations()
        try:
            score = self._engine.score_continuation(
                list(fields.prompt or request.messages), reply, drop_message=fields.drop_message,
                reposition=list(fields.reposition) or None, tools=list(request.tools) or None,
                thinking_drop=fields.thinking_drop, text_drop=fields.text_drop)
        except (ContextLengthExceeded, KVCapacityError) as err:
            raise ReplyTooLong(f"the embedded engine cannot score the reply: {err}") from err
        except (ValueError, RuntimeError) as err:
            raise BackendError(f"the embedded engine could not score the reply: {err}") from err
        closed = bool(score.token_ids) and score.token_ids[-1] in self._engine.tokenizer.eos_token_ids
        return score.logprobs[:-1] if closed else score.logprobs

    def _message(self, text: str, parse_calls: bool) -> dict[str, Any]:
        """The generated text as an assistant message, tool calls parsed as the server parses them."""
        if not parse_calls:
            return {"role": "assistant", "content": text}
        reply = self._engine.tokenizer.parse_reply(text)
        message: dict[str, Any] = {"role": "assistant", "content": reply.content}
        if reply.tool_calls:
            # Without ids: the tokenizer numbers each reply's calls from call_0, which would repeat from step to
            # step of a task; the agent (or the harness) gives each call an id unique in the task.
            message["tool_calls"] = [{k: v for k, v in call.items() if k != "id"} for call in reply.tool_calls]
        return message

    def close(self) -> None:
        close = getattr(self._engine, "close", None)
        if close is not None:
            close()


def forced_call(tools: Sequence[Mapping[str, Any]], choice: str | Mapping[str, Any] | None
                ) -> tuple[list[Mapping[str, Any]] | None, Any]:
    """(the tools the prompt declares, the grammar of the call `choice` forces, or None), as `akv serve`
    reads `tool_choice` (`akv_core/server/validation.py`); BackendError for a choice it would answer with 400."""
    from akv_core.constrain import GrammarError, tool_call_grammar

    declared = list(tools) or None
    if choice is None or choice == "auto":
        return declared, None
    if choice == "none":
        return None, None
    if declared is None:
        raise BackendError("tool_choice: is only allowed when tools are specified")
    if choice == "required":
        name = None
    elif isinstance(choice, Mapping) and isinstance((choice.get("function") or {}).get("name"), str):
        name = choice["function"]["name"]
    else:
        raise BackendError(f"tool_choice: expected none, auto, required or a named function, got {choice!r}")
    try:
        return declared, tool_call_grammar(declared, name)
    except GrammarError as err:
        raise BackendError(f"tool_choice: {err}") from err
