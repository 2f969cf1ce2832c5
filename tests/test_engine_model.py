"""The engine on the real SmolLM2 weights: reuse, drop, reposition and restore are exact.

"Exact" means: the logits of every generated token equal those of a fresh
engine that computes the same history under the same operations from scratch
(fp32; only the order of floating-point sums differs, so within 1e-4).
"""
from __future__ import annotations

import threading

import pytest
import torch

from akv_core.cache.key import build_key
from akv_core.cache.kv_cache import KVCapacityError
from akv_core.cache.ops import validate_operations
from akv_core.cache.simulator import CacheSimulator
from akv_core.engine import Engine
from akv_core.request import RequestFailed
from test_model_support import SECRET, THOUGHT, engine_parts

pytestmark = pytest.mark.model


def thinking_agent(turns: int) -> list[dict]:
    """A growing tool-use history whose assistant turns carry reasoning."""
    history = agent(0)
    for turn in range(turns):
        history.append({"role": "assistant", "reasoning_content": f"Candidate {turn} is worth a search.",
                        "content": f"I will search for candidate number {turn}."})
        history.append({"role": "tool", "content": f"Result {turn}: city {turn} holds {turn + 3} million books."})
    return history


def agent(turns: int) -> list[dict]:
    """A growing tool-use history, as an agent would send it."""
    history = [{"role": "system", "content": "You are a research agent. Use the search tool."},
               {"role": "user", "content": "Which city hosts the largest library in Europe?"}]
    for turn in range(turns):
        history.append({"role": "assistant", "content": f"I will search for candidate number {turn}."})
        history.append({"role": "tool", "content": f"Result {turn}: the library in city {turn} holds "
                                                   f"{turn + 3} million books and opened in {1900 + turn}."})
    return history


@pytest.fixture(scope="module")
def shared():
    return engine_parts()


def new_engine(shared, kv_tokens: int = 2048, max_running: int = 8) -> Engine:
    model, tokenizer = shared
    # One thread per phase: on a busy shared CPU two threads wait on each other.
    return Engine(model, tokenizer, kv_tokens, max_running, threads={"prefill": 1, "decode": 1})


def run(engine: Engine, messages, drops=None, repos=None, max_tokens: int = 4, thinking: bool = False,
        text_drop=None):
    """Generate greedily; returns (generation, logits of every sampled token)."""
    logits = []
    engine.logits_probe = lambda handle, row: logits.append(row.clone())
    out = engine.generate(messages, drop_message=drops, reposition=repos, max_tokens=max_tokens,
                          thinking_drop=thinking, text_drop=text_drop)
    engine.logits_probe = None
    engine.check_integrity()
    usage = out.usage
    assert usage.prompt_tokens == (usage.prefilled_tokens + usage.cached_tokens + usage.repos_tokens
                                   + usage.drop_skipped_tokens)
    return out, torch.stack(logits)


def assert_same_logits(got, want):
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_prefix_hit_decodes_as_a_fresh_run(shared):
    engine = new_engine(shared)
    run(engine, agent(2))
    hit, hit_logits = run(engine, agent(3))
    assert hit.usage.cached_tokens > hit.usage.prefilled_tokens > 0
    fresh, fresh_logits = run(new_engine(shared), agent(3))
    assert fresh.usage.cached_tokens == 0
    assert hit.token_ids == fresh.token_ids
    assert_same_logits(hit_logits, fresh_logits)


def test_same_history_and_operations_hit_fully_and_other_operations_never_reuse_wrong_state(shared):
    engine = new_engine(shared)
    history = agent(4)
    first, first_logits = run(engine, history, {"7": [3]}, [7])
    again, again_logits = run(engine, history, {"7": [3]}, [7])
    assert again.usage.prefilled_tokens == 1 and again.usage.repos_tokens == 0
    assert_same_logits(again_logits, first_logits)
    for drops, repos in [({"7": [5]}, [5, 7])]:
        reused, reused_logits = run(engine, history, drops, repos)
        assert reused.usage.prefilled_tokens < reused.usage.prompt_tokens   # some prefix is reused
        _, fresh_logits = run(new_engine(shared), history, drops, repos)
        assert_same_logits(reused_logits, fresh_logits)


