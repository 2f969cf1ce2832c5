"""Retained KV: what a finished path no longer reads stays in the tree, evictable, for earlier states.

A request for the history before a drop or a reposition (a retry, a second run of the same
trajectory, a fork) finds that KV and revives it instead of recomputing it; under pool
pressure eviction takes retained KV first, least recently used first, and never leaks a slot.
Integrity (live + retained + free == the pool, one owner per slot) is checked after every step.
"""
from __future__ import annotations

from akv_core.cache.key import build_key
from akv_core.cache.kv_cache import KVCache
from akv_core.cache.layout import expand
from akv_core.cache.ops import validate_operations
from akv_core.cache.radix import HOLE
from akv_core.cache.simulator import CacheSimulator
from test_cache_planner import agent_history, fresh_state, run_symbolic
from test_cache_support import HEADER, SymbolicKV, render

ROLLING_WINDOW = 3


def rolling(n_messages: int) -> tuple[dict[str, list[int]] | None, list[int] | None]:
    """A keep-last-window policy over `n_messages` equal messages: drop and reposition every step."""
    triggers = list(range(ROLLING_WINDOW + 2, n_messages))
    drops = {str(t): [t - ROLLING_WINDOW - 1] for t in triggers}
    return drops or None, triggers or None


def trajectory(turns: int) -> list[tuple[list[tuple[int, ...]], dict | None, list[int] | None]]:
    """Each request of a rolling agent trajectory: (messages, drop_message, reposition)."""
    messages = [tuple(range(1000 + 10 * i, 1010 + 10 * i)) for i in range(turns + 2)]
    return [(messages[:n], *rolling(n)) for n in range(2, turns + 3)]


def test_the_history_before_a_drop_finds_its_kv_retained():
    """An earlier turn of the same history (before message 5 dropped message 3) is asked again."""
    cache, kv = KVCache(1000), SymbolicKV()
    messages = agent_history(3)
    rendered, earlier = render(messages), render(messages[:5])
    start, end = rendered.spans[3]
    run_symbolic(cache, kv, rendered, {"5": [3]}, None)
    assert cache.stats().slots_retained == end - start     # message 3: read by no path end, kept
    plan = cache.plan(build_key(earlier, validate_operations(5, None, None)), 2)
    assert plan.revive.token_offsets == tuple(range(start, end)) and not plan.restore
    state, usage = run_symbolic(cache, kv, earlier, None, None)
    assert usage.prefilled_tokens == len(HEADER) and usage.retained_tokens == end - start
    assert state == fresh_state(earlier, None, None)       # the revived KV is the state before the drop
    assert cache.stats().slots_retained == 0
    _, again = run_symbolic(cache, kv, rendered, {"5": [3]}, None)   # and the later history is whole
    assert again.prefilled_tokens == 1


def test_the_history_before_a_reposition_finds_its_birth_slots_and_copies_retained():
    """The later reposition moved keys (their birth slots are retained) and superseded the
    earlier record's copies (retained too): the earlier state comes back without any forward."""
    cache, kv = KVCache(2000), SymbolicKV()
    rendered = render(agent_history(4))
    later = ({"5": [2], "7": [3]}, [5, 7])
    earlier_messages = agent_history(4)[:8]
    earlier = ({"5": [2]}, [5])
    run_symbolic(cache, kv, render(earlier_messages), *earlier)
    run_symbolic(cache, kv, rendered, *later)
    moved = cache.plan(build_key(render(earlier_messages), validate_operations(8, *earlier)), 2)
    assert moved.revive.token_offsets and moved.revive.copies and not moved.restore
    state, usage = run_symbolic(cache, kv, render(earlier_messages), *earlier)
    assert usage.prefilled_tokens == 1 and usage.retained_tokens > 0
    assert state == fresh_state(render(earlier_messages), *earlier)
    state, usage = run_symbolic(cache, kv, rendered, *later)   # and the later state is whole again
    assert usage.prefilled_tokens == 1
    assert state == fresh_state(rendered, *later)


def test_a_second_run_of_a_trajectory_prefills_one_token_per_request():
    cache, kv = KVCache(5000), SymbolicKV()
    first = [run_symbolic(cache, kv, render(m), d, r) for m, d, r in trajectory(8)]
    second = [run_symbolic(cache, kv, render(m), d, r) for m, d, r in trajectory(8)]
    assert sum(u.prefilled_tokens for _, u in first) > 10 * len(first)
    assert [u.prefilled_tokens for _, u in second] == [1] * len(second)
    assert sum(u.retained_tokens for _, u in second) > 0
    assert [s for s, _ in second] == [s for s, _ in first]   # the same states, token for token


