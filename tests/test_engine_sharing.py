"""Requests running at once share their common prompt prefix: the real SmolLM2 engine.

A request publishes its prompt into the radix cache as its prefill completes (step by step
while another request waits for it), so requests that arrive together compute a shared system
prompt once, decode exactly as they would one after another, and neither a cancellation nor a
failure of the request that published it harms the others.
"""
from __future__ import annotations

import pytest
import torch

from akv_core.engine import Engine
from akv_core.request import ERROR_ENGINE, RequestFailed
from akv_core.scheduler import SHARE_MIN_TOKENS
from test_engine_model import assert_same_logits
from test_model_support import engine_parts, run_together

pytestmark = pytest.mark.model

SYSTEM = {"role": "system", "content": "You are a careful research agent working for a public library. Answer in "
          "one short sentence, cite the tool result you relied on, never invent a source, and say so plainly when "
          "the tools gave you nothing useful. Prefer primary sources over summaries and dates over adjectives. "
          "The catalogue tool takes a title or an author and returns shelf marks; the archive tool takes a shelf "
          "mark and returns the first page of the document; the calendar tool returns opening hours. Readers ask "
          "about history, science, local events and the collections themselves. Keep every answer polite, brief "
          "and checkable, and end with the shelf mark of the document you used, if any."}
TOPICS = ("owls", "copper", "green tea", "tides", "glass", "maps", "salt", "bees")
HISTORIES = [[SYSTEM, {"role": "user", "content": f"One fact about {topic}."}] for topic in TOPICS]


@pytest.fixture(scope="module")
def shared():
    return engine_parts()


def new_engine(shared, prefill_chunk: int = 512) -> Engine:
    model, tokenizer = shared
    return Engine(model, tokenizer, 4096, 8, threads={"prefill": 1, "decode": 1}, prefill_chunk=prefill_chunk)


def probe_logits(engine: Engine) -> dict:
    logits: dict = {}
    engine.logits_probe = lambda handle, row: logits.setdefault(handle, []).append(row.clone())
    return logits


@pytest.fixture(scope="module")
def serial(shared):
    """Each history served alone, one after another on one engine: (generations, logits, prefilled tokens)."""
    engine = new_engine(shared)
    logits = probe_logits(engine)
    handles, outputs = [], []
    for history in HISTORIES:
        handles.append(engine.submit(history, max_tokens=4))
        run_together(engine, handles[-1:])
        outputs.append(handles[-1].result())
    return outputs, [torch.stack(logits[h]) for h in handles], engine.stats().prefilled_tokens


def shared_tokens(engine: Engine) -> int:
    first, second = (engine.tokenizer.render(h).token_ids for h in HISTORIES[:2])
    return next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)


def test_requests_submitted_together_compute_their_shared_prompt_once(shared, serial) -> None:
    outputs, logits, serial_prefilled = serial
    engine = new_engine(shared)
    assert shared_tokens(engine) >= SHARE_MIN_TOKENS
    probed = probe_logits(engine)
    handles = [engine.submit(history, max_tokens=4) for history in HISTORIES]
    run_together(engine, handles)
    results = [handle.result() for handle in handles]
    assert engine.stats().prefilled_tokens == serial_prefilled   # the shared part once, as one after another
    assert [r.usage for r in results] == [o.usage for o in outputs]
    assert [r.token_ids for r in results] == [o.token_ids for o in outputs]
    for handle, want in zip(handles, logits):
        assert_same_logits(torch.stack(probed[handle]), want)
    stats = engine.stats()
    assert stats.running == 0 and stats.kv_slots_used == stats.kv_slots_cached


@pytest.mark.parametrize("when", ["mid-prefill", "mid-decode"])
def test_cancelling_the_request_that_published_the_prefix_leaves_the_others_exact(shared, serial, when) -> None:
    outputs, _, _ = serial
    engine = new_engine(shared, prefill_chunk=64)   # the first prompt takes several steps
    first = engine.submit(HISTORIES[0], max_tokens=8)
    others = [engine.submit(history, max_tokens=4) for history in HISTORIES[1:3]]
    engine.step()
    publisher = engine.scheduler.running[0]
    assert publisher.handle is first and publisher.awaited and len(engine.scheduler.running) == 1
    if when == "mid-decode":
        while publisher.prefilling:
            engine.step()
        engine.step()   # the others reuse the published prompt and start beside its decode
        assert len(engine.scheduler.running) == 3
    first.cancel()
    run_together(engine, others)
    assert first.result().finish_reason == "cancelled"
    results = [h.result() for h in others]
    assert [r.token_ids for r in results] == [o.token_ids for o in outputs[1:3]]
    # Admitted once less than SHARE_MIN_TOKENS of the shared part was left to publish: after the
    # publisher's first chunk (cancelled then), or its second.
    published = 64 if when == "mid-prefill" else 128
    assert shared_tokens(engine) - 128 < SHARE_MIN_TOKENS
    assert all(r.usage.cached_tokens >= published for r in results)
    stats = engine.stats()
    assert stats.running == 0 and stats.kv_slots_used == stats.kv_slots_cached


def test_a_publisher_that_fails_does_not_poison_what_the_others_share(shared, serial) -> None:
    outputs, _, _ = serial
    engine = new_engine(shared)
    handles = [engine.submit(history, max_tokens=4) for history in HISTORIES[:3]]
    victim = handles[0]

    def probe(handle, logits) -> None:
        if handle is victim:   # after its prefill: it has published its prompt
            raise RuntimeError("probe failure")

    engine.logits_probe = probe
    run_together(engine, handles)
    with pytest.raises(RequestFailed, match="probe failure") as failed:
        victim.result()
    assert failed.value.code == ERROR_ENGINE
    results = [h.result() for h in handles[1:]]
    assert [r.token_ids for r in results] == [o.token_ids for o in outputs[1:3]]
    assert all(r.usage.cached_tokens >= shared_tokens(engine) for r in results)


def test_a_publisher_whose_prefill_fails_leaves_the_others_to_compute_it(shared, serial) -> None:
    outputs, _, _ = serial
    engine = new_engine(shared, prefill_chunk=64)
    handles = [engine.submit(history, max_tokens=4) for history in HISTORIES[:3]]
    engine.step()   # the first prompt's first chunk, published for the others

    def probe(layer, seq, slots, probs) -> None:
        raise RuntimeError("attention failure")   # only the first request runs in this step

    engine.model.attention_probe = probe
    try:
        engine.step()
    finally:
        engine.model.attention_probe = None
    with pytest.raises(RequestFailed, match="attention failure"):
        handles[0].result()
    run_together(engine, handles[1:])
    results = [h.result() for h in handles[1:]]
    assert [r.token_ids for r in results] == [o.token_ids for o in outputs[1:3]]
    assert results[0].usage.cached_tokens == 64   # the chunk it published before failing (the next one waits
    assert results[1].usage.cached_tokens >= 64   # for the first of the others, which publishes in turn)
    stats = engine.stats()
    assert stats.running == 0 and stats.kv_slots_used == stats.kv_slots_cached
