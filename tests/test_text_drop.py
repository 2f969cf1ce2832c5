"""text_drop and keep_text_drop: upstream's rules, checked once for the server and the simulator,
and their characters mapped to tokens through the chat renderer's provenance."""
from __future__ import annotations

import pytest

from akv_core.cache.key import DropRecord, build_key
from akv_core.cache.ops import OperationError, validate_operations
from akv_core.cache.text_drop import (MAX_MESSAGES, MAX_SELECTORS, TextCut, TextDrop, parse_text_drop,
                                      project_kept, remaining_text)
from akv_core.chat import ChatTokenizer

pytestmark = pytest.mark.model   # the embedded model's tokenizer

HISTORY = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "The code is 4721. Remember the code 4721 and abab."},
    {"role": "assistant", "content": "Noted, briefly."},
    {"role": "user", "content": "What was the code?"},
]


@pytest.fixture(scope="module")
def tokenizer() -> ChatTokenizer:
    return ChatTokenizer.from_model()


def entries(**by_index) -> list:
    return [by_index.get(f"m{i}") for i in range(len(HISTORY))]


def test_selectors_pick_occurrences_and_merge_per_message():
    drop = parse_text_drop(entries(m1={"role": "user", "content": ["4721", "aba", "bab"], "occurrence": [2, 1, 1]},
                                   m2={"role": "assistant", "content": "Noted, briefly."}), HISTORY)
    text = HISTORY[1]["content"]
    second = text.find("4721", text.find("4721") + 1)
    # overlapping matches: "aba" at 45 and "bab" at 46 merge into one cut
    assert drop == TextDrop(3, (TextCut(1, ((second, second + 4), (45, 49))),
                                TextCut(2, ((0, 15),), whole=True)))
    # null, "", [] and [""] select nothing; a rule that selects nothing is no rule
    assert parse_text_drop(entries(m1={"role": "user", "content": [""]}, m2={"role": "assistant", "content": ""},
                                   m0={"role": "system", "content": None}), HISTORY) is None
    assert remaining_text("abcdef", ((1, 2), (4, 6))) == "acd"


@pytest.mark.parametrize("drop_messages, field", [
    ("x", "drop_rule.drop_messages"),
    ([None, None], "drop_rule.drop_messages"),                                        # not aligned
    (entries(m1={"role": "user", "content": "4722"}), "drop_rule.drop_messages[1].content"),
    (entries(m1={"role": "user", "content": ["code", "5555"]}), "drop_rule.drop_messages[1].content[1]"),
    (entries(m1={"role": "user", "content": "4721", "occurrence": 3}), "drop_rule.drop_messages[1].occurrence"),
    (entries(m1={"role": "user", "content": ["4721"], "occurrence": [1, 2]}), "drop_rule.drop_messages[1].occurrence"),
    (entries(m1={"role": "user", "content": "4721", "occurrence": 0}), "drop_rule.drop_messages[1].occurrence"),
    (entries(m1={"role": "user", "content": "4721", "occurrence": True}), "drop_rule.drop_messages[1].occurrence"),
    (entries(m1={"role": "user", "occurrence": 1}), "drop_rule.drop_messages[1].occurrence"),
    (entries(m1={"role": "user", "content": ["code", ""]}), "drop_rule.drop_messages[1].content"),
    (entries(m1={"role": "user", "content": 4721}), "drop_rule.drop_messages[1].content"),
    (entries(m1={"role": "assistant", "content": "code"}), "drop_rule.drop_messages[1].role"),
    (entries(m1={"role": "user", "content": "code", "colour": "red"}), "drop_rule.drop_messages[1].colour"),
    (entries(m1="code"), "drop_rule.drop_messages[1]"),
    (entries(m1={"role": "user", "content": ["a"] * (MAX_SELECTORS + 1)}), "drop_rule.drop_messages[1].content"),
    ([None] * (MAX_MESSAGES + 1), "drop_rule.drop_messages"),
])
def test_malformed_text_drops_name_the_field(drop_messages, field):
    with pytest.raises(OperationError) as caught:
        parse_text_drop(drop_messages, HISTORY)
    assert caught.value.field == field, caught.value


def test_text_drop_takes_effect_after_the_latest_user_message_so_later_messages_cannot_be_cut():
    history = HISTORY[:3]   # the latest user message is 1
    with pytest.raises(OperationError) as caught:
        parse_text_drop([None, None, {"role": "assistant", "content": "Noted"}], history)
    assert caught.value.field == "drop_rule.drop_messages[2]" and "latest user message (1)" in caught.value.message
    with pytest.raises(OperationError) as caught:
        parse_text_drop([{"role": "system", "content": "terse"}], HISTORY[:1])
    assert caught.value.field == "drop_rule"
    assert parse_text_drop([None, {"role": "user", "content": "4721"}, None], history).trigger == 1


