"""One live run of a localcomp task: the two research tools and grading."""
from __future__ import annotations

import json
from typing import Any, Mapping

from sandbox.suites.base import Grade, Task, ToolError
from sandbox.suites.localcomp.context import search_page
from sandbox.suites.localcomp.corpus import Corpus
from sandbox.suites.localcomp.grading import grade_answer

TOOLS: tuple[Mapping[str, Any], ...] = (  # edition 1's schemas
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

SEARCH_PAGE_TOOL: Mapping[str, Any] = {"type": "function", "function": {
    **TOOLS[0]["function"],
    "description": "BM25 search over the encyclopedia. Returns a result page: the query, then the top 5 hits, "
                   "each with its docid, title and a snippet."}}


def tools_of(edition: int) -> tuple[Mapping[str, Any], ...]:
    """The tool schemas of an edition (edition 2's search returns a result page, not JSON)."""
    return TOOLS if edition == 1 else (SEARCH_PAGE_TOOL, TOOLS[1])


class LocalCompEnv:
    def __init__(self, corpus: Corpus, task: Task, edition: int = 2):
        self._corpus = corpus
        self._task = task
        self._edition = edition

    def call_tool(self, name: str, arguments: Mapping[str, Any]) -> str:
        if name == "search":
            query = _string_argument(name, arguments, "query")
            hits = [{"docid": h.docid, "title": h.title, "snippet": h.snippet} for h in self._corpus.search(query)]
            if self._edition == 1:  # a bare JSON list
                return json.dumps(hits, ensure_ascii=False)
            return search_page(query, hits)  # a result page that says its query
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
