"""Run the scripted agent on a task without a backend or a policy: everything stays visible
unless `hidden` says otherwise (kv mode) or `edit` rewrites the history (text mode).
The build uses it to keep only questions the plan can answer
and whose trajectories have the intended length; tests use it to hide evidence on purpose.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable

from policy_dsl.counter import CHARS_PER_TOKEN
from sandbox.suites.base import Agent, AgentView, Message, Task, TaskEnv, ToolError

Hidden = Callable[[int, list[Message]], set[int]]  # (step, history) -> indices the model cannot see
Edit = Callable[[int, list[Message]], list[Message]]  # (step, history) -> the history as text mode edits it


@dataclass(frozen=True)
class Walk:
    messages: tuple[Message, ...]
    answer: str | None
    steps: int
    tool_calls: tuple[tuple[str, str], ...]  # (tool, argument) in order


def walk(task: Task, env: TaskEnv, agent: Agent, hidden: Hidden | None = None, edit: Edit | None = None,
         max_steps: int = 100) -> Walk:
    history: list[Message] = task.initial_messages()
    calls: list[tuple[str, str]] = []
    for step in range(max_steps):
        history = edit(step, history) if edit else history
        gone = hidden(step, history) if hidden else set()
        view = AgentView(task, tuple(history), tuple(i not in gone for i in range(len(history))), None, step)
        action = agent.act(view)
        history.append(action.message)
        if action.final_answer is not None:
            return Walk(tuple(history), action.final_answer, step + 1, tuple(calls))
        for call in action.message.get("tool_calls") or ():
            name, arguments = call["function"]["name"], json.loads(call["function"]["arguments"])
            calls.append((name, next(iter(arguments.values()), "")))
            try:
                result = env.call_tool(name, arguments)
            except ToolError as err:
                result = f"error: {err}"
            history.append({"role": "tool", "tool_call_id": call["id"], "name": name, "content": result})
    return Walk(tuple(history), None, max_steps, tuple(calls))


@lru_cache(maxsize=1)
def chat_tokenizer() -> Any:
    """The embedded model's chat tokenizer; None where its files are not installed."""
    try:
        from akv_core.chat import ChatTokenizer

        return ChatTokenizer.from_model("smollm2")
    except (ImportError, OSError, ValueError):
        return None


def trajectory_tokens(task: Task, messages: tuple[Message, ...]) -> int:
    """Prompt tokens of the last request of a trajectory (the whole history, rendered).

    Counted with the smollm2 chat template; a rough estimate (policy_dsl's CHARS_PER_TOKEN)
    where it is unavailable.
    """
    tokenizer = chat_tokenizer()
    if tokenizer is None:
        return sum(len(json.dumps(m, ensure_ascii=False)) for m in messages) // CHARS_PER_TOKEN
    return len(tokenizer.render(list(messages[:-1]), tools=list(task.tools)).token_ids)
