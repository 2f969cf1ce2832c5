"""The planner and radix tree: reuse, operation records, accounting, integrity."""
from __future__ import annotations

import pytest

from akv_core.cache.key import REPOS, DropRecord, build_key
from akv_core.cache.kv_cache import KVCache
from akv_core.cache.layout import expand
from akv_core.cache.planner import end_position, plan_request
from akv_core.cache.ops import validate_operations
from akv_core.cache.simulator import CacheSimulator
from test_cache_support import HEADER, SymbolicKV, account, reference_state, render

SYSTEM, TASK = (1, 2, 3, 4), (5, 6, 7)
CALL, RESULT = (8, 9), (10, 11, 12, 13, 14)


def agent_history(turns: int) -> list[tuple[int, ...]]:
    history = [SYSTEM, TASK]
    for turn in range(turns):
        history += [CALL + (20 + turn,), RESULT + (40 + turn,)]
    return history


def serve(sim: CacheSimulator, messages, drops=None, repos=None):
    usage = sim.request(render(messages), drops, repos)
    sim.check_integrity()
    return usage


def test_key_places_drop_before_reposition_after_the_trigger():
    rendered = render([SYSTEM, TASK, CALL, RESULT])
    key = build_key(rendered, validate_operations(4, {"3": [1, 2]}, [3]))
    assert key.records == ((14, DropRecord(((4, 9),))), (14, REPOS))


def test_agent_loop_reuses_the_previous_prompt():
    sim = CacheSimulator(1000)
    first = serve(sim, agent_history(1))
    assert (first.prefilled_tokens, first.cached_tokens) == (first.prompt_tokens, 0)
    second = serve(sim, agent_history(2))
    # The previous prompt's messages are reused, its generation header is not (it is re-rendered).
    assert second.cached_tokens == len(render(agent_history(1)).token_ids) - 2
    assert second.prefilled_tokens == second.prompt_tokens - second.cached_tokens


def test_same_history_and_operations_is_a_full_hit():
    sim = CacheSimulator(1000)
    messages, drops, repos = agent_history(3), {"5": [3]}, [5]
    serve(sim, messages, drops, repos)
    again = serve(sim, messages, drops, repos)
    # Everything but the last prompt token, whose logits start decoding.
    assert again.prefilled_tokens == 1
    assert again.cached_tokens + again.drop_skipped_tokens == again.prompt_tokens - 1
    assert again.repos_tokens == 0


def test_same_tokens_with_other_operations_share_only_the_common_prefix():
    sim = CacheSimulator(1000)
    messages = agent_history(3)
    rendered = render(messages)
    serve(sim, messages, {"5": [3]})
    # Message 3's KV was retained when the first request ended (nobody running reads it): a
    # history that keeps it visible revives it, and computes what follows the record where the
    # histories part; the tokens between (messages 4 and 5) are reused.
    trigger_end = rendered.spans[5][1]
    other = serve(sim, messages, {"5": [2]})
    assert other.prefilled_tokens == other.prompt_tokens - trigger_end
    assert other.retained_tokens == _length(rendered, 3)
    sim.cache.tree.evict(sim.cache.tree.retained_slots)   # pool pressure takes retained KV first
    sim.check_integrity()
    plain = serve(sim, messages)   # message 2, retained by the second request in turn, was evicted
    assert plain.prefilled_tokens == _length(rendered, 2) + plain.prompt_tokens - trigger_end
    assert plain.retained_tokens == 0
    again = serve(sim, messages, {"5": [3]})   # everything is back: a full hit
    assert again.prefilled_tokens == 1


def _length(rendered, message: int) -> int:
    start, end = rendered.spans[message]
    return end - start


