"""A chat request turned into engine arguments, or a 400 that names the field.

Pydantic has already checked the shapes; this module checks what needs more
than one field or the length of the history: the AKV operations (through the
cache layer's own validator, so the server and the replay simulator agree),
token limits, and the OpenAI options this server does not implement.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from akv_core.cache.ops import OperationError, validate_operations
from akv_core.cache.text_drop import TextDrop, parse_text_drop, project_kept
from akv_core.constrain import Grammar, tool_call_grammar
from akv_core.sampling import TOP_LOGPROBS_MAX
from akv_core.server.constraint import output_constraint
from akv_core.server.errors import APIError
from akv_core.server.protocol import (ChatCompletionRequest, KeepTextDropRule, MessageDropRule, TextDropRule,
                                      ThinkingDropRule)
from akv_core.server.reply_fields import ReplyOptions, reply_options


# Choices one request may ask for (`n`): each is an engine request of its own, sharing the prompt.
MAX_CHOICES = 8
# OpenAI fields that are hints this server has nothing to do with: accepted, ignored, and named in
# the response's `x-akv-ignored-params` header when a request sends them.
IGNORED_FIELDS = ("audio", "metadata", "parallel_tool_calls", "prediction", "prompt_cache_key",
                  "prompt_cache_options", "prompt_cache_retention", "reasoning_effort", "safety_identifier",
                  "service_tier", "store", "user", "verbosity", "web_search_options")
TOOL_CHOICES = '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}'


@dataclass(frozen=True)
class GenerationArgs:
    """Everything `engine.submit` takes, already validated."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    drop_message: dict[str, list[int]] | None
    reposition: list[int] | None
    thinking_drop: bool
    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str] | None
    grammar: Grammar | None = None
    grammar_field: str | None = None   # the request field the grammar came from, for its 400
    text_drop: TextDrop | None = None  # a text_drop / keep_text_drop rule, resolved
    n: int = 1                         # choices: engine requests with the same prompt
    top_logprobs: int | None = None    # None: no log probabilities; k: the sampled token's and k more
    reply: ReplyOptions = ReplyOptions()   # return_attribution, continue_final_message, prompt_logprobs


def generation_args(request: ChatCompletionRequest) -> GenerationArgs:
    if not request.messages:
        raise APIError("messages: the history must contain at least one message", param="messages")
    _reject_unsupported(request)
    messages, text_drop = prompt_messages(request)
    drop_message, reposition, thinking_drop = cache_operations(request, messages, text_drop)
    grammar, grammar_field = output_constraint(request)
    tools, forced_call = tool_choice(request)
    if forced_call is not None:
        # The call is the whole output; a response_format shapes text answers, which it leaves none of.
        for field in ("regex", "ebnf", "lark"):
            if getattr(request, field) is not None:
                raise APIError(f"{field}: cannot constrain the output of a forced tool call (tool_choice)",
                               param=field)
        grammar, grammar_field = forced_call, "tools"
    reply = reply_options(request, "tool_choice" if forced_call is not None else grammar_field)
    return GenerationArgs(
        messages=messages,
        tools=tools,
        drop_message=drop_message,
        reposition=reposition,
        thinking_drop=thinking_drop,
        text_drop=text_drop,
        max_tokens=_max_tokens(request),
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        seed=request.seed,
        stop=_stop(request.stop),
        grammar=grammar,
        grammar_field=grammar_field,
        n=_choices(request.n),
        top_logprobs=_top_logprobs(request),
        reply=reply,
    )


def tool_choice(request: ChatCompletionRequest) -> tuple[list[dict[str, Any]] | None, Grammar | None]:
    """(the tools the prompt declares, the grammar of a forced call or None).

    `required` and a named function are kept by constrained decoding (`tool_call_grammar`): the
    model is asked, as under `auto`, and can only answer with a call whose arguments match the
    tool's schema. `none` leaves the tools out of the prompt.
    """
    choice = request.tool_choice
    tools = [tool.model_dump(exclude_none=True) for tool in request.tools] if request.tools else None
    if choice is None or choice == "auto":
        return tools, None
    if choice == "none":
        return None, None
    name = None if choice == "required" else _named_function(choice)
    if not tools:
        raise APIError("tool_choice: is only allowed when tools are specified", param="tool_choice")
    names = [tool["function"]["name"] for tool in tools]
    if name is not None and name not in names:
        raise APIError(f"tool_choice: the function {name!r} is not in tools ({', '.join(map(repr, names))})",
                       param="tool_choice")
    return tools, tool_call_grammar(tools, name)


def _named_function(choice: str | dict[str, Any]) -> str:
    """The function a `{"type": "function", "function": {"name": ...}}` choice names, or a 400."""
    if isinstance(choice, dict) and choice.get("type") in ("allowed_tools", "custom"):
        raise APIError(f"tool_choice: {choice['type']} is not supported; send {TOOL_CHOICES}", param="tool_choice")
    function = choice.get("function") if isinstance(choice, dict) else None
    if (not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)):
        raise APIError(f"tool_choice: expected {TOOL_CHOICES}, got {repr(choice)[:80]}", param="tool_choice")
    return function["name"]


