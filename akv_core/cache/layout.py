"""A plan expanded into per-token work for the engine: forward stages and key re-rotations.

The planner counts; the engine needs slots and positions token by token. The
prompt's unreused part is computed in stages: a new reposition record ends a
stage, because the tokens after it must see keys already re-rotated, and the
re-rotations run before the next stage. Inside a stage, a new drop record
hides columns from the following query rows (a segment mask), so a restore or
a first request with several operations still takes one forward per stage.

Restored holes (freed KV the request reads) are computed in the stage of their
place in the key, between reused tokens, which join the stage as context
columns: each query row sees the columns before its own, minus hidden ones. A
reused reposition record that moves keys ends an open stage too, and a restored
copy is re-rotated before the next stage, from its birth slot.

A re-rotation starts from the key's birth slot and birth position while the
tree keeps them, so repeated repositions do not drift. Once the key's birth
slot was freed (the tree keeps only the copy the path reads), it starts from
that copy: one more un-rotate / rotate pair in fp32 per reposition.
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field

from akv_core.cache.key import DropRecord
from akv_core.cache.kv_cache import Lease
from akv_core.cache.radix import HOLE, Node


@dataclass(frozen=True)
class Rerotations:
    """Write key `src` (rotated at `old_positions`) re-rotated to `new_positions` into `dst` (values copied)."""

    src: list[int]
    old_positions: list[int]
    new_positions: list[int]
    dst: list[int]


@dataclass(frozen=True)
class Stage:
    """One forward for one request: new tokens, their slots, and what each may see."""

    rerotations: Rerotations        # to run before the forward (possibly empty)
    token_ids: list[int]
    positions: list[int]
    out_slots: list[int]
    kv_slots: list[int]             # visible slots, in key order
    hidden: tuple[tuple[int, tuple[int, ...]], ...]   # (first query row, kv columns hidden from it on)
    query_columns: list[int]        # each new token's own column in kv_slots; it sees the columns up to it

    @property
    def queries_last(self) -> bool:
        """The new tokens are the last columns (the usual causal layout, no mask needed without drops)."""
        q, k = len(self.token_ids), len(self.kv_slots)
        return q == 0 or (self.query_columns[0] == k - q and self.query_columns[-1] == k - 1)

    def rows(self, start: int, stop: int) -> Stage:
        """Query rows [start, stop) as a forward of their own (a chunk of a chunked prefill).

        A row sees exactly what it sees in the whole stage: the columns up to its own, minus
        the ones hidden from it. The earlier rows' keys are read from their slots, written by
        the forwards of the earlier chunks; the re-rotations go with the first chunk.
        """
        if start == 0 and stop == len(self.token_ids):
            return self
        if not 0 <= start < stop <= len(self.token_ids):
            raise ValueError(f"rows [{start}, {stop}) of a stage of {len(self.token_ids)} tokens")
        columns = self.query_columns[start:stop]
        width = columns[-1] + 1
        hidden = tuple((max(row - start, 0), tuple(c for c in hidden if c < width))
                       for row, hidden in self.hidden if row < stop)
        return Stage(self.rerotations if start == 0 else _no_rerotations(), self.token_ids[start:stop],
                     self.positions[start:stop], self.out_slots[start:stop], self.kv_slots[:width],
                     tuple(entry for entry in hidden if entry[1]), columns)


@dataclass(frozen=True)
class PromptLayout:
    stages: tuple[Stage, ...]
    view_slots: list[int]           # slots visible to the first generated token, in order
    end_position: int


@dataclass
class _View:
    """The visible keys so far, one entry per token."""

    offsets: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    birth_slots: list[int] = field(default_factory=list)
    birth_positions: list[int] = field(default_factory=list)
    columns: list[int] = field(default_factory=list)   # column in the open stage's kv_slots

    def append(self, offsets: range, slots: list[int], first_position: int, first_column: int) -> None:
        positions = range(first_position, first_position + len(offsets))
        self.offsets.extend(offsets)
        self.slots.extend(slots)
        self.positions.extend(positions)
        self.birth_slots.extend(slots)
        self.birth_positions.extend(positions)
        self.columns.extend(range(first_column, first_column + len(offsets)))

    def hide(self, hidden: tuple[tuple[int, int], ...]) -> list[int]:
        """Remove hidden offsets; returns the removed entries' columns."""
        starts = [start for start, _ in hidden]
        keep = []
        for offset in self.offsets:
            i = bisect_right(starts, offset) - 1
            keep.append(i < 0 or offset >= hidden[i][1])
        removed = [c for c, k in zip(self.columns, keep) if not k]
        for name in ("offsets", "slots", "positions", "birth_slots", "birth_positions", "columns"):
            setattr(self, name, [v for v, k in zip(getattr(self, name), keep) if k])
        return removed


