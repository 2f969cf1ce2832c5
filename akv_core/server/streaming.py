"""Server-sent events in OpenAI's chunk format.

A stream opens with a chunk that carries the role, then one chunk per piece of
text the parser releases, then a chunk with the tool calls (if any) and the
finish reason, then, with `stream_options.include_usage`, a chunk with the
usage and no choices, and finally `data: [DONE]`.
"""
from __future__ import annotations

import json
import time
from collections.abc import Mapping

from pydantic import BaseModel

from akv_core.server.assistant_output import AssistantOutputParser, Delta
from akv_core.server.engine_loop import Finished
from akv_core.server.errors import APIError
from akv_core.server.protocol import (
    ChatCompletionChunk,
    ChunkChoice,
    DeltaMessage,
    ErrorDetail,
    ErrorResponse,
    PromptTokensDetails,
    ToolCallDelta,
    UsageInfo,
    completion_id,
)

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
        ),
    )


class ChunkStream:
    """The chunks of one streamed completion; every chunk shares its id and timestamp."""

    def __init__(self, model: str, parser: AssistantOutputParser, include_usage: bool) -> None:
        self.model = model
        self.parser = parser
        self.include_usage = include_usage
        self.id = completion_id()
        self.created = int(time.time())

    def role_chunk(self) -> str:
        return self._chunk(DeltaMessage(role="assistant", content=""))

    def delta_chunk(self, text: str) -> str | None:
        delta = self.parser.feed(text)
        return self._chunk(_delta_message(delta)) if delta else None

    def final_chunks(self, finished: Finished) -> list[str]:
        delta, message = self.parser.finish()
        chunks = [self._chunk(_delta_message(delta))] if delta else []
        final = DeltaMessage()
        if message.tool_calls:
            final.tool_calls = [
                ToolCallDelta(index=i, id=call.id, function=call.function)
                for i, call in enumerate(message.tool_calls)
            ]
        reason = "tool_calls" if message.tool_calls else finished.finish_reason
        chunks.append(self._chunk(final, finish_reason=reason))
        if self.include_usage:
            usage_chunk = ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                              choices=[], usage=usage_info(finished.usage))
            chunks.append(sse(usage_chunk))
        chunks.append(DONE)
        return chunks

    def error_chunk(self, error: APIError) -> str:
        """The request failed after the stream began: an error event, then the end."""
        body = ErrorResponse(error=ErrorDetail(message=error.message, type=error.type,
                                               param=error.param, code=error.code))
        return f"data: {body.model_dump_json()}\n\n" + DONE

    def _chunk(self, delta: DeltaMessage, finish_reason: str | None = None) -> str:
        choice = ChunkChoice(delta=delta, finish_reason=finish_reason)
        chunk = ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                    choices=[choice]).model_dump(exclude_none=True)
        # OpenAI sends these two as explicit nulls on every choice; some clients read them.
        chunk["choices"][0].update(logprobs=None, finish_reason=finish_reason)
        return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"


def _delta_message(delta: Delta) -> DeltaMessage:
    return DeltaMessage(content=delta.content or None, reasoning_content=delta.reasoning or None)
