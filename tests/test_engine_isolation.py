"""One request's bad values or failure never harms another: the engine on the real SmolLM2."""
from __future__ import annotations

import pytest

from akv_core.engine import Engine
from akv_core.request import ERROR_ENGINE, RequestFailed
from test_model_support import engine_parts, run_together

pytestmark = pytest.mark.model

QUESTIONS = [[{"role": "user", "content": f"One fact about {topic}."}]
             for topic in ("owls", "copper", "green tea and its long history")]


@pytest.fixture(scope="module")
def shared():
    return engine_parts()


def new_engine(shared, kv_tokens: int = 2048) -> Engine:
    model, tokenizer = shared
    return Engine(model, tokenizer, kv_tokens, 8, threads={"prefill": 1, "decode": 1})


@pytest.fixture(scope="module")
def alone(shared) -> list[list[int]]:
    return [new_engine(shared).generate(q, max_tokens=4).token_ids for q in QUESTIONS]


def test_a_tiny_temperature_is_greedy_and_its_neighbours_finish(shared, alone) -> None:
    engine = new_engine(shared)
    tiny = engine.submit(QUESTIONS[0], max_tokens=4, temperature=1e-40)
    others = [engine.submit(q, max_tokens=4) for q in QUESTIONS[1:]]
    run_together(engine, [tiny, *others])
    assert tiny.result().token_ids == alone[0]
    assert [h.result().token_ids for h in others] == alone[1:]


def test_a_failure_while_sampling_one_request_fails_it_alone(shared, alone) -> None:
    engine = new_engine(shared)
    handles = [engine.submit(q, max_tokens=4) for q in QUESTIONS]
    victim = handles[1]

    def probe(handle, logits) -> None:
        if handle is victim:
            raise RuntimeError("probe failure")

    engine.logits_probe = probe
    run_together(engine, handles)
    with pytest.raises(RequestFailed, match="probe failure") as failed:
        victim.result()
    assert failed.value.code == ERROR_ENGINE
    assert [handles[0].result().token_ids, handles[2].result().token_ids] == [alone[0], alone[2]]
    assert engine.stats().running == 0 and engine.stats().kv_slots_used == engine.stats().kv_slots_cached


def test_a_failure_in_one_request_s_forward_fails_it_alone(shared, alone) -> None:
    engine = new_engine(shared)
    victim_tokens = len(engine.tokenizer.render(QUESTIONS[2]).token_ids)
    assert victim_tokens not in [len(engine.tokenizer.render(q).token_ids) for q in QUESTIONS[:2]]

    def probe(layer, seq, slots, probs) -> None:
        if probs.shape[0] == victim_tokens:   # the victim's prompt rows, in the batch or alone
            raise RuntimeError("attention failure")

    handles = [engine.submit(q, max_tokens=4) for q in QUESTIONS]
    engine.model.attention_probe = probe
    try:
        run_together(engine, handles)
    finally:
        engine.model.attention_probe = None
    with pytest.raises(RequestFailed, match="attention failure") as failed:
        handles[2].result()
    assert failed.value.code == ERROR_ENGINE
    assert [h.result().token_ids for h in handles[:2]] == alone[:2]


@pytest.mark.parametrize(("options", "field"), [
    ({"temperature": -1.0}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"temperature": 2.5}, "temperature"), ({"top_p": 1.5}, "top_p"), ({"seed": 2**64}, "seed"),
    ({"max_tokens": 2.0}, "max_tokens"),
])
def test_sampling_values_outside_openai_ranges_are_refused_at_submit(shared, options, field) -> None:
    engine = new_engine(shared)
    with pytest.raises(ValueError, match=f"^{field}: "):
        engine.submit(QUESTIONS[0], **options)
    assert engine.stats().waiting == 0


def test_text_with_a_lone_surrogate_is_refused_naming_the_message(shared) -> None:
    engine = new_engine(shared)
    history = [*QUESTIONS[0], {"role": "assistant", "content": "x\ud800y"}]
    with pytest.raises(ValueError, match=r"^messages\[1\]\.content: .*surrogate"):
        engine.submit(history)
