"""The scripted agent: a deterministic navigator that follows a task's research plan.

It keeps no memory between steps. Each step it re-reads what it can still see (the messages
marked visible) and works out the next action from the plan in `Task.meta` (planner.py):

- Its own assistant messages carry short notes of *identity* ("Found A.e: Chlorine [lc-01690]"),
  as a careful human researcher would write down, and its verdict on each dead end.
- The *values* it needs (a year, a subdivision count, a producer's name) it reads only from
  documents that are visible now. When one is gone (kv-dropped, summarized, replaced by a
  placeholder) it fetches the document again and pays for those tokens again.
- The final answer is computed from visible documents only, never from the gold data.
- Each action records the messages it was decided from (`AgentAction.used`).

So its accuracy measures how well a cache policy retains evidence, not how good a model is.

How it writes depends on the suite's edition (its `Voice`): edition 1 makes every independent
call of a leg in one message and notes a dead end as "Ruled out: ..."; edition 2 makes one call
per step, as a ReAct-style research agent does, says in words why a document it opened is not
relevant, and, where the policy offers the `drop_context` cache tool, asks to drop that document.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

from sandbox.suites.base import AgentAction, AgentView, Task
from sandbox.suites.localcomp.context import Hit, read_context
from sandbox.suites.localcomp.planner import GiveUp, Need, Planner, RuledOut, ruled_out_plainly
from sandbox.suites.localcomp.reading import Article

DROP_CONTEXT = "drop_context"  # the cache tool's name (sandbox.agents.llm offers it)


def ruled_out_in_words(var: str, hit: Hit, article: Article, kind: str, where: Mapping[str, str],
                       just_read: bool) -> str:
    """A dead end as a research model words it: what the document is, and why it does not fit.
    The verdict on the document just read says it "is not relevant"; a document read earlier
    for another hop that does not fit this one either is named as such."""
    title = f"{article.title} [{article.docid}]"
    said = f"{title} is not relevant to {var}" if just_read else f"{title} (read earlier) does not fit {var} either"
    if article.kind != kind:
        return f"{said}: it is the article on {_a(article.kind.lower())}, not on {_a(kind.lower())}."
    field = next(k for k, v in where.items() if article.fields.get(k) != v)
    return f"{said}: its {field} is {article.fields[field]}, not {where[field]}."


def _a(noun: str) -> str:
    return ("an " if noun[:1] in "aeiou" else "a ") + noun


@dataclass(frozen=True)
class Voice:
    """How the agent of one edition acts and writes."""

    batch: bool  # every independent call of a leg in one message, or one call per step
    ruled_out: RuledOut
    judge_at_once: bool  # the document just read is judged first, search page or not
    max_steps: int
    cache_tool: bool  # asks drop_context to drop its dead ends when the policy offers the tool


VOICES = {
    1: Voice(batch=True, ruled_out=ruled_out_plainly, judge_at_once=False, max_steps=60, cache_tool=False),
    2: Voice(batch=False, ruled_out=ruled_out_in_words, judge_at_once=True, max_steps=90, cache_tool=True),
}
MAX_STEPS = VOICES[1].max_steps


class ScriptedAgent:
    name = "scripted"

    def __init__(self, task: Task, edition: int = 2, max_steps: int | None = None):
        self.task, self.voice = task, VOICES[edition]
        self.max_steps = self.voice.max_steps if max_steps is None else max_steps
        self.uses_cache_tool = self.voice.cache_tool  # the harness offers drop_context when the policy reads it

    def act(self, view: AgentView) -> AgentAction:
        if view.step >= self.max_steps:
            return _give_up(f"I stop here: the step budget of {self.max_steps} is spent.", ())
        ctx = read_context(view.messages, view.visible)
        planner = Planner(self.task.meta["plan"], ctx, self.voice.batch, self.voice.ruled_out,
                          self.voice.judge_at_once)
        prompt = next(i for i, m in enumerate(view.messages) if m.get("role") == "user")
        planner.used.add(prompt)  # the question itself
        outcome = planner.answer()
        if isinstance(outcome, GiveUp):
            return _give_up(f"I could not finish the research: {outcome.reason}.", planner.used)
        notes = list(dict.fromkeys(planner.notes))
        used = tuple(sorted(planner.used))
        if isinstance(outcome, list):
            drops = [ctx.doc_src[d][-1] for d in planner.ruled if d in ctx.doc_src] \
                if self.voice.cache_tool and _offered(view, DROP_CONTEXT) else []
            return _tool_calls(view.step, outcome, notes, sorted(set(drops)), used)
        answer, said = outcome
        return AgentAction(message={"role": "assistant", "content": "\n".join([*notes, f"{said}.",
                                                                              f"Answer: {answer}"])},
                           final_answer=answer, used=used)


def _offered(view: AgentView, tool: str) -> bool:
    return any((t.get("function") or {}).get("name") == tool for t in view.tools)


def _tool_calls(step: int, needs: list[Need], notes: list[str], drops: list[int],
                used: tuple[int, ...]) -> AgentAction:
    calls: list[tuple[str, dict[str, Any]]] = [(n.tool, n.arguments) for n in needs]
    lines = [*notes, *(n.why for n in needs)]
    if drops:
        calls.insert(0, (DROP_CONTEXT, {"message_ids": drops}))
        lines.insert(len(notes), f"Dropping the dead ends from my context: messages {drops}.")
    return AgentAction(message={"role": "assistant", "content": "\n".join(lines), "tool_calls": [
        {"id": f"call_{step:03d}_{i}", "type": "function",
         "function": {"name": tool, "arguments": json.dumps(arguments, ensure_ascii=False)}}
        for i, (tool, arguments) in enumerate(calls)]}, used=used)


def _give_up(content: str, used: Any) -> AgentAction:
    """A final message without an answer: the task could not be finished (status gave_up)."""
    return AgentAction(message={"role": "assistant", "content": content}, final_answer="", gave_up=True,
                       used=tuple(sorted(used)))
