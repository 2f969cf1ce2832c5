"""The scripted repair agent's notes: one line in each of its messages saying what the call is for.

A note is the agent's plan written down, never a fact copied from a tool: the kind of step
(reproduce, read, attempt, ...) and, while it searches, its *cursor*, the place in its search
order it is working on. The agent keeps nothing between steps; it learns what it has already
done by reading its own notes back, so a note it can no longer see is work it has forgotten.

    Trying repair 2 of 3 at src/isodate/isodates.py:179. [attempt @B0.0 src/isodate/isodates.py:179:2/3 w0]

The tag (in brackets, last) is what the agent parses; the words before it are for people.
Places are paths in the search tree (`search.py`): `F1` is the second traceback frame, `B0.0`
the function of the first, `C0.1.2.0` a function the first failing test calls. A read or a
grep names the place whose fact it fetches first, then (after `@`) the cursor. `^` after a
place means its whole subtree is done; `path:line:k` is the suspect line and the repairs
tried there (`/n` of how many, on attempts); `wN` the context width of an edit.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

KINDS = ("orient", "reproduce", "test", "read", "grep", "attempt", "check", "verify", "undo", "submit")
_TAG = re.compile(r"\[(?P<kind>[a-z_]+)(?: (?P<target>[FBC][\d.]*))?(?: @(?P<node>[FBC][\d.]*)(?P<after>\^)?"
                  r"(?: (?P<path>[\w./-]+):(?P<site>\d+):(?P<k>\d+)(?:/(?P<n>\d+))?)?)?"
                  r"(?: w(?P<width>\d))?(?: (?P<word>[a-z_]+))?\]$")


@dataclass(frozen=True)
class Cursor:
    """A position in the search order: at `node` (its `site` line, `k` repairs tried), or after it."""

    node: tuple = ()  # ("F",), ("B", 0), ("C", 0, 1, 2, 0), ...
    after: bool = False
    site: tuple[str, int] | None = None  # (path, line)
    k: int = 0

    def text(self) -> str:
        if not self.node:
            return ""
        place = node_text(self.node)
        site = f" {self.site[0]}:{self.site[1]}:{self.k}" if self.site is not None else ""
        return f"@{place}{'^' if self.after else ''}{site}"


START = Cursor()


def node_text(node: tuple) -> str:
    return str(node[0]) + ".".join(str(i) for i in node[1:])


def _node(text: str) -> tuple:
    head, rest = text[0], text[1:]
    return (head, *(int(i) for i in rest.split(".") if i))


@dataclass(frozen=True)
class Note:
    kind: str
    cursor: Cursor | None = None
    target: tuple | None = None  # reads and greps: the search node whose fact the call makes
    n: int | None = None  # attempts: how many repairs the suspect line has
    width: int | None = None  # attempts and undos: the context width of the edit
    word: str | None = None  # submit: fixed or gave_up

    def tag(self) -> str:
        parts = [self.kind]
        if self.target:
            parts.append(node_text(self.target))
        if self.cursor is not None and self.cursor.node:
            parts.append(self.cursor.text() + (f"/{self.n}" if self.n is not None else ""))
        if self.width is not None:
            parts.append(f"w{self.width}")
        if self.word:
            parts.append(self.word)
        return "[" + " ".join(parts) + "]"

    def line(self, prose: str) -> str:
        return f"{prose} {self.tag()}"

    def moved(self, cursor: Cursor) -> Note:
        return replace(self, cursor=cursor)


def parse_note(line: str) -> Note | None:
    """The note a line ends with, or None when it carries none."""
    match = _TAG.search(line.strip())
    if match is None or match["kind"] not in KINDS:
        return None
    cursor = None
    if match["node"]:
        node = _node(match["node"])
        site = (match["path"], int(match["site"])) if match["site"] else None
        cursor = Cursor(node, bool(match["after"]), site, int(match["k"] or 0))
    return Note(match["kind"], cursor, _node(match["target"]) if match["target"] else None, int(match["n"]) if match["n"] else None,
                int(match["width"]) if match["width"] else None, match["word"])
