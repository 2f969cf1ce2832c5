"""Closing a forced tool call early: every prefix of a JSON value, or of a call, has a closing after
which it is complete, valid JSON; a complete one needs none."""
from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from akv_core.call_closing import CALL_END, CALL_OPEN, CallCloser, JsonPrefix

NAMES = ["get_weather", "get_time", "write_note"]
scalars = st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False) \
    | st.text(st.characters(codec="utf-8"), max_size=6)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(st.characters(codec="utf-8"), max_size=4), inner, max_size=3),
                      max_leaves=8)
layouts = st.sampled_from([{}, {"ensure_ascii": False}, {"separators": (",", ":")}, {"indent": 1}])


def closed(prefix: str) -> str:
    reader = JsonPrefix()
    assert reader.feed(prefix) == len(prefix)
    closing = reader.closing()
    assert closing is not None, prefix
    return prefix + closing


@settings(max_examples=150, deadline=None)
@given(values, layouts)
def test_every_prefix_of_a_json_value_closes_to_valid_json(value, layout) -> None:
    text = json.dumps(value, **layout)
    for end in range(len(text)):
        json.loads(closed(text[:end]))
    if isinstance(value, (dict, list)):   # a container ends on its last character: nothing more to add
        reader = JsonPrefix()
        assert reader.feed(text + " }") == len(text) and reader.closing() == ""


def test_a_string_or_key_cut_short_is_ended_where_it_stands() -> None:
    assert json.loads(closed('{"city": "San Fr')) == {"city": "San Fr"}
    assert json.loads(closed('{"a": "x\\')) == {"a": "x\\"}
    assert json.loads(closed('{"a": "\\u00')) == {"a": "\u0000"}
    assert json.loads(closed('{"a": [1, {"ci')) == {"a": [1, {"ci": None}]}
    assert json.loads(closed('{"n": -1.')) == {"n": -1.0}
    assert json.loads(closed('{"flag": tr')) == {"flag": True}
    assert JsonPrefix().closing() == "null" and closed("[") == "[]"


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(NAMES), st.dictionaries(st.sampled_from(["city", "zone", "body"]), values, max_size=3),
       st.integers(1, 5))
def test_every_prefix_of_a_call_closes_to_a_call_of_a_declared_tool(name, arguments, chunk) -> None:
    text = f'{CALL_OPEN}{name}", "arguments": {json.dumps(arguments)}{CALL_END}'
    for end in range(len(text) + 1):
        closer = CallCloser(NAMES)
        for start in range(0, end, chunk):   # fed in pieces, as tokens come
            closer.feed(text[start:min(end, start + chunk)])
        done = text[:end] + closer.closing()
        assert done.startswith("<tool_call>\n") and done.endswith("\n</tool_call>"), done
        call = json.loads(done[len("<tool_call>\n"):-len("\n</tool_call>")])
        assert set(call) == {"name", "arguments"} and isinstance(call["arguments"], dict)
        if end >= len(CALL_OPEN) + len(name) + 1:   # the name was written whole: it is kept
            assert call["name"] == name
        else:   # the first declared name that the written part begins
            assert call["name"] == next(n for n in NAMES if n.startswith(text[len(CALL_OPEN):end]))
    assert closer.closing() == ""


def test_a_copy_reads_ahead_without_moving_the_original() -> None:
    closer = CallCloser(NAMES)
    closer.feed('<tool_call>\n{"name": "get_time", "arguments": {"zone": "U')
    ahead = closer.copy()
    ahead.feed('TC"}')
    assert (ahead.closing(), closer.closing()) == (CALL_END, '"}' + CALL_END)


def test_text_that_left_the_layout_has_no_closing() -> None:
    closer = CallCloser(NAMES)
    closer.feed("Sure! <tool_call>")
    assert closer.closing() is None
