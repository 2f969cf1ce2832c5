"""Content coverage: how much of a message's distinctive content other messages say again.

`covered >= P percent` picks a message when at least P percent of its distinctive items (the
paths, identifiers, ids, numbers and quoted phrases of `policy_dsl/reuse.py`) are held by a later
message still visible at the boundary, or by a message no policy hides (the leading system
messages and the first user message: the prompt). A re-read of the same lines, a re-run of the
same tests, a plan the agent then carried out: what such a message says, a newer one says again,
and a model that reuses any of it can read it there. A message never covers itself.

An item counts as held by another message when that message's own text yields it as an item too.
That is a little stricter than the whole-token holding of use records (a middle window of a dotted
name is held but is not an item of the holder), so coverage errs towards keeping a message.
"""
from __future__ import annotations

from typing import AbstractSet, Sequence


class CoverageIndex:
    """The distinctive items of a history's messages, per item its holders in order, and the first
    prompt message holding it.

    Facts about message j at boundary i read holders at or before i only, so a prefix of the
    history decides as the whole does.
    """

    def __init__(self, items: Sequence[frozenset[str]], prompt: AbstractSet[int]) -> None:
        self.items = tuple(items)
        self.holders: dict[str, list[int]] = {}
        self.in_prompt: dict[str, int] = {}  # item -> the first prompt message holding it
        for position, held in enumerate(self.items):
            for item in held:
                self.holders.setdefault(item, []).append(position)
                if position in prompt:
                    self.in_prompt.setdefault(item, position)

    def said_again(self, j: int, i: int, gone: AbstractSet[int]) -> int:
        """How many of message j's items another prompt message, or a message after j still visible
        at boundary i, holds (holders after i do not count: they have not been said yet)."""
        count = 0
        for item in self.items[j]:
            first = self.in_prompt.get(item)
            if first is not None and first != j and first <= i:
                count += 1
                continue
            for k in reversed(self.holders[item]):  # ascending, so the latest holders come first here
                if k <= j:
                    break
                if k <= i and k not in gone:
                    count += 1
                    break
        return count

    def first_said_again(self, j: int) -> list[int | None]:
        """Per item of message j, ascending: the first boundary from which it is said again with
        everything visible (j itself for an item the prompt holds; None: never in this history)."""
        firsts = []
        for item in self.items[j]:
            prompt = self.in_prompt.get(item)
            said = prompt is not None and prompt != j
            firsts.append(j if said else next((k for k in self.holders[item] if k > j), None))
        return sorted(firsts, key=lambda k: (k is None, k or 0))

    def covered(self, j: int, i: int, gone: AbstractSet[int], share: int) -> bool:
        """Whether at least `share` percent of message j's items are said again (never, without items)."""
        items = len(self.items[j])
        return items > 0 and self.said_again(j, i, gone) * 100 >= share * items
