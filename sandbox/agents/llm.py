"""The `llm` agent: a real tool-calling loop, the model's reply is the agent's action.

The backend has already asked the model (the harness sends every step's request); this
agent turns the model's reply into an action. It acts in one of two modes (`AGENT_MODES`):

- `tools` (the default): every step is a tool call. The agent offers `final_answer(answer)`
  besides the task's tools and asks for `tool_choice: "required"`, which a backend with
  constrained decoding keeps (the embedded engine and `akv serve` through the tool-call
  grammar, `akv_core.constrain.tool_call_grammar`; OpenAI-compatible servers accept it too).
  A call of `final_answer` ends the run with its argument as the answer. The first step names
  the task's first tool instead (a research agent looks before it answers): offered
  `final_answer` at once, the embedded 135M model called it on each of the first 4 localcomp
  train tasks with an invented answer.
- `free`: the model chooses; a reply without tool calls is the final answer.

In both modes the agent gives up (status `gave_up`) when the model makes, for the
`REPEAT_LIMIT`-th time in a row, the calls of its latest visible messages: the embedded model
at temperature 0 repeats one search until the step budget runs out.

Calls written as text (`<tool_call>{...}</tool_call>`) by models or servers that do not parse
them are parsed here. It also offers the model-based cache tool `drop_context(message_ids)`,
which the harness executes.
"""
from __future__ import annotations

import json
import re
from typing import Any, Mapping, Sequence

from sandbox.suites.base import AgentAction, AgentView, Message

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

AGENT_MODES = ("tools", "free")
REPEAT_LIMIT = 3  # the same calls this many steps in a row: the model is stuck, the agent gives up
# Where the use records of an agent that keeps none (this one) come from: the strings its message
# reuses from earlier ones (`policy_dsl/reuse.py`), the model's attention mass per message (a backend
# with attribution), or both together.
USE_RECORDS = ("references", "attention", "both")
FINAL_ANSWER = "final_answer"
FINAL_ANSWER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": FINAL_ANSWER,
        "description": "Give your final answer to the task. This ends the task: call it once you know the answer.",
        "parameters": {
            "type": "object",
            # Bounded so that a constrained call closes within a step's token budget.
            "properties": {"answer": {"type": "string", "maxLength": 200,
                                      "description": "the answer alone, e.g. a name or a number"}},
            "required": ["answer"],
        },
    },
}

_TEXT_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


class AgentSetupError(ValueError):
    """An agent that cannot run with the chosen backend."""


def check_agent_mode(mode: str) -> str:
    """`mode` if it is one of AGENT_MODES; else a ValueError naming the option and what was expected."""
    if mode not in AGENT_MODES:
        raise ValueError(f"agent mode {mode!r}: expected {' or '.join(AGENT_MODES)}")
    return mode


class LLMAgent:
    """Acts on the model's reply to the step's request (`mode`: tools or free, module docstring)."""

    name = "llm"
    uses_cache_tool = True  # the harness offers drop_context when the policy acts on it

    def __init__(self, mode: str = "tools") -> None:
        self.mode = check_agent_mode(mode)

    @property
    def offered_tools(self) -> tuple[dict[str, Any], ...]:
        """Tools the agent itself offers the model, besides the task's."""
        return (FINAL_ANSWER_TOOL,) if self.mode == "tools" else ()

    def tool_choice(self, step: int, tools: Sequence[Mapping[str, Any]]) -> str | dict[str, Any] | None:
        """The `tool_choice` of the step's request: in tools mode `required`, and at the first step the
        task's first tool by name (when the task has tools); None (the server's default) in free mode."""
        if self.mode != "tools":
            return None
        first = str((tools[0].get("function") or {}).get("name") or "") if tools else ""
        if step == 0 and first and first not in (FINAL_ANSWER, DROP_CONTEXT):
            return {"type": "function", "function": {"name": first}}
        return "required"

    def act(self, view: AgentView) -> AgentAction:
        if view.response is None:
            raise AgentSetupError("the llm agent needs a model: use --backend embedded or an endpoint URL "
                                  "(replay has no model)")
        message = _normalized(view.response, view.step)
        calls = message.get("tool_calls") or ()
        final = next((c for c in calls if (c.get("function") or {}).get("name") == FINAL_ANSWER), None)
        if final is not None and self.mode == "tools":
            return AgentAction(message, final_answer=_answer_of(final))
        repeated = _repeated(message, view) if calls else ()
        if repeated:  # the check read those messages: the use record names them (the harness adds its own)
            return AgentAction(message, final_answer="", gave_up=True, used=repeated)
        if calls:
            return AgentAction(message)
        return AgentAction(message, final_answer=str(message.get("content") or "").strip())


def _repeated(message: Message, view: AgentView) -> tuple[int, ...]:
    """The latest REPEAT_LIMIT - 1 visible assistant messages when `message` makes the same calls as each of
    them, else (): a dropped message is not seen, so repeating it is no sign of being stuck."""
    earlier = [i for i, m in enumerate(view.messages) if view.visible[i] and m.get("role") == "assistant"]
    recent = earlier[-(REPEAT_LIMIT - 1):]
    if len(recent) == REPEAT_LIMIT - 1 and all(_calls_of(view.messages[i]) == _calls_of(message) for i in recent):
        return tuple(recent)
    return ()


def _calls_of(message: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(name, arguments) of each call, ids left out."""
    return [(str((c.get("function") or {}).get("name")), str((c.get("function") or {}).get("arguments")))
            for c in message.get("tool_calls") or ()]


def _answer_of(call: Message) -> str:
    """The `answer` argument of a final_answer call; its raw arguments text when they hold none."""
    raw = (call.get("function") or {}).get("arguments")
    try:
        arguments = json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError:
        arguments = None
    if isinstance(arguments, dict) and isinstance(arguments.get("answer"), (str, int, float)):
        return str(arguments["answer"]).strip()
    return str(raw or "").strip()


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
