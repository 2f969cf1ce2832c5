"""Where the scripted repair agent looks for the bug: a fixed order, walked as a tree.

    F               the library frames of the reproduction run's tracebacks, deepest first
      F<k>            one frame: the lines around it (a file view; its one suspect line)
    B               the functions those frames are in
      B<k>            one function: where it is defined (a grep)
        B<k>.0          its body (a file view; branch lines first, nearest the frame first)
    C               the failing tests' own frames
      C<t>            one test, in two passes
        C<t>.1          the names it calls (a file view of the test)
          .<i>            one name: its definitions (a grep)
            .<h>            one definition's body (a file view; suspect lines)
        C<t>.2          the same names again, now for what their bodies call
          .<i>.<h>        one definition: the names its body calls (its file view)
            .<j>            one of them: its definitions (a grep)
              .<h2>           one definition's body (a file view; suspect lines)

Each node's fact is one tool result. `Search.advance` walks from a cursor to the next repair
to try; when the fact it needs is not visible it stops and returns the call that fetches it
again, tagged with the cursor it reached, so the walk resumes there and what was passed is
never walked again. The call's arguments come from the agent's own earlier call for that node
when it can still see it (where it looked), else from the parent node's fact.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from sandbox.suites.localswe.mutate import Mutation, repairs_of_line
from sandbox.suites.localswe.notes import START, Cursor, Note
from sandbox.suites.localswe.recall import Call, Recall, View

WINDOW = 12  # lines around a frame
FUNCTION_LINES = 150  # lines read from a definition on
TEST_LINES = 60  # lines read above a test's failing line
_MAX_WALK = 100_000
_TOP = ("F", "B", "C")
_BRANCH = re.compile(r"^\s*(if|elif|while)\b|[<>=!]=|[<>]| (not )?in | is ")
_LOCATION = re.compile(r"^([\w./-]+\.py):(\d+): ?(?:in (\w+))?")
_DEF = re.compile(r"^\s*(?:async )?def (\w+)\(")
_BOUNDARY = re.compile(r"^(_ _ _|___)")
_HIT = re.compile(r"^([\w./-]+\.py):(\d+):", re.M)
_CALLED = re.compile(r"\b([A-Za-z_]\w*)\s*\(")
_TALLY = re.compile(r"\d+ (passed|failed|errors?)\b|no tests ran")
_NOT_LIBRARY = {"assert", "print", "len", "str", "int", "float", "list", "dict", "set", "tuple", "isinstance",
                "range", "sorted", "type", "repr", "getattr", "hasattr", "super", "raises", "parametrize",
                "approx", "mark", "if", "for", "while", "return", "not", "and", "or", "in", "lambda", "def"}


@dataclass(frozen=True)
class Frame:
    path: str
    line: int
    function: str  # "" when the traceback does not name it


@dataclass(frozen=True)
class Need:
    """A fact that is not visible: the call that fetches it, and the cursor the walk reached."""

    name: str
    args: dict[str, Any]
    note: Note


@dataclass(frozen=True)
class Attempt:
    cursor: Cursor  # its site and k, the number of this repair (1-based)
    n: int  # repairs of the line
    repair: Mutation
    view: View


class _Missing(Exception):
    def __init__(self, need: Need) -> None:
        self.need = need


def is_test_path(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return name.startswith("test_") or name == "conftest.py" or "/tests/" in f"/{path}" or "/test/" in f"/{path}"


def is_test_output(text: str) -> bool:
    """Whether a run_tests result is pytest's report (a tally at the end), not an error."""
    return bool(_TALLY.search(text))


def tests_passed(output: str) -> bool:
    """Whether a pytest run passed: something passed and nothing failed or errored."""
    tail = output.strip().splitlines()[-1:] or [""]
    return " passed" in tail[0] and not re.search(r"\d+ (failed|errors?)\b", tail[0])


def frames_of(output: str) -> list[Frame]:
    """Traceback entries in the repository, in output order, from --tb=short (`in fn`) or --tb=long
    (the function is the first `def` of the entry's source). Frames of Python's own files are left out."""
    frames, first_def = [], ""
    for line in output.splitlines():
        location = _LOCATION.match(line)
        if location:
            if not location[1].startswith("/"):
                frames.append(Frame(location[1], int(location[2]), location[3] or first_def))
            first_def = ""
        elif _BOUNDARY.match(line):
            first_def = ""
        elif not first_def and (found := _DEF.match(line)):
            first_def = found[1]
    return frames


