"""Numbers a search may vary without rewriting text: every number written with a range.

Paths follow the AST's field names, e.g. "rules[0].action.target.keep_last" or "reposition.n",
so they stay stable as long as the policy's structure does.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass, replace
from typing import Literal, Mapping

from policy_dsl import nodes as n
from policy_dsl.errors import PolicyValidationError
from policy_dsl.validator import numbers_with_bounds, validate


@dataclass(frozen=True)
class Tunable:
    path: str
    value: int | float
    lo: int | float
    hi: int | float
    kind: Literal["int", "float"] = "int"  # the language has integers only today


def tunables(ast: n.Policy) -> list[Tunable]:
    """The policy's ranged numbers, in source order."""
    return [Tunable(path, num.value, num.lo, num.hi)  # type: ignore[arg-type]
            for path, num, _, _ in numbers_with_bounds(ast) if num.tunable]


def with_tunables(ast: n.Policy, values: Mapping[str, int | float], filename: str = "<tunables>") -> n.Policy:
    """A copy of `ast` with the given tunables set; raises PolicyError for unknown paths or bad values."""
    known = {t.path: t for t in tunables(ast)}
    for path, value in values.items():
        if path not in known:
            raise PolicyValidationError(f"no tunable number at {path!r}; tunables: {', '.join(known) or 'none'}",
                                        filename=filename)
        t = known[path]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
            raise PolicyValidationError(f"{path}: expected an integer, got {value!r}", filename=filename)
        if not t.lo <= value <= t.hi:
            raise PolicyValidationError(f"{path}: {value} is outside its range {t.lo}..{t.hi}", filename=filename)
    out = _replace_numbers(ast, "", {p: int(v) for p, v in values.items()})
    validate(out, filename)
    return out


def _replace_numbers(node: object, path: str, values: Mapping[str, int]) -> object:
    if isinstance(node, tuple):
        return tuple(_replace_numbers(x, f"{path}[{i}]", values) for i, x in enumerate(node))
    if isinstance(node, n.Num):
        return replace(node, value=values[path]) if path in values else node
    if not is_dataclass(node):
        return node
    changes = {}
    for f in fields(node):
        if f.name == "loc":
            continue
        child = f"{path}.{f.name}" if path else f.name
        new = _replace_numbers(getattr(node, f.name), child, values)
        if new is not getattr(node, f.name):
            changes[f.name] = new
    return replace(node, **changes) if changes else node


def without_ranges(ast: n.Policy) -> n.Policy:
    """A copy of `ast` whose numbers keep their values but lose their ranges.

    A range only tells a search where it may look; `keep last 7 in 1..16` and `keep last 7 in 1..12`
    make the same decisions, and print the same once their ranges are gone.
    """
    return _strip(ast)  # type: ignore[return-value]


def _strip(node: object) -> object:
    if isinstance(node, tuple):
        return tuple(_strip(x) for x in node)
    if isinstance(node, n.Num):
        return replace(node, lo=None, hi=None) if node.tunable else node
    if not is_dataclass(node):
        return node
    changes = {f.name: _strip(getattr(node, f.name)) for f in fields(node) if f.name != "loc"}
    return replace(node, **{k: v for k, v in changes.items() if v is not getattr(node, k)})