def test_dropped_kv_is_retained_once_no_running_request_needs_it():
    cache = KVCache(1000)
    messages = agent_history(3)
    rendered = render(messages)
    plain_key = build_key(rendered, validate_operations(8, None, None))
    cache.release(cache.admit(cache.plan(plain_key), 0), keep_prompt=True)
    before = cache.stats().slots_cached
    # A running request that keeps message 3 visible locks the path...
    running = cache.admit(cache.plan(plain_key), 0)
    drop_key = build_key(rendered, validate_operations(8, {"5": [3]}, None))
    cache.release(cache.admit(cache.plan(drop_key), 0), keep_prompt=True)
    cache.check_integrity()
    grown = cache.stats().slots_cached
    assert grown > before            # ...so the dropped KV stays
    cache.release(running, keep_prompt=True)
    cache.release(cache.admit(cache.plan(drop_key), 0), keep_prompt=True)
    cache.check_integrity()
    start, end = rendered.spans[3]
    assert cache.stats().slots_cached == grown                   # retained when nobody reads it...
    assert cache.stats().slots_retained == cache.tree.holes == end - start
    revived = cache.plan(plain_key)
    assert revived.revive.token_offsets == tuple(range(start, end)) and not revived.restore
    assert revived.usage.prefilled_tokens == 1 and revived.usage.retained_tokens == end - start
    cache.tree.evict(cache.tree.retained_slots)                  # ...until eviction takes it first
    cache.check_integrity()
    assert cache.stats().slots_cached == grown - (end - start) and cache.tree.holes == end - start
    refill = cache.plan(plain_key)
    assert refill.restore.token_holes == tuple(range(start, end))  # needed visible again: recomputed alone
    assert refill.usage.prefilled_tokens == end - start + 1
    cache.release(cache.admit(refill, 0), keep_prompt=True)
    cache.check_integrity()
    assert cache.tree.holes == 0


def test_a_trigger_dropping_itself_is_accounted_as_the_reference_does():
    """`trigger included` policies send a message dropped at its own boundary (upstream's drop_target_tokens)."""
    sim = CacheSimulator(1000)
    serve(sim, agent_history(3))
    messages = agent_history(4)
    usage = serve(sim, messages, {"9": [3, 4, 9]}, [9])
    reused = len(render(agent_history(3)).token_ids) - 2
    expected = account(build_key(render(messages), validate_operations(10, {"9": [3, 4, 9]}, [9])), reused, 0)
    kept = account(build_key(render(messages), validate_operations(10, {"9": [3, 4]}, [9])), reused, 0)
    assert (usage.drop_skipped_tokens, usage.repos_tokens, usage.cached_tokens, usage.prefilled_tokens) == \
        (expected["drop_skipped"], expected["repos"], expected["cached"], expected["prefilled"])
    # The reposition after it leaves the dropped trigger no position.
    assert expected["end_position"] == kept["end_position"] - len(RESULT) - 1


def test_drop_then_reposition_accounting_matches_the_reference():
    sim = CacheSimulator(1000)
    serve(sim, agent_history(3))
    messages = agent_history(4)
    usage = serve(sim, messages, {"9": [3, 4]}, [9])
    key = build_key(render(messages), validate_operations(10, {"9": [3, 4]}, [9]))
    reused = len(render(agent_history(3)).token_ids) - 2
    expected = account(key, reused, 0)
    assert usage.drop_skipped_tokens == expected["drop_skipped"] == len(CALL) + 1 + len(RESULT) + 1
    assert usage.repos_tokens == expected["repos"] > 0
    assert usage.cached_tokens == expected["cached"] == len(SYSTEM + TASK + CALL) + 1
    assert usage.prefilled_tokens == expected["prefilled"]


def test_end_position_counts_what_reposition_compacts():
    rendered = render([SYSTEM, TASK, CALL, RESULT])
    n = len(rendered.token_ids)
    assert end_position(build_key(rendered, validate_operations(4, {"3": [1]}, None))) == n
    assert end_position(build_key(rendered, validate_operations(4, {"3": [1]}, [3]))) == n - len(TASK)
    assert end_position(build_key(rendered, validate_operations(4, None, [3]))) == n


def test_eviction_frees_least_recently_used_unlocked_leaves():
    sim = CacheSimulator(40)
    a = [SYSTEM, TASK, CALL]
    b = [SYSTEM, (30, 31, 32, 33, 34, 35), RESULT, RESULT]
    serve(sim, a)
    serve(sim, b)
    serve(sim, [SYSTEM, (50,) * 12, CALL])   # needs room: a's branch is the oldest leaf
    again_b = serve(sim, b)
    assert again_b.cached_tokens > len(SYSTEM)
    again_a = serve(sim, a)
    assert again_a.cached_tokens == len(SYSTEM)