def attention_on(engine: Engine, messages, hidden: tuple[int, int], trigger_end: int,
                 **operations) -> tuple[float, float, int]:
    """Attention weight on the prompt tokens `hidden` from the rows after `trigger_end` (and the
    generated tokens), and from the rows between them and `trigger_end`; and the attention calls.

    A fresh engine computes the prompt in one forward whose slots are in prompt order.
    """
    seen = []   # (kv slots, attention weights [queries, heads, K]) of every attention call
    engine.model.attention_probe = lambda layer, seq, slots, probs: seen.append((slots.clone(), probs.clone()))
    try:
        run(engine, messages, max_tokens=3, **operations)
    finally:
        engine.model.attention_probe = None
    prompt_slots = next(slots for slots, probs in seen if probs.shape[0] > 1)
    watched = prompt_slots[hidden[0]:hidden[1]]
    after = before = 0.0
    for slots, probs in seen:
        on_hidden = torch.isin(slots, watched)
        if probs.shape[0] > 1:   # the prompt: rows are prompt offsets
            after += probs[trigger_end:][:, :, on_hidden].abs().sum().item()
            before += probs[hidden[1]:trigger_end][:, :, on_hidden].sum().item()
        else:
            after += probs[:, :, on_hidden].abs().sum().item()
    return after, before, len(seen)


def test_dropped_slots_get_exactly_zero_attention(shared):
    engine = new_engine(shared)
    rendered = engine.tokenizer.render(SECRET)
    secret_start, secret_end = rendered.spans[1]
    after, before, calls = attention_on(engine, SECRET, (secret_start, secret_end), rendered.spans[3][1],
                                        drops={"3": [1]})
    assert calls == 30 * 3 and after == 0.0
    assert before > 0.0   # the same slots were attended to before the drop
    assert engine.cache.tree.holes == secret_end - secret_start   # and retained once the request ended


def test_a_dropped_secret_is_forgotten_and_an_unrelated_drop_keeps_it(shared):
    engine = new_engine(shared)
    assert "4721" in run(engine, SECRET, max_tokens=14)[0].text
    assert "4721" not in run(engine, SECRET, {"3": [1]}, max_tokens=14)[0].text
    assert "4721" in run(engine, SECRET, {"3": [2]}, max_tokens=14)[0].text


def test_thinking_drop_gives_the_reasoning_exactly_zero_attention_after_its_message(shared):
    engine = new_engine(shared)
    rendered = engine.tokenizer.render(THOUGHT)
    start, end = rendered.reasoning_spans[2]
    trigger_end = rendered.spans[2][1]
    assert rendered.spans[2][0] < start < end < trigger_end
    after, before, calls = attention_on(engine, THOUGHT, (start, end), trigger_end, thinking=True)
    assert calls == 30 * 3 and after == 0.0
    assert before > 0.0   # the message's own content saw its reasoning
    assert engine.cache.tree.holes == end - start   # retained once the request ended


def test_a_secret_only_in_earlier_reasoning_is_forgotten_under_thinking_drop(shared):
    engine = new_engine(shared)
    assert "4721" in run(engine, THOUGHT, max_tokens=14)[0].text
    assert "4721" not in run(engine, THOUGHT, max_tokens=14, thinking=True)[0].text


