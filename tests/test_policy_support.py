"""History builders shared by the policy tests (this module holds no tests)."""
from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

Message = dict[str, Any]


class CharCounter:
    """Exactly one token per character of content: makes token arithmetic in tests readable."""

    def count(self, message: Any) -> int:
        content = message.get("content")
        return len(content) if isinstance(content, str) else 0


def call(call_id: str, name: str = "search", arguments: Any = None) -> Message:
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments or {})}}


def agent_history(rounds: int, tools_per_round: int = 1, response: str = "r" * 40,
                  system: bool = True) -> list[Message]:
    """system?, user, then `rounds` x (assistant calling tools, their tool responses)."""
    history: list[Message] = [{"role": "system", "content": "You are an agent."}] if system else []
    history.append({"role": "user", "content": "Find the answer."})
    for r in range(rounds):
        ids = [f"c{r}_{k}" for k in range(tools_per_round)]
        history.append({"role": "assistant", "content": None, "tool_calls": [call(i) for i in ids]})
        history += [{"role": "tool", "tool_call_id": i, "name": "search", "content": response} for i in ids]
    return history


def tool_indices(history: list[Message]) -> list[int]:
    return [i for i, m in enumerate(history) if m["role"] == "tool"]


# Lines with distinctive content (a path, identifiers, an id) that results and turns repeat, as an agent
# re-reads a file or re-runs a test: what `covered` compares.
LINES = ("src/app/main.py", "def parse_config(path):", "FAILED tests/test_main.py::test_parse", "booking HAT136",
         "1 passed")
ARGUMENTS = (None, {"q": 1}, {"q": 2}, {"command": "cat src/app/main.py"}, {"command": "grep -n parse_config src"})


def distinctive(draw: st.DrawFn) -> str:
    return "\n".join(draw(st.lists(st.sampled_from(LINES), min_size=1, max_size=3)))


@st.composite
def histories(draw: st.DrawFn, max_rounds: int = 14) -> list[Message]:
    """Random agent histories: batches of 0-3 tool calls, drop_context calls, thinking, extra user turns,
    content that earlier messages held (LINES), and possibly an unfinished last batch."""
    history: list[Message] = []
    if draw(st.booleans()):
        history.append({"role": "system", "content": "s" * draw(st.integers(1, 30))})
    history.append({"role": "user", "content": "u" * draw(st.integers(1, 30))})
    for r in range(draw(st.integers(0, max_rounds))):
        if draw(st.integers(0, 9)) == 0:
            words = "more " * draw(st.integers(1, 5))
            history.append({"role": "user", "content": distinctive(draw) if draw(st.booleans()) else words})
        width = draw(st.integers(0, 3))
        calls = []
        for k in range(width):
            if draw(st.integers(0, 5)) == 0:
                ids = draw(st.lists(st.integers(-2, len(history) + 6), max_size=4))
                calls.append(call(f"c{r}_{k}", "drop_context", {"message_ids": ids}))
            else:
                arguments = draw(st.sampled_from(ARGUMENTS))
                calls.append(call(f"c{r}_{k}", draw(st.sampled_from(["search", "open", "run"])), arguments))
        said = distinctive(draw) if draw(st.integers(0, 3)) == 0 else "a" * draw(st.integers(0, 20))
        assistant: Message = {"role": "assistant", "content": said or None}
        if calls:
            assistant["tool_calls"] = calls
        if draw(st.booleans()):
            assistant["reasoning_content"] = "think " * draw(st.integers(1, 6))
        history.append(assistant)
        answered = width if draw(st.integers(0, 7)) else draw(st.integers(0, width))
        for c in calls[:answered]:
            size = draw(st.integers(1, 400))
            content = distinctive(draw) if draw(st.integers(0, 2)) == 0 else \
                draw(st.sampled_from(["x", "error: ", "ok "])) * size
            history.append({"role": "tool", "tool_call_id": c["id"], "name": c["function"]["name"], "content": content})
    return history