def test_locked_paths_survive_eviction_and_waiting_is_reported():
    cache = KVCache(30)
    rendered = render([SYSTEM, TASK, CALL])
    key = build_key(rendered, validate_operations(3, None, None))
    plan = cache.plan(key)
    lease = cache.admit(plan, decode_reserve=4)
    cache.release(lease, keep_prompt=True)
    held = cache.admit(cache.plan(key), decode_reserve=4)     # locks the cached path
    other = build_key(render([(60,) * 8, (61,) * 4]), validate_operations(2, None, None))
    other_plan = cache.plan(other)
    assert not cache.can_admit(other_plan, decode_reserve=4)  # only the locked path could make room
    cache.check_integrity()
    cache.release(held, keep_prompt=True)
    assert cache.can_admit(cache.plan(other), decode_reserve=4)
    cache.check_integrity()


def test_cancelled_request_leaves_nothing_behind():
    cache = KVCache(100)
    key = build_key(render(agent_history(2)), validate_operations(6, {"5": [3]}, [5]))
    lease = cache.admit(cache.plan(key), decode_reserve=8)
    cache.release(lease, keep_prompt=False)
    cache.check_integrity()
    assert cache.stats().slots_used == 0


def test_a_cleared_cache_serves_as_a_new_one_and_refuses_while_a_request_holds_slots():
    cache = KVCache(100)
    key = build_key(render(agent_history(2)), validate_operations(6, {"5": [3]}, [5]))
    cache.release(cache.admit(cache.plan(key), decode_reserve=2), keep_prompt=True)
    assert cache.plan(key).usage.cached_tokens > 0
    held = cache.admit(cache.plan(key), decode_reserve=2)
    with pytest.raises(RuntimeError, match="hold slots"):
        cache.clear()
    cache.release(held, keep_prompt=True)
    cache.clear()
    cache.check_integrity()
    assert cache.stats() == KVCache(100).stats()
    assert cache.plan(key).usage == KVCache(100).plan(key).usage


def run_symbolic(cache: KVCache, kv: SymbolicKV, rendered, drops, repos, max_tokens: int = 2,
                 thinking: bool = False, chunk: int | None = None):
    """Serve one request symbolically; `chunk` runs every stage in rows of that many tokens."""
    key = build_key(rendered, validate_operations(len(rendered.spans), drops, repos, thinking))
    plan = cache.plan(key, max_tokens)
    if not cache.can_admit(plan, max_tokens):
        return None
    lease = cache.admit(plan, max_tokens)
    layout = expand(cache.tree.path(plan.match.node), lease)
    assert layout.end_position == plan.end_position
    assert len(layout.view_slots) == plan.visible_tokens
    for stage in layout.stages:
        size = chunk or len(stage.token_ids)
        for start in range(0, len(stage.token_ids), size):
            kv.run_stage(stage.rows(start, min(start + size, len(stage.token_ids))))
    state = kv.state(layout.view_slots, layout.end_position)
    cache.release(lease, keep_prompt=True)
    cache.check_integrity()
    return state, plan.usage


def fresh_state(rendered, drops, repos, thinking: bool = False):
    state, usage = run_symbolic(KVCache(10_000), SymbolicKV(), rendered, drops, repos, thinking=thinking)
    assert usage.prefilled_tokens == usage.prompt_tokens
    key = build_key(rendered, validate_operations(len(rendered.spans), drops, repos, thinking))
    assert state == reference_state(key)
    return state


def test_reused_state_equals_a_fresh_computation_across_operations():
    cache, kv = KVCache(10_000), SymbolicKV()
    requests = [
        (agent_history(2), None, None),
        (agent_history(3), {"7": [3]}, None),
        (agent_history(3), {"7": [3]}, [7]),
        (agent_history(4), {"7": [3], "9": [2, 5]}, [7, 9]),
        (agent_history(4), None, [9]),
        (agent_history(4), {"9": [3]}, [9]),
        (agent_history(4), {"7": [3], "9": [2, 5]}, [7, 9]),
    ]
    for messages, drops, repos in requests:
        rendered = render(messages)
        state, _ = run_symbolic(cache, kv, rendered, drops, repos)
        assert state == fresh_state(rendered, drops, repos)


