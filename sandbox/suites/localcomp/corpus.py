"""The document store and its BM25 search (SQLite FTS5 from the standard library)."""
from __future__ import annotations

import random
import re
import sqlite3
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from sandbox.suites.localcomp import documents as render
from sandbox.suites.localcomp.atlas import Atlas
from sandbox.suites.localcomp.documents import Document

SEARCH_TOP_K = 5
_WORD = re.compile(r"\w+", re.UNICODE)
_STOPWORDS = frozenset("a an and by for in is of on or the to was with".split())


@dataclass(frozen=True)
class Hit:
    docid: str
    title: str
    snippet: str


def render_corpus(atlas: Atlas, seed: int) -> list[Document]:
    """All documents, with docids shuffled by the seed so that a docid says nothing about its kind."""
    entities = ([("element", str(e.number), e) for e in atlas.facts.elements]
                + [("country", c.alpha_2, c) for c in atlas.facts.countries]
                + [("currency", c.code, c) for c in atlas.facts.currencies]
                + [("language", lang.code, lang) for lang in atlas.facts.languages]
                + [("subdivision", s.code, s) for s in atlas.facts.subdivisions])
    numbers = list(range(len(entities)))
    random.Random(seed).shuffle(numbers)
    renderers = {"element": render.element_doc, "country": render.country_doc,
                 "currency": render.currency_doc, "language": render.language_doc,
                 "subdivision": render.subdivision_doc}
    docs = []
    for (kind, key, entity), n in zip(entities, numbers):
        docid = f"lc-{n:05d}"
        text = renderers[kind](docid, entity, atlas)
        title = text.split("\n", 1)[0].split("] ", 1)[1]
        docs.append(Document(docid=docid, key=f"{kind}:{key}", kind=kind, title=title, text=text))
    return sorted(docs, key=lambda d: d.docid)


def write_index(docs: list[Document], path: Path) -> None:
    db = sqlite3.connect(path)
    with db:
        db.execute("CREATE TABLE docs (docid TEXT PRIMARY KEY, key TEXT UNIQUE, kind TEXT, title TEXT, "
                   "text TEXT)")
        db.execute("CREATE VIRTUAL TABLE docs_fts USING fts5(docid UNINDEXED, title, lead, body, "
                   "tokenize = 'unicode61 remove_diacritics 2')")
        db.executemany("INSERT INTO docs VALUES (?, ?, ?, ?, ?)",
                       [(d.docid, d.key, d.kind, d.title, d.text) for d in docs])
        db.executemany("INSERT INTO docs_fts VALUES (?, ?, ?, ?)",
                       [(d.docid, d.title, *_lead_and_body(d.text)) for d in docs])
        db.execute("INSERT INTO docs_fts(docs_fts) VALUES ('optimize')")
    db.close()


def _lead_and_body(text: str) -> tuple[str, str]:
    """Lead and infobox apart from the rest, so a long article is not penalized for its length
    when the query matches its key facts (BM25 normalizes per column)."""
    cut = text.find("\n== ")
    return (text, "") if cut < 0 else (text[:cut], text[cut:])


class Corpus:
    """Read-only access to a built index."""

    def __init__(self, path: Path):
        self._db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
        # Queries repeat across runs of a split ("China country", "Euro EUR"), and a query with
        # common terms ranks thousands of rows: remember recent answers.
        self.search = lru_cache(maxsize=8192)(self._search)  # type: ignore[method-assign]

    def close(self) -> None:
        self._db.close()

    def _search(self, query: str, k: int = SEARCH_TOP_K) -> tuple[Hit, ...]:
        """BM25 over title, lead and body (weighted 20 : 3 : 1); common stopwords are ignored.

        Any term matches and more terms rank higher; a term is a whitespace-separated chunk, so
        "7440-18-8" is searched as one phrase."""
        terms = [" ".join(_WORD.findall(chunk)) for chunk in query.split()]
        terms = [t for t in terms if t and t not in _STOPWORDS]  # "AND" (Andorra's code) stays
        if not terms:
            return ()
        match = " OR ".join(f'"{t}"' for t in terms)
        rows = self._db.execute(
            "SELECT docid, title, snippet(docs_fts, -1, '', '', ' ... ', 64) FROM docs_fts "
            "WHERE docs_fts MATCH ? ORDER BY bm25(docs_fts, 0.0, 20.0, 3.0, 1.0) LIMIT ?",
            (match, k)).fetchall()
        return tuple(Hit(docid=d, title=t, snippet=" ".join(s.split())) for d, t, s in rows)

    def text(self, docid: str) -> str | None:
        row = self._db.execute("SELECT text FROM docs WHERE docid = ?", (docid,)).fetchone()
        return row[0] if row else None

    def docid_of(self, key: str) -> str:
        row = self._db.execute("SELECT docid FROM docs WHERE key = ?", (key,)).fetchone()
        if row is None:
            raise KeyError(key)
        return row[0]

    def count(self) -> int:
        return self._db.execute("SELECT count(*) FROM docs").fetchone()[0]