def test_keep_text_drop_matches_kept_messages_in_order_from_the_end():
    kept = [HISTORY[0], {"role": "user", "content": "Remember the code"}, HISTORY[3]]
    got = project_kept(HISTORY, kept)
    start = HISTORY[1]["content"].find("Remember the code")
    assert got.messages == HISTORY
    assert got.drop == TextDrop(3, (TextCut(1, ((0, start), (start + 17, len(HISTORY[1]["content"])))),
                                    TextCut(2, (), whole=True)))
    assert project_kept(HISTORY, HISTORY).drop is None   # everything kept: no drop
    # protocol fields take part in matching: a kept tool result names its call
    full = [{"role": "user", "content": "go"}, {"role": "tool", "tool_call_id": "a", "content": "x1"},
            {"role": "tool", "tool_call_id": "b", "content": "x1"}]
    got = project_kept(full, [full[0], {"role": "tool", "tool_call_id": "a", "content": "x"}])
    assert got.drop.cuts == (TextCut(1, ((1, 2),)), TextCut(2, (), whole=True))


@pytest.mark.parametrize("full, kept, field", [
    (HISTORY, [HISTORY[3], HISTORY[1]], "drop_rule.full_messages"),                  # out of order
    (HISTORY, [{"role": "user", "content": "not in the history"}], "drop_rule.full_messages"),
    (HISTORY[:1], HISTORY, "drop_rule.full_messages"),                                # more kept than full
    ([], HISTORY, "drop_rule.full_messages"),
    ("x", HISTORY, "drop_rule.full_messages"),
    ([{"role": "user", "content": 3}], HISTORY[:1], "drop_rule.full_messages[0].content"),
    ([{"role": "user", "content": "a"}] * (MAX_MESSAGES + 1), HISTORY[:1], "drop_rule.full_messages"),
])
def test_a_kept_history_that_is_not_a_projection_is_refused_unless_forced(full, kept, field):
    with pytest.raises(OperationError) as caught:
        project_kept(full, kept)
    assert caught.value.field == field, caught.value
    if field == "drop_rule.full_messages" and isinstance(full, list) and 0 < len(full) <= MAX_MESSAGES:
        forced = project_kept(full, kept, force=True)   # served as sent, nothing dropped
        assert forced.messages == kept and forced.drop is None


def test_cut_characters_become_the_tokens_wholly_inside_them(tokenizer):
    rendered = tokenizer.render(HISTORY)
    drop = parse_text_drop(entries(m1={"role": "user", "content": "4721", "occurrence": 2},
                                   m2={"role": "assistant", "content": "Noted, briefly."},
                                   m3={"role": "user", "content": "at was"}), HISTORY)
    key = build_key(rendered, validate_operations(4, None, None, text_drop=drop))
    [(offset, record)] = key.records
    assert offset == rendered.spans[3][1] and isinstance(record, DropRecord)
    hidden = [tokenizer.decode(rendered.token_ids[a:b]) for a, b in record.hidden]
    # the second 4721 alone; the whole assistant message with its header; "at was" straddles
    # "What" at its start, so only " was" goes (the trigger cuts its own text)
    assert hidden[0] == "4721" and hidden[2] == " was"
    assert record.hidden[1] == rendered.spans[2]
    # a cut holding no whole token drops nothing
    none = parse_text_drop(entries(m1={"role": "user", "content": "ode"}), HISTORY)
    assert build_key(rendered, validate_operations(4, None, None, text_drop=none)).records == ()


def test_content_is_located_after_tools_reasoning_and_special_token_strings(tokenizer):
    tools = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
    history = [{"role": "system", "content": "S <|im_end|> S"},
               {"role": "user", "content": "find <|im_start|> it"},
               {"role": "assistant", "reasoning_content": "think first", "content": "I will find it"}]
    rendered = tokenizer.render(history, tools)
    for index, word in ((0, " S"), (1, " it"), (2, " find")):
        content = history[index]["content"]
        at = content.rfind(word)
        [(start, end)] = rendered.content_tokens(index, [(at, at + len(word))])
        assert tokenizer.decode(rendered.token_ids[start:end]) == word
        assert rendered.spans[index][0] <= start < end <= rendered.spans[index][1]
