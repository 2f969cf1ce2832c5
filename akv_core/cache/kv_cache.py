"""The cache a request talks to: plan, check-then-admit, and release.

One `KVCache` owns the slot allocator and the radix tree. A request's
`Lease` owns the slots it was given until `publish` or `release` hands them to
the tree (the prompt path) or back to the allocator (decode slots, or what of a
request cancelled before its prompt was computed it had not published). The
engine and the replay simulator call exactly these methods in the same order
for requests served one after another, which is what makes their accounting
and evictions agree.

Publishing: the engine hands a request's prompt to the tree as soon as its
prefill is done (`publish`), and the part computed so far, step by step, while
another request waits for it (`publish(lease, tokens)`), so that requests
running at once share what they have in common. Published nodes stay locked by
the request until it ends; where another request published the same KV first,
the tree keeps that one and the request keeps reading its own copy, which it
frees when it ends (`Lease.kept_slots`). Decode slots stay private.

Retention: KV a finished path no longer reads stays in the tree as retained
entries (radix.py), evicted before anything else. A plan that reads some
(`Plan.revive`) makes them live again at admission, before any eviction runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from akv_core.cache.allocator import SlotAllocator
from akv_core.cache.key import CacheKey, key_prefix
from akv_core.cache.planner import Plan, map_copies, plan_request
from akv_core.cache.radix import HOLE, Match, Node, RadixCache


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
    published: Match | None = None   # the prefix of the key handed to the tree so far (None: nothing yet)
    complete: bool = False           # the whole prompt is in the tree (restored KV and live copies too)
    kept_slots: list[int] = field(default_factory=list)   # its copies of KV another request published first

    @property
    def node(self) -> Node:
        """The node whose path the request locks: the end of what it reused or published."""
        return (self.published or self.plan.match).node

    @property
    def published_tokens(self) -> int:
        """Key tokens [0, n) that the tree holds for this request (reused or published)."""
        return (self.published or self.plan.match).tokens

    @property
    def publishes_parts(self) -> bool:
        """Whether a part of its prompt can be published before the rest is computed.

        Restored KV and recycled copies are placed only when the whole prompt is done.
        """
        return not self.plan.restore and self.plan.copy_ids is None

    def prompt_slots(self) -> list[list[int]]:
        """The prompt slots it still owns: what it has not published, and its kept copies."""
        if self.complete:
            return [self.kept_slots]
        plan = self.plan
        published = self.published or plan.match
        copies = sum(plan.copies[:published.records - plan.match.records])
        return [self.token_slots[published.tokens - plan.match.tokens:], self.copy_slots[copies:],
                self.hole_slots, self.copy_hole_slots, self.kept_slots]

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
    slots_cached: int       # held by the radix tree (reusable by later requests), retained slots included
    slots_evictable: int    # ... of which eviction may take (no live request has locked them, or retained)
    slots_evicted: int      # freed by eviction since the start (KV a path end still read)
    slots_retained: int = 0           # of the cached slots: KV no path end reads, kept for earlier states
    slots_retained_evicted: int = 0   # retained slots freed by eviction since the start


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
        if plan.slots_needed + decode_reserve + self.tree.cached_slots + plan.revive.slots <= total:
            return plan   # the path holds at most what the tree holds: it fits, no walk up the path
        if plan.match.tokens and self._footprint(plan, decode_reserve) > total:
            cold = plan_request(self.tree, key, reuse=False)
            if cold.slots_needed < self._footprint(plan, 0):
                return cold
        return plan

    def _footprint(self, plan: Plan, decode_reserve: int) -> int:
        """Slots the request holds once admitted: its new slots plus the path it reuses (revived KV included)."""
        return plan.slots_needed + decode_reserve + self.tree.slots_on_path(plan.match.node) + plan.revive.slots

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
        revived = plan.revive.slots   # retained now, held by the request once revived
        if needed > free + self.tree.evictable_slots - self.tree.unlocked_slots_on_path(plan.match.node) - revived:
            return False
        if not self._leases:
            return True
        cheap = free + self.tree.cheap_evictable_slots(plan.match.node) - revived
        return needed <= cheap or needed > cheap + sum(lease.frees_on_release for lease in self._leases)

    def admit(self, plan: Plan, decode_reserve: int) -> Lease:
        """Lock the reused path, revive the retained KV it reads, evict if short, and hand the request its
        slots. Check `can_admit` first."""
        self.tree.lock(plan.match.node)
        if plan.revive:
            self.tree.revive(plan.match.node, plan.revive.token_offsets, plan.revive.copies)
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

    def publish(self, lease: Lease, tokens: int | None = None) -> None:
        """Hand the computed prompt to the tree now: key tokens [0, tokens), or all of it (None).

        A part comes with the records before its end and only for a lease that
        `publishes_parts`; the whole prompt brings restored KV and live copies too. The
        published nodes stay locked by the lease until `release`; duplicates of what another
        request published first stay the lease's (`kept_slots`): its layout reads them.
        """
        plan = lease.plan
        whole = tokens is None or tokens >= len(plan.key)
        if lease.released or lease.complete or (not whole and (not lease.publishes_parts
                                                               or tokens <= lease.published_tokens)):
            return
        key = plan.key if whole else key_prefix(plan.key, tokens)
        start = lease.published or plan.match
        record_slots = lease.record_slots
        if whole and plan.copy_ids is not None:   # recycled copies: the tree takes the live ones
            record_slots, unused = _live_record_slots(plan, lease)
            lease.kept_slots += unused
        first = start.records - plan.match.records
        end = self.tree.insert(start, key, lease.token_slots[start.tokens - plan.match.tokens:],
                               record_slots[first:], lease.kept_slots)
        if whole and plan.restore:
            lease.kept_slots += self.tree.fill(plan.match.node, plan.restore.token_holes, lease.hole_slots,
                                               plan.restore.copy_holes, lease.copy_hole_slots)
        self.tree.lock(end)
        self.tree.unlock(start.node)
        lease.published = Match(end, len(key), len(key.records))
        lease.complete = whole

    def release(self, lease: Lease, keep_prompt: bool) -> None:
        """End a request: its prompt path goes into the tree (if computed), everything else is freed.

        What it published stays in the tree either way, no longer locked by it.
        """
        if lease.released:
            return
        if keep_prompt:
            self.publish(lease)
        lease.released = True
        self._leases.discard(lease)
        plan = lease.plan
        for slots in lease.prompt_slots():
            self.allocator.free(slots)
        self.tree.unlock(lease.node)
        self.allocator.free(lease.decode_slots)
        if lease.complete:   # KV the finished path no longer reads, where nobody running needs it
            end = lease.node
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
        tree = self.tree
        return PoolStats(total, total - free, free, tree.cached_slots + tree.retained_slots, tree.evictable_slots,
                         tree.evicted_slots, tree.retained_slots, tree.retained_evicted)

    def check_integrity(self) -> None:
        """Every slot has exactly one owner; lock refs equal the live requests' paths; live (tree and
        requests) + retained + free slots == the pool. AssertionError if not."""
        leases = list(self._leases)
        owned = [slots for lease in leases for slots in lease.prompt_slots()]
        owned += [lease.decode_slots for lease in leases]
        self.tree.check_integrity([lease.node for lease in leases], owned)


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
