"""The operation-aware radix tree over cache keys.

Edges are token runs (split as needed) or operation records (atomic). A token
node owns one KV slot per token; a reposition record node owns the re-rotated
copies of the keys whose position it changes (copy-on-write: the path without
the record keeps its own slots); a drop record node owns nothing.

Contract (as in mini-sglang / SGLang): `match` -> `lock` -> `insert` ->
`unlock` -> `evict` gives freed slots back to the allocator. A locked node
(on the path of a live request) is never evicted, and a node is evicted only
once it is a leaf, so a node's ancestors (the tokens it attended to, and the
birth slots of the keys it re-rotated unless those were freed) always outlive it.

A key that the end state of a finished path reads through a copy gives up its
birth slot (`punch_births`): later repositions re-rotate it from the copy, so a
rolling drop-and-reposition history reads about one slot per visible key.

KV a finished path no longer reads (dropped keys, superseded copies, the birth
slots of moved keys) is not freed but *retained*: the entry becomes a `HOLE`
whose slot the node keeps aside (`Node.kept`), so a later request that needs an
earlier state (the history before a drop or a reposition: a retry, a second run
of a trajectory, a fork) makes it live again (`revive`) instead of recomputing
it. Retained slots are read by no live request: eviction takes them first
(copies, then tokens, least recently used first), before any KV a path still reads.
"""
from __future__ import annotations

import heapq
import itertools
from array import array
from collections.abc import Callable, Iterable
from typing import NamedTuple

from akv_core.cache.allocator import SlotAllocator
from akv_core.cache.key import CacheKey, DropRecord, Record, common_prefix


HOLE = -1   # an entry no path end reads: its KV is retained (`Node.kept`) or freed (recomputed when read)

# Creation order of nodes: eviction breaks ties in last use with it, so that two trees fed the same
# requests (the engine's and the replay simulator's) evict the same nodes.
_SERIALS = itertools.count()


class Node:
    """A token run (`record is None`) or an operation record."""

    __slots__ = ("parent", "children", "tokens", "slots", "record", "lock_ref", "last_access", "holes",
                 "births_freed", "kept", "retained", "serial")

    def __init__(self, parent: Node | None, tokens: array | tuple[()], slots: list[int],
                 record: Record | None = None, last_access: int = 0) -> None:
        self.parent = parent
        self.children: dict[object, Node] = {}
        self.tokens = tokens
        self.slots = slots
        self.record = record
        self.lock_ref = 0
        self.last_access = last_access
        self.holes = 0   # entries of `slots` that are HOLE
        self.births_freed = False   # a record node some of whose keys lost their birth slots (`punch_births`)
        self.kept: list[int] | None = None   # per entry: the retained slot of a HOLE, else HOLE (None: none yet)
        self.retained = 0   # entries of `kept` that hold a slot
        self.serial = next(_SERIALS)

    @property
    def sole(self) -> bool:
        """A record node whose copies are, for some keys, their only KV (while it owns any)."""
        return self.births_freed and self.size > 0

    @property
    def size(self) -> int:
        """Slots this node owns (holes own none)."""
        return len(self.slots) - self.holes

    def owned_slots(self) -> list[int]:
        return [slot for slot in self.slots if slot != HOLE] if self.holes else self.slots

    def retain(self, lo: int, hi: int) -> int:
        """Turn the live slots [lo, hi) into holes whose KV is kept aside (retained); returns how many.

        An entry that is already a hole keeps what it had (its retained slot, or nothing).
        """
        segment = self.slots[lo:hi]
        live = hi - lo - (segment.count(HOLE) if self.holes else 0)
        if not live:
            return 0
        if live == len(self.slots):   # the whole node, no holes yet: the old list becomes `kept`
            self.kept, self.slots = self.slots, [HOLE] * len(self.slots)
        else:
            if self.kept is None:
                self.kept = [HOLE] * len(self.slots)
            if live == hi - lo:
                self.kept[lo:hi] = segment
            else:
                self.kept[lo:hi] = [slot if slot != HOLE else kept for slot, kept in zip(segment, self.kept[lo:hi])]
            self.slots[lo:hi] = [HOLE] * (hi - lo)
        self.holes += live
        self.retained += live
        return live

    def is_retained(self, index: int) -> bool:
        return self.kept is not None and self.kept[index] != HOLE

    def retained_slots(self) -> list[int]:
        return [slot for slot in self.kept if slot != HOLE] if self.retained else []

    def take_retained(self) -> list[int]:
        """Stop retaining: the retained slots, for the caller to free (their entries stay holes)."""
        slots = self.retained_slots()
        self.kept, self.retained = None, 0
        return slots

    def revive(self, index: int) -> int:
        """Make the retained slot of entry `index` live again; returns it."""
        slot = self.kept[index]
        self.slots[index], self.kept[index] = slot, HOLE
        self.holes -= 1
        self.retained -= 1
        return slot

    @property
    def edge(self) -> object:
        """This node's key in its parent's children: its first token or its record."""
        return self.tokens[0] if self.record is None else self.record

    def __lt__(self, other: Node) -> bool:  # ties in last use: the older node first, the same in every tree
        return self.serial < other.serial