class Search:
    """The walk over the search tree, on the facts visible in `recall`."""

    def __init__(self, recall: Recall, reproduce: dict[str, Any]) -> None:
        self.recall, self.reproduce_args = recall, reproduce

    def advance(self, cursor: Cursor) -> Need | Attempt | None:
        """The next repair to try from `cursor`, the fact to fetch first, or None when all is searched."""
        position = cursor if cursor.node else Cursor(("F",))
        for _ in range(_MAX_WALK):
            try:
                position = self._step(position)
            except _Missing as missing:
                return missing.need
            if position is None or isinstance(position, Attempt):
                return position
        return None

    def opening(self) -> Need | None:
        """Edition 2's first look, before the walk: the failing modules' run, then the failing test's code."""
        try:
            tests = self._tests(START)
            if tests and not self.recall.some_note(lambda n: n.target == ("C", 0, 1)):
                self._view(("C", 0, 1), START)
        except _Missing as missing:
            return missing.need
        return None

    def _step(self, at: Cursor) -> Cursor | Attempt | None:
        node = at.node
        if at.after:
            if len(node) == 1:
                later = _TOP.index(node[0]) + 1
                return Cursor((_TOP[later],)) if later < len(_TOP) else None
            later = [c for c in self._children(node[:-1], at) if c > node[-1]]
            return Cursor(node[:-1] + (later[0],)) if later else Cursor(node[:-1], after=True)
        if _is_leaf(node):
            return self._in_leaf(at)
        children = self._children(node, at)
        return Cursor(node + (children[0],)) if children else Cursor(node, after=True)

    # -- the tree ------------------------------------------------------------------------------

    def _children(self, node: tuple, at: Cursor) -> list[int]:
        kind, depth = node[0], len(node)
        if depth == 1:
            return list(range(len({"F": self._library_frames, "B": self._functions, "C": self._tests}[kind](at))))
        if kind == "B":  # B<k>: one child when the function's definition is found
            return [0] if self._definition(node, at) is not None else []
        if depth == 2:  # C<t>: its two passes
            return [1, 2]
        if depth in (3, 5):  # the names a test (C<t>.p) or a body (C<t>.2.<i>.<h>) calls
            return list(range(len(self._names(node, at))))
        return list(range(len(self._hits(node, at))))  # C<t>.p.<i>, C<t>.2.<i>.<h>.<j>: definitions

    def _library_frames(self, at: Cursor) -> list[Frame]:
        return _unique([f for f in reversed(frames_of(self.reproduction(at))) if not is_test_path(f.path)],
                       lambda f: (f.path, f.line))

    def _functions(self, at: Cursor) -> list[Frame]:
        return _unique([f for f in self._library_frames(at) if f.function], lambda f: (f.path, f.function))

    def _tests(self, at: Cursor) -> list[Frame]:
        return _unique([f for f in frames_of(self.reproduction(at)) if is_test_path(f.path) and f.function],
                       lambda f: (f.path, f.function))

    def _definition(self, node: tuple, at: Cursor) -> int | None:
        """B<k>: the line of the definition of frame k's function (at or above the frame)."""
        frame = self._functions(at)[node[1]]
        starts = [int(n) for n in re.findall(r"^(?:[\w./-]+:)?(\d+):", self._grep(node, at), re.M)]
        return max((n for n in starts if n <= frame.line), default=None)

    def _names(self, node: tuple, at: Cursor) -> list[str]:
        """The names a test calls (down to its failing line), or the names a function's body calls."""
        view, start = self._view(node, at), self._call_args(node, at)["start"]
        if len(node) == 3:
            frame = self._tests(at)[node[1]]
            defs = [n for n, t in view.lines.items() if n <= frame.line and re.match(rf"\s*def {frame.function}\b", t)]
            lines = range(max(defs, default=frame.line), frame.line + 1)
        else:
            lines = _block(view.lines, start)
        return [name for name in _called_names(view.lines.get(n, "") for n in lines) if not name.startswith("test")]

    def _hits(self, node: tuple, at: Cursor) -> list[tuple[str, int]]:
        """The library definitions a grep for a name found; none for a name searched elsewhere."""
        if len(node) == 6 and self._visited(node, "grep", self._call_args(node, at)):
            return []
        return [(p, int(n)) for p, n in _HIT.findall(self._grep(node, at)) if not is_test_path(p)]

    # -- a node's call and its fact ------------------------------------------------------------

    def _call_args(self, node: tuple, at: Cursor) -> dict[str, Any]:
        """The arguments of the call that fetches `node`'s fact: as the agent made it, else derived."""
        own = self.recall.latest_call(lambda c: c.note is not None and c.note.target == node, answered=False)
        return own.args if own is not None else self._derive(node, at)

    def _derive(self, node: tuple, at: Cursor) -> dict[str, Any]:
        kind, depth = node[0], len(node)
        if kind == "F":
            frame = self._library_frames(at)[node[1]]
            return _read(frame.path, frame.line - WINDOW, frame.line + WINDOW)
        if kind == "B":
            frame = self._functions(at)[node[1]]
            if depth == 2:
                return {"pattern": rf"def {frame.function}\(", "path": frame.path}
            start = self._definition(node[:2], at)
            return _read(frame.path, start, start + FUNCTION_LINES)
        if depth == 3:
            frame = self._tests(at)[node[1]]
            return _read(frame.path, frame.line - TEST_LINES, frame.line + 2)
        if depth in (4, 6):  # a name's definitions
            return {"pattern": rf"def {self._names(node[:-1], at)[node[-1]]}\("}
        path, line = self._hits(node[:-1], at)[node[-1]]  # one definition's body
        return _read(path, line, line + FUNCTION_LINES)

    def _view(self, node: tuple, at: Cursor) -> View:
        args = self._call_args(node, at)
        view = self.recall.file_view(args["path"], args["start"], args["end"])
        if view is None:
            raise _Missing(Need("read_file", args, Note("read", at, target=node)))
        return view

    def _grep(self, node: tuple, at: Cursor) -> str:
        args = self._call_args(node, at)
        call = self.recall.latest_call(lambda c: c.same("grep", args))
        if call is None:
            raise _Missing(Need("grep", args, Note("grep", at, target=node)))
        return call.result or ""

    def reproduction(self, at: Cursor) -> str:
        """The output of the latest visible reproduction run (the failing tests, no edit of ours in place)."""
        call = self.recall.latest_call(lambda c: c.note is not None and c.note.kind == "reproduce"
                                       and is_test_output(c.result or ""))
        if call is None:
            raise _Missing(Need("run_tests", self.reproduce_args, Note("reproduce", at)))
        return call.result or ""

    def _visited(self, node: tuple, tool: str, args: dict[str, Any]) -> bool:
        """Whether the same call was made for another node: what it fetches was searched there."""
        return self.recall.latest_call(lambda c: c.same(tool, args) and c.note is not None
                                       and c.note.target not in (None, node), answered=False) is not None

    # -- leaves: suspect lines and their repairs ------------------------------------------------

    def _in_leaf(self, at: Cursor) -> Cursor | Attempt:
        node = at.node
        args = self._call_args(node, at)
        if self._visited(node, "read_file", args):
            return Cursor(node, after=True)
        view = self._view(node, at)
        sites = self._sites(node, args, view, at)
        first = sites.index(at.site) if at.site in sites else 0
        for index in range(first, len(sites)):
            site = sites[index]
            tried = at.k if site == at.site else 0
            if tried == 0 and self._tried_elsewhere(node, site):
                continue
            repairs = repairs_of_line(view.lines.get(site[1], ""), site[0], site[1]) if site[1] in view.lines else []
            if tried < len(repairs):
                self.reproduction(at)  # it repairs with the failure in view
                return Attempt(Cursor(node, False, site, tried + 1), len(repairs), repairs[tried], view)
        return Cursor(node, after=True)

    def _sites(self, node: tuple, args: dict[str, Any], view: View, at: Cursor) -> list[tuple[str, int]]:
        path = args["path"]
        if node[0] == "F":
            return [(path, self._library_frames(at)[node[1]].line)]
        anchor = self._functions(at)[node[1]].line if node[0] == "B" else args["start"]
        body = _block(view.lines, args["start"]) if args["start"] in view.lines else []
        body.sort(key=lambda n: (n != anchor, not _BRANCH.search(view.lines[n]), abs(n - anchor)))
        return [(path, n) for n in body]

    def _tried_elsewhere(self, node: tuple, site: tuple[str, int]) -> bool:
        """Whether every repair of `site` was tried at another place (its last attempt's note is visible)."""
        return self.recall.some_note(lambda n: n.kind == "attempt" and n.cursor is not None
                                     and n.cursor.site == site and n.cursor.node != node and n.cursor.k == n.n)


