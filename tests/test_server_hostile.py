"""Requests from a campaign of hostile ones: one request's values or failure never harm another.

Hostile bodies (nested past any recursion limit, absurd `n` and `max_tokens`, over the body limit
by their Content-Length or while they arrive chunked) each get a 4xx error object or a 200, never
a 5xx, and the server answers a well-formed request right after each. The helpers here serve the
API key's tests (test_server_auth.py) and the proxy's (test_proxy_auth.py) too.
"""
from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from akv_core.server.guard import body_limit_for
from test_server_support import MODEL, LiveServer, greeting, live_server

pytestmark = [pytest.mark.server, pytest.mark.model]


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest) -> LiveServer:
    return live_server(request.config)


def outcomes(server: LiveServer) -> dict[str, float]:
    counts = {}
    for line in server.client.get("/metrics").text.splitlines():
        if line.startswith('akv_requests_total{endpoint="chat"'):
            counts[line.split('outcome="')[1].split('"')[0]] = float(line.split()[-1])
    return counts


def post(server: LiveServer, body: dict) -> httpx.Response:
    with httpx.Client(base_url=server.url, timeout=300) as client:   # one connection per client
        return client.post("/v1/chat/completions", json={"model": MODEL, **body})


def test_a_tiny_temperature_is_greedy_and_leaves_the_requests_beside_it_alone(server: LiveServer) -> None:
    tiny = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 1e-40}
    others = [{"messages": greeting(f"One fact about {topic}."), "max_tokens": 4, "temperature": 0}
              for topic in ("owls", "copper")]
    alone = [post(server, body).json()["choices"][0]["message"]["content"] for body in others]
    greedy = post(server, {**tiny, "temperature": 0}).json()["choices"][0]["message"]["content"]
    before = outcomes(server)
    with ThreadPoolExecutor(max_workers=3) as pool:
        responses = list(pool.map(lambda body: post(server, body), [tiny, *others]))
    assert [r.status_code for r in responses] == [200, 200, 200], [r.text for r in responses]
    texts = [r.json()["choices"][0]["message"]["content"] for r in responses]
    assert texts == [greedy, *alone]
    after = outcomes(server)
    assert after["ok"] == before["ok"] + 3
    assert after.get("failed", 0) == before.get("failed", 0)
    assert after.get("rejected", 0) == before.get("rejected", 0)
    server.check_idle_and_intact()


def test_an_engine_failure_is_a_500_counted_as_failed_not_a_400(server: LiveServer) -> None:
    def broken(handle, logits) -> None:
        raise RuntimeError("a bug while sampling")

    body = {"messages": greeting("Say ok."), "max_tokens": 2}
    before = outcomes(server)
    server.engine.logits_probe = broken
    try:
        plain = server.chat(body)
        streamed = server.client.post("/v1/chat/completions",
                                      json={"model": MODEL, **body, "stream": True}).text
    finally:
        server.engine.logits_probe = None
    assert plain.status_code == 500, plain.text
    error = plain.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "engine_error"
    assert error["param"] is None and "a bug while sampling" in error["message"]
    assert '"code":"engine_error"' in streamed and streamed.rstrip().endswith("data: [DONE]")
    after = outcomes(server)
    assert after["failed"] == before.get("failed", 0) + 2
    assert after.get("rejected", 0) == before.get("rejected", 0)
    server.check_idle_and_intact()
    assert server.chat(body).status_code == 200


# ---- hostile requests, each followed by a well-formed one ------------------------------------------------

NESTING = 100_000


def nested(depth: int) -> str:
    """JSON text of `depth` nested arrays (written as text: building it as objects would itself recurse)."""
    return "[" * depth + "1" + "]" * depth