def test_restore_after_eviction_equals_the_never_evicted_run():
    messages, drops, repos = agent_history(4), {"5": [2, 3], "9": [4]}, [5, 9]
    rendered = render(messages)
    for filler, everything in ((44, False), (56, True)):
        cache, kv = KVCache(120), SymbolicKV()
        before, _ = run_symbolic(cache, kv, rendered, drops, repos)
        # Another history takes the room: a smaller one evicts the tail, including the last
        # reposition's copies, which are the only KV of the keys they moved (their birth
        # slots were freed), so those keys are recomputed with what they attended to; a
        # larger one evicts the whole history.
        run_symbolic(cache, kv, render([(70,) * filler, (71,) * filler]), None, None)
        assert cache.stats().slots_evicted > 0
        after, usage = run_symbolic(cache, kv, rendered, drops, repos)
        assert 1 < usage.prefilled_tokens
        assert (usage.prefilled_tokens == len(rendered.token_ids)) == everything
        assert after == before == fresh_state(rendered, drops, repos)


def test_copies_whose_birth_slots_are_kept_are_evicted_before_any_leaf():
    """A request still running when the history finished kept the birth slots (a running
    request's path is never punched), so the copies are cheap: eviction takes them first
    and the next request re-rotates them again without any forward."""
    messages, drops, repos = agent_history(4), {"5": [2, 3]}, [5]
    rendered = render(messages)
    cache, kv = KVCache(200), SymbolicKV()
    plain = build_key(rendered, validate_operations(len(rendered.spans), None, None))
    run_symbolic(cache, kv, rendered, None, None)
    held = cache.admit(cache.plan(plain, 2), 2)
    before, _ = run_symbolic(cache, kv, rendered, drops, repos)
    cache.release(held, keep_prompt=True)
    copies = sum(node.size for node in cache.tree._nodes() if node.record is not None)
    assert copies > 0 and all(not node.holes for node in cache.tree._nodes() if node.record is None)
    filler = render([(70,) * (cache.allocator.free_count + 1)])   # header and decode: 5 slots short
    lease = cache.admit(cache.plan(build_key(filler, validate_operations(1, None, None)), 2), 2)
    assert cache.stats().slots_evicted == copies > 5        # the copies alone, whole
    cache.release(lease, keep_prompt=False)
    after, usage = run_symbolic(cache, kv, rendered, drops, repos)
    assert usage.prefilled_tokens == 1                      # re-rotated again, nothing recomputed
    assert after == before


def test_records_holding_the_only_copy_of_their_keys_are_evicted_after_other_leaves():
    """A's last reposition record holds the only KV of the keys it moved: evicting it would
    mean recomputing A's whole history. Short of room, a newer plain history's tail goes first."""
    messages, drops, repos = agent_history(4), {"5": [2, 3], "9": [4]}, [5, 9]
    rendered = render(messages)
    cache, kv = KVCache(150), SymbolicKV()
    run_symbolic(cache, kv, rendered, drops, repos)
    sole = [node for node in cache.tree._nodes() if node.record is not None and node.sole]
    assert sole and all(node.size for node in sole)
    run_symbolic(cache, kv, render([(60,) * 30, (61,) * 30]), None, None)   # B, used later than A
    # Room for A's header leaf and more, once the retained KV (evicted first) is gone.
    filler = render([(70,) * (cache.allocator.free_count + cache.tree.retained_slots + 4)])
    lease = cache.admit(cache.plan(build_key(filler, validate_operations(1, None, None)), 2), 2)
    assert cache.stats().slots_evicted > 2 and cache.tree.retained_slots == 0
    assert all(node.parent is not None and not node.holes for node in sole)
    cache.release(lease, keep_prompt=False)
    _, usage = run_symbolic(cache, kv, rendered, drops, repos)
    assert usage.prefilled_tokens <= len(HEADER) + 1        # A lost only its header leaf