def test_thinking_drop_equals_a_forward_with_the_reasoning_masked_and_repeats_as_a_full_hit(shared):
    from akv_core.model.batch import ForwardBatch, SeqAttention

    model = shared[0]
    engine = new_engine(shared)
    rendered = engine.tokenizer.render(THOUGHT)
    start, end = rendered.reasoning_spans[2]
    trigger_end, n = rendered.spans[2][1], len(rendered.token_ids)
    first, first_logits = run(engine, THOUGHT, max_tokens=3, thinking=True)
    assert first.usage.prefilled_tokens == n
    # The reference: the whole prompt in one forward, rows after message 2 masked off the reasoning.
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    mask[trigger_end:, start:end] = False
    slots = torch.arange(n)
    batch = ForwardBatch(torch.tensor(rendered.token_ids), torch.arange(n), slots,
                         [SeqAttention(0, n, slots, mask)], torch.tensor([n - 1]))
    masked = model.forward(batch, new_engine(shared, kv_tokens=n).kv)
    assert_same_logits(first_logits[:1], masked)
    _, plain_logits = run(new_engine(shared), THOUGHT, max_tokens=1)
    assert (plain_logits - masked).abs().max() > 1e-2   # the reasoning did matter
    again, again_logits = run(engine, THOUGHT, max_tokens=3, thinking=True)
    assert again.usage.prefilled_tokens == 1 and again.usage.repos_tokens == 0
    assert again.usage.drop_skipped_tokens == end - start
    assert again.usage.cached_tokens == n - 1 - (end - start)
    assert again.token_ids == first.token_ids
    assert_same_logits(again_logits, first_logits)
    # With a reposition after the last message the reasoning gap closes; reuse still equals a fresh run.
    moved, moved_logits = run(engine, THOUGHT, None, [3], max_tokens=3, thinking=True)
    assert moved.usage.repos_tokens > 0 and moved.usage.drop_skipped_tokens == end - start
    _, fresh_logits = run(new_engine(shared), THOUGHT, None, [3], max_tokens=3, thinking=True)
    assert_same_logits(moved_logits, fresh_logits)


def test_reposition_moves_keys_to_compacted_positions(shared):
    engine = new_engine(shared)
    model = engine.model
    rendered = engine.tokenizer.render(SECRET)
    drops, repos = {"3": [1]}, [3]
    handle = engine.submit(SECRET, drop_message=drops, reposition=repos, max_tokens=2)
    engine.step()
    request = engine.scheduler.running[0]   # admitted: its layout says where each visible key lives
    while not handle.done:
        engine.step()
    view = request.layout.view_slots
    kept = [t for t in range(rendered.header_start) if not rendered.spans[1][0] <= t < rendered.spans[1][1]]
    kept += list(range(rendered.header_start, len(rendered.token_ids)))
    assert len(view) == len(kept)
    # Layer 0 keys depend only on the token and its position: a fresh forward of the compacted
    # sequence computes them directly.
    compact = new_engine(shared)
    ids = [rendered.token_ids[t] for t in kept]
    from akv_core.model.batch import ForwardBatch, SeqAttention
    slots = torch.arange(len(ids))
    batch = ForwardBatch(torch.tensor(ids), torch.arange(len(ids)), slots, [SeqAttention(0, len(ids), slots)],
                         torch.tensor([len(ids) - 1]))
    model.forward(batch, compact.kv)
    torch.testing.assert_close(engine.kv.k[0][torch.tensor(view)], compact.kv.k[0][:len(ids)], atol=1e-5, rtol=0)
    # Keys before the dropped message keep their position: the very same slots, bits untouched.
    first = rendered.spans[1][0]
    plain = new_engine(shared)
    run(plain, SECRET, max_tokens=1)
    path = plain.cache.tree.path(plain.cache.plan(request.key).match.node)
    plain_slots = [s for node in path if node.record is None for s in node.slots][:first]
    assert torch.equal(engine.kv.k[5][torch.tensor(view[:first])], plain.kv.k[5][torch.tensor(plain_slots)])


