"""Grammar-constrained decoding in the engine, on the real SmolLM2: masks, ends, isolation."""
from __future__ import annotations

import json
import re

import pytest
import torch

from akv_core.constrain import Grammar, GrammarError, tool_call_grammar
from akv_core.engine import Engine
from akv_core.request import ERROR_ENGINE, FINISH_LENGTH, FINISH_STOP, RequestFailed

pytestmark = pytest.mark.model

ASK = [{"role": "user", "content": "Name a colour."}]
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}


@pytest.fixture(scope="module")
def engine() -> Engine:
    torch.set_num_threads(1)
    loaded = Engine.from_pretrained("smollm2", device="cpu", kv_tokens=4096)
    return Engine(loaded.model, loaded.tokenizer, 4096, threads={"prefill": 1, "decode": 1})

NOTE = {"type": "function", "function": {"name": "write_note", "parameters": {
    "type": "object", "required": ["title", "body"],
    "properties": {"title": {"type": "string"}, "body": {"type": "string"}}}}}
CALL_OPEN, CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"


def run_batch(engine: Engine, requests: list[dict]) -> list:
    handles = [engine.submit(ASK, **r) for r in requests]
    while not all(h.done for h in handles):
        engine.step()
    engine.check_integrity()
    return [h.result() for h in handles]


def test_a_regex_decides_the_output_and_its_end(engine):
    # The model would rather write a sentence; the grammar forces five digits, then nothing more.
    out = engine.generate(ASK, max_tokens=20, temperature=1.0, seed=3, grammar=Grammar.regex(r"[0-9]{5}"))
    assert re.fullmatch(r"[0-9]{5}", out.text) and out.finish_reason == FINISH_STOP
    # Too few tokens to finish: cut off by max_tokens as any request is.
    cut = engine.generate(ASK, max_tokens=2, grammar=Grammar.regex(r"x{40}"))
    assert cut.finish_reason == FINISH_LENGTH and set(cut.text) == {"x"}


def test_eos_only_where_the_grammar_accepts(engine):
    # "yes" or "yes, indeed": the model's EOS after "yes" is allowed, before it never.
    grammar = Grammar.lark('start: "yes" | "yes, indeed"')
    outs = run_batch(engine, [{"max_tokens": 8, "temperature": 1.0, "seed": s, "grammar": grammar}
                              for s in range(6)])
    assert all(o.text in ("yes", "yes, indeed") and o.finish_reason == FINISH_STOP for o in outs)


def test_json_schema_output_is_valid_json_matching_the_schema(engine):
    outs = run_batch(engine, [{"max_tokens": 40, "temperature": 1.0, "seed": s,
                               "grammar": Grammar.json_schema(PERSON)} for s in range(4)])
    for out in outs:
        value = json.loads(out.text)
        assert set(value) == {"name", "age"} and isinstance(value["age"], int) and 0 <= value["age"] <= 120
        assert isinstance(value["name"], str) and len(value["name"]) <= 12


def test_a_constrained_neighbour_changes_nothing_for_an_unconstrained_request(engine):
    alone = engine.generate(ASK, max_tokens=6)
    mixed = run_batch(engine, [{"max_tokens": 6}, {"max_tokens": 6, "grammar": Grammar.regex(r"[a-z]+")}])
    assert mixed[0].token_ids == alone.token_ids
    assert re.fullmatch(r"[a-z]+", mixed[1].text)


def test_a_permissive_grammar_leaves_greedy_decoding_unchanged(engine):
    free = engine.generate(ASK, max_tokens=8)
    anything = engine.generate(ASK, max_tokens=8, grammar=Grammar.regex(r"(.|\n)*"))
    assert anything.token_ids == free.token_ids


