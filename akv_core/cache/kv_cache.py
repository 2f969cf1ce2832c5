"""The cache a request talks to: plan, check-then-admit, and release.

One `KVCache` owns the slot allocator and the radix tree. A request's
`Lease` owns the slots it was given until `release` hands them to the tree
(the prompt path) or back to the allocator (decode slots, or everything of a
request cancelled before its prompt was computed). The engine and the replay
simulator call exactly these methods in the same order, which is what makes
their accounting and evictions agree.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from akv_core.cache.allocator import SlotAllocator
from akv_core.cache.key import CacheKey
from akv_core.cache.planner import Plan, map_copies, plan_request
from akv_core.cache.radix import HOLE, RadixCache


class KVCapacityError(ValueError):
    """A request that could never fit the KV pool, even with everything else evicted."""


@dataclass(eq=False)
class Lease:
    """Slots one live request owns, and the tree path it has locked."""

    plan: Plan
    token_slots: list[int]           # prompt tokens [plan.match.tokens, len(key))
    record_slots: list[list[int]]    # per new record: the slot of each re-rotated copy (recycled ones repeat)
    decode_slots: list[int]          # reserved for generated tokens, taken front to back
    hole_slots: list[int] = field(default_factory=list)        # per plan.restore.token_holes
    copy_hole_slots: list[int] = field(default_factory=list)   # per plan.restore.copy_holes
    copy_slots: list[int] = field(default_factory=list)        # the new records' copy slots, each once
    frees_on_release: int = 0   # reused keys its new records move: the tree frees their old KV at release
    decode_used: int = 0
    released: bool = field(default=False)

    def take_decode_slot(self) -> int | None:
        """The next reserved slot for a generated token, or None when the reservation is used up."""
        if self.decode_used >= len(self.decode_slots):
            return None
        self.decode_used += 1
        return self.decode_slots[self.decode_used - 1]


@dataclass(frozen=True)
class PoolStats:
    slots_total: int
    slots_used: int
    slots_free: int
    slots_cached: int       # held by the radix tree (reusable by later requests)
    slots_evictable: int    # ... of which no live request has locked
    slots_evicted: int      # freed by eviction since the start


class KVCache:
    """The allocator plus the operation-aware radix tree, behind a small request contract."""

    def __init__(self, kv_tokens: int) -> None:
        self.allocator = SlotAllocator(kv_tokens)
        self.tree = RadixCache(self.allocator)
        self._leases: set[Lease] = set()

    def plan(self, key: CacheKey, decode_reserve: int = 0) -> Plan:
        """Plan against the tree as it is now; admit (or drop) the plan before anything else changes it.

        Reusing a path is not always smaller: the reused path keeps the copies of its own
        reposition records while the new records add theirs, where a cold plan recycles the
        dead ones. A plan that could never fit beside its reused path is made cold instead.
        """
        plan = plan_request(self.tree, key)
        total = self.allocator.total
        if plan.slots_needed + decode_reserve + self.tree.cached_slots <= total:
            return plan   # the path holds at most what the tree holds: it fits, no walk up the path
        if plan.match.tokens and self._footprint(plan, decode_reserve) > total:
            cold = plan_request(self.tree, key, reuse=False)
            if cold.slots_needed < self._footprint(plan, 0):
                return cold
        return plan

    def _footprint(self, plan: Plan, decode_reserve: int) -> int:
        """Slots the request holds once admitted: its new slots plus the path it reuses."""
        return plan.slots_needed + decode_reserve + self.tree.slots_on_path(plan.match.node)

    def check_fits(self, plan: Plan, decode_reserve: int) -> None:
        """Raise KVCapacityError if the request needs more slots than the whole pool holds."""
        needed = self._footprint(plan, decode_reserve)
        if needed > self.allocator.total:
            raise KVCapacityError(
                f"messages: the prompt ({len(plan.key)} tokens, {sum(plan.copies)} re-rotated keys) plus "
                f"max_tokens ({decode_reserve}) needs {needed} KV slots, the pool has {self.allocator.total}")

    def can_admit(self, plan: Plan, decode_reserve: int) -> bool:
        """Whether `admit` would succeed now (free slots plus what eviction can free).

        A request that fits only by evicting a `sole` record (the only KV of an AKV window:
        restoring it recomputes its whole history) waits instead, when the running requests
        free enough when they end (the keys they move supersede what the tree held for them).
        When they do not, waiting would not help, and the record may go.
        """
        needed = plan.slots_needed + decode_reserve
        free = self.allocator.free_count
        if needed <= free:
            return True
        if needed > free + self.tree.evictable_slots - self.tree.unlocked_slots_on_path(plan.match.node):
            return False
        if not self._leases:
            return True
        cheap = free + self.tree.cheap_evictable_slots(plan.match.node)
        return needed <= cheap or needed > cheap + sum(lease.frees_on_release for lease in self._leases)

    def admit(self, plan: Plan, decode_reserve: int) -> Lease:
        """Lock the reused path, evict if short, and hand the request its slots. Check `can_admit` first."""
        self.tree.lock(plan.match.node)
        needed = plan.slots_needed + decode_reserve
        if needed > self.allocator.free_count + self.tree.evictable_slots:
            self.tree.unlock(plan.match.node)
            raise RuntimeError("admit() without room; call can_admit() first")
        shortfall = needed - self.allocator.free_count
        if shortfall > 0:
            self.tree.evict(shortfall, spare_sole=True)
            if needed > self.allocator.free_count:   # sole records too (see `can_admit`)
                self.tree.evict(needed - self.allocator.free_count)
        slots = self.allocator.allocate(needed)
        cursor = plan.suffix_tokens
        token_slots = slots[:cursor]
        copy_slots = slots[cursor:cursor + plan.copy_slots]
        cursor += plan.copy_slots
        holes = len(plan.restore.token_holes)
        hole_slots = slots[cursor:cursor + holes]
        cursor += holes
        copy_hole_slots = slots[cursor:cursor + len(plan.restore.copy_holes)]
        cursor += len(copy_hole_slots)
        lease = Lease(plan, token_slots, _record_slots(plan, copy_slots), slots[cursor:], hole_slots,
                      copy_hole_slots, copy_slots, sum(hi - lo for lo, hi in plan.walk.moved))
        self._leases.add(lease)
        return lease

    def release(self, lease: Lease, keep_prompt: bool) -> None:
        """End a request: its prompt path goes into the tree (if computed), everything else is freed."""
        if lease.released:
            return
        lease.released = True
        self._leases.discard(lease)
        plan = lease.plan
        end = None
        if keep_prompt:
            record_slots = lease.record_slots
            if plan.copy_ids is not None:   # recycled copies: the tree takes the live ones, the rest is freed
                record_slots, unused = _live_record_slots(plan, lease)
                self.allocator.free(unused)
            end = self.tree.insert(plan.match, plan.key, lease.token_slots, record_slots)
            if plan.restore:
                self.allocator.free(self.tree.fill(plan.match.node, plan.restore.token_holes, lease.hole_slots,
                                                   plan.restore.copy_holes, lease.copy_hole_slots))
        else:
            self.allocator.free(lease.token_slots)
            self.allocator.free(lease.copy_slots)
            self.allocator.free(lease.hole_slots)
            self.allocator.free(lease.copy_hole_slots)
        self.tree.unlock(plan.match.node)
        self.allocator.free(lease.decode_slots)
        if end is not None:   # KV the finished path no longer reads, where nobody running needs it
            self.tree.punch(end, plan.key)
            if plan.key.records:
                self.tree.punch_copies(end, plan.walk.live_copies)
                self.tree.punch_births(end, plan.walk.runs)

    def clear(self) -> None:
        """Forget everything cached: the pool and the tree as new. No request may hold a lease."""
        if self._leases:
            raise RuntimeError(f"cannot clear the KV cache while {len(self._leases)} request(s) hold slots")
        self.allocator = SlotAllocator(self.allocator.total)
        self.tree = RadixCache(self.allocator)

    def stats(self) -> PoolStats:
        total, free = self.allocator.total, self.allocator.free_count
        return PoolStats(total, total - free, free, self.tree.cached_slots, self.tree.evictable_slots,
                         self.tree.evicted_slots)

    def check_integrity(self) -> None:
        """Every slot has exactly one owner; lock refs equal the live requests' paths. AssertionError if not."""
        leases = list(self._leases)
        owned = [lease.token_slots for lease in leases] + [lease.decode_slots for lease in leases]
        owned += [lease.hole_slots for lease in leases] + [lease.copy_hole_slots for lease in leases]
        owned += [lease.copy_slots for lease in leases]
        self.tree.check_integrity([lease.plan.match.node for lease in leases], owned)


