"""`akv proxy`: the official openai client and an unchanged tool-calling agent loop, through the proxy,
to a real AKV server on loopback (the embedded SmolLM2); and the proxy's failures, bounded and named."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

import httpx
import openai
import pytest

from akv_core.server import serve_in_thread
from akv_proxy import create_proxy_app
from policy_dsl import compile_policy, load_policy, parse
from sandbox.backends.tokens import shared_tokenizer
from test_server_support import MODEL, interrupt, live_server, ready_url

AKV = [sys.executable, "-m", "akv_cli.main"]
SUMMARIZE_EARLY = "mode text\non history_tokens > 300: summarize all within 48 tokens\n"
PAGE = "The archive lists shipments by date; each entry names the port, the cargo and the clerk. " * 6


@contextmanager
def proxy(policy: Any, upstream: str, timeout_s: float = 120.0) -> Iterator[str]:
    app = create_proxy_app(policy, upstream, shared_tokenizer(), timeout_s=timeout_s)
    with serve_in_thread(app) as url:
        yield url


def metric(url: str, name: str) -> float:
    """One sample of the proxy's /metrics, e.g. 'akv_proxy_requests_total{outcome="decided"}' (0 if absent)."""
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def agent_loop(client: openai.OpenAI, steps: int) -> dict[str, int]:
    """An ordinary tool-calling loop on the openai client: the planner picks the next lookup (the 135M
    model does not call tools reliably), the tool runs, its result joins the history. Returns usage totals."""
    tools = [{"type": "function", "function": {"name": "lookup", "description": "An archive page.",
                                               "parameters": {"type": "object",
                                                              "properties": {"page": {"type": "integer"}}}}}]
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You research an archive."},
                                      {"role": "user", "content": "Which clerk signed the most entries?"}]
    totals = {"prompt": 0, "cached": 0, "drop_skipped": 0, "repos": 0}
    for step in range(steps):
        reply = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=1,
                                               temperature=0)
        details = reply.usage.prompt_tokens_details
        totals["prompt"] += reply.usage.prompt_tokens
        totals["cached"] += details.cached_tokens
        totals["drop_skipped"] += getattr(details, "drop_skipped_tokens", 0)
        totals["repos"] += getattr(details, "repos_tokens", 0)
        call = {"id": f"call_{step}", "type": "function",
                "function": {"name": "lookup", "arguments": json.dumps({"page": step})}}
        messages.append({"role": "assistant", "content": reply.choices[0].message.content or "", "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": call["id"], "name": "lookup",
                         "content": f"Page {step}. {PAGE} Clerk of page {step}: C{step}."})
    return totals


@pytest.fixture(scope="module")
def server(pytestconfig):
    return live_server(pytestconfig)


# ---- through a real server ---------------------------------------------------------------------------

@pytest.mark.server
@pytest.mark.model
@pytest.mark.slow
def test_an_unchanged_agent_loop_shows_the_policy_acting_in_its_usage(server) -> None:
    policy = compile_policy(parse("mode kv\non each tool_response: drop role tool keep last 2\n"
                                  "reposition after each drop\n"), name="window-2")
    direct = agent_loop(openai.OpenAI(base_url=server.url + "/v1", api_key="none"), steps=6)
    with proxy(policy, server.url) as url:
        proxied = agent_loop(openai.OpenAI(base_url=url + "/v1", api_key="none"), steps=6)
        assert metric(url, 'akv_proxy_requests_total{outcome="decided"}') == 6
        assert metric(url, 'akv_proxy_decisions_total{effect="drop"}') == 3  # tool responses 3, 4, 5 roll out
        assert metric(url, "akv_proxy_dropped_tokens_total") > 0
        assert metric(url, 'akv_proxy_upstream_tokens_total{kind="drop_skipped"}') == proxied["drop_skipped"]
    assert direct["drop_skipped"] == 0 and direct["repos"] == 0
    assert proxied["drop_skipped"] > 0 and proxied["repos"] > 0  # dropped KV is not read; survivors moved
    assert proxied["cached"] > 0  # each request still reuses the cache the previous one left
    assert proxied["prompt"] == direct["prompt"]  # the text is the same: only the cache changed
    server.check_idle_and_intact()


@pytest.mark.server
@pytest.mark.model
def test_the_openai_client_streams_through_with_usage_and_own_fields_pass_untouched(server) -> None:
    with proxy(load_policy("rolling-3"), server.url) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        messages = [{"role": "system", "content": "You are concise."}, {"role": "user", "content": "Say hi."}]
        chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0)
        assert plain.choices[0].message.content == text  # the same request, streamed or not
        assert metric(url, 'akv_proxy_upstream_tokens_total{kind="completion"}') == \
            chunks[-1].usage.completion_tokens + plain.usage.completion_tokens
        own = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": MODEL, "max_tokens": 1, "drop_message": {"2": [1]},
            "messages": [*messages, {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Again."}]})
        assert own.status_code == 200 and own.headers["x-akv-proxy"] == "passthrough"
        assert own.json()["usage"]["prompt_tokens_details"]["drop_skipped_tokens"] >= 0
        refused = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"content": "x"}]})
        assert refused.status_code == 400 and "message 0" in refused.json()["error"]["message"]
        assert metric(url, 'akv_proxy_requests_total{outcome="passthrough"}') == 1
        assert metric(url, 'akv_proxy_requests_total{outcome="rejected"}') == 1
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == MODEL  # other paths pass through
    server.check_idle_and_intact()


