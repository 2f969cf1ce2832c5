"""Content coverage: how much of a message's distinctive content later messages say again.

`covered >= P percent` picks a message when at least P percent of its distinctive items (the
paths, identifiers, ids, numbers and quoted phrases of `policy_dsl/reuse.py`) are held by a later
message still visible at the boundary, or by the prompt (the system messages and the user messages
before the first assistant message, which no policy hides). A re-read of the same lines, a re-run
of the same tests, a plan the agent then carried out: what such a message says, a newer one says
again, and a model that reuses any of it can read it there.

An item counts as held by another message when that message's own text yields it as an item too.
That is a little stricter than the whole-token holding of use records (a middle window of a dotted
name is held but is not an item of the holder), so coverage errs towards keeping a message.
"""
from __future__ import annotations

from typing import AbstractSet, Sequence

PROMPT = -1  # a holder no policy hides


class CoverageIndex:
    """The distinctive items of a history's messages, and per item its holders in order.

    Facts about message j at boundary i read holders at or before i only, so a prefix of the
    history decides as the whole does.
    """

    def __init__(self, items: Sequence[frozenset[str]], prompt: AbstractSet[int]) -> None:
        self.items = tuple(items)
        self.holders: dict[str, list[int]] = {}
        for position, held in enumerate(self.items):
            for item in held:
                self.holders.setdefault(item, []).append(PROMPT if position in prompt else position)

    def said_again(self, j: int, i: int, gone: AbstractSet[int]) -> int:
        """How many of message j's items the prompt, or a message after j still visible at boundary i, holds."""
        count = 0
        for item in self.items[j]:
            holders = self.holders[item]
            if holders[0] == PROMPT:
                count += 1
                continue
            for k in reversed(holders):  # ascending, so the latest holders come first here
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
            holders = self.holders[item]
            firsts.append(j if holders[0] == PROMPT else next((k for k in holders if k > j), None))
        return sorted(firsts, key=lambda k: (k is None, k or 0))

    def covered(self, j: int, i: int, gone: AbstractSet[int], share: int) -> bool:
        """Whether at least `share` percent of message j's items are said again (never, without items)."""
        items = len(self.items[j])
        return items > 0 and self.said_again(j, i, gone) * 100 >= share * items