@pytest.mark.parametrize("running_moves_keys", [True, False])
def test_a_request_waits_rather_than_evict_the_only_copy_of_a_window_when_waiting_helps(running_moves_keys):
    """Evicting A's `sole` record would make A's next request recompute A's whole history. While
    B runs and will free room when it ends (the reused keys its new reposition moves), C waits;
    when B frees nothing, waiting would not help and C takes the record at once."""
    cache, kv = KVCache(400), SymbolicKV()
    run_symbolic(cache, kv, render(agent_history(4)), {"5": [2, 3], "9": [4]}, [5, 9])   # A
    other = [tuple(range(2000 + 20 * i, 2020 + 20 * i)) for i in range(8)]
    if running_moves_keys:
        run_symbolic(cache, kv, render(other[:6]), {"5": [1]}, [5])
        b_key = build_key(render(other), validate_operations(8, {"5": [1], "7": [2]}, [5, 7]))
    else:
        b_key = build_key(render(other[:3]), validate_operations(3, None, None))
    running = cache.admit(cache.plan(b_key, 2), 2)
    assert (running.frees_on_release > 0) == running_moves_keys
    sole = sum(node.size for node in cache.tree._nodes() if node.sole and not node.lock_ref)
    cheap = cache.tree.cheap_evictable_slots(cache.tree.root)
    assert sole > 0 and cheap <= cache.tree.evictable_slots - sole
    c_key = build_key(render([(70,) * (cache.allocator.free_count + cheap - 1)]), validate_operations(1, None, None))
    plan = cache.plan(c_key, 2)                 # a few slots more than free + cheap: a sole record must go
    assert cache.can_admit(plan, 2) != running_moves_keys
    if running_moves_keys:
        cache.release(running, keep_prompt=True)
        plan = cache.plan(c_key, 2)
        assert cache.can_admit(plan, 2)         # nothing runs
    lease = cache.admit(plan, 2)
    cache.release(lease, keep_prompt=True)
    if not running_moves_keys:
        cache.release(running, keep_prompt=True)
    cache.check_integrity()


def test_freed_keys_and_copies_a_branch_reads_are_restored_alone():
    """A dropped message 3 after reposition 5 moved it: a branch that keeps it gets its birth slot
    recomputed (with message 2, which message 3 attended to) and reposition 5's copies re-rotated.
    The first history read messages 4 to 7 through reposition 7's copies, which freed their birth
    slots, and the branch reads them as they were before that record: they are recomputed too.
    Messages 0 and 1 are reused as they are."""
    cache, kv = KVCache(1000), SymbolicKV()
    rendered = render(agent_history(4))
    dropping = ({"5": [2], "7": [3]}, [5, 7])
    branch = ({"5": [2], "7": [4]}, [5, 7])
    run_symbolic(cache, kv, rendered, *dropping)
    assert cache.tree.holes > 0
    cache.tree.evict(cache.tree.retained_slots)   # pool pressure took the retained KV: it is freed
    key = build_key(rendered, validate_operations(10, *branch))
    plan = cache.plan(key)
    msg2, msg7 = rendered.spans[2], rendered.spans[7]
    assert plan.restore.token_holes == tuple(range(msg2[0], msg7[1]))
    assert plan.restore.copy_holes and all(record == 1 for record, _ in plan.restore.copy_holes)
    trigger_end = rendered.spans[7][1]
    assert plan.match.tokens == trigger_end                 # messages 4 to 7 are reused as they are
    assert plan.usage.prefilled_tokens == (msg7[1] - msg2[0]) + len(key) - trigger_end
    state, _ = run_symbolic(cache, kv, rendered, *branch)
    assert state == fresh_state(rendered, *branch)
    again = cache.plan(key)                                 # everything it restored stayed
    assert not again.restore and again.usage.prefilled_tokens == 1
    state, _ = run_symbolic(cache, kv, rendered, *dropping)
    assert state == fresh_state(rendered, *dropping)


@pytest.mark.parametrize("pool", [100_000, 1000])
def test_a_rolling_drop_and_reposition_loop_keeps_the_tree_near_the_visible_window(pool):
    """Superseded re-rotated copies and dropped keys are retained, not read: the live KV follows the
    window, not the history, and in a pool that holds little more than the window, eviction takes
    the retained KV alone."""
    sim = CacheSimulator(pool)
    messages = [tuple(range(1000 + 20 * i, 1020 + 20 * i)) for i in range(60)]
    window = 12
    for n in range(2, 61):
        triggers = range(window + 2, n)
        drops = {str(t): [t - window - 1] for t in triggers}
        usage = serve(sim, messages[:n], drops or None, list(triggers) or None)
        if n > window + 3:
            assert usage.prefilled_tokens == 20 + 2   # the new message and the header: nothing restored
    # One live slot per visible key (the moved ones keep only their copy: their birth slots are
    # retained), plus the 2-token assistant header each earlier request left as a leaf.
    stats = sim.stats()
    assert stats.slots_cached - stats.slots_retained <= (window + 2) * 20 + 2 * len(messages)
    assert stats.slots_evicted == 0 and (stats.slots_retained_evicted > 0) == (pool < 100_000)


