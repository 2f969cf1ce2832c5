"""The reply fields: what the model used (`return_attribution`, AKV's), and a final assistant
message continued or scored (`continue_final_message`, `add_generation_prompt`, `prompt_logprobs`,
vLLM's names and shapes).

A request checks them here (a 400 naming the field); a response shows them here: each choice's
`attribution` object, and `prompt_logprobs`, a list aligned with the prompt's tokens (null where
nothing was scored, which is everything before the final message's tokens), each scored entry
`{token id: {"logprob", "rank", "decoded_token"}}` holding the prompt's own token and the
`prompt_logprobs` most likely ones, as vLLM returns it.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from akv_core.attribution import Attribution
from akv_core.continuation import TokenScore
from akv_core.sampling import TOP_LOGPROBS_MAX
from akv_core.server.errors import APIError
from akv_core.server.logprobs import TokenTexts, finite_logprob
from akv_core.server.protocol import AttributionInfo, ChatCompletionRequest


@dataclass(frozen=True)
class ReplyOptions:
    """The reply fields of a request, checked."""

    attribution: bool = False
    continue_final_message: bool = False
    prompt_logprobs: int | None = None   # None: no prompt_logprobs; k: each scored token and k more


def reply_options(request: ChatCompletionRequest, grammar_field: str | None) -> ReplyOptions:
    """The request's reply options, or a 400 naming the field (`grammar_field`: the field that
    constrains the output, if any, which a continued message was not written under)."""
    continues = bool(request.continue_final_message)
    if continues and request.add_generation_prompt:
        raise APIError("add_generation_prompt: must be false with continue_final_message: the reply continues "
                       "the final message instead of starting a new one", param="add_generation_prompt")
    if request.add_generation_prompt is False and not continues:
        raise APIError("add_generation_prompt: false is supported only with continue_final_message: true",
                       param="add_generation_prompt")
    if continues:
        _check_final_message(request)
        if grammar_field is not None:
            raise APIError(f"continue_final_message: cannot be combined with {grammar_field} (the final message "
                           "was not written under its constraint)", param="continue_final_message")
    top = request.prompt_logprobs
    if top is not None:
        _check_prompt_logprobs(request, top, continues)
    return ReplyOptions(bool(request.return_attribution), continues, top)


def _check_final_message(request: ChatCompletionRequest) -> None:
    last = len(request.messages) - 1
    if request.messages[last].role != "assistant":
        raise APIError(f"messages[{last}].role: with continue_final_message the final message must be an assistant "
                       f"message, got {request.messages[last].role!r}", param=f"messages[{last}].role")
    if last < 1:
        raise APIError("messages: with continue_final_message the final assistant message needs a history before "
                       "it", param="messages")


def _check_prompt_logprobs(request: ChatCompletionRequest, top: int, continues: bool) -> None:
    if not 0 <= top <= TOP_LOGPROBS_MAX:
        raise APIError(f"prompt_logprobs: must be an integer from 0 to {TOP_LOGPROBS_MAX}, got {top}",
                       param="prompt_logprobs")
    if not continues:
        raise APIError("prompt_logprobs: scores the final assistant message's tokens, so it needs "
                       "continue_final_message: true (and add_generation_prompt: false)", param="prompt_logprobs")
    if request.stream:
        raise APIError("stream: prompt_logprobs are not streamed; send stream: false", param="stream")
    if (request.n or 1) > 1:
        raise APIError("n: prompt_logprobs score the prompt once; send n: 1", param="n")


def attribution_field(attribution: Attribution | None) -> dict[str, Any] | None:
    """A choice's `attribution` object (None when the request did not ask)."""
    return None if attribution is None else AttributionInfo(**attribution.to_dict()).model_dump()


def prompt_logprobs_field(scores: Sequence[TokenScore], prompt_tokens: int,
                          texts: TokenTexts) -> list[dict[str, dict[str, Any]] | None]:
    """`prompt_logprobs`: null for each prompt token before the scored ones, then each scored token's
    entry (its own id first, then the most likely ones ranked 1, 2, ...)."""
    field: list[dict[str, dict[str, Any]] | None] = [None] * (prompt_tokens - len(scores))
    for score in scores:
        entry = {str(score.token_id): _entry(score.logprob, score.rank, texts(score.token_id)[0])}
        for rank, (token, value) in enumerate(score.top, start=1):
            entry.setdefault(str(token), _entry(value, rank, texts(token)[0]))
        field.append(entry)
    return field


def _entry(logprob: float, rank: int, text: str) -> dict[str, Any]:
    return {"logprob": finite_logprob(logprob), "rank": rank, "decoded_token": text}
