"""Concurrent clients and clients that leave, on the real server: same outputs, no leaked state."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from test_server_support import MODEL, LiveServer, greeting, live_server

pytestmark = [pytest.mark.server, pytest.mark.model]

TOPICS = ["the moon", "rivers", "owls", "copper", "glaciers", "bread", "volcanoes", "tea"]
LONG_ANSWER = greeting("Count from 1 to 500, separated by commas.")


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest) -> LiveServer:
    return live_server(request.config)


def ask(server: LiveServer, topic: str) -> str:
    history = [{"role": "user", "content": f"One fact about {topic}."}]
    with httpx.Client(base_url=server.url, timeout=300) as client:  # one connection per client
        response = client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": history, "max_tokens": 4, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def test_eight_concurrent_clients_match_one_at_a_time(server: LiveServer) -> None:
    with ThreadPoolExecutor(max_workers=len(TOPICS)) as pool:
        together = list(pool.map(lambda topic: ask(server, topic), TOPICS))
    alone = [ask(server, topic) for topic in TOPICS]
    assert together == alone
    assert len(set(alone)) > 1  # different histories, different answers
    server.check_idle_and_intact()


def wait_until_idle(server: LiveServer) -> None:
    """Bounded wait for the engine to notice the cancellation (a hang fails the test)."""
    for _ in range(600):
        stats = server.engine.stats()
        if stats.running == 0 and stats.waiting == 0:
            return
        time.sleep(0.05)
    pytest.fail(f"the cancelled request still runs: {stats}")


def disconnected_count(server: LiveServer) -> float:
    for line in server.client.get("/metrics").text.splitlines():
        if line.startswith('akv_requests_total{endpoint="chat",outcome="disconnected"}'):
            return float(line.split()[-1])
    return 0.0


def test_a_client_that_leaves_mid_stream_has_its_request_cancelled(server: LiveServer) -> None:
    before = disconnected_count(server)
    body = {"model": MODEL, "messages": LONG_ANSWER, "max_tokens": 400, "temperature": 0,
            "stream": True}
    with httpx.Client(base_url=server.url, timeout=300) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            for number, _ in enumerate(response.iter_lines()):
                if number >= 6:
                    break  # leaving the block closes the connection
    wait_until_idle(server)
    server.check_idle_and_intact()
    assert disconnected_count(server) == before + 1


def test_a_client_that_times_out_has_its_request_cancelled(server: LiveServer) -> None:
    before = disconnected_count(server)
    body = {"model": MODEL, "messages": LONG_ANSWER, "max_tokens": 400, "temperature": 0}
    with httpx.Client(base_url=server.url, timeout=1.0) as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post("/v1/chat/completions", json=body)
    wait_until_idle(server)
    server.check_idle_and_intact()
    # The server saw the disconnect (not a finished request) and still answers.
    for _ in range(100):
        if disconnected_count(server) == before + 1:
            break
        time.sleep(0.05)
    assert disconnected_count(server) == before + 1
    assert server.chat({"messages": greeting("Say ok."), "max_tokens": 1}).status_code == 200