def test_reposition_that_closes_no_gap_changes_nothing(shared):
    """Nothing is re-rotated and the logits are the plain run's. The second run finds the prompt cached and
    computes only its last rows, on torch's SDPA; the first attended in one pass over the prompt, on the float32
    path's attention kernel where it runs: the same sums in another order, so equal to float rounding."""
    engine = new_engine(shared)
    plain, plain_logits = run(engine, agent(3))
    moved, moved_logits = run(engine, agent(3), None, [5])
    assert moved.usage.repos_tokens == 0
    torch.testing.assert_close(moved_logits, plain_logits, atol=2e-4, rtol=0)
    assert torch.equal(moved_logits.argmax(-1), plain_logits.argmax(-1))


def test_restore_after_eviction_equals_the_never_evicted_run(shared):
    engine = new_engine(shared, kv_tokens=560)
    history, drops, repos = agent(4), {"5": [3], "9": [2, 4]}, [5, 9]
    first, first_logits = run(engine, history, drops, repos)
    # Another task with the same system prompt takes room: the history's tail goes, with the
    # last reposition's copies, which were the only KV of the keys they moved (their birth
    # slots were freed): those keys are recomputed at birth, with what they attended to,
    # and re-rotated again.
    filler = [history[0], {"role": "user", "content": "Tell me about the history of the printing press. " * 44}]
    run(engine, filler, max_tokens=2)
    assert engine.cache.stats().slots_evicted > 0
    restored, restored_logits = run(engine, history, drops, repos)
    assert 1 < restored.usage.prefilled_tokens < restored.usage.prompt_tokens
    assert restored.token_ids == first.token_ids
    assert_same_logits(restored_logits, first_logits)


@pytest.mark.parametrize("retained", [True, False])
def test_a_branch_restores_only_the_freed_keys_it_reads(shared, retained):
    """Message 3 is dropped after reposition 5 moved it, and its KV retained; a branch that keeps
    it revives it, with 5's superseded copies and the birth slots of messages 4-7 (the first
    history read them through reposition 7's copies), and computes only what follows record 7.
    Once eviction took the retained KV (freed), the branch recomputes messages 2-3 (message 3
    attended to 2) and re-rotates 5's copies; messages 4-7, read as they were before record 7,
    are recomputed too. Messages 0-1 are reused. Either way the logits equal a fresh run's."""
    engine = new_engine(shared)
    history, branch_ops = agent(4), ({"5": [2], "7": [4]}, [5, 7])
    run(engine, history, {"5": [2], "7": [3]}, [5, 7])
    assert engine.cache.tree.holes > 0
    if not retained:
        engine.cache.tree.evict(engine.cache.tree.retained_slots)
    branch, branch_logits = run(engine, history, *branch_ops)
    spans = engine.tokenizer.render(history).spans
    restored = 0 if retained else spans[7][1] - spans[2][0]
    assert branch.usage.prefilled_tokens == restored + branch.usage.prompt_tokens - spans[7][1]
    assert branch.usage.retained_tokens == (spans[7][1] - spans[3][0] if retained else 0)   # messages 3-7
    fresh, fresh_logits = run(new_engine(shared), history, *branch_ops)
    assert branch.token_ids == fresh.token_ids
    assert_same_logits(branch_logits, fresh_logits)


def test_a_cold_history_with_many_repositions_equals_the_step_by_step_run(shared):
    """Cold, the history's copies that later repositions supersede share slots (recycled);
    step by step, each request adds one record. Both must reach the same state."""
    drops, repos = {"5": [3], "7": [4, 5], "9": [7], "11": [2, 9]}, [5, 7, 9, 11]
    stepwise = new_engine(shared)
    for turns in range(3, 6):
        n = 2 + 2 * turns
        out, logits = run(stepwise, agent(turns), {t: d for t, d in drops.items() if int(t) < n},
                          [t for t in repos if t < n])
    cold = new_engine(shared)
    key = build_key(cold.tokenizer.render(agent(5)), validate_operations(12, drops, repos))
    plan = cold.cache.plan(key)
    assert plan.copy_slots < sum(plan.copies)
    fresh, fresh_logits = run(cold, agent(5), drops, repos)
    assert fresh.usage.prefilled_tokens == fresh.usage.prompt_tokens
    assert fresh.token_ids == out.token_ids
    assert_same_logits(fresh_logits, logits)