def _record_slots(plan: Plan, copy_slots: list[int]) -> list[list[int]]:
    """Per new record, the slot of each copy: consecutive, or by recycled id ranges."""
    if plan.copy_ids is not None:
        out = []
        for pieces in plan.copy_ids:
            slots: list[int] = []
            for a, b, first in pieces:
                slots += copy_slots[first:first + b - a]
            out.append(slots)
        return out
    out, cursor = [], 0
    for count in plan.copies:
        out.append(copy_slots[cursor:cursor + count])
        cursor += count
    return out


def _live_record_slots(plan: Plan, lease: Lease) -> tuple[list[list[int]], list[int]]:
    """The copies the key's end state reads keep their slots, the dead ones become holes; and the slots
    no live copy holds (to free)."""
    out, live_ids = [], []
    for offset, (slots, pieces) in enumerate(zip(lease.record_slots, plan.copy_ids)):
        live = [HOLE] * len(slots)
        for lo, hi in plan.walk.live_copies(plan.match.records + offset) if slots else ():
            live[lo:hi] = slots[lo:hi]
            live_ids.extend(map_copies(pieces, lo, hi))
        out.append(live)
    unused, cursor = [], 0
    for lo, hi in sorted(live_ids) + [(plan.copy_slots, plan.copy_slots)]:
        unused.extend(lease.copy_slots[cursor:lo])
        cursor = max(cursor, hi)
    return out, unused
