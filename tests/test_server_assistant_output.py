"""The model's output as an assistant message: tool calls, reasoning, and streaming consistency."""
from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from akv_core.server.assistant_output import AssistantOutputParser, parse_assistant_output

CALL = '<tool_call>\n{"name": "search", "arguments": {"query": "tallest mountain"}}\n</tool_call>'


def test_a_tool_call_block_becomes_tool_calls_with_generated_ids() -> None:
    message = parse_assistant_output("Let me look.\n" + CALL, parse_tool_calls=True)
    assert message.content == "Let me look."
    [call] = message.tool_calls
    assert call.function.name == "search"
    assert json.loads(call.function.arguments) == {"query": "tallest mountain"}
    assert call.id.startswith("call_") and call.type == "function"


def test_several_blocks_and_a_list_inside_one_block() -> None:
    two = CALL + "\n" + CALL.replace("search", "get_document")
    assert [c.function.name for c in parse_assistant_output(two, True).tool_calls] == [
        "search", "get_document"]
    listed = '<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": "{\\"x\\": 1}"}]</tool_call>'
    calls = parse_assistant_output(listed, True).tool_calls
    assert [(c.function.name, c.function.arguments) for c in calls] == [("a", "{}"), ("b", '{"x": 1}')]
    assert calls[0].id != calls[1].id


def test_unparseable_calls_come_back_as_text() -> None:
    for text in [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": 3}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"a": 1}}',  # unclosed, but not cut off by max_tokens
        CALL + '<tool_call>{"name": "g"',  # second block unclosed
    ]:
        message = parse_assistant_output(text, parse_tool_calls=True)
        assert message.tool_calls is None
        assert message.content == text


def test_a_call_cut_off_by_max_tokens_is_the_call_it_began_never_text() -> None:
    # OpenAI returns such a call as written, its arguments not valid JSON yet; finish_reason says why.
    cut = '<tool_call>\n{"name": "write_note", "arguments": {"title": "Tod'
    parser = AssistantOutputParser(parse_tool_calls=True)
    streamed = parser.feed("Noted. " + cut).content
    last, message = parser.finish(cut=True)
    assert streamed + last.content == "Noted." and message.content == "Noted."
    [call] = message.tool_calls
    assert (call.function.name, call.function.arguments) == ("write_note", '{"title": "Tod')
    calls = AssistantOutputParser(True)
    calls.feed(CALL + '\n<tool_call>\n{"name": "get_')
    assert [(c.function.name, c.function.arguments) for c in calls.finish(cut=True)[1].tool_calls] == [
        ("search", '{"query": "tallest mountain"}'), ("get_", "")]
    # Not cut (a stop sequence, the model's own end): an unclosed block stays text, as before.
    assert parse_assistant_output(cut, True).content == cut


def test_without_tools_a_call_block_is_plain_text() -> None:
    message = parse_assistant_output(CALL, parse_tool_calls=False)
    assert message.tool_calls is None and message.content == CALL


def test_leading_think_block_is_reasoning() -> None:
    message = parse_assistant_output("<think>compare both</think>\n\nParis.", False)
    assert (message.reasoning, message.content) == ("compare both", "Paris.")
    unfinished = parse_assistant_output("<think>still going", False)
    assert (unfinished.reasoning, unfinished.content) == ("still going", None)
    inner_call = parse_assistant_output("<think>" + CALL + "</think>done", True)
    assert inner_call.tool_calls is None and inner_call.content == "done"


pieces = st.sampled_from(["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool", "_call>",
                          "<", ">", "\n", " ", "hello", '{"name": "f", "arguments": {}}', "{", "}"])


@settings(max_examples=300, deadline=None)
@given(st.lists(pieces, max_size=12), st.lists(st.integers(0, 200), max_size=8), st.booleans())
def test_streamed_deltas_concatenate_to_the_final_message(parts, cuts, tools) -> None:
    text = "".join(parts)
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    parser = AssistantOutputParser(tools)
    deltas = [parser.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])]
    last, message = parser.finish()
    deltas.append(last)
    assert "".join(d.content for d in deltas) == (message.content or "")
    assert "".join(d.reasoning for d in deltas) == (message.reasoning or "")
    assert message == _without_ids(parse_assistant_output(text, tools), message)


def _without_ids(expected, actual):
    """Tool-call ids are random; compare everything else."""
    if expected.tool_calls and actual.tool_calls:
        for mine, theirs in zip(expected.tool_calls, actual.tool_calls):
            mine.id = theirs.id
    return expected


def test_leading_and_only_whitespace_survive() -> None:
    # Generated code keeps its indentation; a reply of only whitespace is that whitespace, not null.
    for tools in (False, True):
        assert parse_assistant_output("    x = 1", tools).content == "    x = 1"
        assert parse_assistant_output("\n\n  ", tools).content == "\n\n  "
    # Whitespace before a think block still separates nothing: the block is reasoning.
    message = parse_assistant_output("\n<think>hm</think>\n\n  indented", False)
    assert (message.reasoning, message.content) == ("hm", "  indented")
    parser = AssistantOutputParser(parse_tool_calls=False)
    streamed = [parser.feed(piece).content for piece in ("  ", "  x", " = 1")]
    assert "".join(streamed) + parser.finish()[0].content == "    x = 1"
