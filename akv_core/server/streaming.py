"""Server-sent events in OpenAI's chunk format.

A stream opens with a chunk that carries the role, then one chunk per piece of
text the parser releases, then a chunk with the tool calls (if any) and the
finish reason, then, with `stream_options.include_usage`, a chunk with the
usage and no choices, and finally `data: [DONE]`. With `n` choices, each has
its role chunk, text chunks and finish chunk (its `index` says whose, in the
order the engine produced them); the usage chunk and `[DONE]` come once, after
the last. With log probabilities, each chunk carries the entries of the tokens
whose text it releases (text held back keeps its entries until it goes).
"""
from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence

from pydantic import BaseModel

from akv_core.attribution import Attribution
from akv_core.request import FINISH_LENGTH
from akv_core.sampling import TokenLogprob
from akv_core.server.assistant_output import AssistantMessage, AssistantOutputParser, Delta
from akv_core.server.engine_loop import Finished
from akv_core.server.errors import APIError
from akv_core.server.logprobs import TokenTexts, choice_logprobs
from akv_core.server.protocol import (
    ChatCompletionChunk,
    ChunkChoice,
    DeltaMessage,
    ErrorDetail,
    ErrorResponse,
    PromptTokensDetails,
    TokenLogprobEntry,
    ToolCallDelta,
    UsageInfo,
    completion_id,
)
from akv_core.server.reply_fields import attribution_field

DONE = "data: [DONE]\n\n"


def sse(payload: BaseModel) -> str:
    """One event; `None` fields are left out as OpenAI leaves them out."""
    return f"data: {payload.model_dump_json(exclude_none=True)}\n\n"


def usage_info(usage: Mapping[str, int]) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=usage["prompt_tokens"],
        completion_tokens=usage["completion_tokens"],
        total_tokens=usage["total_tokens"],
        prompt_tokens_details=PromptTokensDetails(
            cached_tokens=usage["cached_tokens"],
            drop_skipped_tokens=usage["drop_skipped_tokens"],
            repos_tokens=usage["repos_tokens"],
            prefilled_tokens=usage["prefilled_tokens"],
            retained_tokens=usage.get("retained_tokens", 0),
        ),
    )


def combined_usage(finished: Sequence[Finished]) -> dict[str, int]:
    """A request's usage over its choices, as OpenAI counts it: the prompt once (the first choice's
    accounting; the others read that prompt from the cache) and every choice's completion tokens."""
    usage = dict(finished[0].usage)
    usage["completion_tokens"] = sum(done.usage["completion_tokens"] for done in finished)
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    return usage


class ChunkStream:
    """The chunks of one streamed completion (one parser per choice); every chunk shares its id and
    timestamp. `token_texts` is given when the request asked for log probabilities."""

    def __init__(self, model: str, parser: AssistantOutputParser | Sequence[AssistantOutputParser],
                 include_usage: bool, token_texts: TokenTexts | None = None) -> None:
        self.model = model
        self.parsers = [parser] if isinstance(parser, AssistantOutputParser) else list(parser)
        self.include_usage = include_usage
        self.token_texts = token_texts
        self._entries: list[list[TokenLogprobEntry]] = [[] for _ in self.parsers]   # not sent yet
        self.id = completion_id()
        self.created = int(time.time())

    def role_chunk(self) -> str:
        return "".join(self._chunk(DeltaMessage(role="assistant", content=""), index)
                       for index in range(len(self.parsers)))

    def delta_chunk(self, text: str, index: int = 0, logprob: TokenLogprob | None = None) -> str | None:
        if logprob is not None and self.token_texts is not None:
            self._entries[index].append(self.token_texts.entry(logprob))
        delta = self.parsers[index].feed(text)
        return self._chunk(_delta_message(delta), index) if delta else None

    def choice_end(self, finished: Finished, index: int = 0) -> list[str]:
        """The last text of choice `index`, then its chunk with the tool calls and finish reason."""
        delta, message = self.parsers[index].finish(cut=finished.finish_reason == FINISH_LENGTH)
        chunks = [self._chunk(_delta_message(delta), index)] if delta else []
        final = DeltaMessage()
        if message.tool_calls:
            final.tool_calls = [
                ToolCallDelta(index=i, id=call.id, function=call.function)
                for i, call in enumerate(message.tool_calls)
            ]
        reason = finish_reason(message, finished)
        chunks.append(self._chunk(final, index, finish_reason=reason, attribution=finished.attribution))
        return chunks

    def end(self, usage: Mapping[str, int]) -> list[str]:
        """After every choice has ended: the usage chunk (if asked for), then [DONE]."""
        chunks = []
        if self.include_usage:
            usage_chunk = ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                              choices=[], usage=usage_info(usage))
            chunks.append(sse(usage_chunk))
        return chunks + [DONE]

    def final_chunks(self, finished: Finished) -> list[str]:
        """The end of a one-choice stream."""
        return self.choice_end(finished) + self.end(finished.usage)

    def error_chunk(self, error: APIError) -> str:
        """The request failed after the stream began: an error event, then the end."""
        body = ErrorResponse(error=ErrorDetail(message=error.message, type=error.type,
                                               param=error.param, code=error.code))
        return f"data: {body.model_dump_json()}\n\n" + DONE

    def _chunk(self, delta: DeltaMessage, index: int = 0, finish_reason: str | None = None,
               attribution: Attribution | None = None) -> str:
        choice = ChunkChoice(index=index, delta=delta, finish_reason=finish_reason)
        chunk = ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                    choices=[choice]).model_dump(exclude_none=True)
        logprobs = None
        if self.token_texts is not None:
            logprobs, self._entries[index] = choice_logprobs(self._entries[index]), []
        # OpenAI sends these two on every choice, as explicit nulls when empty; some clients read them.
        chunk["choices"][0].update(logprobs=logprobs, finish_reason=finish_reason)
        if attribution is not None:   # the finish chunk of a request with return_attribution
            chunk["choices"][0]["attribution"] = attribution_field(attribution)
        return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"


def finish_reason(message: AssistantMessage, finished: Finished) -> str:
    """`tool_calls` for an answer of calls, but `length` whenever max_tokens ended the output (a call cut
    short, or closed early because its tokens ran out, is not a call the model finished)."""
    if message.tool_calls and finished.finish_reason != FINISH_LENGTH:
        return "tool_calls"
    return finished.finish_reason


def _delta_message(delta: Delta) -> DeltaMessage:
    return DeltaMessage(content=delta.content or None, reasoning_content=delta.reasoning or None)
