"""One live run of a localcomp task: the two research tools and grading."""
from __future__ import annotations

import json
from typing import Any, Mapping

from sandbox.suite import Grade, Task, ToolError
from sandbox.suites.localcomp.corpus import Corpus
from sandbox.suites.localcomp.grading import grade_answer

TOOLS: tuple[Mapping[str, Any], ...] = (
    {"type": "function", "function": {
        "name": "search",
        "description": "BM25 search over the encyclopedia. Returns the top 5 hits as a JSON list of "
                       "{docid, title, snippet}.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string",
                                                                  "description": "keywords"}},
                       "required": ["query"]}}},
    {"type": "function", "function": {
        "name": "get_document",
        "description": "The full text of one document, by the docid a search returned.",
        "parameters": {"type": "object", "properties": {"docid": {"type": "string",
                                                                  "description": "e.g. lc-01234"}},
                       "required": ["docid"]}}},
)


class LocalCompEnv:
    def __init__(self, corpus: Corpus, task: Task):
        self._corpus = corpus
        self._task = task

    def call_tool(self, name: str, arguments: Mapping[str, Any]) -> str:
        if name == "search":
            query = _string_argument(name, arguments, "query")
            hits = self._corpus.search(query)
            return json.dumps([{"docid": h.docid, "title": h.title, "snippet": h.snippet} for h in hits],
                              ensure_ascii=False)
        if name == "get_document":
            docid = _string_argument(name, arguments, "docid")
            text = self._corpus.text(docid.strip())
            if text is None:
                raise ToolError(f"get_document: no document with docid {docid!r}")
            return text
        raise ToolError(f"unknown tool {name!r}: expected search or get_document")

    def grade(self, answer: str | None) -> Grade:
        return grade_answer(answer, self._task.meta["gold"])

    def close(self) -> None:
        """Nothing to release: the corpus is shared read-only by all runs of the suite."""


def _string_argument(tool: str, arguments: Mapping[str, Any], name: str) -> str:
    if not isinstance(arguments, Mapping):
        raise ToolError(f"{tool}: arguments must be a JSON object with {name!r}")
    value = arguments.get(name)
    if not isinstance(value, str) or not value.strip():
        raise ToolError(f"{tool}: argument {name!r} must be a non-empty string")
    return value
