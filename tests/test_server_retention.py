"""A trajectory with drops and repositions sent twice to the real server: the second run is a cache hit.

Retrying a task, evaluating another policy on it or forking an agent sends earlier states of a
history again (the history before a drop or a reposition). The server keeps the KV it no
longer reads as retained entries, so the second run finds those states: it prefills at most
1.2 times what the first run's last request prefilled alone (usage figures, not time).
"""
from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from test_server_support import LiveServer, live_server

pytestmark = [pytest.mark.server, pytest.mark.model]

KEEP = 2     # tool responses kept visible; each newer one drops the oldest kept and repositions
TURNS = 7


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest) -> LiveServer:
    return live_server(request.config)


def trajectory(salt: str) -> list[dict[str, Any]]:
    """Every request of a scripted agent run: the history so far plus its cumulative operations."""
    history: list[dict[str, Any]] = [
        {"role": "system", "content": f"[{salt}] You are a weather agent."},
        {"role": "user", "content": "Read the stations one by one; report the warmest."},
    ]
    requests, tool_indices = [], []
    for turn in range(1, TURNS + 1):
        requests.append(_request(history, tool_indices))
        call_id = f"call_{turn}"
        history = history + [
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": call_id, "type": "function",
                "function": {"name": "read", "arguments": json.dumps({"station": turn})}}]},
            {"role": "tool", "tool_call_id": call_id,
             "content": f"Station {turn}: {10 + turn} C, wind {3 * turn} km/h, sky clear, humidity {40 + turn}%."},
        ]
        tool_indices.append(len(history) - 1)
    requests.append(_request(history, tool_indices))
    return requests


def _request(history: list[dict[str, Any]], tool_indices: list[int]) -> dict[str, Any]:
    drops = {str(trigger): [tool_indices[n - KEEP]] for n, trigger in enumerate(tool_indices) if n >= KEEP}
    fields = {"drop_message": drops, "reposition": [int(t) for t in drops]} if drops else {}
    return {"messages": list(history), "max_tokens": 1, "temperature": 0, **fields}


def run(server: LiveServer, requests: list[dict[str, Any]]) -> list[dict[str, int]]:
    """Send the requests in order; each one's usage.prompt_tokens_details."""
    details = []
    for body in requests:
        response = server.chat(body)
        assert response.status_code == 200, response.text
        details.append(response.json()["usage"]["prompt_tokens_details"])
        server.check_idle_and_intact()
    return details


def test_a_second_run_of_a_trajectory_prefills_about_what_the_first_runs_last_request_did(server):
    # The session's server may come here with its pool full of earlier files' KV, and eviction takes
    # retained entries first: what is measured is a server with room for the run, so start empty.
    server.engine.clear_cache()
    requests = trajectory(uuid.uuid4().hex)
    assert "drop_message" in requests[-1] and len(requests[-1]["drop_message"]) >= 3
    first = run(server, requests)
    second = run(server, requests)
    last_alone = first[-1]["prefilled_tokens"]
    assert sum(d["prefilled_tokens"] for d in second) <= 1.2 * last_alone, (first, second)
    # The earlier states came back from retained KV, and the server says so.
    assert sum(d["retained_tokens"] for d in second) > 0
    assert all(d["retained_tokens"] == 0 for d in first)
    metrics = server.client.get("/metrics").text
    retained = [line for line in metrics.splitlines() if line.startswith("akv_retained_tokens_total ")]
    assert retained and float(retained[0].split()[1]) >= sum(d["retained_tokens"] for d in second)
    assert "akv_kv_slots_retained " in metrics