def _in_range(field: str, value: int | None, low: int, high: int) -> None:
    """A 400 in OpenAI's words and code unless `value` is None or inside [low, high]."""
    if value is not None and value > high:
        raise APIError(f"{field}: integer above maximum value. Expected a value <= {high}, but got {value} "
                       "instead.", param=field, code="integer_above_max_value")
    if value is not None and value < low:
        raise APIError(f"{field}: integer below minimum value. Expected a value >= {low}, but got {value} "
                       "instead.", param=field, code="integer_below_min_value")


def _choices(n: int | None) -> int:
    _in_range("n", n, 1, MAX_CHOICES)
    return n or 1


def _top_logprobs(request: ChatCompletionRequest) -> int | None:
    """None unless `logprobs` is true: the engine then computes none, and decoding costs what it did."""
    top = request.top_logprobs
    _in_range("top_logprobs", top, 0, TOP_LOGPROBS_MAX)
    if not request.logprobs:
        if top:
            raise APIError("top_logprobs: requires logprobs to be true", param="top_logprobs")
        return None
    return top or 0


def ignored_params(request: ChatCompletionRequest) -> list[str]:
    """The accepted-and-ignored fields the request sent with a value (`IGNORED_FIELDS`)."""
    return [field for field in IGNORED_FIELDS if getattr(request, field) is not None]


def prompt_messages(request: ChatCompletionRequest) -> tuple[list[dict[str, Any]], TextDrop | None]:
    """The messages to render (the full history under keep_text_drop) and the text drop, if any."""
    messages = [_engine_message(message) for message in request.messages]
    rule = request.drop_rule
    try:
        if isinstance(rule, TextDropRule):
            return messages, parse_text_drop(rule.drop_messages, messages)
        if isinstance(rule, KeepTextDropRule):
            full = [_engine_message(message) for message in rule.full_messages]
            kept = project_kept(full, messages, rule.force)
            return kept.messages, kept.drop
    except OperationError as error:
        raise APIError(str(error), param=error.field) from None
    return messages, None


def cache_operations(
    request: ChatCompletionRequest, messages: list[dict[str, Any]] | None = None,
    text_drop: TextDrop | None = None,
) -> tuple[dict[str, list[int]] | None, list[int] | None, bool]:
    """(drop_message, reposition, thinking_drop) from `drop_message` / `drop_rule` and
    `reposition`, checked against the history (`messages`, the prompt, when it is not the
    request's own: the full history of a keep_text_drop) with its text drop."""
    if request.drop_message is not None and request.drop_rule is not None:
        raise APIError(
            "drop_rule: send either drop_message or drop_rule, not both", param="drop_rule"
        )
    field, drops = "drop_message", request.drop_message
    if isinstance(request.drop_rule, MessageDropRule):
        field, drops = "drop_rule.drop_messages", request.drop_rule.drop_messages
    thinking_drop = isinstance(request.drop_rule, ThinkingDropRule)
    n_messages = len(request.messages if messages is None else messages)
    try:
        validate_operations(n_messages, drops, request.reposition, thinking_drop, text_drop)
    except OperationError as error:
        param = _rename(error.field, field)
        raise APIError(f"{param}: {error.message}", param=param) from None
    return drops, request.reposition, thinking_drop


def _rename(engine_field: str, request_field: str) -> str:
    """The cache layer names `drop_message`; the client may have sent `drop_rule`."""
    if engine_field.startswith("drop_message"):
        return request_field + engine_field[len("drop_message"):]
    return engine_field


def _max_tokens(request: ChatCompletionRequest) -> int | None:
    for field in ("max_completion_tokens", "max_tokens"):
        value = getattr(request, field)
        if value is not None:
            if value <= 0:
                raise APIError(f"{field}: must be a positive integer, got {value}", param=field)
            return value
    return None


def _stop(stop: str | list[str] | None) -> list[str] | None:
    if stop is None:
        return None
    stops = [stop] if isinstance(stop, str) else stop
    if any(not text for text in stops):
        raise APIError("stop: stop sequences must be non-empty strings", param="stop")
    return stops or None


_UNSUPPORTED = {"function_call": "; use tools and tool_choice", "functions": "; use tools",
                "moderation": "; this server runs no moderation model"}


def _reject_unsupported(request: ChatCompletionRequest) -> None:
    """OpenAI options that would silently change meaning if ignored."""
    for field in ("frequency_penalty", "presence_penalty"):
        if getattr(request, field):
            raise APIError(f"{field}: penalties are not supported; send 0", param=field)
    if request.logit_bias:
        raise APIError("logit_bias: is not supported", param="logit_bias")
    for field, hint in _UNSUPPORTED.items():
        if getattr(request, field):
            raise APIError(f"{field}: is not supported{hint}", param=field)
    if request.modalities and request.modalities != ["text"]:
        raise APIError("modalities: this model outputs text only; send [\"text\"]", param="modalities")


def _engine_message(message: Any) -> dict[str, Any]:
    """OpenAI message -> the plain dict the chat renderer reads (content as one string)."""
    data = message.model_dump(exclude_none=True)
    if message.content is not None:
        data["content"] = message.text()
    return data