def test_a_cold_rolling_history_recycles_dead_copies_and_restores_exactly():
    """Restored cold, a drop-and-reposition-every-step history re-rotates the window at every
    record; copies a later record supersedes are dead, and their slots serve later copies."""
    messages = [tuple(range(1000 + 20 * i, 1020 + 20 * i)) for i in range(30)]
    window = 4
    triggers = list(range(window + 2, 30))
    drops = {str(t): [t - window - 1] for t in triggers}
    rendered = render(messages)
    key = build_key(rendered, validate_operations(30, drops, triggers))
    plan = KVCache(100_000).plan(key)
    assert sum(plan.copies) > 3 * len(key)                  # one copy per key per record...
    assert plan.copy_slots <= (window + 2) * 20             # ...but about a window of them alive at once
    assert plan.slots_needed == len(key) + plan.copy_slots
    cache, kv = KVCache(plan.slots_needed + 2), SymbolicKV()   # the pool the recycled plan needs
    state, usage = run_symbolic(cache, kv, rendered, drops, triggers, max_tokens=2)
    assert state == reference_state(key)
    assert cache.tree.cached_slots <= len(key) + plan.copy_slots
    again, _ = run_symbolic(cache, kv, rendered, drops, triggers, max_tokens=2)
    assert again == state


def test_a_reuse_that_could_never_fit_beside_its_path_is_planned_cold():
    """Reusing a path keeps its record's copies while two new records add theirs; cold, the
    dead copies are recycled. When only the cold plan fits the pool, the cold plan is used."""
    messages = [tuple(range(1000 + 20 * i, 1020 + 20 * i)) for i in range(8)]
    short_ops = ({"5": [1]}, [5])
    long_ops = ({"5": [1], "6": [2], "7": [3]}, [5, 6, 7])
    cache, kv = KVCache(250), SymbolicKV()
    # A request on the plain history runs meanwhile, so the birth slots stay (see above).
    run_symbolic(cache, kv, render(messages[:6]), None, None)
    held = cache.admit(cache.plan(build_key(render(messages[:6]), validate_operations(6, None, None)), 2), 2)
    run_symbolic(cache, kv, render(messages[:6]), *short_ops)
    cache.release(held, keep_prompt=True)
    rendered = render(messages)
    key = build_key(rendered, validate_operations(8, *long_ops))
    warm = plan_request(cache.tree, key)
    assert warm.match.tokens > 0
    assert warm.slots_needed + 2 + cache.tree.slots_on_path(warm.match.node) > 250   # never fits warm
    plan = cache.plan(key, 2)
    assert plan.match.tokens == 0 and plan.usage.prefilled_tokens == len(key)
    state, usage = run_symbolic(cache, kv, rendered, *long_ops)
    assert usage.prefilled_tokens == len(key)
    assert state == reference_state(key)


def test_a_running_request_keeps_what_a_finishing_one_would_free():
    """A finishes a longer history whose later reposition supersedes copies B (still running) reads."""
    cache, kv = KVCache(1000), SymbolicKV()
    short = render(agent_history(2))
    long = render(agent_history(3))
    ops_short = ({"5": [3]}, [5])
    ops_long = ({"5": [3], "7": [2]}, [5, 7])
    run_symbolic(cache, kv, short, *ops_short)           # the cached state both extend
    short_key = build_key(short, validate_operations(6, *ops_short))
    plan = cache.plan(short_key)
    running = cache.admit(plan, 2)                      # B: locks the path through message 5's records
    layout = expand(cache.tree.path(plan.match.node), running)
    for stage in layout.stages:
        kv.run_stage(stage)
    run_symbolic(cache, kv, long, *ops_long)            # A: computes, finishes, frees what it can
    run_symbolic(cache, kv, render([(99,) * 40]), None, None)   # reuses any freed slot
    assert kv.state(layout.view_slots, layout.end_position) == reference_state(short_key)
    cache.release(running, keep_prompt=True)
    cache.check_integrity()


