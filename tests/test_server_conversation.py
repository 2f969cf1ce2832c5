"""A 20-turn agent conversation under a rolling keep-last-3 policy, on the real server.

Each turn sends the whole history plus the cumulative operations. From turn 2
on, everything the previous turn's prompt held must come from the cache (as
cached, repositioned or drop-skipped tokens) and only the new tokens are
prefilled.
"""
from __future__ import annotations

import json
from typing import Any

import pytest

from test_server_support import LiveServer, live_server

pytestmark = [pytest.mark.server, pytest.mark.model]

KEEP = 3
TURNS = 20


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest) -> LiveServer:
    return live_server(request.config)


def keep_last(history: list[dict[str, Any]], keep: int) -> dict[str, Any]:
    """Rolling window: each new tool response beyond `keep` drops the oldest kept one and repositions."""
    tool_indices = [i for i, message in enumerate(history) if message["role"] == "tool"]
    drops, reposition = {}, []
    for n, trigger in enumerate(tool_indices):
        if n >= keep:
            drops[str(trigger)] = [tool_indices[n - keep]]
            reposition.append(trigger)
    return {"drop_message": drops, "reposition": reposition} if drops else {}


def agent_step(turn: int) -> list[dict[str, Any]]:
    """An assistant tool call and its result, kept short: the CPU test budget is small."""
    call_id = f"call_{turn}"
    return [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": call_id, "type": "function",
            "function": {"name": "read", "arguments": json.dumps({"station": turn})}}]},
        {"role": "tool", "tool_call_id": call_id, "content": f"Station {turn}: {10 + turn} C."},
    ]


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_rolling_keep_last_3_reuses_the_whole_previous_prompt(server: LiveServer) -> None:
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a weather agent."},
        {"role": "user", "content": "Read the stations; report the warmest."},
    ]
    previous: tuple[int, ...] | None = None
    for turn in range(1, TURNS + 1):
        fields = keep_last(history, KEEP)
        response = server.chat({"messages": history, "max_tokens": 1, "temperature": 0, **fields})
        assert response.status_code == 200, (turn, response.text)
        usage = response.json()["usage"]
        d = usage["prompt_tokens_details"]
        ids = server.engine.tokenizer.render(history).token_ids
        assert usage["prompt_tokens"] == len(ids)
        assert usage["prompt_tokens"] == (d["prefilled_tokens"] + d["cached_tokens"]
                                          + d["repos_tokens"] + d["drop_skipped_tokens"])
        if previous is not None:
            reused = common_prefix(previous, ids)
            assert reused == len(previous), "history rendering is prefix-stable"
            assert d["prefilled_tokens"] == len(ids) - reused, (turn, d)
            assert d["cached_tokens"] + d["repos_tokens"] + d["drop_skipped_tokens"] == reused
            if "reposition" not in fields:
                assert d["repos_tokens"] == 0 and d["cached_tokens"] == reused, (turn, d)
            else:
                assert d["repos_tokens"] > 0 and d["drop_skipped_tokens"] > 0, (turn, d)
        previous = ids
        history += agent_step(turn)
    server.check_idle_and_intact()
