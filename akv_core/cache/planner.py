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
from akv_core.cache.radix import HOLE, Match, RadixCache
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
    walk: Walk                # the whole key walked: what the end state reads (for freeing the rest)

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
    walk = _walk(key, n, len(key.records), reused, match.records)
    runs = walk.runs
    visible = sum(run[1] - run[0] for run in runs)
    visible_reused = sum(min(run[1], reused) - run[0] for run in runs if run[0] < reused)
    repos = _overlap(runs, _merge(walk.moved), reused)
    usage = Usage.of_prompt(prefilled=n - reused, cached=visible_reused - repos, repos=repos,
                            drop_skipped=reused - visible_reused)
    return Plan(key, match, tuple(walk.copies), usage, walk.position, visible, walk)


def end_position(key: CacheKey) -> int:
    """The position of the first generated token: follows from the key alone (no tree needed)."""
    return _walk(key, len(key), len(key.records), 0, 0).position


@dataclass
class Walk:
    """A key walked up to some point: the visible runs and where each reposition put its copies."""

    runs: list[list[int]]            # [start, end, position, source]; source: -1 birth slot, else record index
    position: int                    # the next position
    moved: list[tuple[int, int]]     # reused ranges a new reposition record moved
    copies: list[int]                # per new record: re-rotated keys it needs
    copy_maps: dict[int, list[tuple[int, int, int]]]   # reposition record -> (first copy, start, end) per run

    def live_copies(self, record_index: int) -> list[tuple[int, int]]:
        """Copy index ranges of `record_index` that the visible runs still read.

        Runs and the record's copy map are both in key order, so one merge-like pass does.
        """
        live = []
        copy_map = self.copy_maps[record_index]
        first_entry = 0
        for run in self.runs:
            if run[3] != record_index:
                continue
            while first_entry < len(copy_map) and copy_map[first_entry][2] <= run[0]:
                first_entry += 1   # entries ending before this run cannot reach the later runs either
            for first, start, end in copy_map[first_entry:]:
                if start >= run[1]:
                    break
                lo, hi = max(start, run[0]), min(end, run[1])
                if lo < hi:
                    live.append((first + lo - start, first + hi - start))
        return sorted(live)


def _walk(key: CacheKey, tokens: int, records: int, reused: int, first_new: int) -> Walk:
    """Walk key tokens [0, tokens) and records [0, records); records from `first_new` on are new."""
    walk = Walk([], 0, [], [], {})
    offset = 0
    for index, (record_offset, record) in enumerate(key.records[:records]):
        walk.position = _append(walk.runs, offset, record_offset, walk.position)
        offset = record_offset
        is_new = index >= first_new
        if isinstance(record, DropRecord):
            walk.runs = _hide(walk.runs, record.hidden)
            if is_new:
                walk.copies.append(0)
            continue
        count, walk.position = _reposition(walk.runs, index, reused if is_new else 0, walk.moved, walk.copy_maps)
        if is_new:
            walk.copies.append(count)
    walk.position = _append(walk.runs, offset, tokens, walk.position)
    return walk


def _match_without_needed_holes(tree: RadixCache, key: CacheKey, match: Match) -> Match:
    """Shorten the match to end before the first hole (freed KV) that is read where it ends.

    A key is read if it is visible at the match point: its birth slot (re-rotations
    start there) and, if a reposition record moved it, that record's copy. A hole
    hidden at the match point is never read again by this request; a needed one
    is recomputed, and so is everything after it.
    """
    while tree.holes:
        walk = _walk(key, match.tokens, match.records, 0, match.records)
        record = _first_copy_hole(tree, match, walk)
        if record is not None:
            match = tree.match(key, key.records[record][0], record_limit=record)
            continue
        hole = tree.first_hole(match.node, walk.runs)
        if hole is None:
            break
        match = tree.match(key, hole)
    return match


def _first_copy_hole(tree: RadixCache, match: Match, walk: Walk) -> int | None:
    """The first reposition record whose copy of a visible key was freed."""
    record_nodes = [node for node in tree.path(match.node) if node.record is not None]
    for index in sorted({run[3] for run in walk.runs if run[3] >= 0}):
        slots = record_nodes[index].slots
        if record_nodes[index].holes and any(HOLE in slots[lo:hi] for lo, hi in walk.live_copies(index)):
            return index
    return None


def _append(runs: list[list[int]], start: int, end: int, position: int) -> int:
    """Append tokens [start, end) at `position` (in their birth slots); returns the next position."""
    if end <= start:
        return position
    last = runs[-1] if runs else None
    if last is not None and last[1] == start and last[3] == -1 and last[2] + (last[1] - last[0]) == position:
        last[1] = end
    else:
        runs.append([start, end, position, -1])
    return position + end - start


def _hide(runs: list[list[int]], hidden: tuple[tuple[int, int], ...]) -> list[list[int]]:
    """The runs minus the hidden ranges (both sorted by offset, so one merge-like pass does)."""
    kept: list[list[int]] = []
    first = 0
    for start, end, position, source in runs:
        while first < len(hidden) and hidden[first][1] <= start:
            first += 1   # ranges ending before this run cannot reach the later runs either
        for hide_start, hide_end in hidden[first:]:
            if hide_start >= end:
                break
            if hide_start > start:
                kept.append([start, hide_start, position, source])
            if hide_end >= end:
                start = end
                break
            position += hide_end - start
            start = hide_end
        if start < end:
            kept.append([start, end, position, source])
    return kept


def _reposition(runs: list[list[int]], record_index: int, reused: int, moved: list[tuple[int, int]],
                copy_maps: dict[int, list[tuple[int, int, int]]]) -> tuple[int, int]:
    """Compact the runs to 0..r-1 in place; returns (keys whose position changed, r).

    Keys that move get a copy in the record, numbered in run order (`copy_maps`);
    reused tokens (offsets below `reused`) that move are recorded in `moved`.
    """
    changed = position = 0
    copy_map = copy_maps.setdefault(record_index, [])
    for run in runs:
        start, end = run[0], run[1]
        if run[2] != position:
            copy_map.append((changed, start, end))
            changed += end - start
            if start < reused:
                moved.append((start, min(end, reused)))
            run[2], run[3] = position, record_index
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
    for start, end, *_ in runs:
        end = min(end, limit)
        while j < len(ranges) and ranges[j][1] <= start:
            j += 1
        k = j
        while k < len(ranges) and ranges[k][0] < end:
            total += max(0, min(end, ranges[k][1]) - max(start, ranges[k][0]))
            k += 1
    return total
