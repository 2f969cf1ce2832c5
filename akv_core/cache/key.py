"""A request's cache key: its prompt token ids with the operation records between them.

Two requests can hold the same tokens in different cache states (one dropped a
message, one did not), so plain prefix matching could reuse the wrong state.
The key inserts a record right after the last token of each trigger message:
first a drop record (the absolute token ranges it hides), then a reposition
record. Records take part in matching like tokens but hold no KV of their own.

A drop record hides whole messages (`drop_message`) or, under `thinking_drop`,
the rendered reasoning of the message it follows: every message with a
reasoning span and at least one message after it gets a record right after
itself, so its own content was computed seeing its reasoning and nothing
later does. A text drop (`text_drop`, `keep_text_drop`) hides, right after its
trigger, the tokens wholly inside the cut characters of message contents (whole
messages where a cut says so), mapped through the renderer's provenance.
"""
from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from akv_core.cache.ops import Operations
from akv_core.cache.ranges import merge_ranges


class RenderedPrompt(Protocol):
    """What the cache needs from a rendered history (`akv_core.chat.Rendered` satisfies it)."""

    token_array: array   # the token ids as C ints (typecode "i")
    spans: tuple[tuple[int, int], ...]
    header_start: int
    reasoning_spans: tuple[tuple[int, int] | None, ...]

    def content_tokens(self, index: int, chars: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """Absolute token ranges of message `index` wholly inside characters `chars` of its content."""


@dataclass(frozen=True)
class DropRecord:
    """From here on, the tokens in `hidden` (absolute [start, end) ranges) leave attention."""

    hidden: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class ReposRecord:
    """From here on, the visible tokens sit at positions 0..r-1 (keys re-rotated)."""


REPOS = ReposRecord()
Record = DropRecord | ReposRecord


@dataclass(frozen=True)
class CacheKey:
    """Token ids plus (offset, record) pairs in key order: drop before reposition at one offset.

    The ids are an `array("i")`: the radix tree compares runs of them in C, with no Python
    int per token.
    """

    tokens: array
    records: tuple[tuple[int, Record], ...]

    def __len__(self) -> int:
        return len(self.tokens)


def build_key(rendered: RenderedPrompt, operations: Operations) -> CacheKey:
    """The key of a rendered history under validated operations."""
    tokens = rendered.token_array
    if operations.empty:
        return CacheKey(tokens, ())
    spans = rendered.spans
    records: list[tuple[int, int, Record]] = []  # (offset, order, record); drops sort first
    for trigger, ranges in sorted(_hidden_by_trigger(rendered, operations).items()):
        # merged, empty ones left out: equal hidden token sets give equal records
        hidden = merge_ranges((start, end) for start, end in ranges if start < end)
        if hidden:
            records.append((spans[trigger][1], 0, DropRecord(hidden)))
    for trigger in operations.repositions:
        records.append((spans[trigger][1], 1, REPOS))
    records.sort(key=lambda item: (item[0], item[1]))
    return CacheKey(tokens, tuple((offset, record) for offset, _, record in records))


def _hidden_by_trigger(rendered: RenderedPrompt, operations: Operations) -> dict[int, list[tuple[int, int]]]:
    """Per trigger message, the token ranges it hides: dropped messages and its own reasoning."""
    hidden: dict[int, list[tuple[int, int]]] = {}
    for trigger, dropped in operations.drops:
        hidden.setdefault(trigger, []).extend(rendered.spans[index] for index in dropped)
    if operations.thinking_drop:
        for trigger, reasoning in enumerate(rendered.reasoning_spans[:len(rendered.spans) - 1]):
            if reasoning is not None:
                hidden.setdefault(trigger, []).append(reasoning)
    text_drop = operations.text_drop
    if text_drop is not None:
        cut = hidden.setdefault(text_drop.trigger, [])
        for part in text_drop.cuts:
            if part.whole:
                cut.append(rendered.spans[part.message])
            else:
                cut.extend(rendered.content_tokens(part.message, part.chars))
    return hidden


def shared_prefix(a: CacheKey, b: CacheKey) -> int:
    """How many leading tokens two keys hold in the same state: equal tokens, seen through equal records.

    A record at offset o acts on the tokens from o on, so where the keys' records first differ
    (one has a record the other lacks, or another one) the shared part ends at that offset.
    """
    shared = common_prefix(a.tokens, b.tokens, 0, len(b.tokens))
    for (offset_a, record_a), (offset_b, record_b) in zip(a.records, b.records):
        if min(offset_a, offset_b) >= shared:
            return shared
        if offset_a != offset_b or record_a != record_b:
            return min(offset_a, offset_b)
    extra = a.records[len(b.records):] or b.records[len(a.records):]
    return min(shared, extra[0][0]) if extra else shared


def key_prefix(key: CacheKey, tokens: int) -> CacheKey:
    """The key of the first `tokens` tokens: the records before them, none at or after `tokens`."""
    return CacheKey(key.tokens[:tokens], tuple(item for item in key.records if item[0] < tokens))


def common_prefix(run: array, tokens: array, offset: int, end: int) -> int:
    """Length of the common prefix of `run` and tokens[offset:end], by slice comparisons."""
    m = min(len(run), end - offset)
    if run[:m] == tokens[offset:offset + m]:
        return m
    low, high = 0, m - 1  # run[:low] matches; run[:high + 1] does not
    while low < high:
        mid = (low + high + 1) // 2
        if run[low:mid] == tokens[offset + low:offset + mid]:
            low = mid
        else:
            high = mid - 1
    return low
