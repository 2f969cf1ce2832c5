"""Requests from a campaign of hostile ones: one request's values or failure never harm another."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

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
