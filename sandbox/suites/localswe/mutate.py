"""Single-line source mutations: the bugs we inject, and the repairs the scripted agent tries.

Mutations are found with `ast` (node positions) but applied as text splices on one line, so
the rest of the file, comments and formatting included, is untouched and a bug is undone by
one exact-text edit. Kinds (SWE-smith style):

- `flip_operator`: `==`/`!=`, `<`/`>=`, `>`/`<=`, `in`/`not in`, `is`/`is not`, `+`/`-`,
  `*`/`/`, `&`/`|`, `<<`/`>>`, `and`/`or` (every flip is its own inverse);
- `invert_condition`: `if c:` -> `if not c:` (and back);
- `off_by_one`: integer indices, slice bounds and `range()` arguments moved by one;
- `remove_statement`: a one-line assignment or call replaced by `pass` (no repair can
  guess the lost line, so the scripted agent cannot fix these);
- `swap_arguments`: the first two positional arguments of a call exchanged.

`bugs_in` lists the injectable bugs of a module; `repairs_of_line` lists the candidate
repairs of one line seen on its own (all the scripted agent may have in view), in both
directions where a bug kind has two (off by one up or down).
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import Iterator

_COMPARE = {"==": "!=", "!=": "==", "<": ">=", ">=": "<", ">": "<=", "<=": ">",
            "in": "not in", "not in": "in", "is": "is not", "is not": "is"}
_BINARY = {"+": "-", "-": "+", "*": "/", "/": "*", "&": "|", "|": "&", "<<": ">>", ">>": "<<"}
_BOOLEAN = {"and": "or", "or": "and"}
_SIMPLE = (ast.Name, ast.Attribute, ast.Call, ast.Subscript, ast.Constant)
_REMOVABLE = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr)


@dataclass(frozen=True)
class Mutation:
    """Line `line` (1-based) of `path` reads `before`; the mutation makes it read `after`."""

    path: str
    line: int
    kind: str
    before: str
    after: str

    def apply(self, source: str) -> str:
        """`source` with the mutation made; ValueError when the line no longer matches."""
        lines = source.splitlines(keepends=True)
        current = lines[self.line - 1] if 0 < self.line <= len(lines) else ""
        if current.rstrip("\r\n") != self.before:
            raise ValueError(f"{self.path}:{self.line} does not read {self.before!r}")
        lines[self.line - 1] = self.after + current[len(self.before):]
        return "".join(lines)


def bugs_in(source: str, path: str) -> list[Mutation]:
    """Every injectable bug of a module, in source order; duplicates removed."""
    return _collect(source, path, repair=False)


# A line seen alone is rarely a whole statement: these wrappers make it parse (a block header
# gets a body, an argument line gets a call around it, an opened bracket gets closed).
_WRAPPERS = (("", ""), ("", " pass"), ("f(", ")"), ("", ")"), ("", "]"), ("", "}"), ("", "): pass"),
             ("f(", ""), ("[", "]"), ("{", "}"), ("x ", ""), ("(x ", ")"), ("(x ", ""), ("if x ", ": pass"),
             ("def f(", "): pass"), ("if (", "): pass"))
_TRAILING_COMMENT = re.compile(r"\s+#[^'\"]*$")


def repairs_of_line(text: str, path: str, line: int) -> list[Mutation]:
    """Candidate repairs of line `line` of `path`, which reads `text`: every single mutation."""
    body = text.lstrip()
    indent = text[:len(text) - len(body)]
    keep, comment = "", ""
    if body.startswith("elif "):
        keep, body = "el", body[2:]  # `elif c:` parses as `if c:`
    if match := _TRAILING_COMMENT.search(body):
        body, comment = body[:match.start()], match.group()
    for pre, post in _WRAPPERS:
        snippet = pre + body + post
        try:
            ast.parse(snippet)
        except SyntaxError:
            continue
        found = []
        for m in _collect(snippet, path, repair=True):
            if m.after.startswith(pre) and m.after.endswith(post):  # the wrapper itself is untouched
                inner = m.after[len(pre):len(m.after) - len(post)]
                found.append(Mutation(path, line, m.kind, text, indent + keep + inner + comment))
        return [m for m in found if m.after != text]
    return []


def _collect(source: str, path: str, repair: bool) -> list[Mutation]:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    lines = source.splitlines()
    docstrings = _docstring_nodes(tree)
    found: dict[tuple[int, str], Mutation] = {}
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) is None:
            continue
        one_line = node.test if isinstance(node, ast.If) else node  # an `if` spans its body
        if one_line.lineno != one_line.end_lineno or one_line.lineno != node.lineno:
            continue
        text = lines[node.lineno - 1].encode()
        for kind, new in _variants(node, text, repair, docstrings):
            after = new.decode()
            if after != text.decode():
                found.setdefault((node.lineno, after), Mutation(path, node.lineno, kind, text.decode(), after))
    return sorted(found.values(), key=lambda m: (m.line, m.kind, m.after))


def _variants(node: ast.AST, line: bytes, repair: bool, docstrings: set[int]) -> Iterator[tuple[str, bytes]]:
    if isinstance(node, ast.Compare) and len(node.ops) == 1:
        yield from _flip(line, node.left, node.comparators[0], _COMPARE)
    elif isinstance(node, ast.BinOp):
        yield from _flip(line, node.left, node.right, _BINARY)
    elif isinstance(node, ast.BoolOp) and len(node.values) == 2:
        yield from _flip(line, node.values[0], node.values[1], _BOOLEAN)
    elif isinstance(node, (ast.If, ast.IfExp)) and node.test.lineno == node.test.end_lineno:
        yield from _invert(line, node.test)
    elif isinstance(node, ast.Subscript):
        yield from _off_by_one_index(line, node.slice, repair)
    elif isinstance(node, ast.Slice):
        for bound in (node.lower, node.upper):
            yield from _off_by_one_bound(line, bound, repair)
    elif isinstance(node, ast.Call):
        if isinstance(node.func, ast.Name) and node.func.id == "range":
            for arg in node.args[:2]:
                yield from _off_by_one_bound(line, arg, repair)
        yield from _swap(line, node)
    if not repair and isinstance(node, _REMOVABLE) and id(node) not in docstrings:
        yield from _remove(line, node)


def _flip(line: bytes, left: ast.AST, right: ast.AST, table: dict[str, str]) -> Iterator[tuple[str, bytes]]:
    between = line[left.end_col_offset:right.col_offset]
    token = between.decode().strip(" ()")
    if token in table and between.count(token.encode()) == 1:
        new = between.replace(token.encode(), table[token].encode())
        yield "flip_operator", line[:left.end_col_offset] + new + line[right.col_offset:]


def _invert(line: bytes, test: ast.AST) -> Iterator[tuple[str, bytes]]:
    start, end = test.col_offset, test.end_col_offset
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = line[test.operand.col_offset:test.operand.end_col_offset]
        prefix, suffix = line[start:test.operand.col_offset], line[test.operand.end_col_offset:end]
        if (prefix, suffix) in ((b"not ", b""), (b"not (", b")")):
            yield "invert_condition", line[:start] + inner + line[end:]
        return
    inner = line[start:end]
    wrapped = b"not " + inner if isinstance(test, _SIMPLE) else b"not (" + inner + b")"
    yield "invert_condition", line[:start] + wrapped + line[end:]


def _int_value(node: ast.AST | None) -> int | None:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _int_value(node.operand)
        return -inner if inner is not None else None
    return None


def _off_by_one_index(line: bytes, index: ast.AST, repair: bool) -> Iterator[tuple[str, bytes]]:
    value = _int_value(index)
    if value is None:
        return
    moves = (1, -1) if repair else ((1,) if value >= 0 else (-1,))  # bugs move away from the end
    for move in moves:
        if (value >= 0) == (value + move >= 0):  # never from the front of a sequence to its back
            yield "off_by_one", _splice(line, index, str(value + move).encode())


def _off_by_one_bound(line: bytes, bound: ast.AST | None, repair: bool) -> Iterator[tuple[str, bytes]]:
    if bound is None:
        return
    value = _int_value(bound)
    text = line[bound.col_offset:bound.end_col_offset]
    if value is not None:
        for move in ((1, -1) if repair else (1,)):
            yield "off_by_one", _splice(line, bound, str(value + move).encode())
    elif repair:
        if (isinstance(bound, ast.BinOp) and isinstance(bound.op, (ast.Add, ast.Sub))
                and _int_value(bound.right) == 1):
            yield "off_by_one", _splice(line, bound, line[bound.left.col_offset:bound.left.end_col_offset])
    elif isinstance(bound, (ast.Name, ast.Attribute, ast.Call)):
        yield "off_by_one", _splice(line, bound, text + b" - 1")
        yield "off_by_one", _splice(line, bound, text + b" + 1")


def _swap(line: bytes, call: ast.Call) -> Iterator[tuple[str, bytes]]:
    if len(call.args) < 2 or any(isinstance(a, ast.Starred) for a in call.args[:2]):
        return
    first, second = call.args[0], call.args[1]
    a = line[first.col_offset:first.end_col_offset]
    b = line[second.col_offset:second.end_col_offset]
    if a != b:
        yield "swap_arguments", (line[:first.col_offset] + b + line[first.end_col_offset:second.col_offset]
                                 + a + line[second.end_col_offset:])


def _remove(line: bytes, statement: ast.stmt) -> Iterator[tuple[str, bytes]]:
    if isinstance(statement, ast.Expr) and not isinstance(statement.value, ast.Call):
        return
    if line.strip() == line[statement.col_offset:statement.end_col_offset].strip():
        yield "remove_statement", line[:statement.col_offset] + b"pass"


def _splice(line: bytes, node: ast.AST, text: bytes) -> bytes:
    return line[:node.col_offset] + text + line[node.end_col_offset:]


def _docstring_nodes(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            found.add(id(body[0]))
    return found
