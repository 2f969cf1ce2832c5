"""Half-open ranges [start, end) of token offsets or characters, merged into one canonical form."""
from __future__ import annotations

from collections.abc import Iterable


def merge_ranges(ranges: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """The ranges sorted, with overlapping and adjacent ones joined: equal sets give equal tuples.

    An empty range is kept like any other (joined where it touches one); callers that mean nothing
    by it leave it out first.
    """
    merged: list[list[int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return tuple((start, end) for start, end in merged)
