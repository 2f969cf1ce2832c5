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
        "cached_tokens": 4, "drop_skipped_tokens": 2, "repos_tokens": 1, "prefilled_tokens": 3}


def test_without_include_usage_the_stream_ends_after_the_finish_chunk() -> None:
    stream = ChunkStream("smollm2", AssistantOutputParser(parse_tool_calls=False), include_usage=False)
    stream.delta_chunk("Hello")
    events = stream.final_chunks(Finished("length", USAGE))
    assert events[-1] == DONE
    assert decode(events[-2])["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in decode(event) for event in events[:-1])
