"""Summaries for text-mode policies: the prompt for a real model, and the extractive stand-in.

With a model backend the summary is a real call that writes it (billed as its own request).
The replay backend has no model, so a deterministic extractive summarizer writes it instead:
the agent's own lines (its notes and conclusions) rank first, then the sentences of documents
and tool output by how fact-like they are (digits, capitalised names, document ids); the
best-ranked units are kept, in their original order and one per line, until the token budget
is spent. Facts that do not make the cut are gone from the history, which is exactly the loss
a text-engineering policy risks.

A suite whose tool outputs have a structure (documents with tables, search result pages) can
read its messages for the summarizer as a model that knows those formats would (a `FactReader`,
the suite's `summary_facts`): the facts the messages state, each whole (a table with all its
rows, a result page with all its hits) and written under what it is a fact of (the document's
title, the search's query), ranked by how much a summary needs it. `fact_summary` keeps the
best-ranked facts within the budget, grouped in blocks by their source, so an agent reading the
summary can tie each fact to its source, and reads nothing a model's summary would not say.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from policy_dsl.decision import SUMMARY_PREFIX

Message = dict[str, Any]

SUMMARY_SYSTEM = (
    "You compress an agent's working history. Write a dense summary that keeps every fact the agent "
    "found (names, numbers, dates, document ids) and what it was looking for. No preamble."
)

_TEXT_TOKENS: dict[tuple[int, str], int] = {}  # the counter is the process-wide shared tokenizer
_TEXT_TOKENS_CAPACITY = 200_000
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_FACTLIKE = re.compile(r"\d|\b[A-Z][a-z]+|\b[a-z]+[-_:]\d")


def message_text(message: Mapping[str, Any]) -> str:
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
    body = "\n\n".join(message_text(m) for m in messages)
    return [
        {"role": "system", "content": SUMMARY_SYSTEM},
        {"role": "user", "content": f"Task: {task_prompt}\n\nHistory to summarize:\n{body}"},
    ]


def extractive_summary(messages: Sequence[Mapping[str, Any]], budget_tokens: int,
                       count_text: Callable[[str], int]) -> str:
    """The agent's own notes, then the most fact-like sentences of `messages`, within `budget_tokens`.

    Kept units stay in their original order, one per line, so line-oriented notes survive intact.
    """
    units = _units(messages)
    ranked = sorted(range(len(units)), key=lambda i: (-units[i][0], i))
    kept: set[int] = set()
    spent = 0
    for index in ranked:
        cost = count_text(units[index][1]) + 1  # +1 for the line break
        if spent + cost > budget_tokens:
            continue  # a shorter unit further down may still fit
        kept.add(index)
        spent += cost
    return "\n".join(units[i][1] for i in sorted(kept))


@dataclass(frozen=True)
class Fact:
    """One self-contained fact of the summarized messages, as a summarizer writes it down.

    Facts of one `block` are written together under its `head` (what they are facts of: a
    document's title and kind, a search's query); blocks keep their original order.
    """

    rank: float  # higher is kept first; ties keep the earlier fact
    block: int
    text: str
    head: str = ""


FactReader = Callable[[Sequence[Mapping[str, Any]]], Sequence[Fact]]


def fact_summary(facts: Sequence[Fact], budget_tokens: int, count_text: Callable[[str], int]) -> str:
    """The best-ranked `facts` within `budget_tokens`, one block per source, blocks split by a blank line.

    A block's head is paid once, with its first kept fact; a fact that does not fit is skipped
    (a shorter one further down may still fit).
    """
    kept: list[int] = []
    headed: set[int] = set()
    spent = 0
    for index in sorted(range(len(facts)), key=lambda i: (-facts[i].rank, i)):
        fact = facts[index]
        head_cost = count_text(fact.head) + 2 if fact.head and fact.block not in headed else 0
        cost = count_text(fact.text) + 1 + head_cost
        if spent + cost > budget_tokens:
            continue
        kept.append(index)
        spent += cost
        headed.add(fact.block)
    blocks: dict[int, list[str]] = {}
    for index in sorted(kept, key=lambda i: (facts[i].block, i)):
        fact = facts[index]
        blocks.setdefault(fact.block, [fact.head] if fact.head else []).append(fact.text)
    return "\n\n".join("\n".join(lines) for lines in blocks.values())


def _units(messages: Sequence[Mapping[str, Any]]) -> list[tuple[float, str]]:
    """(score, text) per line of the agent's notes and per sentence of everything else, deduplicated.

    The agent's own lines are its conclusions, the first thing any summary keeps: they outrank
    every sentence of documents and tool output, which are ranked by fact density.
    """
    units: list[tuple[float, str]] = []
    seen: set[str] = set()
    for message in messages:
        content = message.get("content") or ""
        if not isinstance(content, str):
            content = "".join(part.get("text", "") for part in content if isinstance(part, Mapping))
        own = message.get("role") == "assistant"
        for line in content.splitlines():
            for unit in ([line] if own else _SENTENCE_END.split(line)):
                unit = unit.strip()
                if unit and unit not in seen:
                    seen.add(unit)
                    units.append(((1.0 if own else 0.0) + _density(unit), unit))
    return units


def _density(text: str) -> float:
    """Fact-like tokens per word, below 1, so short factual sentences beat long vague ones."""
    words = max(1, len(text.split()))
    return min(0.99, len(_FACTLIKE.findall(text)) / words / 2)


class TextEditor:
    """Applies a text-mode decision's edits (policy_dsl's TextEdit) to a history.

    A summary replaces messages start..end with one user message beginning with the policy
    language's SUMMARY_PREFIX (so policies recognise it); an omitted message keeps its role and
    ids with the edit's placeholder as content; a removed one leaves. Tool calls and tool results whose partner was
    summarized away are rewritten as plain text, so every request stays a valid conversation.
    Untouched messages stay the same objects (the tokenizer's memo and the trajectory's deltas
    rely on it).
    """

    def __init__(self, task_prompt: str, backend: Any, counter: Any,
                 bill: Callable[[int, Any, Message | None, Any], None], facts: FactReader | None = None) -> None:
        self.task_prompt, self.backend, self.counter, self.bill = task_prompt, backend, counter, bill
        self.facts = facts  # the suite's reader of facts for the extractive summarizer, if it has one

    def apply(self, history: Sequence[Message], edits: Sequence[Any], step: int) -> list[Message]:
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
        """A real model call on generating backends; the extractive summarizer on replay (the suite's
        fact reader's facts where it has one)."""
        from sandbox.backends import BackendRequest

        room = max(1, budget - self._tokens(SUMMARY_PREFIX))
        request = BackendRequest(messages=tuple(summary_request(self.task_prompt, messages)), max_tokens=room)
        reply = self.backend.complete(request)
        if reply.message is not None:
            body = str(reply.message.get("content") or "").strip()
            self.bill(step, request, reply.message, reply.usage)
        else:
            body = fact_summary(self.facts(messages), room, self._tokens) if self.facts is not None \
                else extractive_summary(messages, room, self._tokens)
            self.bill(step, request, {"role": "assistant", "content": body},
                      reply.usage.with_completion(self._tokens(body)))
        return body

    def _tokens(self, text: str) -> int:
        # Successive summaries re-read the same sentences (the last summary, the agent's notes),
        # so counts are memoized per tokenizer and text.
        key = (id(self.counter), text)
        count = _TEXT_TOKENS.get(key)
        if count is None:
            if len(_TEXT_TOKENS) >= _TEXT_TOKENS_CAPACITY:
                _TEXT_TOKENS.clear()
            count = _TEXT_TOKENS[key] = len(self.counter.encode_text(text))
        return count


def _paired(history: list[Message]) -> list[Message]:
    """Rewrite tool calls without results, then tool results without calls, as plain text."""
    result_ids = {m.get("tool_call_id") for m in history if m.get("role") == "tool"}
    history = [
        {"role": "assistant", "content": message_text(m)}
        if m.get("tool_calls") and any(c.get("id") not in result_ids for c in m["tool_calls"]) else m
        for m in history
    ]
    call_ids = {c.get("id") for m in history for c in m.get("tool_calls") or ()}
    return [
        {"role": "user", "content": f"[result of {m.get('name') or 'a tool'}]\n{m.get('content') or ''}"}
        if m.get("role") == "tool" and m.get("tool_call_id") not in call_ids else m
        for m in history
    ]