class _StageBuilder:
    def __init__(self, view: _View, rerotations: Rerotations) -> None:
        self.rerotations = rerotations
        self.kv_slots = list(view.slots)
        view.columns = list(range(len(view.slots)))
        self.token_ids: list[int] = []
        self.positions: list[int] = []
        self.out_slots: list[int] = []
        self.query_columns: list[int] = []
        self.hidden: list[tuple[int, tuple[int, ...]]] = []

    @property
    def next_column(self) -> int:
        return len(self.kv_slots)

    def add_context(self, slots: list[int]) -> None:
        """Reused keys after the stage opened: visible to the query rows after them."""
        self.kv_slots.extend(slots)

    def add_queries(self, token_ids: tuple[int, ...], positions: range, slots: list[int]) -> None:
        self.query_columns.extend(range(self.next_column, self.next_column + len(slots)))
        self.token_ids.extend(token_ids)
        self.positions.extend(positions)
        self.out_slots.extend(slots)
        self.kv_slots.extend(slots)

    def build(self) -> Stage:
        kv_slots = self.kv_slots[:self.query_columns[-1] + 1]   # columns after the last query are never read
        hidden = tuple((row, tuple(c for c in columns if c < len(kv_slots))) for row, columns in self.hidden)
        hidden = tuple(entry for entry in hidden if entry[1])
        kv_slots = _stand_in_for_freed(kv_slots, hidden, self.query_columns, self.out_slots[0])
        return Stage(self.rerotations, self.token_ids, self.positions, self.out_slots, kv_slots,
                     hidden, self.query_columns)


def _stand_in_for_freed(kv_slots: list[int], hidden: tuple[tuple[int, tuple[int, ...]], ...],
                        query_columns: list[int], stand_in: int) -> list[int]:
    """`kv_slots` with each freed (HOLE) column, which no query row may read, given a real slot.

    A reused key whose KV was freed joins a stage as a context column when the stage is open
    around it (a restored hole or a message dropped at its own trigger before it) and is hidden
    from every query row that reaches it; the attention still gathers every column before
    masking, so the column needs a slot it can read (any: the mask zeroes it). A freed column
    that some row would read is a planning error.
    """
    if HOLE not in kv_slots:
        return kv_slots
    first_hidden: dict[int, int] = {}   # column -> first query row it is hidden from
    for row, columns in hidden:
        for column in columns:
            first_hidden.setdefault(column, row)
    filled = list(kv_slots)
    for column, slot in enumerate(kv_slots):
        if slot != HOLE:
            continue
        first_reader = bisect_left(query_columns, column)   # rows before it do not reach the column
        if first_reader < len(query_columns) and first_hidden.get(column, len(query_columns)) > first_reader:
            raise RuntimeError(f"stage column {column} is freed KV that query row {first_reader} reads")
        filled[column] = stand_in
    return filled


def _no_rerotations() -> Rerotations:
    return Rerotations([], [], [], [])


