"""Fuzzing the front end: whatever the text, only the language's own errors may escape."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policy_dsl import PolicyError, builtin_names, builtin_source, compile_policy, parse

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SOURCES = [builtin_source(name) for name in builtin_names()] + [
    "mode kv\non each tool_call and visible_tokens > 6000: drop role tool until visible_tokens <= 3000 trigger included\n"
    "reposition after 1 tool_calls then every 1\n",
    'mode kv\non each turn: drop role tool and (covered >= 80 in 50..100 percent or call contains "cat ")\n'
    "reposition after each drop\n"]
WORDS = ["mode", "kv", "text", "on", "each", "every", "after", "drop", "omit", "summarize", "within", "tokens",
         "keep", "last", "until", "visible_tokens", "history_tokens", "<=", ">", ">=", "(", ")", ":", "and", "or",
         "not", "role", "tool", "tool_name", "age", "contains", "next_turn", "requested", "superseded", "drop_context", "thinking", "where",
         "reposition", "never", "gap", "in", "..", "0", "12", "99999999999999", '"x"', '"\\q"', "#", "\n", "\x00",
         "cut", "before", "from", "trigger", "included", "with", "turns", "covered", "percent", "call", "100", "101"]


def parse_and_compile(text: str) -> None:
    try:
        compile_policy(parse(text, filename="fuzz.akvp"))
    except PolicyError as err:
        assert str(err).startswith("fuzz.akvp:") and "\n" not in err.message


@FUZZ
@given(st.text(max_size=300))
def test_random_text(text: str) -> None:
    parse_and_compile(text)


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes(data: bytes) -> None:
    parse_and_compile(data.decode("utf-8", errors="replace"))
    try:
        compile_policy(parse(data, filename="fuzz.akvp"))
    except PolicyError as err:
        assert str(err).startswith("fuzz.akvp:")


@FUZZ
@given(st.lists(st.sampled_from(WORDS), max_size=40))
def test_random_keyword_soup(words: list[str]) -> None:
    parse_and_compile(" ".join(words))


@FUZZ
@given(source=st.sampled_from(SOURCES), data=st.data())
def test_mutated_builtins(source: str, data: st.DataObject) -> None:
    text = source
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(text)))
        edit = data.draw(st.sampled_from(["delete", "insert", "duplicate"]))
        if edit == "delete":
            text = text[:at] + text[at + data.draw(st.integers(1, 8)):]
        elif edit == "insert":
            text = text[:at] + data.draw(st.sampled_from(WORDS) | st.text(max_size=3)) + text[at:]
        else:
            text = text[:at] + text[at: at + 20] + text[at:]
    parse_and_compile(text)


def test_deep_nesting_is_a_limit_error_not_a_crash() -> None:
    for text in ["mode kv on each turn: drop " + "(" * 30_000 + "all" + ")" * 30_000,
                 "mode kv on each turn: drop " + "not " * 15_000 + "all",
                 "mode kv on " + "(each turn and " * 3000 + "each turn" + ")" * 3000 + ": drop all"]:
        parse_and_compile(text)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
MESSAGE_LIKE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "robot"])},
    optional={"content": JSON_VALUES, "tool_calls": JSON_VALUES, "tool_call_id": JSON_VALUES,
              "name": JSON_VALUES, "reasoning_content": JSON_VALUES},
)


@FUZZ
@given(history=st.lists(MESSAGE_LIKE | JSON_VALUES, max_size=12), name=st.sampled_from(builtin_names()))
def test_odd_histories_decide_or_raise_history_error(history: list, name: str) -> None:
    from policy_dsl import HistoryError, load_policy

    try:
        decision = load_policy(name).decide(history)
    except HistoryError as err:
        assert str(err).startswith("message ")
        return
    assert all(0 <= int(k) < len(history) for k in decision.drop_message)
