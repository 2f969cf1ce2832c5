"""Token counting: the interface policies use, and a simple approximate implementation.

The exact counter (the chat template rendered by the engine's tokenizer) lives in akv_core.chat;
policy_dsl imports nothing of ours, so it only defines the protocol.
"""
from __future__ import annotations

import json
from typing import Any, Mapping, Protocol, runtime_checkable

# Estimates for where no tokenizer is at hand, shared by every layer that counts approximately (this
# counter, the sandbox's fallbacks, the llm proposer's spend when a reply has no usage). They are
# typical figures, not bounds: code that must be sure a text fits a budget keeps a bound of its own.
CHARS_PER_TOKEN = 4  # English prose and JSON under a BPE tokenizer
MESSAGE_OVERHEAD_TOKENS = 4  # role header and end-of-turn marker of a typical chat template


@runtime_checkable
class TokenCounter(Protocol):
    """Tokens of one message as rendered in the prompt."""

    def count(self, message: Mapping[str, Any]) -> int: ...


def message_text(message: Mapping[str, Any]) -> str:
    """The visible text of a message's content (str, None, or a list of OpenAI content parts)."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str))
    return ""


class ApproxTokenCounter:
    """Approximate: one token per 4 characters plus 4 per message.

    Good enough for thresholds in the tens of thousands of tokens and for tests; it is not the
    model's tokenizer, so counts can be off by tens of percent on code or non-English text.
    Use akv_core.chat's counter where exact numbers matter.
    """

    def count(self, message: Mapping[str, Any]) -> int:
        chars = len(message_text(message))
        reasoning = message.get("reasoning_content")
        if isinstance(reasoning, str):
            chars += len(reasoning)
        calls = message.get("tool_calls")
        if isinstance(calls, list) and calls:
            chars += len(json.dumps(calls, ensure_ascii=False, default=str))
        name = message.get("name")
        if isinstance(name, str):
            chars += len(name)
        return -(-chars // CHARS_PER_TOKEN) + MESSAGE_OVERHEAD_TOKENS