def test_batched_greedy_equals_one_at_a_time(shared):
    requests = [(agent(2), None, None), (agent(3), {"5": [3]}, [5]), (SECRET, {"3": [1]}, None)]
    alone = []
    for messages, drops, repos in requests:
        alone.append(run(new_engine(shared), messages, drops, repos)[0].token_ids)
    engine = new_engine(shared)
    handles = [engine.submit(m, drop_message=d, reposition=r, max_tokens=4) for m, d, r in requests]
    while not all(h.done for h in handles):
        engine.step()
        engine.check_integrity()
    assert [h.result().token_ids for h in handles] == alone


def test_usage_agrees_with_the_replay_simulator(shared):
    engine = new_engine(shared, kv_tokens=450)   # small enough that the last request was evicted
    simulator = CacheSimulator(450)
    sequence = [(agent(1), None, None), (agent(2), None, None), (agent(3), {"7": [3]}, None),
                (agent(4), {"7": [3], "9": [5]}, [9]), (SECRET, {"3": [1]}, [3]), (agent(4), None, None),
                (agent(5), {"7": [3], "9": [5], "11": [7]}, [9, 11]), (SECRET, {"3": [1]}, [3])]
    for messages, drops, repos in sequence:
        out = engine.generate(messages, drop_message=drops, reposition=repos, max_tokens=2)
        engine.check_integrity()
        rendered = engine.tokenizer.render(messages)
        replayed = simulator.request(rendered, drops, repos, completion_tokens=out.usage.completion_tokens,
                                     max_tokens=2)
        assert out.usage == replayed
    assert simulator.stats().slots_evicted == engine.cache.stats().slots_evicted > 0
    assert out.usage.prefilled_tokens > 1   # the repeated request was restored, not a full hit


def test_thinking_drop_usage_agrees_with_the_replay_simulator(shared):
    engine = new_engine(shared, kv_tokens=400)   # small enough that earlier turns get evicted
    simulator = CacheSimulator(400)
    sequence = [(thinking_agent(1), None, True), (thinking_agent(2), None, True), (thinking_agent(2), [5], True),
                (thinking_agent(3), None, False), (thinking_agent(3), [5, 7], True), (THOUGHT, None, True),
                (thinking_agent(3), [5, 7], True), (thinking_agent(3), None, True)]
    skipped = 0
    for messages, repos, thinking in sequence:
        out = engine.generate(messages, reposition=repos, max_tokens=2, thinking_drop=thinking)
        engine.check_integrity()
        replayed = simulator.request(engine.tokenizer.render(messages), None, repos, max_tokens=2,
                                     completion_tokens=out.usage.completion_tokens, thinking_drop=thinking)
        simulator.check_integrity()
        assert out.usage == replayed
        skipped += out.usage.drop_skipped_tokens
    assert skipped > 0
    assert simulator.stats().slots_evicted == engine.cache.stats().slots_evicted > 0


def rolling_keep_2(history: list[dict]) -> tuple[dict | None, list[int] | None]:
    """Each tool response beyond the 2 most recent drops the oldest kept one, then repositions."""
    tools = [i for i, message in enumerate(history) if message["role"] == "tool"]
    drops = {str(trigger): [tools[n - 2]] for n, trigger in enumerate(tools) if n >= 2}
    return drops or None, [int(trigger) for trigger in drops] or None