def expand(path: list[Node], lease: Lease) -> PromptLayout:
    """Per-token work for `lease` (admitted); `path` is the tree path of its reused prefix."""
    plan = lease.plan
    key, reused, reused_records = plan.key, plan.match.tokens, plan.match.records
    prompt_slots = [slot for node in path if node.record is None for slot in node.slots]
    if len(prompt_slots) != reused:
        raise RuntimeError(f"tree path holds {len(prompt_slots)} slots for {reused} reused tokens")
    holes = plan.restore.token_holes
    for offset, slot in zip(holes, lease.hole_slots):
        prompt_slots[offset] = slot
    prompt_slots += lease.token_slots
    record_copies = [node.slots for node in path if node.record is not None]
    restored_copies: dict[int, set[int]] = {}
    for (index, copy), slot in zip(plan.restore.copy_holes, lease.copy_hole_slots):
        if index not in restored_copies:
            record_copies[index] = list(record_copies[index])
            restored_copies[index] = set()
        record_copies[index][copy] = slot
        restored_copies[index].add(copy)
    view = _View()
    stages: list[Stage] = []
    stage: _StageBuilder | None = None
    pending = _no_rerotations()
    position = offset = 0
    for index, (end, record) in enumerate([*key.records, (len(key), None)]):
        for start, stop, computed in _pieces(offset, end, reused, holes):
            slots = prompt_slots[start:stop]
            if not computed:
                view.append(range(start, stop), slots, position, stage.next_column if stage else 0)
                if stage is not None:
                    stage.add_context(slots)
            else:
                if stage is None:
                    stage, pending = _StageBuilder(view, _last_write_wins(pending)), _no_rerotations()
                view.append(range(start, stop), slots, position, stage.next_column)
                stage.add_queries(key.tokens[start:stop], range(position, position + stop - start), slots)
            position += stop - start
        offset = end
        if record is None:
            break
        if isinstance(record, DropRecord):
            columns = view.hide(record.hidden)
            if stage is not None and columns:
                stage.hidden.append((len(stage.token_ids), tuple(columns)))
            continue
        is_new = index >= reused_records
        copies = lease.record_slots[index - reused_records] if is_new else record_copies[index]
        redo = None if is_new else restored_copies.get(index, set())
        moved = _reposition(view, copies, pending, redo)
        position = len(view.slots)
        if stage is not None and (is_new or moved):
            stages.append(stage.build())
            stage = None
    if stage is not None:
        stages.append(stage.build())
    return PromptLayout(tuple(stages), view.slots, position)


def _last_write_wins(work: Rerotations) -> Rerotations:
    """One write per destination: a recycled copy slot written twice in one batch keeps the later copy."""
    if len(set(work.dst)) == len(work.dst):
        return work
    last = {dst: i for i, dst in enumerate(work.dst)}
    keep = [i for i, dst in enumerate(work.dst) if last[dst] == i]
    return Rerotations(*([getattr(work, name)[i] for i in keep] for name in ("src", "old_positions",
                                                                             "new_positions", "dst")))


def _pieces(offset: int, end: int, reused: int, holes: tuple[int, ...]) -> list[tuple[int, int, bool]]:
    """Key tokens [offset, end) as runs (start, stop, computed): reused ones, restored holes, the suffix."""
    pieces = []
    lo, hi = bisect_left(holes, offset), bisect_left(holes, min(end, reused))
    cursor = offset
    for hole in holes[lo:hi]:
        if pieces and pieces[-1][2] and pieces[-1][1] == hole:
            pieces[-1] = (pieces[-1][0], hole + 1, True)
        else:
            if cursor < hole:
                pieces.append((cursor, hole, False))
            pieces.append((hole, hole + 1, True))
        cursor = hole + 1
    if cursor < min(end, reused):
        pieces.append((cursor, min(end, reused), False))
    if max(offset, reused) < end:
        pieces.append((max(offset, reused), end, True))
    return pieces


def _source(view: _View, j: int, work: Rerotations, written: dict[int, int]) -> tuple[int, int]:
    """Slot and position to re-rotate view key `j` from: its birth slot, or its copy once that was freed.

    A copy this batch writes is read from where it is written from: the batch gathers
    every source before it writes any destination.
    """
    if view.birth_slots[j] != HOLE:
        return view.birth_slots[j], view.birth_positions[j]
    slot, position = view.slots[j], view.positions[j]
    if slot == HOLE:
        raise RuntimeError(f"key {view.offsets[j]} has neither its birth slot nor a copy to re-rotate from")
    i = written.get(slot)
    return (slot, position) if i is None else (work.src[i], work.old_positions[i])


def _reposition(view: _View, copies: list[int], work: Rerotations, redo: set[int] | None) -> int:
    """Move the view to positions 0..r-1, taking `copies` in order for keys that move; returns how many.

    `redo` None: a new record, every copy is re-rotated into its slot (`work`); else a reused
    record, and only the restored copies in `redo` are.
    """
    used = 0
    written = {dst: i for i, dst in enumerate(work.dst)}   # copies this batch writes, before this record
    for j, current in enumerate(view.positions):
        if current == j:
            continue
        dst = copies[used]
        if redo is None or used in redo:
            src, old = _source(view, j, work, written)
            work.src.append(src)
            work.old_positions.append(old)
            work.new_positions.append(j)
            work.dst.append(dst)
        used += 1
        view.slots[j] = dst
        view.positions[j] = j
    if used != len(copies):
        raise RuntimeError(f"a reposition record owns {len(copies)} copies but moves {used} keys")
    return used