def test_under_pressure_retained_kv_goes_first_least_recently_used_first():
    """Two histories leave retained KV; a newcomer short of room evicts the older history's
    retained KV alone: no live KV is evicted while retained KV is left, and no slot leaks."""
    sim = CacheSimulator(400)
    a = [(70 + i,) * 12 for i in range(6)]
    b = [(90 + i,) * 12 for i in range(6)]
    for history in (a, b):
        sim.request(render(history), {"5": [2, 3]}, [5])
        sim.check_integrity()
    retained = {name: _retained_on(sim, history[0][0]) for name, history in (("a", a), ("b", b))}
    assert retained["a"] == retained["b"] > 0
    stats = sim.stats()
    short = stats.slots_free + 1   # one slot short: eviction must free something
    sim.request(render([(50,) * (short - len(render([()]).token_ids))]))
    sim.check_integrity()
    stats = sim.stats()
    assert stats.slots_evicted == 0 and stats.slots_retained_evicted > 0
    assert _retained_on(sim, a[0][0]) < retained["a"] and _retained_on(sim, b[0][0]) == retained["b"]
    assert stats.slots_used + stats.slots_free == stats.slots_total


def test_retained_copies_go_before_retained_tokens_and_come_back_without_a_forward():
    """A rolling history retains the copies each reposition superseded and the dropped tokens.
    Short of room, eviction takes the copies first: the earlier state then re-rotates them
    again from the retained birth slots, and still prefills nothing but its last token."""
    cache, kv = KVCache(5000), SymbolicKV()
    requests = trajectory(8)
    for messages, drops, repos in requests:
        run_symbolic(cache, kv, render(messages), drops, repos)
    copies = sum(node.retained for node in cache.tree._nodes() if node.record is not None)
    tokens = cache.tree.retained_slots - copies
    assert copies > tokens > 0
    cache.tree.evict(copies)
    cache.check_integrity()
    assert cache.tree.retained_slots == tokens and cache.stats().slots_evicted == 0
    messages, drops, repos = requests[-3]
    plan = cache.plan(build_key(render(messages), validate_operations(len(messages), drops, repos)), 2)
    assert plan.restore.copy_holes and not plan.restore.token_holes and plan.revive.token_offsets
    state, usage = run_symbolic(cache, kv, render(messages), drops, repos)
    assert usage.prefilled_tokens == 1 and usage.retained_tokens > 0
    assert state == fresh_state(render(messages), drops, repos)


def test_retained_kv_beside_a_running_request_is_evictable_and_what_it_revived_is_not():
    """A running request locks its path: the retained KV there that it does not read may go,
    the KV it revived (it reads it) may not. Its computed state stays exact."""
    cache, kv = KVCache(120), SymbolicKV()
    rendered = render(agent_history(4))
    run_symbolic(cache, kv, rendered, {"7": [3, 5]}, None)
    run_symbolic(cache, kv, rendered, {"5": [2], "7": [3, 5]}, None)   # message 2 retained too
    cache.check_integrity()
    first = build_key(rendered, validate_operations(10, {"7": [3, 5]}, None))   # reads 2, not 3 and 5
    plan = cache.plan(first, 2)
    assert plan.revive.token_offsets == tuple(range(*rendered.spans[2])) and not plan.revive.copies
    lease = cache.admit(plan, 2)
    layout = expand(cache.tree.path(plan.match.node), lease)
    cache.check_integrity()
    assert cache.tree.retained_slots > 0 and cache.tree.evictable_slots >= cache.tree.retained_slots
    filler = build_key(render([(60,) * (cache.allocator.free_count + cache.tree.retained_slots - 4)]),
                       validate_operations(1, None, None))
    filler_plan = cache.plan(filler, 2)
    assert cache.can_admit(filler_plan, 2)
    other = cache.admit(filler_plan, 2)
    cache.check_integrity()
    assert cache.tree.retained_slots == 0 and cache.stats().slots_evicted == 0
    for stage in expand(cache.tree.path(filler_plan.match.node), other).stages:
        kv.run_stage(stage)    # the newcomer writes its slots first: a shared slot would show
    for stage in layout.stages:
        kv.run_stage(stage)
    assert HOLE not in layout.view_slots
    assert kv.state(layout.view_slots, layout.end_position) == fresh_state(rendered, {"7": [3, 5]}, None)
    cache.release(other, keep_prompt=False)
    cache.release(lease, keep_prompt=True)
    cache.check_integrity()


def _retained_on(sim: CacheSimulator, first_token: int) -> int:
    """Retained slots on the tree nodes whose run starts with `first_token`."""
    return sum(node.retained for node in sim.cache.tree._nodes()
               if node.record is None and len(node.tokens) and node.tokens[0] == first_token)
