"""Chunked prefill on the real SmolLM2: the same logits as whole stages, and no head-of-line blocking.

Step counts, not wall time: a short request submitted during a long prefill starts decoding
within two steps, a cancellation ends a prefill between two chunks, and a small request may
pass a large one that waits for memory, a bounded number of times.
"""
from __future__ import annotations

import pytest

from akv_core.cache.key import build_key, shared_prefix
from akv_core.cache.ops import validate_operations
from akv_core.engine import Engine
from akv_core.scheduler import MAX_BYPASS
from test_engine_model import THOUGHT, agent, assert_same_logits, run, thinking_agent
from test_model_support import engine_parts

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def shared():
    return engine_parts()


def new_engine(shared, prefill_chunk: int | None, kv_tokens: int = 2048, max_running: int = 8) -> Engine:
    model, tokenizer = shared
    return Engine(model, tokenizer, kv_tokens, max_running, threads={"prefill": 1, "decode": 1},
                  prefill_chunk=prefill_chunk)


# (case, chunk size, requests): chunks that end inside messages, at records and across masks.
CASES = [
    ("drops and repositions, cold", 7, [(agent(4), {"5": [3], "9": [2, 4]}, [5, 9], False)]),
    ("a prefix hit that adds operations", 13, [(agent(2), None, None, False),
                                               (agent(4), {"5": [3], "9": [2, 4]}, [5, 9], False)]),
    ("thinking drop", 64, [(thinking_agent(2), None, [5], True), (THOUGHT, None, None, True)]),
]


@pytest.mark.parametrize(("name", "chunk", "requests"), CASES, ids=[c[0] for c in CASES])
def test_a_chunked_prefill_gives_the_logits_of_an_unchunked_one(shared, name, chunk, requests) -> None:
    chunked, whole = new_engine(shared, chunk), new_engine(shared, None)
    for messages, drops, repos, thinking in requests:
        got, got_logits = run(chunked, messages, drops, repos, thinking=thinking)
        want, want_logits = run(whole, messages, drops, repos, thinking=thinking)
        assert got.usage == want.usage and got.token_ids == want.token_ids
        assert_same_logits(got_logits, want_logits)


@pytest.mark.slow
def test_a_chunked_restore_after_eviction_equals_the_never_evicted_run(shared) -> None:
    engine = new_engine(shared, 16, kv_tokens=560)
    history, drops, repos = agent(4), {"5": [3], "9": [2, 4]}, [5, 9]
    first, first_logits = run(engine, history, drops, repos)
    filler = [history[0], {"role": "user", "content": "Tell me about the history of the printing press. " * 44}]
    run(engine, filler, max_tokens=2)
    assert engine.cache.stats().slots_evicted > 0
    restored, restored_logits = run(engine, history, drops, repos)
    assert 1 < restored.usage.prefilled_tokens < restored.usage.prompt_tokens
    assert restored.token_ids == first.token_ids
    assert_same_logits(restored_logits, first_logits)


LONG = [{"role": "user", "content": "Tell me about the history of the printing press. " * 30}]
SHORT = [{"role": "user", "content": "Hi."}]


def test_a_short_request_starts_decoding_while_a_long_prefill_runs(shared) -> None:
    engine = new_engine(shared, 64)
    long = engine.submit(LONG, max_tokens=2)
    engine.step()
    short = engine.submit(SHORT, max_tokens=8)
    steps = 0
    while short.events.empty():
        engine.step()
        steps += 1
    assert steps == 1   # its whole prompt and a chunk of the long one shared the step
    request = next(r for r in engine.scheduler.running if r.handle is long)
    assert request.prefilling and request.prefill_left > 64
    while not (long.done and short.done):
        engine.step()
        engine.check_integrity()
    alone = new_engine(shared, None)
    assert short.result().token_ids == alone.generate(SHORT, max_tokens=8).token_ids
    assert long.result().token_ids == alone.generate(LONG, max_tokens=2).token_ids


def test_a_cancelled_prefill_ends_between_two_chunks(shared) -> None:
    engine = new_engine(shared, 32)
    handle = engine.submit(LONG, max_tokens=2)
    engine.step()
    engine.step()
    request = engine.scheduler.running[0]
    assert request.prefilling and request.prefill_left > 32
    handle.cancel()
    engine.step()
    assert handle.result().finish_reason == "cancelled"
    engine.check_integrity()
    stats = engine.stats()
    assert stats.running == 0 and stats.kv_slots_used == 0   # a prompt never finished keeps nothing


def test_small_requests_pass_a_large_one_waiting_for_memory_a_bounded_number_of_times(shared) -> None:
    tokens = lambda messages: len(shared[1].render(messages).token_ids)   # noqa: E731
    small = [[{"role": "user", "content": f"Say {n}."}] for n in range(MAX_BYPASS + 2)]
    holder = [{"role": "user", "content": "Count to twenty."}]
    pool = 1 + tokens(holder) + 24 + max(map(tokens, small)) * (MAX_BYPASS + 1) + 2 * (MAX_BYPASS + 1)
    room = pool - tokens(holder) - 24
    large = [{"role": "user", "content": "word " * 10}]
    # It reuses the chat template's prefix from the holder's prompt, published into the cache
    # while the holder decodes: it fits the pool alone, not beside the running holder.
    common = shared_prefix(*(build_key(shared[1].render(m), validate_operations(1, None, None))
                                for m in (holder, large)))
    while tokens(large) - common + 2 <= room:
        large[0]["content"] += "word " * 10
    assert tokens(large) + 2 <= pool
    engine = new_engine(shared, None, kv_tokens=pool, max_running=MAX_BYPASS + 4)
    first = engine.submit(holder, max_tokens=24)
    engine.step()
    waiting = engine.submit(large, max_tokens=2)
    passers = [engine.submit(messages, max_tokens=2) for messages in small]
    engine.step()
    running = {r.handle for r in engine.scheduler.running}
    assert running == {first, *passers[:MAX_BYPASS]}   # the next one waits behind the large one
    admitted_before_large = set()
    while not all(h.done for h in [first, waiting, *passers]):
        if waiting not in {r.handle for r in engine.scheduler.running} and not waiting.done:
            admitted_before_large |= {r.handle for r in engine.scheduler.running}
        engine.step()
        engine.check_integrity()
    assert passers[-1] not in admitted_before_large and passers[-2] not in admitted_before_large
    assert waiting.result().finish_reason in ("stop", "length")
