"""How a summarizing model reads localcomp's messages: the facts they state, for the replay summarizer.

A model asked to "keep every fact the agent found (names, numbers, dates, document ids) and what
it was looking for" writes down the agent's findings and verdicts, and the facts of the documents
it read, each under the document it comes from. This reader gives the extractive summarizer
(`sandbox.runs.summarize.fact_summary`) those facts, ranked as such a summary needs them:

1. the agent's conclusions (`Found ...`, `Noted ...`, its verdicts on dead ends of a hop still
   open); its plans ("Checking whether ...") and the verdicts of a hop whose document it has
   found last, since they were carried out or settled;
2. the infobox and tables of the documents the agent has found (its notes name them), then of
   those it has not judged yet, each table whole and under its document's title and kind;
3. search result pages: the query and every hit (without snippets), whole;
4. the documents the agent called dead ends, last: their verdict says what matters.

It reads only the summarized messages (no task data, nothing later), and an earlier summary is
read back the same way, so facts survive one summary after another while the budget allows.
The agent reads such a summary with the same parsers as the messages (`context.py`).
"""
from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

from policy_dsl.decision import SUMMARY_PREFIX
from sandbox.runs.summarize import Fact
from sandbox.suites.localcomp.context import _FOUND, _NOT_RELEVANT, _RULED_OUT, read_search_page
from sandbox.suites.localcomp.reading import Article, read_articles

CONCLUSION, FOUND_DOC, OPEN_DOC, SEARCH, DEAD_END, SETTLED, PLAN = 4.0, 3.0, 2.0, 1.5, 0.5, 0.3, 0.2
_CONCLUSION = re.compile(r"^(Found \S+: |Noted \S+: |Ruled out: )|\[lc-\d{5}\](?: is not relevant to| \(read "
                         r"earlier\) does not fit) ")


def summary_facts(messages: Sequence[Mapping[str, Any]]) -> list[Fact]:
    """The facts of `messages` (a span being summarized), ranked for a summary."""
    texts = [_text(m) for m in messages]
    found = {d for t in texts for _, _, d in _FOUND.findall(t)}
    settled = {var for t in texts for var, _, _ in _FOUND.findall(t)}  # hops whose document is found
    dead = {d for t in texts for d in _RULED_OUT.findall(t)} | {d for t in texts for d, _ in _NOT_RELEVANT.findall(t)}
    facts: list[Fact] = []
    for text in texts:
        # an earlier summary is read back block by block, as the messages it kept
        parts = text[len(SUMMARY_PREFIX):].split("\n\n") if text.startswith(SUMMARY_PREFIX) else [text]
        for part in parts:
            facts += _facts_of(part, len(facts), found, dead, settled)
    return facts


def _facts_of(text: str, block: int, found: set[str], dead: set[str], settled: set[str]) -> list[Fact]:
    """The facts of one message (or summary block); `block` numbers its first source, one more per document."""
    page = read_search_page(text)
    if page is not None:
        query, hits = page
        head = f'Search results for "{query}": {len(hits)} hit{"" if len(hits) == 1 else "s"}'
        return [Fact(SEARCH, block, "\n".join(f"{n}. [{h['docid']}] {h['title']}" for n, h in enumerate(hits, 1)),
                     head)]
    articles = read_articles(text)
    if articles:
        facts: list[Fact] = []
        for article in articles:
            facts += _document(article, block + len(facts), found, dead)
        return facts
    return [Fact(_rank_line(line, settled), block, line) for line in text.splitlines() if line.strip()]


def _rank_line(line: str, settled: set[str]) -> float:
    """The agent's own line: a finding, a verdict (of no more use once its hop is found), or a plan."""
    verdict = _NOT_RELEVANT.match(line)
    if verdict is not None:
        return SETTLED if verdict.group(2) in settled else CONCLUSION
    return CONCLUSION if _CONCLUSION.search(line) else PLAN


def _document(article: Article, block: int, found: set[str], dead: set[str]) -> list[Fact]:
    """A document's infobox and each of its tables, whole, under its title and kind."""
    rank = FOUND_DOC if article.docid in found else DEAD_END if article.docid in dead else OPEN_DOC
    head = f"[{article.docid}] {article.title}\n{article.kind}"
    facts = []
    if article.fields:
        rows = [f"| {k} | {v} |" for k, v in article.fields.items()]
        facts.append(Fact(rank, block, "\n".join(["Infobox", "| Field | Value |", "| --- | --- |", *rows]), head))
    for name, rows in article.tables.items():
        columns = list(rows[0])
        lines = [f"== {name} ==", "| " + " | ".join(columns) + " |", "| " + " | ".join("---" for _ in columns) + " |"]
        lines += ["| " + " | ".join(row.get(c, "") for c in columns) + " |" for row in rows]
        facts.append(Fact(rank - 0.25, block, "\n".join(lines), head))
    return facts


def _text(message: Mapping[str, Any]) -> str:
    content = message.get("content") or ""
    return content if isinstance(content, str) else ""