# ---- thinking_drop: the reasoning tokens inside assistant messages -------------------------------

REASONING = (1, 4)   # tokens 1..3 of a thinking call: its rendered reasoning


def thinking_history(turns: int):
    """(messages, reasoning spans): an agent whose calls carry reasoning (tokens 70-72)."""
    messages = [SYSTEM, TASK]
    for turn in range(turns):
        messages += [(8, 70 + turn, 71, 72, 9, 20 + turn), RESULT + (40 + turn,)]
    return messages, {2 + 2 * turn: REASONING for turn in range(turns)}


def reasoning_at(rendered, index: int) -> tuple[int, int]:
    start = rendered.spans[index][0]
    return start + REASONING[0], start + REASONING[1]


def test_thinking_drop_hides_each_reasoning_right_after_its_message_but_not_the_last():
    messages, reasoning = thinking_history(2)
    rendered = render(messages[:5], reasoning)   # message 4, the last one, thinks too
    key = build_key(rendered, validate_operations(5, None, None, thinking_drop=True))
    assert key.records == ((rendered.spans[2][1], DropRecord((reasoning_at(rendered, 2),))),)
    # Cumulative and deterministic: the grown history keeps that record and adds one for message 4.
    grown = render(messages, reasoning)
    key = build_key(grown, validate_operations(6, None, [3, 4], thinking_drop=True))
    assert key.records == ((grown.spans[2][1], DropRecord((reasoning_at(grown, 2),))), (grown.spans[3][1], REPOS),
                           (grown.spans[4][1], DropRecord((reasoning_at(grown, 4),))), (grown.spans[4][1], REPOS))
    assert key == build_key(render(messages, reasoning), validate_operations(6, None, [4, 3], thinking_drop=True))
    # Without the rule, or without reasoning, there is nothing to drop.
    assert build_key(grown, validate_operations(6, None, None)).records == ()
    assert build_key(render(messages), validate_operations(6, None, None, thinking_drop=True)).records == ()


def test_thinking_drop_repeated_is_a_full_hit_that_skips_the_reasoning():
    sim = CacheSimulator(1000)
    messages, reasoning = thinking_history(3)
    rendered = render(messages, reasoning)
    first = sim.request(rendered, thinking_drop=True)
    sim.check_integrity()
    assert first.prefilled_tokens == first.prompt_tokens and first.drop_skipped_tokens == 0
    again = sim.request(rendered, thinking_drop=True)
    sim.check_integrity()
    assert again.prefilled_tokens == 1
    assert again.drop_skipped_tokens == 3 * (REASONING[1] - REASONING[0])
    assert again.cached_tokens == again.prompt_tokens - 1 - again.drop_skipped_tokens
    # The agent's next turn reuses everything before it and accounts as the per-token reference.
    longer, longer_reasoning = thinking_history(4)
    grown = render(longer, longer_reasoning)
    usage = sim.request(grown, reposition=[9], thinking_drop=True)
    sim.check_integrity()
    key = build_key(grown, validate_operations(10, None, [9], thinking_drop=True))
    expected = account(key, len(rendered.token_ids) - 2, len(build_key(rendered, validate_operations(
        8, None, None, thinking_drop=True)).records))
    assert usage.drop_skipped_tokens == expected["drop_skipped"] == 3 * (REASONING[1] - REASONING[0])
    assert (usage.cached_tokens, usage.repos_tokens, usage.prefilled_tokens) == \
        (expected["cached"], expected["repos"], expected["prefilled"])
    assert usage.repos_tokens > 0


def test_thinking_drop_reuses_correct_state_mixed_with_other_requests():
    cache, kv = KVCache(10_000), SymbolicKV()
    requests = [(3, None, False), (3, None, True), (4, None, True), (4, [7], True), (4, None, False),
                (4, [7], True), (4, [9], False)]
    for turns, repos, thinking in requests:
        messages, reasoning = thinking_history(turns)
        rendered = render(messages, reasoning)
        state, _ = run_symbolic(cache, kv, rendered, None, repos, thinking=thinking)
        assert state == fresh_state(rendered, None, repos, thinking)
