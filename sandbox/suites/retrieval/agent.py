"""The scripted agent of an imported retrieval suite: it fetches a question's evidence documents and
answers once all of them are visible at the same time.

It keeps no memory between steps: each step it looks at the visible `get_document` results and
fetches the evidence that is not among them (a document the policy dropped, or one a summary
replaced, is fetched again and paid for again). The answer itself is the question's reference
answer: with free-form documents a script cannot read it off the text, so what it measures is
evidence retention (whether the policy lets every evidence document be seen at once), not
reading. Its `used` records are the visible evidence results.
"""
from __future__ import annotations

import json
from typing import Any

from sandbox.suites.base import AgentAction, AgentView, Message, Task

MAX_STEPS = 40  # its own budget: a policy that never lets the evidence be seen together makes it give up


class EvidenceAgent:
    name = "scripted"

    def __init__(self, task: Task) -> None:
        self.task = task
        self.evidence: tuple[str, ...] = tuple(task.meta["evidence_ids"])

    def act(self, view: AgentView) -> AgentAction:
        if view.step == 0:
            return _calls(0, [("search", {"query": self.task.prompt})], "Searching for the question first.")
        seen = visible_documents(view.messages, view.visible, self.evidence)
        missing = [d for d in self.evidence if d not in seen]
        if not missing:
            answer = str(self.task.meta["gold"]["answer"])
            used = tuple(sorted(seen[d] for d in self.evidence))
            return AgentAction({"role": "assistant", "content": f"All evidence is in view.\nAnswer: {answer}"},
                               final_answer=answer, used=used)
        if view.step >= MAX_STEPS:
            return AgentAction({"role": "assistant", "content": "I could not keep the evidence in view."},
                               final_answer="", gave_up=True, used=tuple(sorted(seen.values())))
        calls = [("get_document", {"docid": d}) for d in missing]
        return _calls(view.step, calls, f"Reading {', '.join(missing)}.", tuple(sorted(seen.values())))


def visible_documents(messages: Any, visible: Any, wanted: tuple[str, ...]) -> dict[str, int]:
    """docid -> index of the latest visible, intact `get_document` result for each wanted document.

    A result is known by the tool's name on the tool message and the `[docid] title` header the
    document starts with; a placeholder or a summary has neither.
    """
    headers = {f"[{d}] ": d for d in wanted}
    out: dict[str, int] = {}
    for i, message in enumerate(messages):
        if not visible[i] or message.get("role") != "tool" or message.get("name") != "get_document":
            continue
        content = str(message.get("content") or "")
        docid = next((d for h, d in headers.items() if content.startswith(h)), None)
        if docid is not None:
            out[docid] = i
    return out


def _calls(step: int, calls: list[tuple[str, dict[str, str]]], content: str,
           used: tuple[int, ...] = ()) -> AgentAction:
    message: Message = {"role": "assistant", "content": content, "tool_calls": [
        {"id": f"call_{step:03d}_{n}", "type": "function",
         "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
        for n, (name, arguments) in enumerate(calls)]}
    return AgentAction(message, used=used)
