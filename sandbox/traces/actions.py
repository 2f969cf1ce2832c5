"""Agents that act in text: telling them apart, and offering their runs in tool-call form.

mini-swe-agent (1.x, and 2.x with a text-based model), SWE-agent without function calling and
many home-grown agents write their command in a fenced block of the assistant's text and get the
observation back as the next user message. Tool-based policies need tool messages to act on, so
a trace set offers such runs converted (`as_tool_calls`), whatever format they came in.

`as_tool_calls`: an assistant message's action is the last fenced block of its content (from a
line starting with ``` and an info string empty or one of bash, sh, shell, console,
mswea_bash_command, to the next line starting with ```), stripped: SWE-agent's whole command
block, a multi-line `edit` included. It becomes the message's one call `call_<n>` (n from 1) to
`bash` with arguments `{"command": ...}`; the content keeps the text outside the block (the
thought, not the command twice). The user message directly after it is its observation: the tool
message answering it (same content, `name` "bash"). Any other user message (the task, a human
turn, the reply to a message without an action) stays, and so does an assistant message without
an action. Indices do not change.

`text_actions`: whether a history is such a run: no tool calls or tool messages, and more than
half of the assistant messages that have a next message carry an action that a user message
answers (so a chat whose assistant once shows a shell snippet is not taken for one).
"""
from __future__ import annotations

import json
import re
from dataclasses import replace
from typing import Any, Mapping, Sequence

from sandbox.traces.model import Message, Trace, check_trace, with_requests
from sandbox.traces.reading import content_text, dig

BASH_TOOL: Mapping[str, Any] = {"type": "function", "function": {
    "name": "bash", "description": "Execute a bash command", "parameters": {
        "type": "object", "required": ["command"],
        "properties": {"command": {"type": "string", "description": "The bash command to execute"}}}}}
_ACTION_LANGUAGES = ("", "bash", "sh", "shell", "console", "mswea_bash_command")
_FENCE = re.compile(r"^```([\w-]*)[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def uses_tools(messages: Sequence[Any]) -> bool:
    """Whether any message is a native tool call or a tool message."""
    return any(dig(m, "tool_calls") or dig(m, "role") == "tool" for m in messages)


def text_actions(messages: Sequence[Any]) -> bool:
    """Whether the history is an agent acting in text (module docstring)."""
    if uses_tools(messages):
        return False
    answered = asked = 0
    for message, following in zip(messages, messages[1:]):
        if dig(message, "role") != "assistant":
            continue
        asked += 1
        answered += dig(following, "role") == "user" and split_action(dig(message, "content")) is not None
    return 2 * answered > asked


def as_tool_calls(trace: Trace) -> Trace:
    """The text-action trace in tool-call form (module docstring); a "tools" trace unchanged."""
    if trace.actions != "text":
        return trace
    messages: list[Message] = []
    calls = 0
    pending: str | None = None  # the call of the previous message, until its observation
    for message in trace.messages:
        if message.get("role") == "user" and pending is not None:
            messages.append({"role": "tool", "tool_call_id": pending, "name": "bash",
                             "content": message.get("content")})
            pending = None
            continue
        pending = None
        action = split_action(message.get("content")) if message.get("role") == "assistant" else None
        if action is None:
            messages.append(message)
            continue
        calls += 1
        pending = f"call_{calls}"
        function = {"name": "bash", "arguments": json.dumps({"command": action[1]})}
        messages.append({**message, "content": action[0],
                         "tool_calls": [{"id": pending, "type": "function", "function": function}]})
    converted = replace(trace, messages=tuple(messages), tools=(BASH_TOOL,), actions="tools",
                        provenance={**trace.provenance, "converted_from": "text"})
    check_trace(converted, f"trace {trace.id!r} in tool-call form")
    return with_requests(converted)


def split_action(content: Any) -> tuple[str, str] | None:
    """(text outside the action block, command) of an assistant message, or None without an action."""
    text = content_text(content)
    found = None
    for match in _FENCE.finditer(text):
        if match.group(1).lower() in _ACTION_LANGUAGES and match.group(2).strip():
            found = match
    if found is None:
        return None
    outside = [part for part in (text[:found.start()].rstrip(), text[found.end():].strip()) if part]
    return "\n\n".join(outside), found.group(2).strip()
