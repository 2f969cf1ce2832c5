"""A plan expanded into per-token work for the engine: forward stages and key re-rotations.

The planner counts; the engine needs slots and positions token by token. The
prompt's unreused part is computed in stages: a new reposition record ends a
stage, because the tokens after it must see keys already re-rotated, and the
re-rotations run before the next stage. Inside a stage, a new drop record
hides columns from the following query rows (a segment mask), so a restore or
a first request with several operations still takes one forward per stage.

Every re-rotation starts from the key's birth slot and birth position, so
repeated repositions never drift.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field

from akv_core.cache.key import DropRecord
from akv_core.cache.kv_cache import Lease
from akv_core.cache.radix import Node


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
    kv_slots: list[int]             # visible slots, the new tokens last
    hidden: tuple[tuple[int, tuple[int, ...]], ...]   # (first query row, kv columns hidden from it on)


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
        self.start_slots = list(view.slots)
        view.columns = list(range(len(view.slots)))
        self.token_ids: list[int] = []
        self.positions: list[int] = []
        self.out_slots: list[int] = []
        self.hidden: list[tuple[int, tuple[int, ...]]] = []

    @property
    def next_column(self) -> int:
        return len(self.start_slots) + len(self.out_slots)

    def build(self) -> Stage:
        return Stage(self.rerotations, self.token_ids, self.positions, self.out_slots,
                     self.start_slots + self.out_slots, tuple(self.hidden))


def _no_rerotations() -> Rerotations:
    return Rerotations([], [], [], [])


def expand(path: list[Node], lease: Lease) -> PromptLayout:
    """Per-token work for `lease` (admitted); `path` is the tree path of its reused prefix."""
    plan = lease.plan
    key, reused, reused_records = plan.key, plan.match.tokens, plan.match.records
    prompt_slots = [slot for node in path if node.record is None for slot in node.slots]
    if len(prompt_slots) != reused:
        raise RuntimeError(f"tree path holds {len(prompt_slots)} slots for {reused} reused tokens")
    prompt_slots += lease.token_slots
    record_nodes = [node for node in path if node.record is not None]
    view = _View()
    stages: list[Stage] = []
    stage: _StageBuilder | None = None
    pending = _no_rerotations()
    position = offset = 0
    n = len(key)
    for index, (end, record) in enumerate([*key.records, (n, None)]):
        stop = min(end, reused)
        if offset < stop:
            view.append(range(offset, stop), prompt_slots[offset:stop], position, 0)
            position += stop - offset
        start = max(offset, reused)
        if start < end:
            if stage is None:
                stage, pending = _StageBuilder(view, pending), _no_rerotations()
            view.append(range(start, end), prompt_slots[start:end], position, stage.next_column)
            stage.token_ids.extend(key.tokens[start:end])
            stage.positions.extend(range(position, position + end - start))
            stage.out_slots.extend(prompt_slots[start:end])
            position += end - start
        offset = end
        if record is None:
            break
        if isinstance(record, DropRecord):
            columns = view.hide(record.hidden)
            if stage is not None and columns:
                stage.hidden.append((len(stage.token_ids), tuple(columns)))
            continue
        is_new = index >= reused_records
        copies = lease.record_slots[index - reused_records] if is_new else record_nodes[index].slots
        _reposition(view, copies, pending if is_new else None)
        position = len(view.slots)
        if is_new and stage is not None:
            stages.append(stage.build())
            stage = None
    if stage is not None:
        stages.append(stage.build())
    return PromptLayout(tuple(stages), view.slots, position)


def _reposition(view: _View, copies: list[int], work: Rerotations | None) -> None:
    """Move the view to positions 0..r-1, taking `copies` in order for keys that move."""
    used = 0
    for j, current in enumerate(view.positions):
        if current == j:
            continue
        dst = copies[used]
        used += 1
        if work is not None:
            work.src.append(view.birth_slots[j])
            work.old_positions.append(view.birth_positions[j])
            work.new_positions.append(j)
            work.dst.append(dst)
        view.slots[j] = dst
        view.positions[j] = j
    if used != len(copies):
        raise RuntimeError(f"a reposition record owns {len(copies)} copies but moves {used} keys")
