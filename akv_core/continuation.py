"""A final assistant message split into the prompt before it and the reply tokens it holds.

A request that continues its final message (the API's `continue_final_message`) or scores a
recorded reply (`Engine.score_continuation`) renders the history before that message exactly as a
generation request would (the same cache key, so its KV is reused), followed by the generation
prompt, and feeds the message's own tokens after it: what the model would have generated there.
The message is rendered by the chat template after the history (`<|im_start|>assistant\\n...`);
its tokens after the generation prompt are the reply. Open (`closed=False`, vLLM's
`continue_final_message`): the reply stops before the template's end-of-turn token, so that
generation continues the message. Closed: the end-of-turn token is the reply's last token (the
model chose to stop there too); what the template writes after it (a line break) is not.

If the message's leading characters merge with the generation prompt's last token (content that
starts with line breaks after SmolLM2's `assistant\\n`), the prompt keeps the generation prompt's
tokens up to where the two agree and the reply starts there.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from akv_core.attribution import Attribution
from akv_core.cache.ops import TextDrop
from akv_core.cache.usage import Usage


@dataclass(frozen=True)
class TokenScore:
    """A token's natural-log probability at its position, its rank among all tokens (1: the most
    likely; None when not asked) and the `top` most likely tokens' (id, logprob), most likely first."""

    token_id: int
    logprob: float
    rank: int | None = None
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class ContinuationScore:
    """A recorded reply scored under a request's visible KV (`Engine.score_continuation`): its token ids
    (through the end-of-turn token), each one's natural-log probability, their sum, the request's usage
    (the reply's tokens counted as prompt tokens) and, if asked, the reply's attention over its history."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    total: float
    usage: Usage
    attribution: Attribution | None = None


class ContextLengthExceeded(ValueError):
    """A continued message that ends past the model's context; `field` names it, `positions` is
    where it would end (after the request's drops and repositions)."""

    def __init__(self, field: str, positions: int, context: int) -> None:
        super().__init__(f"{field}: the history and this message take {positions} positions, past the model's "
                         f"context of {context}")
        self.field, self.positions, self.context = field, positions, context


@dataclass(frozen=True)
class SplitReply:
    """`prompt`: the history rendered (`akv_core.chat.Rendered`) whose ids end inside or after the
    generation prompt; `reply`: the final message's token ids after them."""

    prompt: Any
    reply: tuple[int, ...]


def split_final_message(tokenizer: Any, messages: Sequence[Mapping], tools: Sequence[Mapping] | None,
                        closed: bool) -> SplitReply:
    """Split `messages` (ending with an assistant message) into the prompt and the reply tokens.

    Raises ValueError naming the field: a final message that is not an assistant's, no history
    before it, or a template whose assistant message does not begin with its generation prompt.
    """
    last = len(messages) - 1
    if last < 1:
        raise ValueError("messages: a final assistant message to continue needs at least one message before it")
    role = messages[last].get("role")
    if role != "assistant":
        raise ValueError(f"messages[{last}].role: the final message must be an assistant message to continue "
                         f"or score, got {role!r}")
    history = tokenizer.render(messages[:last], tools)
    whole = tokenizer.render(messages, tools, add_generation_prompt=False)
    start, end = whole.spans[last]
    if whole.token_array[:start] != history.token_array[:history.header_start]:
        raise ValueError(f"messages[{last}]: the chat template renders the history differently when this message "
                         "follows it; it cannot be continued")
    message = whole.token_array[start:end]
    header = history.token_array[history.header_start:]
    agree = 0
    while agree < min(len(header), len(message)) and header[agree] == message[agree]:
        agree += 1
    if agree == 0:
        raise ValueError(f"messages[{last}]: the chat template's assistant message does not begin with its "
                         "generation prompt; it cannot be continued")
    reply = list(message[agree:])
    ends = [i for i, token in enumerate(reply) if token in tokenizer.eos_token_ids]
    if ends:
        reply = reply[:ends[-1] + 1] if closed else reply[:ends[-1]]
    prompt = replace(history, token_array=history.token_array[:history.header_start + agree])
    return SplitReply(prompt, tuple(reply))


def text_drop_before_reply(text_drop: TextDrop | None, reply: int) -> TextDrop | None:
    """A text drop read against messages that end with the continued message `reply`: one that takes
    effect right after it (a keep_text_drop's, whose full history ends with the reply too) takes effect
    right before it instead, so that the reply does not see what it cuts; a cut of the reply is refused."""
    if text_drop is None or text_drop.trigger != reply:
        return text_drop
    if any(cut.message == reply for cut in text_drop.cuts):
        raise ValueError(f"drop_rule: cuts messages[{reply}], the continued final message; send it whole")
    return replace(text_drop, trigger=reply - 1)

