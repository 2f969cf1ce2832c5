"""What the model used, on the real SmolLM2 weights: attribution of a reply over its history's
messages, and the teacher-forced likelihood of a recorded reply under a request's visible KV."""
from __future__ import annotations

import random

import pytest

from akv_core.attribution import USED_MASS, Attribution
from akv_core.continuation import ContextLengthExceeded
from akv_core.engine import Engine
from akv_core.model.linear import Linear
from test_model_support import SECRET, THOUGHT, engine_parts

pytestmark = pytest.mark.model


VAULTS = "ABCDEFGHJKLMNPQRSTUVWXYZ"
FILLERS = ["The weather in Lisbon is sunny with a high of {n} degrees today.",
           "The train to Porto leaves from platform {n} at noon.",
           "The library holds {n} thousand books on its third floor.",
           "The museum opens at {n} o'clock on weekdays and closes late.",
           "The parcel weighs {n} grams and ships tomorrow morning.",
           "The bakery sells {n} loaves of bread every single day.",
           "The river is {n} kilometres long and flows to the sea."]


def new_engine() -> Engine:
    model, tokenizer = engine_parts()
    return Engine(model, tokenizer, 2048)


def vault_history(seed: int) -> tuple[list[dict], int, str]:
    """(history, index of the planted tool message, the right answer): six tool results, one of them
    the access code the last user message asks for, the others unrelated facts; an assistant turn
    closes the lookups before the question, as an agent's history would."""
    rng = random.Random(seed)
    vault, code = rng.choice(VAULTS), rng.randint(1000, 9999)
    results = [f"The access code for vault {vault} is {code}."]
    results += [filler.format(n=rng.randint(2, 90)) for filler in rng.sample(FILLERS, 5)]
    order = list(range(len(results)))
    rng.shuffle(order)
    history = [{"role": "system", "content": "You are a helpful assistant. Answer from the tool results."},
               {"role": "user", "content": "Please gather the facts I will need."}]
    planted = -1
    for call, result in enumerate(order):
        history.append({"role": "assistant", "content": f"I will call the lookup tool (call {call + 1})."})
        planted = len(history) if result == 0 else planted
        history.append({"role": "tool", "content": results[result]})
    history += [{"role": "assistant", "content": "I have gathered all the results you asked for."},
                {"role": "user", "content": "Thank you. Now I have one question about them, please answer it "
                                            "briefly and exactly."},
                {"role": "user", "content": f"What is the access code for vault {vault}?"}]
    return history, planted, f"The access code for vault {vault} is {code}."


def total(attribution: Attribution) -> float:
    return sum(m.mass for m in attribution.messages) + attribution.generation_header + attribution.reply


def test_attribution_adds_up_and_dropped_messages_have_none() -> None:
    engine = new_engine()
    seen = engine.generate(SECRET, max_tokens=16, attribution=True)
    assert seen.attribution is not None and seen.attribution.tokens == seen.usage.completion_tokens   # EOS too
    assert total(seen.attribution) == pytest.approx(1.0, abs=1e-6)
    spans = engine.tokenizer.render(SECRET).spans
    assert [m.visible_tokens for m in seen.attribution.messages] == [end - start for start, end in spans]
    assert seen.attribution.messages[1].mass > seen.attribution.messages[2].mass   # the code, not the lunch
    dropped = engine.generate(SECRET, drop_message={"3": [1]}, max_tokens=16, attribution=True)
    assert dropped.attribution.messages[1].mass == 0.0 and dropped.attribution.messages[1].visible_tokens == 0
    assert total(dropped.attribution) == pytest.approx(1.0, abs=1e-6)
    assert 1 not in dropped.attribution.used() and USED_MASS > 0
    thought = engine.generate(THOUGHT, max_tokens=8, thinking_drop=True, attribution=True)
    shown = thought.attribution.messages[2].visible_tokens   # the reasoning is hidden, the content is not
    assert 0 < shown < spans_of(engine, THOUGHT)[2]
    engine.check_integrity()


def spans_of(engine: Engine, messages: list[dict]) -> list[int]:
    return [end - start for start, end in engine.tokenizer.render(messages).spans]


def test_attribution_runs_no_extra_pass() -> None:
    """Each reply token's query adds its weights as it runs (the prompt's last row, then the decode rows): a
    request that asks runs the passes of one that does not, and one that does not ask sets no probe."""
    engine = new_engine()
    plain = engine.generate(SECRET, max_tokens=8)
    assert plain.attribution is None and engine.stats().prefill_passes == 1
    asked = engine.generate(SECRET, max_tokens=8, attribution=True)   # its cached prompt's last token, alone
    assert engine.stats().prefill_passes == 2
    assert asked.token_ids == plain.token_ids and engine.model.attention_probe is None
    assert engine.model.mass_probe is None
    fresh = engine.generate(THOUGHT, max_tokens=8, attribution=True)   # its last token in a pass of many rows
    assert engine.stats().prefill_passes == 3
    assert fresh.attribution.tokens == fresh.usage.completion_tokens
    assert total(fresh.attribution) == pytest.approx(1.0, abs=1e-6)