@pytest.mark.parametrize("grammar, words", [
    (Grammar.lark("start: foo"), "unknown name"),
    (Grammar.regex("a(b"), "unclosed group"),
    (Grammar("json_schema", '{"type": "objekt"}'), "objekt"),
    (Grammar("json_schema", "{not json"), "json"),
    (Grammar.ebnf("root ::= (("), "grammar"),
])
def test_an_invalid_grammar_is_refused_at_submit_with_the_reason(engine, grammar, words):
    with pytest.raises(GrammarError, match=f"(?i){re.escape(words)}"):
        engine.submit(ASK, grammar=grammar)
    assert engine.stats().waiting == 0


def test_requests_with_one_grammar_get_independent_matchers(engine):
    grammar = Grammar.lark('start: "ab" | "ac"')
    first, second = engine.constrainer.start(grammar), engine.constrainer.start(grammar)
    [a, b, c] = (engine.tokenizer.encode(x)[0] for x in "abc")
    assert not first.advance(a) and first.advance(b)   # "ab": nothing may follow
    assert not second.accepting and not second.advance(a) and second.advance(c)
    assert first.error is None and second.error is None


def test_an_empty_grammar_is_refused():
    with pytest.raises(GrammarError, match="empty"):
        Grammar.lark("  ")


def test_a_failed_matcher_fails_its_request_alone(engine):
    # A matcher that fails mid-decode (here: made to consume a token its grammar forbids, as a
    # resource limit would fail it) would allow EOS alone; the engine fails that request with
    # the grammar's reason instead of ending it as "stop", and its neighbours decode on as alone.
    alone = [engine.generate(ASK, max_tokens=6, **r) for r in ({}, {"grammar": Grammar.regex(r"[a-z]+")})]
    handles = [engine.submit(ASK, max_tokens=6), engine.submit(ASK, max_tokens=6, grammar=Grammar.regex("[0-9]{5}")),
               engine.submit(ASK, max_tokens=6, grammar=Grammar.regex(r"[a-z]+"))]
    engine.step()
    broken = next(r for r in engine.scheduler.running if r.handle is handles[1])
    with pytest.raises(GrammarError, match="doesn't satisfy the grammar"):
        broken.constraint.advance(engine.tokenizer.encode("a")[0])
    while not all(h.done for h in handles):
        engine.step()
    engine.check_integrity()
    with pytest.raises(RequestFailed, match="grammar: the matcher failed earlier") as failed:
        handles[1].result()
    assert failed.value.code == ERROR_ENGINE and "\n" not in str(failed.value)
    assert [handles[0].result().token_ids, handles[2].result().token_ids] == [a.token_ids for a in alone]


def test_a_forced_call_is_closed_before_max_tokens_runs_out(engine):
    # The model writes a long note; each budget ends it inside the call. The grammar closes the call in
    # time instead: a call of the tool with valid JSON arguments (strings cut short), finish "length".
    shortest = len(engine.tokenizer.encode(CALL_OPEN + '{"name": "write_note", "arguments": {}}' + CALL_CLOSE))
    budgets = [shortest + extra for extra in range(0, 24, 3)]
    outs = run_batch(engine, [{"tools": [NOTE], "grammar": tool_call_grammar([NOTE]), "max_tokens": budget,
                               "temperature": 1.0, "seed": seed} for seed, budget in enumerate(budgets)])
    for out, budget in zip(outs, budgets):
        assert len(out.token_ids) <= budget and out.finish_reason in (FINISH_LENGTH, FINISH_STOP), out
        assert out.text.startswith(CALL_OPEN) and out.text.endswith(CALL_CLOSE), out.text
        call = json.loads(out.text[len(CALL_OPEN):-len(CALL_CLOSE)])
        assert call["name"] == "write_note" and isinstance(call["arguments"], dict), out.text
    closed = [out for out in outs if out.finish_reason == FINISH_LENGTH]   # the others ended by themselves
    assert len(closed) >= len(outs) // 2 and any(out.text.count('"') > 8 for out in closed)
    # Too few tokens for even the shortest call: cut off as written, as any request is.
    cut = engine.generate(ASK, tools=[NOTE], grammar=tool_call_grammar([NOTE]), max_tokens=shortest - 1)
    assert cut.finish_reason == FINISH_LENGTH and len(cut.token_ids) == shortest - 1
