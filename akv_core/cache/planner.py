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

`HOLE`s on the reused path (dropped keys, superseded copies, and birth slots of
keys read through a copy) cost nothing unless this request reads them. A hole
whose KV the tree retained is made live again (the plan's `Revive`: no work).
What it reads of the freed ones is restored alone, not everything after it: a
freed birth slot is recomputed (with the holes its own computation reads,
transitively), a freed re-rotated copy is re-rotated again from its birth slot
(recomputed first if it was freed too). That set is the plan's `Restore`.
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

from akv_core.cache.key import CacheKey, DropRecord
from akv_core.cache.radix import HOLE, Match, Node, RadixCache
from akv_core.cache.ranges import merge_ranges
from akv_core.cache.usage import Usage


@dataclass(frozen=True)
class Restore:
    """Freed KV on the reused path that the request reads, and how it comes back."""

    token_holes: tuple[int, ...] = ()                  # key offsets whose birth slot is recomputed, sorted
    copy_holes: tuple[tuple[int, int], ...] = ()       # (record index, copy index) re-rotated again, sorted

    def __bool__(self) -> bool:
        return bool(self.token_holes or self.copy_holes)


NO_RESTORE = Restore()


@dataclass(frozen=True)
class Revive:
    """Retained KV on the reused path that the request reads: made live again at admission, not recomputed."""

    token_offsets: tuple[int, ...] = ()                # key offsets whose retained birth slot is read, sorted
    copies: tuple[tuple[int, int], ...] = ()           # (record index, copy index) whose retained copy is read
    tokens: int = 0   # distinct key offsets whose KV comes back this way (births and copies): `retained_tokens`

    @property
    def slots(self) -> int:
        return len(self.token_offsets) + len(self.copies)

    def __bool__(self) -> bool:
        return bool(self.token_offsets or self.copies)


NO_REVIVE = Revive()


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
    restore: Restore = NO_RESTORE   # freed KV on the reused path that this request reads
    copy_ids: tuple[Pieces, ...] | None = None   # per new record, its copies' slot ids (recycled; see Pieces)

    @property
    def suffix_tokens(self) -> int:
        """Key tokens after the reused prefix."""
        return len(self.key) - self.match.tokens

    @property
    def compute_tokens(self) -> int:
        """Tokens the forward computes: the suffix plus the recomputed holes."""
        return self.suffix_tokens + len(self.restore.token_holes)

    copy_slots: int = 0       # slots the new records' copies take: fewer than the copies when recycled
    revive: Revive = NO_REVIVE   # retained KV on the reused path that this request reads

    @property
    def slots_needed(self) -> int:
        """New slots for the prompt: computed tokens, re-rotated copies, restored copies."""
        return self.compute_tokens + self.copy_slots + len(self.restore.copy_holes)


def plan_request(tree: RadixCache, key: CacheKey, reuse: bool = True) -> Plan:
    """Match `key` and account for it. The last prompt token is always computed: its logits start decoding.

    `reuse=False` plans the request cold, as if nothing of it were cached.
    """
    n = len(key)
    if n == 0:
        raise ValueError("an empty prompt cannot be planned")
    match = tree.match(key, n - 1) if reuse else Match(tree.root, 0, 0)
    restore, revive = _restore(tree, key, match) if tree.holes and match.tokens else (NO_RESTORE, NO_REVIVE)
    reused = match.tokens
    walk = _walk(key, n, len(key.records), reused, match.records)
    runs = walk.runs
    visible = sum(run[1] - run[0] for run in runs)
    visible_reused = sum(min(run[1], reused) - run[0] for run in runs if run[0] < reused)
    moved = merge_ranges(walk.moved)
    repos = _overlap(runs, moved, reused)
    holes = restore.token_holes
    if holes:   # recomputed: prefilled, whatever they are at the end
        visible_holes = [h for h in holes if _inside(runs, h)]
        visible_reused -= len(visible_holes)
        repos -= sum(1 for h in visible_holes if _inside(moved, h))
    usage = Usage.of_prompt(prefilled=n - reused + len(holes), cached=visible_reused - repos, repos=repos,
                            drop_skipped=reused - len(holes) - visible_reused, retained=revive.tokens)
    copies = tuple(walk.copies)
    copy_ids, copy_slots = None, sum(copies)
    if copy_slots and _new_repositions(key, match.records) > 1:
        copy_ids, copy_slots = _recycled_copy_ids(key, match.records)
    return Plan(key, match, copies, usage, walk.position, visible, walk, restore, copy_ids, copy_slots, revive)


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


def _restore(tree: RadixCache, key: CacheKey, match: Match) -> tuple[Restore, Revive]:
    """The holes on the matched path that the request reads, closed under what recomputing them reads.

    Read at the match point: the birth slot of every visible key that no record moved,
    and the copy of each moved key in the record that moved it (a new reposition
    re-rotates a key from its birth slot, or from that copy once the birth slot was
    freed). A retained hole is revived; a freed one is restored: a recomputed hole reads
    what was visible where it sits, so the holes there join in turn; a restored copy is
    re-rotated from its birth slot, which joins too (revived if retained).
    """
    token_nodes = tree.token_offsets(match.node)
    record_nodes = [node for node in tree.path(match.node) if node.record is not None]
    record_offsets = [offset for offset, _ in key.records]
    found = _Holes(token_nodes)
    frontier = [(match.tokens, match.records)]
    seen_points: set[int] = set()
    while frontier:
        offset, records = frontier.pop()
        walk = _walk(key, offset, records, 0, records)
        births = found.read_births([run for run in walk.runs if run[3] < 0])
        for index in sorted({run[3] for run in walk.runs if run[3] >= 0}):
            if record_nodes[index].holes:
                births += found.read_copies(index, record_nodes[index], walk)
        new = sorted(set(births) - found.token_holes)
        found.token_holes.update(new)
        for start in _segment_starts(new, record_offsets):   # each recomputed run reads what it saw
            if start not in seen_points:
                seen_points.add(start)
                frontier.append((start, bisect_right(record_offsets, start)))
    return found.restore(), found.revive()


class _Holes:
    """What a request reads among the holes of its path: retained entries to revive, freed ones to restore."""

    def __init__(self, token_nodes: list[tuple[int, Node]]) -> None:
        self.token_nodes = token_nodes
        self.starts = [start for start, _ in token_nodes]
        self.token_holes: set[int] = set()
        self.copy_holes: set[tuple[int, int]] = set()
        self.revived_tokens: set[int] = set()
        self.revived_copies: set[tuple[int, int]] = set()
        self.revived_offsets: set[int] = set()   # key offsets whose KV a revived entry holds

    def read_births(self, runs: list[list[int]]) -> list[int]:
        """Key offsets inside `runs` whose birth slot is a hole: retained ones are revived, the freed returned."""
        freed = []
        for start, node in self.token_nodes:
            if not node.holes:
                continue
            end = start + len(node.tokens)
            for run in runs:
                lo, hi = max(start, run[0]) - start, min(end, run[1]) - start
                if lo < hi and HOLE in node.slots[lo:hi]:
                    for i in range(lo, hi):
                        if node.slots[i] == HOLE:
                            self._read_hole(node, i, start + i, freed)
        return freed

    def read_copies(self, index: int, record_node: Node, walk: Walk) -> list[int]:
        """The copies of the path's record `index` that `walk` reads: retained ones are revived, freed ones
        restored; returns the freed birth slots those need."""
        copy_map, slots, freed = walk.copy_maps[index], record_node.slots, []
        for lo, hi in walk.live_copies(index):
            for copy in range(lo, hi):
                if slots[copy] != HOLE or (index, copy) in self.copy_holes:
                    continue
                birth = _copy_birth(copy_map, copy)
                if record_node.is_retained(copy):
                    self.revived_copies.add((index, copy))
                    self.revived_offsets.add(birth)
                    continue
                self.copy_holes.add((index, copy))
                node_start, node = self.token_nodes[bisect_right(self.starts, birth) - 1]
                if node.slots[birth - node_start] == HOLE:
                    self._read_hole(node, birth - node_start, birth, freed)
        return freed

    def _read_hole(self, node: Node, index: int, offset: int, freed: list[int]) -> None:
        if node.is_retained(index):
            self.revived_tokens.add(offset)
            self.revived_offsets.add(offset)
        else:
            freed.append(offset)

    def restore(self) -> Restore:
        return Restore(tuple(sorted(self.token_holes)), tuple(sorted(self.copy_holes)))

    def revive(self) -> Revive:
        if not self.revived_tokens and not self.revived_copies:
            return NO_REVIVE
        return Revive(tuple(sorted(self.revived_tokens)), tuple(sorted(self.revived_copies)), len(self.revived_offsets))


def _copy_birth(copy_map: list[tuple[int, int, int]], copy: int) -> int:
    """The key offset whose re-rotated copy has index `copy` in its record."""
    for first, start, end in copy_map:
        if first <= copy < first + end - start:
            return start + copy - first
    raise ValueError(f"copy {copy} is not in the record's copy map")


def _segment_starts(offsets: list[int], record_offsets: list[int]) -> list[int]:
    """Starts of the runs of consecutive `offsets` (sorted), split where a record sits between two."""
    starts = []
    for i, offset in enumerate(offsets):
        if i == 0 or offsets[i - 1] != offset - 1 or _record_at(record_offsets, offset):
            starts.append(offset)
    return starts


def _record_at(record_offsets: list[int], offset: int) -> bool:
    i = bisect_left(record_offsets, offset)
    return i < len(record_offsets) and record_offsets[i] == offset


def _inside(ranges: Sequence[Sequence[int]], offset: int) -> bool:
    """Whether `offset` lies in one of `ranges` ([start, end, ...], sorted, disjoint)."""
    for run in ranges:
        if run[0] <= offset < run[1]:
            return True
    return False


def _new_repositions(key: CacheKey, first_new: int) -> int:
    return sum(1 for _, record in key.records[first_new:] if not isinstance(record, DropRecord))


Pieces = tuple[tuple[int, int, int], ...]   # (first copy, end copy, first id): copies [a, b) take ids from c


def _recycled_copy_ids(key: CacheKey, first_new: int) -> tuple[tuple[Pieces, ...], int]:
    """Slot ids for the copies of each new record, reusing the ids of copies no longer read; and the ids used.

    A copy a new record made is dead once a later record hides its key or moves it
    again: nothing after that point reads it, and re-rotation always starts from the
    birth slot. Its slot then serves a copy of a later record (the layout runs the
    re-rotations of one batch in key order, so the later write wins), which keeps a
    cold restore of a long drop-and-reposition history near its prompt in slots
    instead of one copy per reposition per key. Live copies keep distinct ids.
    Everything is kept as ranges: a cold history has tens of thousands of copies.
    """
    runs: list[list[int]] = []
    copy_maps: dict[int, list[tuple[int, int, int]]] = {}
    pieces: dict[int, Pieces] = {}
    free: list[tuple[int, int]] = []   # id ranges
    position = offset = fresh = 0
    for index, (record_offset, record) in enumerate(key.records):
        position = _append(runs, offset, record_offset, position)
        offset = record_offset
        if isinstance(record, DropRecord):
            for run in runs:
                if run[3] >= first_new:
                    for lo, hi in record.hidden:
                        free.extend(_ids_of(pieces, copy_maps, run[3], max(lo, run[0]), min(hi, run[1])))
            runs = _hide(runs, record.hidden)
            continue
        moving = 0
        for run in runs:
            if run[2] != moving and run[3] >= first_new:
                free.extend(_ids_of(pieces, copy_maps, run[3], run[0], run[1]))
            moving += run[1] - run[0]
        count, position = _reposition(runs, index, 0, [], copy_maps)
        if index >= first_new:
            pieces[index], fresh = _take_ids(free, count, fresh)
    return tuple(pieces.get(index, ()) for index in range(first_new, len(key.records))), fresh


def _take_ids(free: list[tuple[int, int]], count: int, fresh: int) -> tuple[Pieces, int]:
    """Ids for `count` copies: recycled ranges first, then new ones from `fresh`."""
    out: list[tuple[int, int, int]] = []
    copy = 0
    while copy < count and free:
        lo, hi = free.pop()
        n = min(hi - lo, count - copy)
        if n < hi - lo:
            free.append((lo + n, hi))
        out.append((copy, copy + n, lo))
        copy += n
    if copy < count:
        out.append((copy, count, fresh))
        fresh += count - copy
    return tuple(out), fresh


def _ids_of(pieces: dict[int, Pieces], copy_maps: dict[int, list[tuple[int, int, int]]], record: int,
            start: int, end: int) -> list[tuple[int, int]]:
    """The id ranges of record `record`'s copies of the keys at offsets [start, end)."""
    out: list[tuple[int, int]] = []
    for first, lo, hi in copy_maps.get(record, ()):
        a, b = max(lo, start), min(hi, end)
        if a < b:
            out.extend(map_copies(pieces[record], first + a - lo, first + b - lo))
    return out


def map_copies(pieces: Pieces, lo: int, hi: int) -> list[tuple[int, int]]:
    """The id ranges of copies [lo, hi) of one record."""
    out = []
    for a, b, first_id in pieces:
        x, y = max(a, lo), min(b, hi)
        if x < y:
            out.append((first_id + x - a, first_id + y - a))
    return out


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


def _overlap(runs: list[list[int]], ranges: Sequence[tuple[int, int]], limit: int) -> int:
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