def test_attribution_is_the_same_whichever_decode_path_made_the_tokens() -> None:
    """The fused C step and the layer-by-layer C attention add up each row's weights as they attend, torch's
    operators compute the row's softmax again beside theirs: the same attribution, also of a continued message
    (teacher-forced) with tokens generated after it."""
    model = engine_parts()[0]
    continued = SECRET + [{"role": "assistant", "content": "The code is"}]

    def replies() -> list:
        engine = new_engine()
        return [engine.generate(SECRET, max_tokens=16, attribution=True),
                engine.generate(continued, max_tokens=12, continue_final_message=True, attribution=True)]

    fused = replies()
    projections = [p for w in model.layers for p in (w.qkv, w.o, w.gate_up, w.down)] + [model.lm_head]
    dense = [p for p in projections if isinstance(p, Linear) and p.dense_rows]
    kernels = (model.fused_decode, model._attention_kernel)
    try:
        model.fused_decode = False   # C attention and products, layer by layer
        layered = replies() if model.kernel_decode else fused
        model._attention_kernel = False   # torch's operators alone
        for projection in dense:
            projection.dense_rows = False
        torch_path = replies()
    finally:
        model.fused_decode, model._attention_kernel = kernels
        for projection in dense:
            projection.dense_rows = True
    for reply, other in [*zip(fused, layered), *zip(fused, torch_path)]:
        assert other.token_ids == reply.token_ids and other.attribution.tokens == reply.attribution.tokens
        for a, b in zip(reply.attribution.messages, other.attribution.messages):
            assert a.mass == pytest.approx(b.mass, abs=1e-5) and a.visible_tokens == b.visible_tokens
        assert reply.attribution.reply == pytest.approx(other.attribution.reply, abs=1e-5)
        assert reply.attribution.generation_header == pytest.approx(other.attribution.generation_header, abs=1e-5)


def test_scored_continuation_equals_the_generation_it_records() -> None:
    engine = new_engine()
    handle = engine.submit(SECRET, max_tokens=32, top_logprobs=0, attribution=True)
    events = []
    while not handle.done:
        engine.step()
    while not handle.events.empty():
        events.append(handle.events.get())
    generated = [e for e in events if e.token_id is not None]
    text = "".join(e.text for e in events)
    assert events[-1].finish_reason == "stop"   # ended with the end-of-turn token, which is scored too
    score = engine.score_continuation(SECRET, text, attribution=True)
    assert list(score.token_ids[:-1]) == [e.token_id for e in generated]
    assert score.token_ids[-1] in engine.tokenizer.eos_token_ids
    for event, logprob in zip(generated, score.logprobs):
        assert logprob == pytest.approx(event.logprob.logprob, abs=1e-4)
    assert score.total == pytest.approx(sum(score.logprobs))
    # The weights each query added up as it decoded, against the same queries teacher-forced in one pass.
    decoded, forced = events[-1].attribution, score.attribution
    assert decoded.tokens == forced.tokens == len(score.token_ids)
    for a, b in zip(decoded.messages, forced.messages):
        assert a.mass == pytest.approx(b.mass, abs=1e-5) and a.visible_tokens == b.visible_tokens
    assert decoded.reply == pytest.approx(forced.reply, abs=1e-5)
    assert decoded.generation_header == pytest.approx(forced.generation_header, abs=1e-5)
    # The history came from the cache (its last token is computed again, as for any hit), the reply was
    # computed; it is not kept for later requests.
    assert score.usage.prefilled_tokens == 1 + len(score.token_ids) and score.usage.completion_tokens == 0
    again = engine.score_continuation(SECRET, {"role": "assistant", "content": text})
    assert again.usage.prefilled_tokens == 1 + len(score.token_ids)
    assert again.logprobs == pytest.approx(score.logprobs, abs=1e-5)   # thread counts may differ
    engine.check_integrity()


def test_the_planted_message_gets_the_most_mass_and_its_drop_hurts() -> None:
    """Teacher-forcing the right answer, the one tool message that holds it takes the largest share
    among the tool messages in at least 9 of 10 seeded histories; dropping it leaves it no mass and
    makes the right answer less likely, in every one of them."""
    engine = new_engine()
    wins = []
    for seed in range(10):
        history, planted, answer = vault_history(seed)
        kept = engine.score_continuation(history, answer, attribution=True)
        tools = [m for m in kept.attribution.messages if history[m.message]["role"] == "tool"]
        wins.append(max(tools, key=lambda m: m.mass).message == planted)
        dropped = engine.score_continuation(history, answer, drop_message={str(len(history) - 1): [planted]},
                                            attribution=True)
        assert dropped.attribution.messages[planted].mass == 0.0, seed
        assert dropped.total < kept.total, seed
        engine.check_integrity()
    assert sum(wins) >= 9, wins


def test_bad_reply_options_name_the_field() -> None:
    engine = new_engine()
    with pytest.raises(ValueError, match=r"^attribution: must be true or false"):
        engine.submit(SECRET, attribution="yes")
    with pytest.raises(ValueError, match=r"^prompt_logprobs: .*continue_final_message"):
        engine.submit(SECRET, prompt_logprobs=0)
    with pytest.raises(ValueError, match=r"^messages\[3\]\.role: the final message must be an assistant"):
        engine.submit(SECRET, continue_final_message=True)
    with pytest.raises(ValueError, match=r"^continuation\.role: must be assistant"):
        engine.score_continuation(SECRET, {"role": "user", "content": "4721"})
    engine.context_length = len(engine.tokenizer.render(SECRET).token_ids) + 2
    with pytest.raises(ContextLengthExceeded, match=r"^continuation: .* past the model's context"):
        engine.score_continuation(SECRET, "The secret code of the blue door is 4721, as you told me.")
