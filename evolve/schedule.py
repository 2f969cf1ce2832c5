"""Which proposer is asked for the next candidate.

`round-robin`: the proposers in turn. `lead`: the first proposer is asked until it is spent
(its last `patience` proposals all failed to reach the whole train split: rejected, duplicate
or pruned), then the others take turns refining what it found. `akv bench evolve` measured why
(docs/evolve.md, "Is the loop worth its budget?"): in turns, reflect's later rules, the ones that
won when it ran alone, were never asked for, because a third of the budget went to it and its
first tries after the first are the pruned ones.

The choice is a function of the stored proposals (proposer and status, in the order proposed),
so a resumed run asks the proposer an uninterrupted run would have asked.
"""
from __future__ import annotations

from collections.abc import Sequence

SCHEDULES = ("lead", "round-robin")
REACHED_TRAIN = "evaluated"  # the status of a proposal scored on the whole train split


def next_proposer(proposers: Sequence[str], history: Sequence[tuple[str, str]], schedule: str = "lead",
                  patience: int = 3) -> str:
    """The proposer to ask next, given the run's proposals so far as (proposer, status), oldest first."""
    if not proposers:
        raise ValueError("proposers: expected at least one proposer")
    if schedule == "round-robin" or len(proposers) == 1:
        return proposers[len(history) % len(proposers)]
    if schedule != "lead":
        raise ValueError(f"schedule: expected one of {', '.join(SCHEDULES)}, got {schedule!r}")
    handover = spent_at(proposers[0], history, patience)
    if handover is None:
        return proposers[0]
    rest = proposers[1:]
    return rest[(len(history) - handover) % len(rest)]


def spent_at(leader: str, history: Sequence[tuple[str, str]], patience: int) -> int | None:
    """How many proposals had been made when `leader` was spent (its `patience`-th failure in a row),
    or None while it is not."""
    failures = 0
    for made, (proposer, status) in enumerate(history, start=1):
        if proposer != leader:
            continue
        failures = 0 if status == REACHED_TRAIN else failures + 1
        if failures >= patience:
            return made
    return None
