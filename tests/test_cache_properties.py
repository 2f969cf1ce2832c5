"""Random request sequences against the cache: no leaks, exact accounting, correct reuse.

Histories are drawn from a few short messages with shared prefixes, so token
runs split, operation records branch and (with a small pool) eviction runs.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from akv_core.cache.allocator import SlotAllocator
from akv_core.cache.key import build_key, shared_prefix
from akv_core.cache.layout import expand
from akv_core.cache.kv_cache import KVCache, KVCapacityError
from akv_core.cache.ops import validate_operations
from akv_core.cache.radix import HOLE, Node, RadixCache
from akv_core.cache.simulator import CacheSimulator
from test_cache_planner import agent_history, run_symbolic
from test_cache_support import SymbolicKV, account, reference_state, render, reused_tokens

MESSAGES = [(1, 2, 3), (1, 2), (4,), (1, 2, 3, 4, 5), (6, 7), (6, 8, 9, 10)]


def _request(messages, drop_pairs, repositions):
    """A history and valid cumulative operations made from freely drawn (trigger, dropped) pairs."""
    drops, repos = _operations(len(messages), drop_pairs, repositions)
    return [MESSAGES[i] for i in messages], drops, repos


def _operations(n, drop_pairs, repositions):
    dropped: set[int] = set()
    drops: dict[str, list[int]] = {}
    for trigger, index in drop_pairs:
        if index <= trigger < n and index not in dropped:
            drops.setdefault(str(trigger), []).append(index)
            dropped.add(index)
    repos = sorted({t for t in repositions if t < n})
    return drops or None, repos or None


requests = st.builds(_request, st.lists(st.integers(0, len(MESSAGES) - 1), min_size=1, max_size=7),
                     st.lists(st.tuples(st.integers(1, 6), st.integers(0, 5)), max_size=4),
                     st.lists(st.integers(0, 6), max_size=3))
sequences = st.lists(requests, min_size=1, max_size=8)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sequences, st.integers(25, 60))
def test_no_slot_leaks_and_exact_accounting_under_eviction(sequence, pool):
    sim = CacheSimulator(pool)
    for messages, drops, repos in sequence:
        rendered = render(messages)
        try:
            usage = sim.request(rendered, drops, repos, max_tokens=3)
        except KVCapacityError:
            with pytest.raises(KVCapacityError):   # refused only if it would not fit an empty pool either
                CacheSimulator(pool).request(rendered, drops, repos, max_tokens=3)
            sim.check_integrity()
            continue
        sim.check_integrity()
        assert usage.prompt_tokens == len(rendered.token_ids)
        assert sim.stats().slots_used == sim.stats().slots_cached   # nothing live, nothing owned
    assert sim.stats().slots_used + sim.stats().slots_free == pool


@settings(max_examples=150, deadline=None)
@given(sequences)
def test_reuse_never_exceeds_an_inserted_prefix_and_accounting_matches_per_token(sequence):
    cache = KVCache(10_000)
    inserted = []
    for messages, drops, repos in sequence:
        rendered = render(messages)
        key = build_key(rendered, validate_operations(len(messages), drops, repos))
        longest, _ = reused_tokens(key, inserted)
        plan = cache.plan(key)
        # Freed KV on the path is restored where it is read, never by cutting the match short.
        assert plan.match.tokens == longest
        assert not plan.restore or cache.tree.holes
        expected = account(key, plan.match.tokens, plan.match.records, plan.restore.token_holes)
        usage = plan.usage
        assert (usage.prefilled_tokens, usage.cached_tokens, usage.repos_tokens, usage.drop_skipped_tokens) == (
            expected["prefilled"], expected["cached"], expected["repos"], expected["drop_skipped"])
        assert plan.end_position == expected["end_position"]
        cache.release(cache.admit(plan, 0), keep_prompt=True)
        cache.check_integrity()
        inserted.append(key)


@settings(max_examples=150, deadline=None)
@given(sequences, st.integers(30, 80))
def test_reused_state_always_equals_the_state_the_operations_define(sequence, pool):
    cache, kv = KVCache(pool), SymbolicKV()
    for messages, drops, repos in sequence:
        rendered = render(messages)
        result = run_symbolic(cache, kv, rendered, drops, repos)
        if result is None:
            continue   # larger than the pool
        key = build_key(rendered, validate_operations(len(messages), drops, repos))
        assert result[0] == reference_state(key)


@settings(max_examples=150, deadline=None)
@given(sequences, st.integers(30, 80), st.integers(1, 7))
def test_a_prefill_in_chunks_reaches_the_state_of_whole_stages(sequence, pool, chunk):
    """Stage.rows: chunks that end anywhere (inside messages, at drop and reposition records,
    in restored holes) see exactly what their rows see in the whole stage."""
    caches = [(KVCache(pool), SymbolicKV()), (KVCache(pool), SymbolicKV())]
    for messages, drops, repos in sequence:
        rendered = render(messages)
        whole = run_symbolic(*caches[0], rendered, drops, repos)
        chunked = run_symbolic(*caches[1], rendered, drops, repos, chunk=chunk)
        assert whole == chunked
        if whole is not None:
            key = build_key(rendered, validate_operations(len(messages), drops, repos))
            assert chunked[0] == reference_state(key)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(requests, st.integers(0, 3), st.booleans()), min_size=1, max_size=10), st.integers(40, 90))
def test_concurrent_requests_reuse_correct_state_and_leak_nothing(actions, pool):
    """Requests overlap: admitted ones hold locks while others finish, insert, free dropped KV and evict."""
    cache, kv = KVCache(pool), SymbolicKV()
    live = []
    for (messages, drops, repos), finish_count, completed in actions:
        for lease, layout, key in live[:finish_count]:
            # Nothing a live request reads was freed and reused while it ran.
            assert kv.state(layout.view_slots, layout.end_position) == reference_state(key)
            cache.release(lease, keep_prompt=completed)
            cache.check_integrity()
        del live[:finish_count]
        rendered = render(messages)
        key = build_key(rendered, validate_operations(len(messages), drops, repos))
        plan = cache.plan(key)
        if not cache.can_admit(plan, 2):
            continue
        lease = cache.admit(plan, 2)
        layout = expand(cache.tree.path(plan.match.node), lease)
        for stage in layout.stages:
            kv.run_stage(stage)
        assert kv.state(layout.view_slots, layout.end_position) == reference_state(key)
        live.append((lease, layout, key))
        cache.check_integrity()
    for lease, layout, key in live:
        assert kv.state(layout.view_slots, layout.end_position) == reference_state(key)
        cache.release(lease, keep_prompt=True)
    cache.check_integrity()
    assert cache.stats().slots_used == cache.stats().slots_cached


class _Prefill:
    """One admitted request computed chunk by chunk on the symbolic KV, as the engine steps it."""

    def __init__(self, cache: KVCache, plan, key) -> None:
        self.cache, self.key = cache, key
        self.lease = cache.admit(plan, 2)
        self.layout = expand(cache.tree.path(plan.match.node), self.lease)
        self.stage = self.row = 0

    @property
    def done(self) -> bool:
        return self.stage == len(self.layout.stages)

    def step(self, kv: SymbolicKV, chunk: int, awaited: bool) -> None:
        """Compute one chunk; publish the whole prompt once done, the part so far while awaited."""
        stage = self.layout.stages[self.stage]
        stop = min(self.row + chunk, len(stage.token_ids))
        kv.run_stage(stage.rows(self.row, stop))
        self.row = stop
        if stop == len(stage.token_ids):
            self.stage, self.row = self.stage + 1, 0
        if self.done:
            self.cache.publish(self.lease)
        elif awaited:
            left = sum(len(s.token_ids) for s in self.layout.stages[self.stage:]) - self.row
            self.cache.publish(self.lease, len(self.key) - left)

    def check_state(self, kv: SymbolicKV) -> None:
        assert kv.state(self.layout.view_slots, self.layout.end_position) == reference_state(self.key)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(requests, st.integers(0, 3), st.sampled_from(["run", "cancel", "finish"])),
                min_size=1, max_size=10),
       st.integers(40, 120), st.integers(1, 6), st.booleans())
def test_prompts_published_while_they_prefill_are_shared_exactly(actions, pool, chunk, awaited):
    """Requests publish their prompt chunk by chunk (`awaited`) and whole once computed; a request
    admitted meanwhile reuses at least the published part it shares, reads exactly the state its
    operations define, and cancelling the publisher mid-prefill or mid-decode leaks nothing."""
    cache, kv = KVCache(pool), SymbolicKV()
    live: list[_Prefill] = []
    for (messages, drops, repos), steps, end in actions:
        for _ in range(steps):
            for run in [run for run in live if not run.done]:
                run.step(kv, chunk, awaited)
                cache.check_integrity()
        if end != "run" and live:
            run = live.pop(0)
            if run.done:
                run.check_state(kv)   # nothing it reads was freed and reused while it ran
            cache.release(run.lease, keep_prompt=end == "finish" and run.done)
            cache.check_integrity()
        rendered = render(messages)
        key = build_key(rendered, validate_operations(len(messages), drops, repos))
        plan = cache.plan(key, 2)
        for other in live:   # published nodes stay locked: nothing evicts them
            assert plan.match.tokens >= min(shared_prefix(key, other.key), len(key) - 1,
                                            other.lease.published_tokens)
        if not cache.can_admit(plan, 2):
            continue
        live.append(_Prefill(cache, plan, key))
        cache.check_integrity()
    for run in live:
        while not run.done:
            run.step(kv, chunk, awaited)
            cache.check_integrity()
        run.check_state(kv)
        cache.release(run.lease, keep_prompt=True)
        cache.check_integrity()
    assert cache.stats().slots_used == cache.stats().slots_cached


def test_shared_prefix_ends_where_the_keys_tokens_or_records_first_differ():
    rendered = render([(1, 2, 3), (4, 5), (6, 7, 8)])
    plain = build_key(rendered, validate_operations(3, None, None))
    dropped = build_key(rendered, validate_operations(3, {"1": [0]}, None))
    moved = build_key(rendered, validate_operations(3, {"1": [0]}, [1]))
    other = build_key(render([(1, 2, 3), (4, 9), (6, 7, 8)]), validate_operations(3, None, None))
    assert shared_prefix(plain, plain) == len(plain)
    assert shared_prefix(plain, dropped) == shared_prefix(dropped, plain) == 5   # the drop record sits after (4, 5)
    assert shared_prefix(dropped, moved) == 5                                     # so does the reposition
    assert shared_prefix(plain, other) == 4
    assert shared_prefix(dropped, other) == 4


spans = st.tuples(st.integers(0, 12), st.integers(0, 12)).map(sorted)


@settings(max_examples=300, deadline=None)
@given(st.lists(spans, max_size=8), st.integers(1, 11))
def test_retained_ranges_keep_each_slot_once_and_survive_a_split(punches, cut):
    node = Node(None, tuple(range(12)), list(range(100, 112)))
    retained = 0
    for lo, hi in punches:
        retained += node.retain(lo, hi)
        assert node.holes == node.slots.count(HOLE) == node.retained == retained
    holed = sorted({i for lo, hi in punches for i in range(lo, hi)})
    assert node.retained_slots() == [100 + i for i in holed]   # every retained slot kept aside exactly once
    assert [i for i, slot in enumerate(node.slots) if slot == HOLE] == holed
    assert node.owned_slots() == [slot for slot in node.slots if slot != HOLE]
    root = Node(None, (), [])
    node.parent, root.children[node.edge] = root, node
    upper = RadixCache(SlotAllocator(200))._split(node, cut)
    for part in (upper, node):
        assert part.holes == part.slots.count(HOLE) == part.retained
    assert upper.retained_slots() + node.retained_slots() == [100 + i for i in holed]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 40), st.booleans()), min_size=1, max_size=12))
def test_pools_of_any_size_hand_out_each_free_slot_once(steps):
    pools = [SlotAllocator(total) for total in (7, 64, 3000)]   # they share the slot numbers' int objects
    held: list[list[int]] = [[] for _ in pools]
    for index, n, give_back in steps:
        pool = pools[index]
        if give_back and held[index]:
            pool.free(held[index][:n])
            del held[index][:n]
        n = min(n, pool.free_count)
        held[index] += pool.allocate(n)
        assert len(set(held[index])) == len(held[index])               # no slot handed out twice
        assert sorted(held[index] + pool.free_slots()) == list(range(pool.total))


pairs = st.lists(st.tuples(st.integers(2, 9), st.integers(0, 8)), max_size=5)
triggers = st.lists(st.integers(2, 9), max_size=4)


@settings(max_examples=300, deadline=None)
@given(pairs, triggers, st.lists(st.tuples(st.integers(2, 9), pairs, triggers), min_size=2, max_size=6),
       st.integers(70, 200))
def test_branches_of_one_history_restore_freed_keys_and_copies_exactly(base_pairs, base_repos, branches, pool):
    """Branches share the records up to a cut and differ after it: each frees what its end state
    hides (keys and re-rotated copies), and the next one reads some of it back."""
    cache, kv = KVCache(pool), SymbolicKV()
    rendered = render(agent_history(4))
    for cut, tail_pairs, tail_repos in branches:
        drops, repos = _operations(10, [p for p in base_pairs if p[0] <= cut] + [p for p in tail_pairs if p[0] > cut],
                                   [t for t in base_repos if t <= cut] + [t for t in tail_repos if t > cut])
        result = run_symbolic(cache, kv, rendered, drops, repos)
        if result is None:
            continue
        key = build_key(rendered, validate_operations(10, drops, repos))
        assert result[0] == reference_state(key)
        assert result[1].prompt_tokens == len(key)
