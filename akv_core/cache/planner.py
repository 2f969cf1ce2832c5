"""The request planner: what of a key is reused, what must be computed, and the usage it reports.

Positions and visibility follow from the key alone. Walking it keeps the
visible tokens as a few runs `[start, end, position]` (one or two per message),
never one entry per token, so planning costs O(messages x records) after the
radix match; the replay simulator plans ten thousand requests a second this way.

Rules along a key: a token gets the next position; a drop record hides its
ranges; a reposition record moves the visible tokens to 0..r-1 and later tokens
continue from r. A reused key token is `cached` if visible at the end and not
moved by a reposition record this request adds, `repos` if visible and moved,
`drop_skipped` if hidden at the end; every computed token is `prefilled`.
"""
from __future__ import annotations

from dataclasses import dataclass

from akv_core.cache.key import CacheKey, DropRecord
from akv_core.cache.radix import Match, RadixCache
from akv_core.cache.usage import Usage


@dataclass(frozen=True)
class Plan:
    """A request against the current tree: the reused prefix and the work left to do."""

    key: CacheKey
    match: Match
    copies: tuple[int, ...]   # per record not reused (key records [match.records:]): re-rotated keys it needs
    usage: Usage              # prompt classes; completion filled in at the end
    end_position: int         # position of the first generated token
    visible_tokens: int       # prompt tokens visible at the end

    @property
    def compute_tokens(self) -> int:
        return len(self.key) - self.match.tokens

    @property
    def slots_needed(self) -> int:
        """New slots for the prompt: computed tokens plus re-rotated copies."""
        return self.compute_tokens + sum(self.copies)


def plan_request(tree: RadixCache, key: CacheKey) -> Plan:
    """Match `key` and account for it. The last prompt token is always computed: its logits start decoding."""
    n = len(key)
    if n == 0:
        raise ValueError("an empty prompt cannot be planned")
    match = _match_without_needed_holes(tree, key, tree.match(key, n - 1))
    reused = match.tokens
    runs: list[list[int]] = []     # visible runs [start, end, position], in offset order
    moved: list[tuple[int, int]] = []
    copies: list[int] = []
    position = offset = 0
    for index, (record_offset, record) in enumerate(key.records):
        position = _append(runs, offset, record_offset, position)
        offset = record_offset
        is_new = index >= match.records
        if isinstance(record, DropRecord):
            runs = _hide(runs, record.hidden)
            if is_new:
                copies.append(0)
            continue
        count, position = _reposition(runs, reused if is_new else 0, moved)
        if is_new:
            copies.append(count)
    position = _append(runs, offset, n, position)
    visible = sum(end - start for start, end, _ in runs)
    visible_reused = sum(min(end, reused) - start for start, end, _ in runs if start < reused)
    repos = _overlap(runs, _merge(moved), reused)
    usage = Usage.of_prompt(prefilled=n - reused, cached=visible_reused - repos, repos=repos,
                            drop_skipped=reused - visible_reused)
    return Plan(key, match, tuple(copies), usage, position, visible)


def _match_without_needed_holes(tree: RadixCache, key: CacheKey, match: Match) -> Match:
    """Shorten the match to end before the first hole (freed dropped KV) that is visible where it ends.

    A hole hidden at the match point is never read again by this request; a
    visible one must be recomputed, and so must everything after it.
    """
    while tree.holes:
        hole = tree.first_hole(match.node, _visible_runs(key, match.tokens, match.records))
        if hole is None:
            break
        match = tree.match(key, hole)
    return match


def _visible_runs(key: CacheKey, tokens: int, records: int) -> list[list[int]]:
    """The visible runs after key tokens [0, tokens) and records [0, records)."""
    runs: list[list[int]] = []
    position = offset = 0
    for record_offset, record in key.records[:records]:
        position = _append(runs, offset, record_offset, position)
        offset = record_offset
        if isinstance(record, DropRecord):
            runs = _hide(runs, record.hidden)
        else:
            _, position = _reposition(runs, 0, [])
    _append(runs, offset, tokens, position)
    return runs


def _append(runs: list[list[int]], start: int, end: int, position: int) -> int:
    """Append tokens [start, end) at `position`; returns the next position."""
    if end <= start:
        return position
    last = runs[-1] if runs else None
    if last is not None and last[1] == start and last[2] + (last[1] - last[0]) == position:
        last[1] = end
    else:
        runs.append([start, end, position])
    return position + end - start


def _hide(runs: list[list[int]], hidden: tuple[tuple[int, int], ...]) -> list[list[int]]:
    """The runs minus the hidden ranges (both sorted by offset)."""
    kept: list[list[int]] = []
    for start, end, position in runs:
        for hide_start, hide_end in hidden:
            if hide_end <= start or hide_start >= end:
                continue
            if hide_start > start:
                kept.append([start, hide_start, position])
            if hide_end >= end:
                start = end
                break
            position += hide_end - start
            start = hide_end
        if start < end:
            kept.append([start, end, position])
    return kept


def _reposition(runs: list[list[int]], reused: int, moved: list[tuple[int, int]]) -> tuple[int, int]:
    """Compact the runs to 0..r-1 in place; returns (keys whose position changed, r).

    Reused tokens (offsets below `reused`) that move are recorded in `moved`.
    """
    changed = position = 0
    for run in runs:
        start, end = run[0], run[1]
        if run[2] != position:
            changed += end - start
            if start < reused:
                moved.append((start, min(end, reused)))
            run[2] = position
        position += end - start
    return changed, position


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[list[int]] = []
    for start, end in sorted(ranges):
        if merged and merged[-1][1] >= start:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def _overlap(runs: list[list[int]], ranges: list[tuple[int, int]], limit: int) -> int:
    """Tokens below `limit` that lie both in a run and in one of `ranges` (both sorted)."""
    total, j = 0, 0
    for start, end, _ in runs:
        end = min(end, limit)
        while j < len(ranges) and ranges[j][1] <= start:
            j += 1
        k = j
        while k < len(ranges) and ranges[k][0] < end:
            total += max(0, min(end, ranges[k][1]) - max(start, ranges[k][0]))
            k += 1
    return total
