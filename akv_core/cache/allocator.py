"""Token slots of the KV pool (page size 1): who may take how many, and the free list.

Every used slot has exactly one owner, either a radix-tree node or a live
request; the allocator only counts. Slots never handed out yet are not listed
(a high-water mark), so a pool of a million slots costs nothing to create.
"""
from __future__ import annotations

import threading

# Slot numbers as int objects, _NUMBERS[i] == i, made once per process and shared by every
# allocator: handing out never-used slots is a list slice, not one new int per slot (the replay
# simulator starts a fresh pool for every task and would otherwise make millions of them).
_NUMBERS: list[int] = []
_GROWING = threading.Lock()


def _numbers(start: int, stop: int, total: int) -> list[int]:
    """The slot numbers [start, stop), for a pool of `total` slots."""
    if stop > len(_NUMBERS):
        with _GROWING:
            if stop > len(_NUMBERS):
                _NUMBERS.extend(range(len(_NUMBERS), max(stop, min(2 * len(_NUMBERS), total))))
    return _NUMBERS[start:stop]


class SlotAllocator:
    """A free list of slot indices in [0, total)."""

    def __init__(self, total: int) -> None:
        if total < 1:
            raise ValueError(f"kv_tokens must be at least 1, got {total}")
        self.total = total
        self._free: list[int] = []   # returned slots, reused last-in first-out
        self._fresh = 0              # slots [fresh, total) were never handed out

    @property
    def free_count(self) -> int:
        return len(self._free) + self.total - self._fresh

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= self.free_count

    def allocate(self, n: int) -> list[int]:
        """`n` slots now owned by the caller; check `can_allocate` first."""
        if not self.can_allocate(n):
            raise RuntimeError(f"allocate({n}) with only {self.free_count} slots free")
        reused = min(n, len(self._free))
        fresh = n - reused
        if not reused:
            slots = _numbers(self._fresh, self._fresh + fresh, self.total)
        else:
            slots = self._free[len(self._free) - reused:]
            del self._free[len(self._free) - reused:]
            if fresh:
                slots += _numbers(self._fresh, self._fresh + fresh, self.total)
        self._fresh += fresh
        return slots

    def free(self, slots: list[int]) -> None:
        """Give slots back; the caller stops owning them."""
        self._free.extend(slots)

    def free_slots(self) -> list[int]:
        """Every free slot (for integrity checks; not for the hot path)."""
        return self._free + list(range(self._fresh, self.total))
