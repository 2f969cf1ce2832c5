"""The `llm` agent: a real tool-calling loop, the model's reply is the agent's action.

The backend has already asked the model (the harness sends every step's request); this
agent turns the model's reply into an action: tool calls to run, or a final answer when
the model calls no tool. Calls written as text (`<tool_call>{...}</tool_call>`) by models or
servers that do not parse them are parsed here. It also offers the model-based cache tool
`drop_context(message_ids)`, which the harness executes.
"""
from __future__ import annotations

import json
import re
from typing import Any

from sandbox.suite import AgentAction, AgentView, Message

DROP_CONTEXT = "drop_context"
DROP_CONTEXT_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": DROP_CONTEXT,
        "description": (
            "Hide earlier messages you no longer need from your attention, to keep your context small. "
            "Messages are numbered from 0 (the system prompt); the system prompt, the task and the latest "
            "message cannot be dropped."
        ),
        "parameters": {
            "type": "object",
            "properties": {"message_ids": {"type": "array", "items": {"type": "integer"}}},
            "required": ["message_ids"],
        },
    },
}

_TEXT_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


class AgentSetupError(ValueError):
    """An agent that cannot run with the chosen backend."""


class LLMAgent:
    """Acts on the model's reply to the step's request."""

    name = "llm"
    uses_cache_tool = True  # the harness offers drop_context when the policy acts on it

    def act(self, view: AgentView) -> AgentAction:
        if view.response is None:
            raise AgentSetupError("the llm agent needs a model: use --backend embedded or an endpoint URL "
                                  "(replay has no model)")
        message = _normalized(view.response, view.step)
        if message.get("tool_calls"):
            return AgentAction(message)
        return AgentAction(message, final_answer=str(message.get("content") or "").strip())


def _normalized(reply: Message, step: int) -> Message:
    """The reply as a history message: tool calls with ids, text-written calls parsed."""
    content = str(reply.get("content") or "")
    calls = list(reply.get("tool_calls") or ())
    if not calls and "<tool_call>" in content:
        calls = _calls_from_text(content)
        content = _TEXT_CALL.sub("", content).strip()
    message: Message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [
            {"id": call.get("id") or f"call_{step}_{n}", "type": "function", "function": call.get("function", {})}
            for n, call in enumerate(calls)
        ]
    return message


def _calls_from_text(content: str) -> list[dict[str, Any]]:
    """Every `<tool_call>` block; a block that is not JSON becomes a call the harness reports as malformed."""
    calls = []
    for block in _TEXT_CALL.findall(content):
        try:
            parsed = json.loads(block)
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict) and isinstance(parsed.get("name"), str):
            arguments = parsed.get("arguments", {})
            text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
            calls.append({"function": {"name": parsed["name"], "arguments": text}})
        else:
            calls.append({"function": {"name": "", "arguments": block}})
    return calls