class Match(NamedTuple):
    """The deepest node whose state a key reuses, and how much of the key that is."""

    node: Node
    tokens: int    # key tokens [0, tokens) are reused
    records: int   # key records [0, records) are reused


class RadixCache:
    """The tree, its lock refs, and the slot accounting it shares with the allocator."""

    def __init__(self, allocator: SlotAllocator) -> None:
        self.allocator = allocator
        self.root = Node(None, (), [])
        self.cached_slots = 0      # slots owned by tree nodes
        self.protected_slots = 0   # ... of which on a locked node
        self.evicted_slots = 0     # freed by eviction so far (KV some path end still read)
        self.holes = 0             # entries in the tree that no path end reads (retained or freed)
        self.retained_slots = 0    # ... of which the tree keeps the KV aside (evicted first)
        self.retained_evicted = 0  # retained slots freed by eviction so far
        self._leaves: set[Node] = set()   # nodes without children (eviction candidates when unlocked)
        self._copy_nodes: set[Node] = set()   # record nodes that may own copies (a superset, pruned lazily)
        self._retained_nodes: set[Node] = set()   # nodes that may retain slots (a superset, pruned lazily)
        self._clock = 0

    @property
    def evictable_slots(self) -> int:
        """Slots eviction may free: live KV on unlocked nodes, and every retained slot (no live request reads one)."""
        return self.cached_slots - self.protected_slots + self.retained_slots

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # -- match ---------------------------------------------------------------------------------

    def match(self, key: CacheKey, token_limit: int, record_limit: int | None = None) -> Match:
        """The longest reusable prefix of `key` with at most `token_limit` tokens (splits a node if needed).

        With `record_limit`, matching stops before key record `record_limit`.
        """
        tokens, records = key.tokens, key.records
        node, offset, record_index = self.root, 0, 0
        now = self._tick()
        boundary = records[0][0] if records else len(tokens)   # where the token run ends: a record or the key's end
        while True:
            if offset == boundary and record_index < len(records):
                if record_index == record_limit:
                    break
                child = node.children.get(records[record_index][1])
                if child is None:
                    break
                node, record_index = child, record_index + 1
                node.last_access = now
                boundary = records[record_index][0] if record_index < len(records) else len(tokens)
                continue
            end = boundary if boundary < token_limit else token_limit
            if offset >= end:
                break
            child = node.children.get(tokens[offset])
            if child is None:
                break
            run = child.tokens
            stop = offset + len(run)
            if stop > end or run != tokens[offset:stop]:   # the edge matches only in part: split it
                n = common_prefix(run, tokens, offset, end)
                child = self._split(child, n)
                stop = offset + n
            node, offset = child, stop
            node.last_access = now
        return Match(node, offset, record_index)

    def _split(self, node: Node, n: int) -> Node:
        """Cut a token node after `n` tokens; the new upper part is returned, `node` keeps the rest."""
        upper = Node(node.parent, node.tokens[:n], node.slots[:n], None, node.last_access)
        upper.lock_ref = node.lock_ref
        if node.holes:
            upper.holes = upper.slots.count(HOLE)
            node.holes -= upper.holes
        if node.kept is not None:
            upper.kept, node.kept = node.kept[:n], node.kept[n:]
            upper.retained = n - upper.kept.count(HOLE)
            node.retained -= upper.retained
            self._retained_nodes.add(upper)
        node.parent.children[upper.edge] = upper
        node.tokens, node.slots, node.parent = node.tokens[n:], node.slots[n:], upper
        upper.children[node.edge] = node
        return upper

    # -- lock ----------------------------------------------------------------------------------

    def lock(self, node: Node) -> None:
        """A live request now uses `node` and all its ancestors."""
        while node is not self.root:
            if node.lock_ref == 0:
                self.protected_slots += node.size
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.protected_slots -= node.size
            node = node.parent

    def slots_on_path(self, node: Node) -> int:
        total = 0
        while node is not self.root:
            total += node.size
            node = node.parent
        return total

    def unlocked_slots_on_path(self, node: Node) -> int:
        """Slots that locking `node` would take out of the evictable pool."""
        total = 0
        while node is not self.root:
            if node.lock_ref == 0:
                total += node.size
            node = node.parent
        return total

    # -- insert --------------------------------------------------------------------------------

    def insert(self, match: Match, key: CacheKey, token_slots: list[int],
               record_slots: list[list[int]], duplicates: list[int] | None = None) -> Node:
        """Hang the rest of `key` below `match.node`, taking ownership of the request's slots.

        `token_slots` hold key tokens [match.tokens, len(key)); `record_slots[i]`
        belongs to record `match.records + i`. Parts another request inserted in
        the meantime are kept, and this request's duplicates fill holes or are
        freed; with `duplicates`, they are appended there instead (a request that
        still runs reads them: it frees them when it ends). Returns the node where
        the key ends.
        """
        tokens, records = key.tokens, key.records
        node, offset, record_index = match.node, match.tokens, match.records
        base, first_record = match.tokens, match.records
        give_back = self.allocator.free if duplicates is None else duplicates.extend
        now = self._tick()
        while True:
            if record_index < len(records) and records[record_index][0] == offset:
                mine = record_slots[record_index - first_record]
                record = records[record_index][1]
                child = node.children.get(record)
                if child is None:   # copies this key no longer reads come as HOLE
                    child = Node(node, (), mine, record, now)
                    child.holes = mine.count(HOLE) if HOLE in mine else 0
                    self.holes += child.holes
                    child = self._add(node, child)
                else:
                    spare = self._fill_holes(child, mine) if child.holes else mine
                    give_back([slot for slot in spare if slot != HOLE] if HOLE in spare else spare)
                node, record_index = child, record_index + 1
                node.last_access = now
                continue
            end = records[record_index][0] if record_index < len(records) else len(tokens)
            if offset >= end:
                return node
            child = node.children.get(tokens[offset])
            if child is None:
                node = self._add(node, Node(node, tokens[offset:end], token_slots[offset - base:end - base],
                                            None, now))
                offset = end
                continue
            n = common_prefix(child.tokens, tokens, offset, end)
            if n < len(child.tokens):
                child = self._split(child, n)
            mine = token_slots[offset - base:offset - base + n]
            if child.holes:
                mine = self._fill_holes(child, mine)
            give_back(mine)
            node, offset = child, offset + n
            node.last_access = now

    def _fill_holes(self, node: Node, mine: list[int]) -> list[int]:
        """Give `node`'s holes this request's recomputed slots; returns the slots it does not need."""
        spare = []
        filled = 0
        for i, slot in enumerate(node.slots):
            if slot == HOLE:
                if mine[i] != HOLE and node.is_retained(i):   # the request's own KV replaces the retained copy
                    self._free_retained(node, i)
                node.slots[i] = mine[i]
                filled += mine[i] != HOLE
            else:
                spare.append(mine[i])
        node.holes -= filled
        self.holes -= filled
        self.cached_slots += filled
        if node.lock_ref:
            self.protected_slots += filled
        if node.record is not None and filled:
            self._copy_nodes.add(node)
        return spare

    def _free_retained(self, node: Node, index: int) -> None:
        slot = node.kept[index]
        node.kept[index] = HOLE
        node.retained -= 1
        self.retained_slots -= 1
        self.allocator.free([slot])

    def _retain(self, node: Node, lo: int, hi: int) -> int:
        """Retain node entries [lo, hi) (see `Node.retain`), with the tree's counters."""
        count = node.retain(lo, hi)
        if count:
            self.holes += count
            self.cached_slots -= count
            self.retained_slots += count
            self._retained_nodes.add(node)
        return count

    def punch(self, node: Node, key: CacheKey) -> int:
        """Retain the KV of tokens the drop records of `key` hide on its path to `node`, where no live request uses it.

        Only token nodes without a lock are punched: a locked node is on a live
        request's path, which may still need the dropped keys visible. Re-rotated
        copies in reposition nodes are left alone (`punch_copies`).
        """
        hidden = sorted(r for _, record in key.records if isinstance(record, DropRecord) for r in record.hidden)
        return sum(self._punch_ranges(node, hidden)) if hidden else 0

    def _punch_ranges(self, node: Node, ranges: list[tuple[int, int]]) -> list[int]:
        """Retain the KV of key ranges [start, end) (sorted by start) on the unlocked token nodes of the
        path to `node`; returns the slots retained per range."""
        freed = [0] * len(ranges)
        first = 0
        for start, path_node in self.token_offsets(node):
            end = start + len(path_node.tokens)
            while first < len(ranges) and ranges[first][1] <= start:
                first += 1   # nodes come in offset order: ranges ending before this one are done
            if path_node.lock_ref:
                continue
            for i in range(first, len(ranges)):
                lo, hi = max(start, ranges[i][0]), min(end, ranges[i][1])
                if ranges[i][0] >= end:
                    break
                if lo < hi:
                    freed[i] += self._retain(path_node, lo - start, hi - start)
        return freed

    def punch_births(self, node: Node, runs: list[list[int]]) -> int:
        """Retain the birth slots of keys the end state of the path to `node` reads through a copy.

        `runs`: [start, end, position, source] visible at the end, where source >= 0 is the
        path's record whose copy the run reads. A later reposition re-rotates such a key from
        that copy, so the birth slot is read only by a request that branches off before the
        record (it recomputes the key). A record whose keys lost their birth slots is marked
        (`births_freed`; `Node.sole`): its copies are no longer a cheap function of them. Locked
        nodes are left alone.
        """
        moved = [run for run in runs if run[3] >= 0]
        if not moved:
            return 0
        records = [path_node for path_node in self.path(node) if path_node.record is not None]
        freed = self._punch_ranges(node, [(run[0], run[1]) for run in moved])
        for run, count in zip(moved, freed):
            if count:
                records[run[3]].births_freed = True
        return sum(freed)

    def punch_copies(self, node: Node, live: Callable[[int], list[tuple[int, int]]]) -> int:
        """Retain the re-rotated copies on the path to `node` that its end state no longer reads.

        `live(i)` gives the copy ranges of the path's i-th record that stay visible.
        A copy superseded by a later reposition, or of a key dropped later, is read
        only by a request that branches off before that point; it recomputes from the
        record instead. Locked record nodes are left alone.
        """
        freed = index = 0
        for path_node in self.path(node):
            if path_node.record is None:
                continue
            index += 1
            if path_node.lock_ref or not path_node.slots or path_node.holes == len(path_node.slots):
                continue
            count, cursor = len(path_node.slots), 0
            for lo, hi in live(index - 1) + [(count, count)]:
                if cursor < lo:   # copies [cursor, lo) are not read at the end
                    freed += self._retain(path_node, cursor, lo)
                cursor = max(cursor, hi)
        return freed

    def token_offsets(self, node: Node) -> list[tuple[int, Node]]:
        """(first key offset, node) of every token node on the path to `node`."""
        out, offset = [], 0
        for path_node in self.path(node):
            if path_node.record is None:
                out.append((offset, path_node))
                offset += len(path_node.tokens)
        return out

    def fill(self, node: Node, token_holes: tuple[int, ...], token_slots: list[int],
             copy_holes: tuple[tuple[int, int], ...], copy_slots: list[int]) -> list[int]:
        """Give holes on the path to `node` a request's restored slots; returns the slots not needed.

        `token_holes` are key offsets, `copy_holes` (record index on the path, copy index).
        A hole another request filled in the meantime keeps its slot and ours is spare.
        """
        spare: list[int] = []
        if token_holes:
            nodes = self.token_offsets(node)
            i = 0
            for offset, slot in zip(token_holes, token_slots):
                while nodes[i][0] + len(nodes[i][1].tokens) <= offset:
                    i += 1
                self._fill_one(nodes[i][1], offset - nodes[i][0], slot, spare)
        if copy_holes:
            records = [path_node for path_node in self.path(node) if path_node.record is not None]
            for (record, copy), slot in zip(copy_holes, copy_slots):
                self._fill_one(records[record], copy, slot, spare)
        return spare

    def _fill_one(self, node: Node, index: int, slot: int, spare: list[int]) -> None:
        if node.slots[index] != HOLE:
            spare.append(slot)
            return
        if node.is_retained(index):
            self._free_retained(node, index)
        node.slots[index] = slot
        node.holes -= 1
        self.holes -= 1
        self.cached_slots += 1
        if node.lock_ref:
            self.protected_slots += 1
        if node.record is not None:
            self._copy_nodes.add(node)

    def revive(self, node: Node, token_offsets: tuple[int, ...], copies: tuple[tuple[int, int], ...]) -> int:
        """Make retained entries on the path to `node` live again; returns how many.

        `token_offsets` are key offsets, `copies` (record index on the path, copy index), as
        in `fill`; every one of them must be retained (the plan found them so).
        """
        revived = 0
        if token_offsets:
            nodes = self.token_offsets(node)
            i = 0
            for offset in token_offsets:
                while nodes[i][0] + len(nodes[i][1].tokens) <= offset:
                    i += 1
                revived += self._revive_one(nodes[i][1], offset - nodes[i][0])
        if copies:
            records = [path_node for path_node in self.path(node) if path_node.record is not None]
            for record, copy in copies:
                revived += self._revive_one(records[record], copy)
        return revived

    def _revive_one(self, node: Node, index: int) -> int:
        if not node.is_retained(index):
            raise RuntimeError(f"entry {index} of a tree node is not retained: nothing to revive")
        node.revive(index)
        self.holes -= 1
        self.retained_slots -= 1
        self.cached_slots += 1
        if node.lock_ref:
            self.protected_slots += 1
        if node.record is not None:
            self._copy_nodes.add(node)
        return 1

    def _add(self, parent: Node, child: Node) -> Node:
        parent.children[child.edge] = child
        self._leaves.discard(parent)
        self._leaves.add(child)
        self.cached_slots += child.size
        if child.record is not None and child.size:
            self._copy_nodes.add(child)
        return child

    # -- evict ---------------------------------------------------------------------------------

    def cheap_evictable_slots(self, keep: Node) -> int:
        """Slots eviction can free without taking a `sole` record node, keeping the path to `keep` too.

        That is every retained slot, every unlocked node off that path whose subtree holds no
        `sole` record and no locked node (leaf-first eviction can take all of it), plus the
        copies of the other unlocked record nodes that are not `sole` (they go first). One walk
        of the tree.
        """
        kept = set(map(id, self.path(keep)))
        total = 0
        removable: dict[int, bool] = {}
        for node in reversed(list(self._nodes())):   # children before parents
            if node is self.root:
                continue
            pinned = node.lock_ref > 0 or id(node) in kept
            ok = not pinned and not node.sole and all(removable[id(child)] for child in node.children.values())
            removable[id(node)] = ok
            if ok or (not pinned and node.record is not None and not node.sole):
                total += node.size
        return total + self.retained_slots

    def evict(self, n_slots: int, spare_sole: bool = False) -> int:
        """Free at least `n_slots` slots, least recently used first; returns the count.

        Retained slots go first (`_evict_retained`): no live request reads them, and only a
        request for an earlier state would. Then re-rotated copies: while its birth slot is
        kept, a copy is a cheap function of it (the next request that reads it re-rotates it again, a restore
        without any forward), so unlocked record nodes give up such copies before any
        leaf's KV is evicted. Then unlocked leaves go, whole, and `sole` record leaves
        (copies that are their keys' only KV: losing them means recomputing the keys and
        what they attended to) only after every other leaf, and never with `spare_sole`.
        """
        freed = self._evict_retained(n_slots)
        freed += self._evict_copies(n_slots - freed)
        heap = [(node.sole, node.last_access, node) for node in self._leaves if node.lock_ref == 0]
        heapq.heapify(heap)
        while freed < n_slots and heap:
            sole, _, node = heapq.heappop(heap)
            if sole and spare_sole:
                break
            parent = node.parent
            del parent.children[node.edge]
            self._leaves.discard(node)
            self._copy_nodes.discard(node)
            self._retained_nodes.discard(node)
            freed += self._free_all_retained(node)   # none by now: leaves go once no retained slot is left
            self.allocator.free(node.owned_slots())
            self.holes -= node.holes
            freed += node.size
            self.cached_slots -= node.size
            self.evicted_slots += node.size
            node.parent = None
            if parent is not self.root and not parent.children:
                self._leaves.add(parent)
                if parent.lock_ref == 0:
                    heapq.heappush(heap, (parent.sole, parent.last_access, parent))
        return freed

    def _evict_retained(self, n_slots: int) -> int:
        """Free the retained slots of whole nodes until `n_slots` are freed: retained copies first,
        then retained tokens, least recently used first within each.

        A retained copy is a cheap function of its key's birth slot, which is still there (live,
        or retained: token nodes go after every copy): a request that reads it again re-rotates
        it, with no forward. A retained token costs a forward, and what it attended to. A rolling
        history supersedes a window of copies at every reposition, so copies are most of what
        is retained.
        """
        if n_slots <= 0 or not self.retained_slots:
            return 0
        candidates = []
        for node in list(self._retained_nodes):
            if node.parent is None or not node.retained:
                self._retained_nodes.discard(node)
            else:
                candidates.append((node.record is None, node.last_access, node))
        candidates.sort()
        freed = 0
        for _, _, node in candidates:
            if freed >= n_slots:
                break
            freed += self._free_all_retained(node)
            self._retained_nodes.discard(node)
        return freed

    def _free_all_retained(self, node: Node) -> int:
        slots = node.take_retained()
        self.allocator.free(slots)
        self.retained_slots -= len(slots)
        self.retained_evicted += len(slots)
        return len(slots)

    def _evict_copies(self, n_slots: int) -> int:
        """Turn the copies of unlocked, not `sole` record nodes into holes, least recently used first."""
        if n_slots <= 0:
            return 0
        candidates = []
        for node in list(self._copy_nodes):
            if node.parent is None or node.size == 0:
                self._copy_nodes.discard(node)
            elif node.lock_ref == 0 and not node.sole:
                candidates.append((node.last_access, node))
        candidates.sort()
        freed = 0
        for _, node in candidates:
            if freed >= n_slots:
                break
            owned = node.owned_slots()
            self.allocator.free(owned)
            node.slots = [HOLE] * len(node.slots)
            node.holes = len(node.slots)
            self._copy_nodes.discard(node)
            self.holes += len(owned)
            self.cached_slots -= len(owned)
            self.evicted_slots += len(owned)
            freed += len(owned)
        return freed

    def _nodes(self) -> Iterable[Node]:
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def path(self, node: Node) -> list[Node]:
        """Nodes from the root's child down to `node`."""
        nodes = []
        while node is not self.root:
            nodes.append(node)
            node = node.parent
        nodes.reverse()
        return nodes

    # -- integrity -----------------------------------------------------------------------------

    def check_integrity(self, locked: Iterable[Node], owned: Iterable[list[int]]) -> None:
        """Raise AssertionError unless every slot has one owner and the lock refs match `locked`.

        `locked`: the match node of every live request; `owned`: slot lists live requests own.
        The pool adds up: live (tree nodes and requests) + retained + free == total.
        """
        expected_refs: dict[int, int] = {}
        for node in locked:
            while node is not self.root:
                expected_refs[id(node)] = expected_refs.get(id(node), 0) + 1
                node = node.parent
        seen: set[int] = set()
        cached, protected, holes, retained = self._check_nodes(expected_refs, seen)
        _check(cached == self.cached_slots, f"cached_slots {self.cached_slots} but nodes own {cached}")
        _check(holes == self.holes, f"holes {self.holes} but nodes have {holes}")
        _check(retained == self.retained_slots, f"retained_slots {self.retained_slots} but nodes retain {retained}")
        _check(protected == self.protected_slots, f"protected_slots {self.protected_slots} but {protected} locked")
        live = cached
        for slots in owned:
            _claim(seen, slots)
            live += len(slots)
        free = self.allocator.free_slots()
        _claim(seen, free)
        _check(live + retained + len(free) == self.allocator.total,
               f"live {live} + retained {retained} + free {len(free)} slots, pool has {self.allocator.total}")
        _check(len(seen) == self.allocator.total and min(seen, default=0) >= 0
               and max(seen, default=0) < self.allocator.total,
               f"{len(seen)} slots accounted for, pool has {self.allocator.total}")

    def _check_nodes(self, expected_refs: dict[int, int], seen: set[int]) -> tuple[int, int, int, int]:
        """Check every node, claiming its live and retained slots; returns (cached, protected, holes, retained)."""
        cached = protected = holes = retained = 0
        for node in self._nodes():
            if node is self.root:
                continue
            _check(node.parent is not None and node.parent.children.get(node.edge) is node,
                   "a node is not its parent's child")
            _check(node.record is not None or (len(node.tokens) == len(node.slots) > 0),
                   "a token node without one slot per token")
            _check(node.lock_ref == expected_refs.get(id(node), 0),
                   f"lock_ref {node.lock_ref} but {expected_refs.get(id(node), 0)} live requests use the node")
            _check((node in self._leaves) == (not node.children), "the leaf set is out of date")
            _check(node.holes == node.slots.count(HOLE), "a node's hole count is out of date")
            _check(node.record is None or node.size == 0 or node in self._copy_nodes,
                   "a record node owning copies is not an eviction candidate")
            _check_retained(node)
            _check(not node.retained or node in self._retained_nodes,
                   "a node retaining slots is not an eviction candidate")
            holes += node.holes
            _claim(seen, node.owned_slots())
            _claim(seen, node.retained_slots())
            cached += node.size
            retained += node.retained
            protected += node.size if node.lock_ref else 0
        return cached, protected, holes, retained


def _check_retained(node: Node) -> None:
    """A node's retained slots sit beside holes only, and its count matches them."""
    if node.kept is None:
        _check(node.retained == 0, "a node counts retained slots it has no room for")
        return
    _check(len(node.kept) == len(node.slots), "a node's retained entries do not line up with its slots")
    _check(node.retained == len(node.kept) - node.kept.count(HOLE), "a node's retained count is out of date")
    _check(all(slot == HOLE for slot, kept in zip(node.slots, node.kept) if kept != HOLE),
           "a retained slot beside a live one")


def _claim(seen: set[int], slots: list[int]) -> None:
    before = len(seen)
    seen.update(slots)
    _check(len(seen) == before + len(slots), "a slot has two owners")


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(f"cache integrity: {message}")
