"""Generic, type-preserving access to the policy AST (frozen dataclasses or pydantic models).

The mutate proposer edits trees through *slots*: a slot is (node class, field name), and
any value ever seen in a slot is a valid value for that slot in any other tree. That makes
edits grammar-aware without hard-coding the grammar: a trigger is swapped only for a
trigger, a selector clause only for a selector clause.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterator

Path = tuple[Any, ...]  # field names and tuple indices from the root
Slot = tuple[str, str]

SKIP_FIELDS = {"loc", "span", "line", "column", "filename", "source"}


def _is_node(value: Any) -> bool:
    return dataclasses.is_dataclass(value) or hasattr(value, "model_fields")


def fields_of(node: Any) -> list[str]:
    if dataclasses.is_dataclass(node):
        names = [f.name for f in dataclasses.fields(node) if f.compare]
    else:
        names = list(type(node).model_fields)
    return [n for n in names if n not in SKIP_FIELDS and type(getattr(node, n)).__name__ != "Loc"]


def replace_field(node: Any, name: str, value: Any) -> Any:
    if dataclasses.is_dataclass(node):
        return dataclasses.replace(node, **{name: value})
    return node.model_copy(update={name: value})


def walk(node: Any, path: Path = ()) -> Iterator[tuple[Path, Slot, Any]]:
    """Every (path, slot, value) under `node`; tuple elements share their field's slot."""
    if not _is_node(node):
        return
    for name in fields_of(node):
        value = getattr(node, name)
        slot = (type(node).__name__, name)
        if isinstance(value, (tuple, list)):
            for i, item in enumerate(value):
                yield path + (name, i), slot, item
                yield from walk(item, path + (name, i))
        else:
            yield path + (name,), slot, value
            yield from walk(value, path + (name,))


def sequences(node: Any, path: Path = ()) -> Iterator[tuple[Path, Slot, tuple]]:
    """Every tuple-valued field (lists of rules, of clauses) with its slot."""
    if not _is_node(node):
        return
    for name in fields_of(node):
        value = getattr(node, name)
        if isinstance(value, (tuple, list)):
            yield path + (name,), (type(node).__name__, name), tuple(value)
            for i, item in enumerate(value):
                yield from sequences(item, path + (name, i))
        else:
            yield from sequences(value, path + (name,))


def get_at(node: Any, path: Path) -> Any:
    for step in path:
        node = node[step] if isinstance(step, int) else getattr(node, step)
    return node


def set_at(node: Any, path: Path, value: Any) -> Any:
    """A copy of the tree with the value at `path` replaced."""
    if not path:
        return value
    step, rest = path[0], path[1:]
    if isinstance(step, int):
        items = list(node)
        items[step] = set_at(items[step], rest, value)
        return type(node)(items)
    return replace_field(node, step, set_at(getattr(node, step), rest, value))


def donors(trees: list[Any]) -> dict[Slot, list[Any]]:
    """Values seen per slot across `trees` (the library and the population)."""
    pool: dict[Slot, list[Any]] = {}
    for tree in trees:
        for _path, slot, value in walk(tree):
            if isinstance(value, bool):
                continue
            bucket = pool.setdefault(slot, [])
            if value not in bucket:
                bucket.append(value)
    return pool