def hostile_bodies(model: str) -> dict[str, bytes]:
    """Bodies that parse badly, nest past any recursion limit or ask for absurd amounts: named for the
    test ids. Each must get a 4xx error object or a 200, never a 5xx."""
    hello = [{"role": "user", "content": "Say ok."}]
    start = f'{{"model": "{model}", "messages": {json.dumps(hello)}, "max_tokens": 1'
    objects = '{"a": ' * NESTING + "1" + "}" * NESTING
    bodies: dict[str, Any] = {
        "100,000 nested arrays": nested(NESTING),
        "100,000 nested arrays as messages": f'{{"model": "{model}", "messages": {nested(NESTING)}}}',
        "100,000 nested objects in metadata": f'{start}, "metadata": {objects}}}',
        "990 nested arrays in a field": f'{start}, "drop_message": {{"0": {nested(990)}}}}}',
        "n = 2**70": {"messages": hello, "max_tokens": 1, "n": 2**70},
        "n = 1,000,000": {"messages": hello, "max_tokens": 1, "n": 1_000_000},
        "max_tokens = 2**70": {"messages": hello, "max_tokens": 2**70, "regex": "ok"},
        "max_completion_tokens = 10**9": {"messages": hello, "max_completion_tokens": 10**9, "regex": "ok"},
        "max_tokens = -2**70": {"messages": hello, "max_tokens": -2**70},
        "seed = 2**200": {"messages": hello, "max_tokens": 1, "seed": 2**200},
        "100,000 messages": {"messages": hello * 100_000, "max_tokens": 1},
    }
    for depth in (940, 990):   # JSON in a string: parsed by the chat renderer, not the body parser
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": nested(depth)}}
        bodies[f"{depth} nested arrays in tool call arguments"] = {"max_tokens": 1, "messages": [
            *hello, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "done"}]}
    return {name: body.encode() if isinstance(body, str) else json.dumps({"model": model, **body}).encode()
            for name, body in bodies.items()}


HOSTILE = hostile_bodies(MODEL)


def assert_error_object(response: httpx.Response | tuple[int, bytes], status: int | None = None,
                        code: str | None = None) -> dict:
    """A 4xx (or `status`) whose body is exactly OpenAI's error object; returns the error."""
    got, body = (response.status_code, response.content) if isinstance(response, httpx.Response) else response
    assert 400 <= got < 500 and got == (status or got), (got, body[:300])
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert error["code"] == (code or error["code"]), error
    return error


def assert_4xx_or_200(response: httpx.Response) -> None:
    if response.status_code != 200:
        assert_error_object(response)


def declared_length(url: str, path: str, length: int, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """(status, body) of a POST that declares `length` body bytes and sends none: a server that read
    the body before judging its length would wait here forever (the timeout fails the test)."""
    parsed = urlsplit(url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=60)
    try:
        conn.putrequest("POST", path)
        for name, value in {"content-type": "application/json", **(headers or {})}.items():
            conn.putheader(name, value)
        conn.putheader("content-length", str(length))
        conn.endheaders()
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def chunked(total: int, piece: int = 1 << 16) -> Iterator[bytes]:
    """`total` bytes of a JSON-looking body as a generator: httpx sends it chunked, with no length."""
    yield b'{"messages": "'
    for _ in range(total // piece + 1):
        yield b"x" * piece
    yield b'"}'


def served(client: httpx.Client, headers: dict[str, str] | None = None) -> None:
    """A well-formed request right after a bad one is answered."""
    response = client.post("/v1/chat/completions", headers=headers,
                           json={"model": MODEL, "messages": greeting("Say ok."), "max_tokens": 1})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_body_gets_a_4xx_or_a_200_and_the_next_request_is_served(server: LiveServer, name: str) -> None:
    response = server.client.post("/v1/chat/completions", content=HOSTILE[name],
                                  headers={"content-type": "application/json"})
    assert_4xx_or_200(response)
    served(server.client)
    server.check_idle_and_intact()


def test_deep_nesting_is_named_and_tool_arguments_too_deep_render_as_their_text(server: LiveServer) -> None:
    error = assert_error_object(server.client.post("/v1/chat/completions", content=HOSTILE["100,000 nested arrays"],
                                                   headers={"content-type": "application/json"}), 400)
    assert error["code"] == "invalid_json" and "nested too deeply" in error["message"]
    # Arguments the renderer cannot parse are shown as the string the client sent, as for any non-JSON text.
    response = server.client.post("/v1/chat/completions", content=HOSTILE["990 nested arrays in tool call arguments"],
                                  headers={"content-type": "application/json"})
    assert response.status_code == 200 and response.json()["usage"]["prompt_tokens"] > 990


def test_a_body_over_the_limit_is_a_413_before_it_is_read_or_as_soon_as_it_passes(server: LiveServer) -> None:
    limit = body_limit_for(server.engine.context_length)
    assert limit == 8 << 20  # the embedded model's 8,192-token context
    for length in (limit + 1, 10**15):
        assert_error_object(declared_length(server.url, "/v1/chat/completions", length), 413, "request_too_large")
        served(server.client)
    response = server.client.post("/v1/chat/completions", content=chunked(limit + 1),
                                  headers={"content-type": "application/json"})
    assert_error_object(response, 413, "request_too_large")
    served(server.client)   # on the same connection: the rest of the body was read and dropped
    at_limit = server.client.post("/v1/chat/completions", content=b" " * limit,
                                  headers={"content-type": "application/json"})
    assert_error_object(at_limit, 400)   # read and parsed: blanks are no JSON object
    server.check_idle_and_intact()
