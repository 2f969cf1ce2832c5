"""A slow, obviously correct reference for the cache tests: one Python step per token.

Shared by the cache tests (it holds no tests itself): synthetic rendered
histories, and the per-token accounting the planner must reproduce.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass

from akv_core.cache.key import CacheKey, DropRecord
from akv_core.cache.radix import HOLE


@dataclass(frozen=True)
class FakeRendered:
    """The fields the cache reads from a rendered history."""

    token_ids: tuple[int, ...]
    spans: tuple[tuple[int, int], ...]
    header_start: int
    reasoning_spans: tuple[tuple[int, int] | None, ...]

    @property
    def token_array(self) -> array:
        return array("i", self.token_ids)


HEADER = (900, 901)


def render(messages: list[tuple[int, ...]], reasoning: dict[int, tuple[int, int]] | None = None) -> FakeRendered:
    """Messages as token tuples; `reasoning` maps a message to its reasoning tokens [start, end) within it."""
    ids: list[int] = []
    spans = []
    reasoning_spans = []
    for index, message in enumerate(messages):
        start = len(ids)
        spans.append((start, start + len(message)))
        inside = (reasoning or {}).get(index)
        reasoning_spans.append(None if inside is None else (start + inside[0], start + inside[1]))
        ids.extend(message)
    header_start = len(ids)
    return FakeRendered(tuple(ids) + HEADER, tuple(spans), header_start, tuple(reasoning_spans))


def items(key: CacheKey) -> list:
    """The key as one flat sequence of tokens and records, in matching order."""
    out: list = []
    records = list(key.records)
    for offset, token in enumerate(key.tokens):
        while records and records[0][0] == offset:
            out.append(("record", records.pop(0)[1]))
        out.append(("token", token))
    return out


def reused_tokens(key: CacheKey, inserted: list[CacheKey]) -> tuple[int, int]:
    """(tokens, records) of the longest prefix of `key` shared with an inserted key, last token excluded."""
    mine = items(key)
    best = 0
    for other in inserted:
        theirs = items(other)
        n = 0
        while n < min(len(mine), len(theirs)) and mine[n] == theirs[n]:
            n += 1
        best = max(best, n)
    tokens = records = 0
    for kind, _ in mine[:best]:
        if kind == "token":
            if tokens == len(key) - 1:
                break
            tokens += 1
        else:
            records += 1
    return tokens, records


def account(key: CacheKey, reused: int, reused_records: int, recomputed: tuple[int, ...] = ()) -> dict[str, int]:
    """Per-token classification of a prompt whose first `reused` tokens, but `recomputed`, come from the cache."""
    position: dict[int, int] = {}
    visible: list[int] = []
    moved: set[int] = set()
    next_position = 0
    records = list(key.records)
    record_index = 0
    for offset in range(len(key) + 1):
        while records and records[0][0] == offset:
            _, record = records.pop(0)
            if isinstance(record, DropRecord):
                visible = [t for t in visible if not any(s <= t < e for s, e in record.hidden)]
            else:
                for new, t in enumerate(visible):
                    if position[t] != new and record_index >= reused_records and t < reused:
                        moved.add(t)
                    position[t] = new
                next_position = len(visible)
            record_index += 1
        if offset < len(key):
            position[offset] = next_position
            next_position += 1
            visible.append(offset)
    end_visible = set(visible)
    from_cache = [t for t in range(reused) if t not in set(recomputed)]
    return {
        "prefilled": len(key) - len(from_cache),
        "cached": sum(1 for t in from_cache if t in end_visible and t not in moved),
        "repos": sum(1 for t in from_cache if t in end_visible and t in moved),
        "drop_skipped": sum(1 for t in from_cache if t not in end_visible),
        "end_position": next_position,
    }


class SymbolicKV:
    """Stands in for the KV tensors: a slot holds (token, position, what the token attended to).

    Executing a layout stage writes, for each new token, a value that depends on
    exactly the (token, position, context) values it may see, as attention does;
    re-rotation rewrites the position only. Two ways of reaching the same cache
    state then hold equal values, and any wrong reuse or wrong mask shows.
    """

    def __init__(self) -> None:
        self.slots: dict[int, tuple[int, int, int]] = {}

    def run_stage(self, stage) -> None:
        # The model gathers every column before masking: a freed slot must never be among them.
        assert HOLE not in stage.kv_slots, "a stage gathers freed KV"
        rot = stage.rerotations
        for src, old, new, dst in zip(rot.src, rot.old_positions, rot.new_positions, rot.dst):
            token, position, context = self.slots[src]
            assert position == old, "re-rotation from a key that is not at its birth position"
            self.slots[dst] = (token, new, context)
        hidden: set[int] = set()
        pending = list(stage.hidden)
        rows = zip(stage.token_ids, stage.positions, stage.out_slots, stage.query_columns)
        for row, (token, position, out, column) in enumerate(rows):
            assert stage.kv_slots[column] == out, "a query's own column is not its slot"
            while pending and pending[0][0] <= row:
                hidden.update(pending.pop(0)[1])
            self.slots[out] = (token, position, 0)   # written before attention, as the model does
            seen = [self.slots[s] for c, s in enumerate(stage.kv_slots[:column + 1]) if c not in hidden]
            self.slots[out] = (token, position, hash(frozenset(seen)))

    def state(self, view_slots: list[int], end_position: int) -> tuple[int, frozenset]:
        """What the first generated token would see."""
        return end_position, frozenset(self.slots[s] for s in view_slots)


def reference_state(key: CacheKey) -> tuple[int, frozenset]:
    """The SymbolicKV state a key must end in, computed token by token from the operation rules."""
    values: dict[int, tuple[int, int, int]] = {}
    visible: list[int] = []
    next_position = 0
    records = list(key.records)
    for offset in range(len(key) + 1):
        while records and records[0][0] == offset:
            _, record = records.pop(0)
            if isinstance(record, DropRecord):
                visible = [t for t in visible if not any(s <= t < e for s, e in record.hidden)]
            else:
                for new, t in enumerate(visible):
                    token, _, context = values[t]
                    values[t] = (token, new, context)
                next_position = len(visible)
        if offset < len(key):
            values[offset] = (key.tokens[offset], next_position, 0)
            visible.append(offset)
            seen = frozenset(values[t] for t in visible)
            values[offset] = (key.tokens[offset], next_position, hash(seen))
            next_position += 1
    return next_position, frozenset(values[t] for t in visible)
