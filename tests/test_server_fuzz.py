"""A bounded fuzz campaign against the live server: random and mutated request bodies.

Whatever arrives, the server answers 200 or an OpenAI error object (400/404),
never a 500; afterwards no request is left running, the KV pool is intact, and
an ordinary request still gets a correct answer.
"""
from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_server_support import MODEL, LiveServer, greeting, live_server

pytestmark = [pytest.mark.server, pytest.mark.model]

VALID: dict[str, Any] = {
    "model": MODEL,
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello."},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Bye."},
    ],
    "max_tokens": 1,
    "temperature": 0,
    "drop_message": {"3": [1, 2]},
    "reposition": [3],
}
FIELDS = ["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
          "seed", "stop", "stream", "stream_options", "tools", "tool_choice", "n",
          "drop_message", "reposition", "drop_rule"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 10) | st.floats(allow_nan=False, width=32)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
indices = st.integers(-2, 6)
index_keys = st.one_of(indices.map(str), st.sampled_from(["x", "1.5", " 2", "", "03", "-1"]))
akv_values = {
    "drop_message": st.dictionaries(index_keys, st.lists(indices | json_values, max_size=3), max_size=3),
    "reposition": st.lists(indices, max_size=3) | json_values,
    "drop_rule": st.fixed_dictionaries({"type": st.sampled_from(["message_drop", "thinking_drop", "x"])},
                                       optional={"drop_messages": st.dictionaries(
                                           index_keys, st.lists(indices, max_size=2), max_size=2)}),
    "messages": st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool", "robot"])},
        optional={"content": st.text(max_size=12) | json_values,
                  "reasoning_content": st.text(max_size=12)}), max_size=5),
    "stream": st.booleans(),
    "max_tokens": st.integers(-2, 2) | json_values,
    "max_completion_tokens": st.integers(-1, 2) | st.none(),
    "model": st.sampled_from([MODEL, MODEL, "gpt-4o", ""]),
    "seed": st.none() | st.integers(-1, 2**31),
    "temperature": st.none() | st.floats(0, 2.5),
    "top_p": st.none() | st.floats(-0.1, 1.1),
    "stop": st.none() | st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3),
    "n": st.sampled_from([None, 1, 2]),
    "stream_options": st.none() | st.fixed_dictionaries({"include_usage": st.booleans()}),
    "tools": st.none() | st.just([]) | st.just([{"type": "function", "function": {"name": "f"}}]),
    "tool_choice": st.sampled_from([None, "auto", "none", "required"]),
}


@st.composite
def mutated_bodies(draw: st.DrawFn) -> dict[str, Any]:
    body = json.loads(json.dumps(VALID))
    for _ in range(draw(st.integers(1, 2))):
        field = draw(st.sampled_from(FIELDS + ["surprise"]))
        # Mostly well-typed values, so that a good share of bodies reaches the engine.
        action = draw(st.sampled_from(["delete", "random", "typed", "typed", "typed"]))
        if action == "delete":
            body.pop(field, None)
        elif action == "typed" and field in akv_values:
            body[field] = draw(akv_values[field])
        else:
            body[field] = draw(json_values)
    # Keep generation short whatever the mutation did to the length fields.
    for field in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(field), int) and body[field] > 2:
            body[field] = 2
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_completion_tokens"] = 1  # null or missing would mean the default of 512
    return body


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest) -> LiveServer:
    return live_server(request.config)


QUESTION = {"messages": greeting("What is 2 + 2? Answer with one number."), "max_tokens": 2,
            "temperature": 0}


@pytest.fixture(scope="module")
def baseline(server: LiveServer) -> str:
    """The greedy answer before the campaign; it must not change after it."""
    response = server.chat(QUESTION)
    assert response.status_code == 200
    return response.json()["choices"][0]["message"]["content"]


STATUSES: Counter[int] = Counter()  # what the campaign saw, checked after it


def check_answer(server: LiveServer, payload: bytes) -> None:
    response = server.client.post("/v1/chat/completions", content=payload,
                                  headers={"content-type": "application/json"})
    STATUSES[response.status_code] += 1
    assert response.status_code in (200, 400, 404), (response.status_code, payload, response.text)
    if response.status_code != 200:
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"]
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.rstrip().endswith("data: [DONE]")
    else:
        assert response.json()["object"] == "chat.completion"


@pytest.mark.usefixtures("baseline")
@settings(max_examples=100, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(payload=st.one_of(
    *[mutated_bodies().map(json.dumps)] * 3, json_values.map(json.dumps), st.binary(max_size=24)))
def test_random_and_mutated_bodies_never_break_the_server(server: LiveServer,
                                                          payload: str | bytes) -> None:
    check_answer(server, payload.encode() if isinstance(payload, str) else payload)


def test_after_the_campaign_the_pool_is_intact_and_answers_are_right(server: LiveServer,
                                                                     baseline: str) -> None:
    # The campaign exercised both the engine and the error paths.
    assert STATUSES[200] > 0 and STATUSES[400] > 0, STATUSES
    server.check_idle_and_intact()
    response = server.chat(QUESTION)
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == baseline
    assert server.client.get("/health").json()["status"] == "ok"
