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

A key that the end state of a finished path reads through a copy has its birth
slot freed (`punch_births`): later repositions re-rotate it from the copy, so a
rolling drop-and-reposition history holds about one slot per visible key.
"""
from __future__ import annotations

import heapq
from array import array
from collections.abc import Callable, Iterable
from typing import NamedTuple

from akv_core.cache.allocator import SlotAllocator
from akv_core.cache.key import CacheKey, DropRecord, Record, common_prefix


HOLE = -1   # a token whose dropped KV was freed; recomputed by the next request that needs it visible


class Node:
    """A token run (`record is None`) or an operation record."""

    __slots__ = ("parent", "children", "tokens", "slots", "record", "lock_ref", "last_access", "holes",
                 "births_freed")

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

    def make_holes(self, lo: int, hi: int) -> list[int]:
        """Turn slots [lo, hi) into holes; returns the slots it owned there, for the caller to free.

        Holes are found with C-level list operations (a range punched again is one count).
        """
        if hi - lo == len(self.slots) and not self.holes:   # the whole node: a new list, no copy of the old one
            owned, self.slots = self.slots, [HOLE] * len(self.slots)
        else:
            owned = self.slots[lo:hi]
            if self.holes:
                already = owned.count(HOLE)
                if already == hi - lo:
                    return []
                if already:
                    owned = [slot for slot in owned if slot != HOLE]
            self.slots[lo:hi] = [HOLE] * (hi - lo)
        self.holes += len(owned)
        return owned

    @property
    def edge(self) -> object:
        """This node's key in its parent's children: its first token or its record."""
        return self.tokens[0] if self.record is None else self.record

    def __lt__(self, other: Node) -> bool:  # heap ties: any order is fine
        return id(self) < id(other)


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
        self.evicted_slots = 0     # freed by eviction so far
        self.holes = 0             # tokens in the tree whose dropped KV was freed
        self._leaves: set[Node] = set()   # nodes without children (eviction candidates when unlocked)
        self._copy_nodes: set[Node] = set()   # record nodes that may own copies (a superset, pruned lazily)
        self._clock = 0

    @property
    def evictable_slots(self) -> int:
        return self.cached_slots - self.protected_slots

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

    def punch(self, node: Node, key: CacheKey) -> int:
        """Free the KV of tokens the drop records of `key` hide on its path to `node`, where no live request uses it.

        Only token nodes without a lock are punched: a locked node is on a live
        request's path, which may still need the dropped keys visible. Re-rotated
        copies in reposition nodes are left alone (eviction frees them).
        """
        hidden = sorted(r for _, record in key.records if isinstance(record, DropRecord) for r in record.hidden)
        return sum(self._punch_ranges(node, hidden)) if hidden else 0

    def _punch_ranges(self, node: Node, ranges: list[tuple[int, int]]) -> list[int]:
        """Free the KV of key ranges [start, end) (sorted by start) on the unlocked token nodes of the
        path to `node`; returns the slots freed per range."""
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
                    owned = path_node.make_holes(lo - start, hi - start)
                    if owned:
                        self.allocator.free(owned)
                        freed[i] += len(owned)
        total = sum(freed)
        self.holes += total
        self.cached_slots -= total
        return freed

    def punch_births(self, node: Node, runs: list[list[int]]) -> int:
        """Free the birth slots of keys the end state of the path to `node` reads through a copy.

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
        """Free the re-rotated copies on the path to `node` that its end state no longer reads.

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
                    owned = path_node.make_holes(cursor, lo)
                    self.allocator.free(owned)
                    freed += len(owned)
                cursor = max(cursor, hi)
        self.holes += freed
        self.cached_slots -= freed
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
        node.slots[index] = slot
        node.holes -= 1
        self.holes -= 1
        self.cached_slots += 1
        if node.lock_ref:
            self.protected_slots += 1
        if node.record is not None:
            self._copy_nodes.add(node)

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

        That is every unlocked node off that path whose subtree holds no `sole` record and
        no locked node (leaf-first eviction can take all of it), plus the copies of the
        other unlocked record nodes that are not `sole` (they go first). One walk of the tree.
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
        return total

    def evict(self, n_slots: int, spare_sole: bool = False) -> int:
        """Free at least `n_slots` slots, least recently used first; returns the count.

        Re-rotated copies go first: while its birth slot is kept, a copy is a cheap
        function of it (the next request that reads it re-rotates it again, a restore
        without any forward), so unlocked record nodes give up such copies before any
        leaf's KV is evicted. Then unlocked leaves go, whole, and `sole` record leaves
        (copies that are their keys' only KV: losing them means recomputing the keys and
        what they attended to) only after every other leaf, and never with `spare_sole`.
        """
        freed = self._evict_copies(n_slots)
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

    def _evict_copies(self, n_slots: int) -> int:
        """Turn the copies of unlocked, not `sole` record nodes into holes, least recently used first."""
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
        """
        expected_refs: dict[int, int] = {}
        for node in locked:
            while node is not self.root:
                expected_refs[id(node)] = expected_refs.get(id(node), 0) + 1
                node = node.parent
        seen: set[int] = set()
        cached = protected = holes = 0
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
            holes += node.holes
            _claim(seen, node.owned_slots())
            cached += node.size
            protected += node.size if node.lock_ref else 0
        _check(cached == self.cached_slots, f"cached_slots {self.cached_slots} but nodes own {cached}")
        _check(holes == self.holes, f"holes {self.holes} but nodes have {holes}")
        _check(protected == self.protected_slots, f"protected_slots {self.protected_slots} but {protected} locked")
        for slots in owned:
            _claim(seen, slots)
        free = self.allocator.free_slots()
        _claim(seen, free)
        _check(len(seen) == self.allocator.total and min(seen, default=0) >= 0
               and max(seen, default=0) < self.allocator.total,
               f"{len(seen)} slots accounted for, pool has {self.allocator.total}")


def _claim(seen: set[int], slots: list[int]) -> None:
    before = len(seen)
    seen.update(slots)
    _check(len(seen) == before + len(slots), "a slot has two owners")


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(f"cache integrity: {message}")
