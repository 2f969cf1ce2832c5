"""From proposed text to a canonical, validated candidate (or a rejection with its reason), and how it fared."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from policy_dsl import PolicyError, canonical_hash, compile_policy, format_policy, parse, without_ranges


@dataclass(frozen=True)
class Checked:
    ast: Any
    text: str  # canonical
    hash: str
    structure: str  # hash of the canonical text without tunable ranges (see evolve/dedup.py)


def structure_hash(ast: Any) -> str:
    """The canonical hash once every tunable range is removed: range variants of a policy share it."""
    return canonical_hash(without_ranges(ast))


def check_policy(text: str, filename: str = "candidate.akvp") -> Checked:
    """Parse, validate (by compiling) and canonicalize; raises PolicyError with a location."""
    ast = parse(text, filename=filename)
    compile_policy(ast, name="candidate")
    return Checked(ast, format_policy(ast), canonical_hash(ast), structure_hash(ast))


def check_ast(ast: Any) -> Checked:
    """Round-trip an edited AST through the printer and parser, so every candidate is real text."""
    return check_policy(format_policy(ast))


def unknown_candidate(ast: Any, known_hashes: frozenset[str], known_structures: frozenset[str]) -> Checked | str:
    """An AST a proposer built, as a checked candidate the run does not know yet; else why not
    (the validator's message, or that the run knows it: its text, or its structure without ranges)."""
    try:
        checked = check_ast(ast)  # print, parse and compile: the candidate is real text
    except PolicyError as err:
        return str(err)
    if checked.hash in known_hashes or checked.structure in known_structures:
        return "already known to the run"
    return checked


def rejection(err: PolicyError) -> str:
    return f"invalid policy: {err}"


@dataclass(frozen=True)
class Outcome:
    """How a candidate fared: rejected, duplicate, pruned (subset stage) or evaluated (full train)."""

    status: str
    score: float | None = None
    cost: float | None = None
    reason: str | None = None