def _is_leaf(node: tuple) -> bool:
    kind, depth = node[0], len(node)
    return (kind == "F" and depth == 2) or (kind == "B" and depth == 3) or (
        kind == "C" and ((depth == 5 and node[2] == 1) or depth == 7))


def _read(path: str, start: int, end: int) -> dict[str, Any]:
    return {"path": path, "start": max(1, start), "end": end}


def _unique(items: list, key) -> list:
    seen, out = set(), []
    for item in items:
        if key(item) not in seen:
            seen.add(key(item))
            out.append(item)
    return out


def _called_names(lines) -> list[str]:
    names: list[str] = []
    for text in lines:
        for name in _CALLED.findall(text):
            if name not in _NOT_LIBRARY and name not in names:
                names.append(name)
    return names


def _block(lines: dict[int, str], start: int) -> list[int]:
    """Line numbers of the body of the block whose header is at `start` (by indentation)."""
    if start not in lines:
        return []
    indent = len(lines[start]) - len(lines[start].lstrip())
    body = []
    for n in range(start + 1, max(lines) + 1):
        text = lines.get(n)
        if text is None:
            break
        if text.strip() and len(text) - len(text.lstrip()) <= indent:
            break
        if text.strip() and not text.strip().startswith("#"):
            body.append(n)
    return body