@pytest.mark.server
@pytest.mark.model
@pytest.mark.slow
def test_text_mode_summarizes_with_the_upstream_once_per_history(server) -> None:
    policy = compile_policy(parse(SUMMARIZE_EARLY), name="summarize-early")
    history = [{"role": "system", "content": "You research an archive."},
               {"role": "user", "content": "Which clerk signed the most entries?"}]
    for step in range(3):
        history += [{"role": "assistant", "content": f"Reading page {step}."},
                    {"role": "user", "content": f"Page {step}. {PAGE} Clerk of page {step}: C{step}."}]
    raw_tokens = sum(shared_tokenizer().count(m) for m in history)
    with proxy(policy, server.url) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        first = client.chat.completions.create(model=MODEL, messages=history, max_tokens=1, temperature=0)
        assert metric(url, "akv_proxy_summaries_total") == 1
        assert metric(url, 'akv_proxy_decisions_total{effect="summarize"}') == 1
        assert first.usage.prompt_tokens < raw_tokens  # the upstream saw the summarized history
        again = client.chat.completions.create(model=MODEL, messages=history, max_tokens=1, temperature=0)
        assert metric(url, "akv_proxy_summaries_total") == 1  # the edited history was remembered
        assert again.usage.prompt_tokens == first.usage.prompt_tokens
        assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 2
    server.check_idle_and_intact()


# ---- failures --------------------------------------------------------------------------------------

def test_an_upstream_that_is_down_is_a_502_with_the_reason() -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with proxy(load_policy("expert-8k"), f"http://127.0.0.1:{port}/v1") as url:
        started = time.monotonic()
        reply = httpx.post(url + "/v1/chat/completions", timeout=30, json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert time.monotonic() - started < 15
        assert reply.status_code == 502
        error = reply.json()["error"]
        assert error["code"] == "upstream_unreachable" and f"127.0.0.1:{port}" in error["message"]
        assert metric(url, 'akv_proxy_upstream_errors_total{reason="unreachable"}') == 1
        with pytest.raises(openai.InternalServerError, match="unreachable"):
            openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0).chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}])


def test_an_upstream_that_never_answers_is_a_504_after_the_timeout() -> None:
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    accepted: list[socket.socket] = []
    worker = threading.Thread(target=lambda: accepted.append(silent.accept()[0]), daemon=True)
    worker.start()
    try:
        with proxy(load_policy("expert-8k"), f"http://127.0.0.1:{silent.getsockname()[1]}", timeout_s=1.0) as url:
            reply = httpx.post(url + "/v1/chat/completions", timeout=30, json={
                "model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True})
            assert reply.status_code == 504 and reply.json()["error"]["code"] == "upstream_timeout"
            assert "within 1 s" in reply.json()["error"]["message"]
            bad = httpx.post(url + "/v1/chat/completions", content=b"{not json")
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "body"
    finally:
        for conn in accepted:
            conn.close()
        silent.close()


def test_a_policy_that_does_not_parse_keeps_the_proxy_from_starting(tmp_path) -> None:
    bad = tmp_path / "bad.akvp"
    bad.write_text("mode kv\non each tool_response: drop role tool keepx last 3\n")
    result = subprocess.run([*AKV, "proxy", "--policy", str(bad), "--upstream", "http://127.0.0.1:9"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"error: {bad}:2:39: unknown keyword 'keepx'" in result.stderr
    assert result.stderr.rstrip().endswith("^")  # the source line with a caret under the column


@pytest.mark.server
@pytest.mark.model
def test_akv_proxy_prints_its_url_and_forwards(server) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen([*AKV, "proxy", "--policy", "expert-8k", "--upstream", server.url + "/v1",
                                "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = ready_url(process)
        assert httpx.get(url + "/health").json() == {"status": "ok", "policy": "expert-8k", "mode": "kv",
                                                     "upstream": server.url}
        reply = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
        assert reply.status_code == 200 and reply.headers["x-akv-policy"] == "expert-8k"
    finally:
        interrupt(process)



def test_the_proxy_layer_never_imports_evolve_or_the_store() -> None:
    code = "import sys, akv_proxy, akv_cli.proxy; print(sorted({m.split('.')[0] for m in sys.modules}))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert loaded.returncode == 0, loaded.stderr
    assert "'evolve'" not in loaded.stdout and "'store'" not in loaded.stdout
