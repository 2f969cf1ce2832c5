"""Summaries for text-mode policies: the harness's text editor, and the extractive stand-in.

The edits themselves are applied by the policy language's editor (`policy_dsl/editor.py`), which
the proxy uses too; this module says who writes each summary in the harness. With a model backend
the summary is a real call that writes it (billed as its own request).
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

from policy_dsl.decision import TextEdit
from policy_dsl.editor import TextEditor as PolicyTextEditor, text_tokens

from sandbox.backends.base import BackendRequest

Message = dict[str, Any]

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_FACTLIKE = re.compile(r"\d|\b[A-Z][a-z]+|\b[a-z]+[-_:]\d")


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
    """The harness's text editor: the policy language's (`policy_dsl.editor.TextEditor`), with each
    summary a real model call on generating backends and the extractive summarizer on replay (the
    suite's fact reader's facts where it has one); `bill(step, request, reply, usage)` hears of each.
    """

    def __init__(self, task_prompt: str, backend: Any, counter: Any,
                 bill: Callable[[int, Any, Message | None, Any], None], facts: FactReader | None = None) -> None:
        self.backend, self.counter, self.bill = backend, counter, bill
        self.facts = facts  # the suite's reader of facts for the extractive summarizer, if it has one
        self._editor = PolicyTextEditor(task_prompt, self._summary, counter)

    def apply(self, history: Sequence[Message], edits: Sequence[TextEdit], step: int) -> list[Message]:
        return self._editor.apply(history, edits, step)

    def _summary(self, messages: Sequence[Message], prompt: list[Message], room: int, step: int) -> str:
        request = BackendRequest(messages=tuple(prompt), max_tokens=room)
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
        return text_tokens(self.counter, text)
