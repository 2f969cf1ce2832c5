"""The text editor: a text-mode decision's edits (`TextEdit`) applied to a history.

A summary replaces messages start..end with one user message beginning with SUMMARY_PREFIX (so
policies recognise it); an omitted message keeps its role and ids with the edit's placeholder as
content; a removed one leaves; a stripped one loses its reasoning. Tool calls and tool results
whose partner was summarized away are rewritten as plain text, so every request stays a valid
conversation. Untouched messages stay the same objects (a tokenizer's memo and a trajectory's
deltas rely on it). `apply_text_edits` in decision.py is the plain reference of the same edits.

Who writes a summary is the caller's: the harness asks its backend (or summarizes extractively on
replay, `sandbox/runs/summarize.py`), the proxy asks its upstream (`akv_proxy/step.py`). Both apply the
edits with this one editor and the same summary request, so a text policy edits behind the proxy
as it did when it was scored.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol, Sequence

from policy_dsl.decision import SUMMARY_PREFIX, TextEdit

Message = dict[str, Any]

SUMMARY_SYSTEM = (
    "You compress an agent's working history. Write a dense summary that keeps every fact the agent "
    "found (names, numbers, dates, document ids) and what it was looking for. No preamble."
)
TEXT_PASSES = 4  # edit-then-decide-again passes per step: a policy decides again on the edited history

_TEXT_TOKENS: dict[tuple[int, str], int] = {}  # the counter is the process-wide shared tokenizer
_TEXT_TOKENS_CAPACITY = 200_000


class TextEncoder(Protocol):
    """A tokenizer that counts plain text (akv_core.chat.ChatTokenizer is one)."""

    def encode_text(self, text: str) -> Sequence[int]:
        """The token ids of `text`, without any chat template."""


# Writes one summary: (the messages it replaces, the summary request's messages, the room in tokens,
# the step) -> the summary's text, without SUMMARY_PREFIX.
SummaryWriter = Callable[[Sequence[Message], list[Message], int, int], str]


def transcript_line(message: Mapping[str, Any]) -> str:
    """A message as plain text for a summary prompt: role, tool calls and content."""
    content = message.get("content") or ""
    if not isinstance(content, str):
        content = "".join(part.get("text", "") for part in content if isinstance(part, Mapping))
    calls = [
        f"{call.get('function', {}).get('name')}({call.get('function', {}).get('arguments')})"
        for call in message.get("tool_calls") or ()
    ]
    head = message.get("role", "user") + (f" [{message['name']}]" if message.get("name") else "")
    return f"{head}: " + " ".join([*calls, content]).strip()


def summary_request(task_prompt: str, messages: Sequence[Mapping[str, Any]]) -> list[Message]:
    """The messages of the summarization call a model answers."""
    body = "\n\n".join(transcript_line(m) for m in messages)
    return [
        {"role": "system", "content": SUMMARY_SYSTEM},
        {"role": "user", "content": f"Task: {task_prompt}\n\nHistory to summarize:\n{body}"},
    ]


def text_tokens(counter: TextEncoder, text: str) -> int:
    """The tokens of `text` under `counter`, memoized per counter and text: successive summaries
    re-read the same sentences (the last summary, the agent's notes)."""
    key = (id(counter), text)
    count = _TEXT_TOKENS.get(key)
    if count is None:
        if len(_TEXT_TOKENS) >= _TEXT_TOKENS_CAPACITY:
            _TEXT_TOKENS.clear()
        count = _TEXT_TOKENS[key] = len(counter.encode_text(text))
    return count


class TextEditor:
    """Applies a text-mode decision's edits to a history; `write` writes each summary."""

    def __init__(self, task_prompt: str, write: SummaryWriter, counter: TextEncoder) -> None:
        self.task_prompt, self.write, self.counter = task_prompt, write, counter

    def apply(self, history: Sequence[Message], edits: Sequence[TextEdit], step: int) -> list[Message]:
        out = list(history)
        for edit in sorted(edits, key=lambda e: e.start, reverse=True):  # back to front keeps indices valid
            if edit.kind == "omit":
                out[edit.start] = {**out[edit.start], "content": edit.placeholder or "[omitted]"}
            elif edit.kind == "remove":
                del out[edit.start]
            elif edit.kind == "strip_thinking":
                out[edit.start] = {k: v for k, v in out[edit.start].items() if k != "reasoning_content"}
            else:
                body = self._summary(out[edit.start: edit.end + 1], edit.budget_tokens or 0, step)
                out[edit.start: edit.end + 1] = [{"role": "user", "content": SUMMARY_PREFIX + body}]
        return _paired(out)

    def _summary(self, messages: Sequence[Message], budget: int, step: int) -> str:
        """The summary within `budget` tokens, the prefix included."""
        room = max(1, budget - text_tokens(self.counter, SUMMARY_PREFIX))
        return self.write(messages, summary_request(self.task_prompt, messages), room, step)


def _paired(history: list[Message]) -> list[Message]:
    """Rewrite tool calls without results, then tool results without calls, as plain text."""
    result_ids = {m.get("tool_call_id") for m in history if m.get("role") == "tool"}
    history = [
        {"role": "assistant", "content": transcript_line(m)}
        if m.get("tool_calls") and any(c.get("id") not in result_ids for c in m["tool_calls"]) else m
        for m in history
    ]
    call_ids = {c.get("id") for m in history for c in m.get("tool_calls") or ()}
    return [
        {"role": "user", "content": f"[result of {m.get('name') or 'a tool'}]\n{m.get('content') or ''}"}
        if m.get("role") == "tool" and m.get("tool_call_id") not in call_ids else m
        for m in history
    ]
