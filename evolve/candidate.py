"""From proposed text to a canonical, validated candidate (or a rejection with its reason)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from policy_dsl import PolicyError, canonical_hash, compile_policy, format_policy, parse


@dataclass(frozen=True)
class Checked:
    ast: Any
    text: str  # canonical
    hash: str


def check_policy(text: str, filename: str = "candidate.akvp") -> Checked:
    """Parse, validate (by compiling) and canonicalize; raises PolicyError with a location."""
    ast = parse(text, filename=filename)
    compile_policy(ast, name="candidate")
    return Checked(ast, format_policy(ast), canonical_hash(ast))


def check_ast(ast: Any) -> Checked:
    """Round-trip an edited AST through the printer and parser, so every candidate is real text."""
    return check_policy(format_policy(ast))


def rejection(err: PolicyError) -> str:
    return f"invalid policy: {err}"
