"""What the scripted agent can see now, and which message each fact came from.

The agent reads only visible messages. Every fact it takes from them (a document, a search
page, one of its own notes) keeps the indices of the messages it came from, so a step can
record exactly which messages it used (`AgentAction.used`).

- Notes come from the agent's own messages and from summaries of them (the extractive
  summarizer keeps the agent's lines whole): `Found B.p1: Chile [lc-01222]`, `Noted B.x: Spain`,
  and the dead ends it ruled out (`Ruled out: Manganese [lc-03126]` in edition 1, for any search;
  `Manganese [lc-03126] is not relevant to A.e: ...` in edition 2, for that var only).
- Documents come from whole tool results, and from a summary's blocks: the replay summarizer
  (`summary.py`) writes each table it keeps whole under its document's title and kind, so a
  summary's rows are tied to their article; what a summary left out is fetched again. Stray
  rows outside such a block (another summarizer's) are not read.
- Search pages come from whole results and from whole pages a summary kept.
- Search pages: edition 1's JSON hit lists name their query only through the call that asked
  for them (so they also use that assistant message); edition 2's result pages say their query.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Mapping, Sequence

from policy_dsl.decision import SUMMARY_PREFIX
from sandbox.suites.localcomp.reading import Article, read_articles

Hit = dict[str, str]  # {"docid", "title", "snippet"}

_FOUND = re.compile(r"^Found (\S+): (.+) \[(lc-\d{5})\]$", re.MULTILINE)
_NOTED = re.compile(r"^Noted (\S+): (.+)$", re.MULTILINE)
_RULED_OUT = re.compile(r"^Ruled out: .+ \[(lc-\d{5})\]$", re.MULTILINE)  # edition 1: for any search
# edition 2: a verdict on the document just read, or on one read earlier for another hop
_NOT_RELEVANT = re.compile(r"^.+ \[(lc-\d{5})\](?: is not relevant to| \(read earlier\) does not fit) (\S+)"
                           r"(?: either)?: .+$", re.MULTILINE)
_UNPAIRED_RESULT = "[result of get_document]"  # a tool result whose call was summarized away
_PAGE_HEAD = re.compile(r'^Search results for "(.*)": (\d+) hits?$')
# a document in a summary: its title, its kind, then only whole tables under their headings
_DOCUMENT_BLOCK = re.compile(r"\[lc-\d{5}\] [^\n]+\n[^|\n]+(?:\n(?:Infobox|== [^\n]+ ==)(?:\n\|[^\n]*\|)+)+\Z")
_PAGE_HIT = re.compile(r"^\d+\. \[(lc-\d{5})\] (.+)$")
_PAGE_SNIPPET = "   "


@dataclass
class Context:
    """The facts visible now; `*_src` say which message indices each one came from."""

    docs: dict[str, Article] = field(default_factory=dict)
    doc_src: dict[str, tuple[int, ...]] = field(default_factory=dict)
    searches: dict[str, list[Hit]] = field(default_factory=dict)
    search_src: dict[str, tuple[int, ...]] = field(default_factory=dict)
    found: dict[str, tuple[str, str]] = field(default_factory=dict)  # var -> (docid, title)
    found_src: dict[str, int] = field(default_factory=dict)
    noted: dict[str, str] = field(default_factory=dict)  # value var -> value
    noted_src: dict[str, int] = field(default_factory=dict)
    # (var, docid) -> the message that ruled the document out as that var (var None: as any)
    ruled_out: dict[tuple[str | None, str], int] = field(default_factory=dict)
    latest: int = -1  # the index of the latest message
    just_read: str | None = None  # the docid of the document in the latest message, when it is one

    def ruled_out_as(self, var: str, docid: str) -> int | None:
        """The message that ruled `docid` out as `var`, if a visible one did."""
        return self.ruled_out.get((var, docid), self.ruled_out.get((None, docid)))

    @property
    def dead_ends(self) -> set[str]:
        """Every document ruled out, as whatever it was checked for."""
        return {docid for _, docid in self.ruled_out}


def read_context(messages: Sequence[Mapping[str, Any]], visible: Sequence[bool]) -> Context:
    ctx = Context(latest=len(messages) - 1)
    calls: dict[str, tuple[str, dict[str, Any], int]] = {}
    for i, (message, seen) in enumerate(zip(messages, visible)):
        content = message.get("content") or ""
        if not seen or not isinstance(content, str):
            continue
        role = message.get("role")
        if role != "tool":
            _read_notes(ctx, content, i)
        for call in message.get("tool_calls") or ():
            fn = call.get("function", {})
            calls[call.get("id", "")] = (fn.get("name", ""), _arguments(fn.get("arguments")), i)
        if role == "tool":
            name, args, asked_at = calls.get(message.get("tool_call_id", ""), ("", {}, -1))
            if _read_search(ctx, content, name, args, (asked_at, i)):
                continue
        if role == "tool" or (role == "user" and content.startswith(_UNPAIRED_RESULT)):
            _read_documents(ctx, content, i, whole=role == "tool")
        elif role == "user" and content.startswith(SUMMARY_PREFIX):
            _read_summary(ctx, content[len(SUMMARY_PREFIX):], i)
    latest = [d for d, src in ctx.doc_src.items() if src == (ctx.latest,)]
    ctx.just_read = latest[0] if len(latest) == 1 and messages[ctx.latest].get("role") == "tool" else None
    return ctx


def _read_summary(ctx: Context, body: str, i: int) -> None:
    """A summary's blocks as summary.py writes them: a result page with every hit its head counts,
    or one document's title, kind and whole tables. Any other block (another summarizer's stray
    rows and hit lines) is not read as evidence."""
    for block in body.split("\n\n"):
        page = read_search_page(block)
        if page is not None:
            query, hits = page
            if len(hits) == int(_PAGE_HEAD.match(block.split("\n", 1)[0]).group(2)):
                ctx.searches[query], ctx.search_src[query] = list(hits), (i,)
        elif _DOCUMENT_BLOCK.match(block):
            _read_documents(ctx, block, i, whole=False)


def _read_notes(ctx: Context, content: str, i: int) -> None:
    found, noted, ruled = _notes(content)
    for var, title, docid in found:
        ctx.found[var], ctx.found_src[var] = (docid, title), i
    for var, value in noted:
        ctx.noted[var], ctx.noted_src[var] = value, i
    for key in ruled:
        ctx.ruled_out[key] = i


@lru_cache(maxsize=8192)
def _notes(content: str) -> tuple[tuple, tuple, tuple]:
    """(found, noted, ruled-out keys) of one message. Cached: the agent re-reads its context every step."""
    ruled = [(None, d) for d in _RULED_OUT.findall(content)] + [(v, d) for d, v in _NOT_RELEVANT.findall(content)]
    return tuple(_FOUND.findall(content)), tuple(_NOTED.findall(content)), tuple(ruled)


def _read_search(ctx: Context, content: str, name: str, args: Mapping[str, Any],
                 sources: tuple[int, int]) -> bool:
    """A search page (either edition's format) into ctx.searches; False when it is not one."""
    page = read_search_page(content)
    if page is not None:
        query, hits = page
        ctx.searches[query], ctx.search_src[query] = list(hits), (sources[1],)
        return True
    hit_list = _hit_list(content) if name == "search" else None
    if hit_list is not None:
        query = args.get("query", "")
        ctx.searches[query], ctx.search_src[query] = list(hit_list), sources
        return True
    return False


def _read_documents(ctx: Context, content: str, i: int, whole: bool) -> None:
    for article in read_articles(content):
        old = ctx.docs.get(article.docid)
        # a whole later copy stands on its own; fragments add up
        if whole or old is None:
            ctx.docs[article.docid], ctx.doc_src[article.docid] = article, (i,)
        else:
            ctx.docs[article.docid] = _merge(old, article)
            ctx.doc_src[article.docid] += (i,)


def search_page(query: str, hits: Sequence[Hit]) -> str:
    """Edition 2's search result page: the query, then one numbered hit and its snippet per entry."""
    lines = [f'Search results for "{query}": {len(hits)} hit{"" if len(hits) == 1 else "s"}']
    for n, hit in enumerate(hits, 1):
        lines += [f"{n}. [{hit['docid']}] {hit['title']}", _PAGE_SNIPPET + hit["snippet"]]
    return "\n".join(lines)


@lru_cache(maxsize=8192)
def read_search_page(content: str) -> tuple[str, tuple[Hit, ...]] | None:
    """(query, hits) of an edition-2 result page; None for any other text. Cached: the agent
    re-reads its context every step (the hits are shared: do not change them)."""
    if not content.startswith("Search results for "):
        return None
    lines = content.split("\n")
    head = _PAGE_HEAD.match(lines[0])
    if head is None:
        return None
    hits: list[Hit] = []
    for line in lines[1:]:
        m = _PAGE_HIT.match(line)
        if m:
            hits.append({"docid": m.group(1), "title": m.group(2), "snippet": ""})
        elif line.startswith(_PAGE_SNIPPET) and hits:
            hits[-1]["snippet"] = line[len(_PAGE_SNIPPET):]
    return head.group(1), tuple(hits)


def _arguments(raw: Any) -> dict[str, Any]:
    value = _json(raw) if isinstance(raw, str) else raw
    return value if isinstance(value, dict) else {}


@lru_cache(maxsize=8192)
def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _hit_list(content: str) -> list[Hit] | None:
    """Edition 1's JSON list of hits; None for any other text."""
    if not content.startswith("["):
        return None
    value = _json(content)
    ok = isinstance(value, list) and all(isinstance(h, dict) and "docid" in h for h in value)
    return value if ok else None


def _merge(old: Article, new: Article) -> Article:
    """Two visible fragments of one document: the union of what they show."""
    return Article(new.docid, new.title, new.kind or old.kind, {**old.fields, **new.fields},
                   {**old.tables, **new.tables})
