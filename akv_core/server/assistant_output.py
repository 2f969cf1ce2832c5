"""The model's raw output as an assistant message: reasoning, content and tool calls.

The chat template renders reasoning as `<think>...</think>` and tool calls as
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (Qwen's format; a
JSON list of calls inside one block is accepted too). Output that fails to parse
comes back as plain text, never as an error; but a last block that max_tokens cut
off comes back as the call it began (`finish(cut=True)`): its name and its
arguments as far as they were written, where a client looks for calls, never as
text that would read as the answer.

One incremental parser serves both modes: a non-streaming response is the
parser fed the whole text at once, so streamed deltas always concatenate to
exactly the non-streaming message.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from akv_core.server.protocol import FunctionCall, ToolCall

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.S)
# The fields of a call block cut short: its name so far, and where its arguments begin.
_CUT_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)')
_CUT_ARGUMENTS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


@dataclass(frozen=True)
class Delta:
    """New text since the last feed, split by where it belongs."""

    reasoning: str = ""
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)


@dataclass(frozen=True)
class AssistantMessage:
    content: str | None
    reasoning: str | None
    tool_calls: list[ToolCall] | None


class AssistantOutputParser:
    """Feed token text as it is decoded; `finish()` gives the final message.

    Text that might still turn into a tag (a partial `<tool_call>` or trailing
    whitespace before one) is held back until the next feed decides it.
    """

    def __init__(self, parse_tool_calls: bool) -> None:
        self.parse_tool_calls = parse_tool_calls
        self.text = ""
        self._sent_reasoning = 0
        self._sent_content = 0

    def feed(self, text: str) -> Delta:
        self.text += text
        return self._advance(*self._split(final=False))

    def finish(self, cut: bool = False) -> tuple[Delta, AssistantMessage]:
        """The last delta and the whole message; tool calls are parsed here. `cut`: the output ended
        at max_tokens, so a last call block without its end is a call cut short."""
        reasoning, content = self._split(final=True)
        calls = self._tool_calls(cut) if self.parse_tool_calls else None
        if calls is None:
            reasoning, content = self._split(final=True, accept_call=False)
        delta = self._advance(reasoning, content)
        message = AssistantMessage(
            content=content or None,
            reasoning=reasoning,
            tool_calls=calls,
        )
        return delta, message

    def _advance(self, reasoning: str | None, content: str) -> Delta:
        reasoning = reasoning or ""
        delta = Delta(reasoning[self._sent_reasoning:], content[self._sent_content:])
        self._sent_reasoning = max(self._sent_reasoning, len(reasoning))
        self._sent_content = max(self._sent_content, len(content))
        return delta

    def _split(self, final: bool, accept_call: bool = True) -> tuple[str | None, str]:
        """(reasoning, content) that are safe to send now."""
        reasoning, body = self._reasoning_and_body(final)
        if body is None:
            return reasoning, ""
        if not (self.parse_tool_calls and accept_call):
            return reasoning, body
        start = body.find(CALL_OPEN)
        if start >= 0:
            return reasoning, body[:start].rstrip()
        return reasoning, body if final else _hold_partial(body, CALL_OPEN).rstrip()

    def _reasoning_and_body(self, final: bool) -> tuple[str | None, str | None]:
        """Split off a leading `<think>` block; body None while it is still open.

        Whitespace is only skipped to look for the block: output without one keeps its leading
        whitespace (indented code, a reply of only spaces), and after `</think>` only the line
        breaks the template puts there are dropped, so indented content stays indented.
        """
        text = self.text.lstrip()
        if text.startswith(THINK_OPEN):
            inner = text[len(THINK_OPEN):]
            end = inner.find(THINK_CLOSE)
            if end < 0:
                return (inner if final else _hold_partial(inner, THINK_CLOSE)), None
            return inner[:end], inner[end + len(THINK_CLOSE):].lstrip("\r\n")
        if not final and THINK_OPEN.startswith(text):
            return None, None  # may still become a <think> block
        return None, self.text

    def _tool_calls(self, cut: bool) -> list[ToolCall] | None:
        _, body = self._reasoning_and_body(final=True)
        start = body.find(CALL_OPEN) if body else -1
        if start < 0:
            return None
        tail = body[start:]
        blocks = _CALL_BLOCK.findall(tail)
        unclosed = tail.count(CALL_OPEN) - len(blocks)
        if unclosed > 1 or (unclosed and not cut) or not (blocks or unclosed):
            return None  # an unclosed block the output did not end in at max_tokens
        calls: list[ToolCall] = []
        for block in blocks:
            parsed = parse_call_block(block)
            if parsed is None:
                return None
            calls.extend(parsed)
        if unclosed:
            calls.append(partial_call(tail[tail.rfind(CALL_OPEN) + len(CALL_OPEN):]))
        return calls


def parse_assistant_output(text: str, parse_tool_calls: bool) -> AssistantMessage:
    parser = AssistantOutputParser(parse_tool_calls)
    parser.feed(text)
    return parser.finish()[1]


def parse_call_block(block: str) -> list[ToolCall] | None:
    """One `<tool_call>` body -> calls, or None if it is not a well-formed call."""
    try:
        value = json.loads(block.strip())
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = [_as_call(item) for item in items]
    if not calls or any(call is None for call in calls):
        return None
    return calls  # type: ignore[return-value]


def partial_call(block: str) -> ToolCall:
    """The call a block cut off by max_tokens began: its name and its arguments' text as far as they
    were written (the arguments may not be valid JSON yet: the finish_reason `length` says why, as
    OpenAI's does)."""
    name = _CUT_NAME.search(block)
    arguments = _CUT_ARGUMENTS.search(block)
    text = name.group(1) if name else ""
    try:
        text = json.loads(f'"{text}"')
    except ValueError:
        pass   # cut inside an escape: the name as written
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}",
                    function=FunctionCall(name=text, arguments=block[arguments.end():].rstrip() if arguments else ""))


def _as_call(item: object) -> ToolCall | None:
    if not isinstance(item, dict):
        return None
    name = item.get("name")
    # Some models write "parameters" where the template says "arguments".
    arguments = item.get("arguments", item.get("parameters", {}))
    if not isinstance(name, str) or not name:
        return None
    if isinstance(arguments, str):
        try:
            json.loads(arguments)
        except ValueError:
            return None
    elif isinstance(arguments, dict):
        arguments = json.dumps(arguments, ensure_ascii=False)
    else:
        return None
    return ToolCall(
        id=f"call_{uuid.uuid4().hex[:24]}",
        function=FunctionCall(name=name, arguments=arguments),
    )


def _hold_partial(text: str, tag: str) -> str:
    """`text` minus a suffix that could be the start of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return text[:-size]
    return text
