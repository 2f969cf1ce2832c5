"""SSE framing of a completion: chunk order, tool calls in the final chunk, usage, [DONE]."""
from __future__ import annotations

import json

from akv_core.server.assistant_output import AssistantOutputParser
from akv_core.server.engine_loop import Finished
from akv_core.server.streaming import DONE, ChunkStream

USAGE = {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13, "cached_tokens": 4,
         "drop_skipped_tokens": 2, "repos_tokens": 1, "prefilled_tokens": 3}


def decode(event: str) -> dict:
    assert event.startswith("data: ") and event.endswith("\n\n")
    return json.loads(event[len("data: "):])


def test_a_stream_with_a_tool_call_and_usage() -> None:
    stream = ChunkStream("smollm2", AssistantOutputParser(parse_tool_calls=True), include_usage=True)
    events = [stream.role_chunk()]
    for piece in ["Looking", " it up.\n<tool", '_call>\n{"name": "search", ',
                  '"arguments": {"q": "owls"}}\n</tool_call>']:
        chunk = stream.delta_chunk(piece)
        if chunk:
            events.append(chunk)
    events += stream.final_chunks(Finished("stop", USAGE))
    assert events[-1] == DONE
    chunks = [decode(event) for event in events[:-1]]
    assert len({(c["id"], c["created"]) for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [c["choices"][0]["delta"].get("content", "") for c in chunks[1:-2]]
    assert "".join(deltas) == "Looking it up."
    final = chunks[-2]["choices"][0]
    assert final["finish_reason"] == "tool_calls"
    [call] = final["delta"]["tool_calls"]
    assert call["index"] == 0 and call["function"]["name"] == "search"
    assert json.loads(call["function"]["arguments"]) == {"q": "owls"}
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-2])
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 4, "drop_skipped_tokens": 2, "repos_tokens": 1, "prefilled_tokens": 3, "retained_tokens": 0}


def test_without_include_usage_the_stream_ends_after_the_finish_chunk() -> None:
    stream = ChunkStream("smollm2", AssistantOutputParser(parse_tool_calls=False), include_usage=False)
    stream.delta_chunk("Hello")
    events = stream.final_chunks(Finished("length", USAGE))
    assert events[-1] == DONE
    assert decode(events[-2])["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in decode(event) for event in events[:-1])


def test_two_choices_with_log_probabilities_held_back_with_their_text() -> None:
    from akv_core.sampling import TokenLogprob
    from akv_core.server.logprobs import TokenTexts

    texts = TokenTexts(lambda ids: {1: b"<tool", 2: b"_call>", 3: b"Hi", 4: b"\xe2"}[ids[0]])
    parsers = [AssistantOutputParser(parse_tool_calls=True), AssistantOutputParser(parse_tool_calls=True)]
    stream = ChunkStream("smollm2", parsers, include_usage=False, token_texts=texts)
    roles = [decode(event + "\n\n") for event in stream.role_chunk().split("\n\n") if event]
    assert [chunk["choices"][0]["index"] for chunk in roles] == [0, 1]
    # "<tool" may still open a call: its text and its entry wait for the next token of choice 0.
    assert stream.delta_chunk("<tool", 0, TokenLogprob(1, -0.5, ((1, -0.5), (3, -1.0)))) is None
    other = decode(stream.delta_chunk("Hi", 1, TokenLogprob(3, -0.25)))
    assert other["choices"][0]["index"] == 1 and other["choices"][0]["delta"]["content"] == "Hi"
    assert [entry["token"] for entry in other["choices"][0]["logprobs"]["content"]] == ["Hi"]
    stream.delta_chunk("", 0, TokenLogprob(4, -9e9))   # a piece of a character: no text yet
    events = stream.choice_end(Finished("length", USAGE), 0) + stream.choice_end(Finished("stop", USAGE), 1)
    first = decode(events[0])["choices"][0]
    assert first["delta"]["content"] == "<tool" and first["finish_reason"] is None
    assert [(e["token"], e["bytes"], e["logprob"]) for e in first["logprobs"]["content"]] == [
        ("<tool", list(b"<tool"), -0.5), ("\\xe2", [0xE2], -9999.0)]
    assert first["logprobs"]["content"][0]["top_logprobs"][1] == {"token": "Hi", "logprob": -1.0,
                                                                  "bytes": list(b"Hi")}
    assert [decode(event)["choices"][0]["finish_reason"] for event in events[1:]] == ["length", "stop"]
    assert stream.end(USAGE) == [DONE]
