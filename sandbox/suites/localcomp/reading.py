"""Reading an article back: its docid, title, kind, infobox fields and tables.

The scripted agent reads only through this module, and only the text it can see, so a
summary that kept a few infobox rows yields just those rows.
"""
from __future__ import annotations

import re
from functools import lru_cache
from dataclasses import dataclass, field

_HEADER = re.compile(r"^\[(lc-\d{5})\] (.+)$", re.MULTILINE)
_ROW = re.compile(r"^\| (.*) \|$")


@dataclass(frozen=True)
class Article:
    docid: str
    title: str
    kind: str
    fields: dict[str, str] = field(default_factory=dict)
    tables: dict[str, list[dict[str, str]]] = field(default_factory=dict)  # section -> rows


@lru_cache(maxsize=4096)
def read_articles(text: str) -> tuple[Article, ...]:
    """Every article (or surviving fragment of one) in a message's text.

    Cached: the agent re-reads its whole visible context at every step.
    """
    headers = list(_HEADER.finditer(text))
    ends = [h.start() for h in headers[1:]] + [len(text)]
    return tuple(_read_one(h.group(1), h.group(2).strip(), text[h.end() + 1:end])
                 for h, end in zip(headers, ends))


def _read_one(docid: str, title: str, body: str) -> Article:
    kind = body.split("\n", 1)[0].strip()
    sections = _sections(body)
    infobox = sections.pop("Infobox", [])
    fields = {row["Field"]: row["Value"] for row in infobox if "Field" in row and "Value" in row}
    return Article(docid=docid, title=title, kind=kind, fields=fields,
                   tables={k: v for k, v in sections.items() if v})


def _sections(text: str) -> dict[str, list[dict[str, str]]]:
    """Markdown-style tables keyed by the heading above them ("Infobox" or "== Name ==")."""
    out: dict[str, list[dict[str, str]]] = {}
    section, columns = "", None
    for line in text.split("\n"):
        if line == "Infobox" or (line.startswith("== ") and line.endswith(" ==")):
            section, columns = line.strip("= "), None
            continue
        m = _ROW.match(line)
        if not m:
            columns = None if not line.strip() else columns
            continue
        cells = [c.strip() for c in m.group(1).split(" | ")]
        if columns is None:
            columns = cells
        elif not all(set(c) <= {"-"} for c in cells):
            out.setdefault(section, []).append(dict(zip(columns, cells)))
    return out