def test_a_trajectory_run_twice_agrees_with_the_replay_simulator_and_repeats_its_logits(shared):
    """The second run finds the earlier states of the history in retained KV. The pool is too
    small to retain all of it: eviction takes retained KV first, some requests revive it, others
    restore what was evicted; usage agrees with the simulator request for request, and every
    request's logits repeat the first run's."""
    engine, simulator = new_engine(shared, kv_tokens=500), CacheSimulator(500)
    first_logits, usages = [], []
    for run_index in range(2):
        for turns in range(1, 7):
            messages = agent(turns)
            drops, repos = rolling_keep_2(messages)
            out, logits = run(engine, messages, drops, repos, max_tokens=2)
            replayed = simulator.request(engine.tokenizer.render(messages), drops, repos, max_tokens=2,
                                         completion_tokens=out.usage.completion_tokens)
            simulator.check_integrity()
            assert out.usage == replayed
            usages.append(out.usage)
            if run_index == 0:
                first_logits.append(logits)
            else:
                assert_same_logits(logits, first_logits[turns - 1])
    second = usages[6:]
    assert sum(u.retained_tokens for u in second) > 0 and min(u.prefilled_tokens for u in second) == 1
    assert max(u.prefilled_tokens for u in second) > 1   # some earlier state was evicted, and restored
    stats = simulator.stats()
    assert (stats.slots_retained_evicted, stats.slots_evicted) == (
        engine.cache.stats().slots_retained_evicted, engine.cache.stats().slots_evicted)
    assert stats.slots_retained_evicted > 0


def test_a_full_pool_makes_requests_wait_and_a_too_large_one_is_refused(shared):
    engine = new_engine(shared, kv_tokens=300)
    first = engine.submit(agent(3), max_tokens=3)
    second = engine.submit(agent(2) + [{"role": "user", "content": "Summarize."}], max_tokens=3)
    engine.step()
    assert engine.stats().running == 1 and engine.stats().waiting == 1   # no room for both prompts
    while not (first.done and second.done):
        engine.step()
        engine.check_integrity()
    assert first.result().finish_reason == second.result().finish_reason == "length"
    with pytest.raises(KVCapacityError, match="messages"):
        engine.submit(agent(8), max_tokens=3)
    # Fits the pool as tokens, but not with the re-rotated keys its repositions need: refused.
    history, drops, repos = agent(3), {"5": [2]}, [5, 7]
    tight = new_engine(shared, kv_tokens=len(engine.tokenizer.render(history).token_ids) + 3)
    with pytest.raises(RequestFailed, match="re-rotated keys"):
        tight.generate(history, drop_message=drops, reposition=repos, max_tokens=3)
    tight.check_integrity()
    assert tight.stats().kv_slots_used == 0


def test_seeded_sampling_is_reproducible(shared):
    engine = new_engine(shared)
    outs = [engine.generate(SECRET, max_tokens=3, temperature=1.5, top_p=0.9, seed=seed).token_ids
            for seed in (7, 7, 8)]
    assert outs[0] == outs[1]
    engine.check_integrity()
    # Each request: one pass over its prompt (which samples the first token), one decode-only pass per later token.
    stats = engine.stats()
    assert stats.prefill_passes == 3 and stats.decode_passes == sum(len(out) - 1 for out in outs)
    assert stats.prefill_pass_seconds > 0 and stats.decode_pass_seconds > 0


def test_cancel_stop_strings_and_the_loop_thread(shared):
    engine = new_engine(shared)
    handle = engine.submit(SECRET, max_tokens=30)
    engine.step()
    handle.cancel()
    engine.step()
    assert handle.result().finish_reason == "cancelled"
    engine.check_integrity()
    assert engine.stats().kv_slots_used == engine.stats().kv_slots_cached   # nothing held by a request
    stop = threading.Event()
    loop = threading.Thread(target=engine.run_forever, args=(stop,))
    loop.start()
    try:
        out = engine.generate(SECRET, max_tokens=16, stop=["blue"])
        assert out.finish_reason == "stop" and out.text == "The secret code of the "
        handles = [engine.submit(SECRET, max_tokens=4), engine.submit(agent(1), max_tokens=4)]
        assert all(h.result(timeout=120).finish_reason in ("stop", "length") for h in handles)
    finally:
        stop.set()
        loop.join()
    engine.check_integrity()
    assert engine.stats().requests_finished == 4
