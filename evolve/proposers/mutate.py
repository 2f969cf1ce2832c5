"""The mutate proposer: grammar-aware random edits of a front parent, and crossover of two.

Edits: change a number, swap a value for another seen in the same slot (a trigger for a
trigger, a selector clause for a selector clause), add or remove an element of a list
(rules, and/or clauses), and crossover (take one subtree of a second parent at the same
place). Every child is printed, re-parsed and compiled; an invalid or already known child
is discarded and another edit is tried.
"""
from __future__ import annotations

import random
from typing import Any, Callable

from evolve.candidate import Checked, check_policy, unknown_candidate
from evolve.config import MutateProposerConfig
from evolve.context import Candidate, ProposerContext
from evolve.proposers.base import Proposer
from evolve.proposers.tree import Path, donors, replace_field, sequences, set_at, walk
from store.records import Proposal

Edit = Callable[[Any, random.Random, dict], tuple[Any, str] | None]


def change_number(tree: Any, rng: random.Random, _pool: dict) -> tuple[Any, str] | None:
    """Scale one number; a tunable one stays inside its declared range."""
    spots = [(p, v) for p, _s, v in walk(tree) if type(v).__name__ == "Num"]
    if not spots:
        return None
    path, num = rng.choice(spots)
    factor = rng.choice((0.5, 0.75, 1.25, 1.5, 2.0))
    new = max(1, int(round(num.value * factor)))
    if new == num.value:
        new = num.value + 1
    if num.lo is not None and num.hi is not None:
        new = min(max(new, num.lo), num.hi)
    if new == num.value:
        return None
    return set_at(tree, path, replace_field(num, "value", new)), f"number {_show(path)}: {num.value} -> {new}"


def swap_value(tree: Any, rng: random.Random, pool: dict) -> tuple[Any, str] | None:
    spots = [(p, s, v) for p, s, v in walk(tree) if len([d for d in pool.get(s, []) if d != v]) > 0]
    if not spots:
        return None
    path, slot, value = rng.choice(spots)
    new = rng.choice([d for d in pool[slot] if d != value])
    return set_at(tree, path, new), f"swap {slot[0]}.{slot[1]} at {_show(path)}"


def remove_element(tree: Any, rng: random.Random, _pool: dict) -> tuple[Any, str] | None:
    spots = [(p, items) for p, _s, items in sequences(tree) if len(items) >= 2]
    if not spots:
        return None
    path, items = rng.choice(spots)
    i = rng.randrange(len(items))
    return set_at(tree, path, type(items)(items[:i] + items[i + 1:])), f"remove {_show(path)}[{i}]"


def add_element(tree: Any, rng: random.Random, pool: dict) -> tuple[Any, str] | None:
    spots = [(p, s, items) for p, s, items in sequences(tree) if [d for d in pool.get(s, []) if d not in items]]
    if not spots:
        return None
    path, slot, items = rng.choice(spots)
    new = rng.choice([d for d in pool[slot] if d not in items])
    return set_at(tree, path, type(items)(items + (new,))), f"add to {_show(path)}"


EDITS: tuple[Edit, ...] = (change_number, change_number, swap_value, remove_element, add_element)


def crossover(a: Any, b: Any, rng: random.Random) -> tuple[Any, str] | None:
    """Take one subtree of `b` at a place where `a` has a different subtree in the same slot."""
    b_at = {p: (s, v) for p, s, v in walk(b)}
    spots = [(p, b_at[p][1]) for p, s, v in walk(a) if p in b_at and b_at[p][0] == s and b_at[p][1] != v]
    if not spots:
        return None
    shallow = min(len(p) for p, _ in spots)
    path, value = rng.choice([(p, v) for p, v in spots if len(p) <= shallow + 2])
    return set_at(a, path, value), f"crossover at {_show(path)}"


def _show(path: Path) -> str:
    return ".".join(str(s) for s in path) or "(root)"


class MutateProposer(Proposer):
    name = "mutate"

    def __init__(self, config: MutateProposerConfig, library: list[str]) -> None:
        self.config = config
        self.library = library  # canonical texts of the built-ins: the donor pool's base

    def ask(self, context: ProposerContext) -> Proposal:
        rng = context.rng
        trees = [check_policy(t).ast for t in self.library] + [check_policy(c.text).ast for c in context.population]
        pool = donors(trees)
        last_error = "no edit applied"
        for _ in range(self.config.attempts):
            parents, child, notes = self._child(context, pool, rng)
            if child is None:
                continue
            checked = unknown_candidate(child, context.known_hashes, context.known_structures)
            if isinstance(checked, str):
                last_error = checked
                continue
            return self._proposal(parents, checked, notes)
        parent = context.pick_parent()
        return Proposal(self.name, raw_text=None, parent_ids=(parent.policy_id,), generation=parent.generation + 1,
                        rejection_reason=f"mutate: no new valid child after {self.config.attempts} tries "
                        f"({last_error})")

    def _child(self, context: ProposerContext, pool: dict, rng: random.Random):
        if rng.random() < self.config.crossover_rate and len(context.population) >= 2:
            a, b = context.pick_two()
            if a.policy_id != b.policy_id:
                made = crossover(check_policy(a.text).ast, check_policy(b.text).ast, rng)
                return (a, b), (made[0] if made else None), ([made[1]] if made else [])
        parent = context.pick_parent()
        tree, notes = check_policy(parent.text).ast, []
        for _ in range(rng.randint(1, self.config.max_edits)):
            made = rng.choice(EDITS)(tree, rng, pool)
            if made is not None:
                tree, note = made
                notes.append(note)
        return (parent,), (tree if notes else None), notes

    def _proposal(self, parents: tuple[Candidate, ...], checked: Checked, notes: list[str]) -> Proposal:
        return Proposal(
            self.name, raw_text=checked.text, parent_ids=tuple(dict.fromkeys(p.policy_id for p in parents)),
            generation=max(p.generation for p in parents) + 1, text=checked.text, hash=checked.hash,
            meta={"edits": notes},
        )
