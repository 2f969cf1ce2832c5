"""Log probabilities in OpenAI's shape: `choices[].logprobs.content`, one entry per generated token.

The engine reports ids and numbers (`akv_core.sampling.TokenLogprob`); a client reads each token's
text and its UTF-8 bytes. Bytes come from the token table llguidance builds of the model's
tokenizer, exact for every token, a piece of a multi-byte character included (its text then shows
the bytes as escapes, and a client joins `bytes` to rebuild the character).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from akv_core.sampling import TokenLogprob
from akv_core.server.protocol import ChoiceLogprobs, TokenLogprobEntry, TopLogprob

# OpenAI's floor for a token that is all but impossible: JSON has no -inf.
LOWEST_LOGPROB = -9999.0


class TokenTexts:
    """Token id -> (text, bytes), remembered: a request's tokens repeat, and so do their alternatives."""

    def __init__(self, decode_bytes: Callable[[list[int]], bytes]) -> None:
        self._decode_bytes = decode_bytes
        self._known: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        known = self._known.get(token_id)
        if known is None:
            try:
                data = self._decode_bytes([token_id])
            except (ValueError, IndexError, OverflowError):   # an id past the tokenizer (a padded vocabulary)
                data = b""
            known = self._known[token_id] = (data.decode("utf-8", "backslashreplace"), list(data))
        return known

    def entry(self, logprob: TokenLogprob) -> TokenLogprobEntry:
        """One generated token with its most likely alternatives, most likely first."""
        text, data = self(logprob.token_id)
        top = [TopLogprob(token=self(token)[0], logprob=finite_logprob(value), bytes=self(token)[1])
               for token, value in logprob.top]
        return TokenLogprobEntry(token=text, logprob=finite_logprob(logprob.logprob), bytes=data, top_logprobs=top)


def token_texts(engine: Any) -> TokenTexts:
    """The engine's token table (built on first use, about 0.3 s of CPU: call it off the event loop)."""
    return TokenTexts(engine.constrainer.tokenizer.decode_bytes)


def choice_logprobs(entries: Sequence[TokenLogprobEntry]) -> dict[str, Any]:
    """`choices[].logprobs` as OpenAI sends it, `refusal` as an explicit null."""
    return ChoiceLogprobs(content=list(entries)).model_dump()


def finite_logprob(value: float) -> float:
    """A log probability JSON can carry: -inf (and anything below OpenAI's floor) becomes LOWEST_LOGPROB."""
    return value if math.isfinite(value) and value > LOWEST_LOGPROB else LOWEST_LOGPROB
