"""`akv proxy --api-key`, `--upstream-api-key`, `--max-body-bytes` and its summaries, against a tiny
upstream on loopback that answers every request and remembers the headers it got.

The callers' credentials never reach the upstream; the upstream key, when set, is what it gets,
on forwarded requests and on the summaries a text-mode policy writes. A proxy reachable by anyone
refuses those summaries. Bad tokens, oversized and hostile bodies get a 4xx error object (or a 200),
and the proxy answers a well-formed request right after each.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from contextlib import contextmanager
from typing import Any, Iterator

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from akv_core.server import serve_in_thread
from akv_proxy import create_proxy_app
from akv_proxy.access import ALLOW_SUMMARIES_FLAG, ProxyAccess, summaries_allowed
from policy_dsl import compile_policy, load_policy, parse
from sandbox.backends.tokens import shared_tokenizer
from test_server_hostile import (HOSTILE, assert_4xx_or_200, assert_error_object, chunked, declared_length)
from test_server_support import interrupt, ready_url

AKV = [sys.executable, "-m", "akv_cli.main"]
KEY, UPSTREAM_KEY = "sk-proxy-callers", "sk-upstream-own"
AUTH = {"authorization": f"Bearer {KEY}"}
CALLER = {"authorization": "Bearer sk-the-callers-secret", "cookie": "session=callers-cookie", "x-trace": "t-1"}
HELLO = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
PAGE = "The archive lists shipments by date; each entry names the port, the cargo and the clerk. " * 6
SUMMARIZE_EARLY = compile_policy(parse("mode text\non history_tokens > 300: summarize all within 48 tokens\n"),
                                 name="summarize-early")


class Echo:
    """The upstream: a chat completion for every chat request, the headers it got for any other path."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, str]]] = []   # (path, headers) of every request
        self.app = FastAPI()
        self.app.api_route("/{path:path}", methods=["GET", "POST"])(self.answer)

    async def answer(self, request: Request, path: str) -> JSONResponse:
        self.seen.append(("/" + path, dict(request.headers)))
        if path != "v1/chat/completions":
            return JSONResponse({"path": "/" + path, "headers": dict(request.headers)})
        return JSONResponse({"id": "c", "object": "chat.completion", "created": 0, "model": "m", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "A short summary."}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})


@pytest.fixture
def echo() -> Iterator[tuple[Echo, str]]:
    upstream = Echo()
    with serve_in_thread(upstream.app) as url:
        yield upstream, url


@contextmanager
def proxy(upstream_url: str, access: ProxyAccess = ProxyAccess(), policy: Any = None) -> Iterator[httpx.Client]:
    app = create_proxy_app(policy or load_policy("expert-8k"), upstream_url, shared_tokenizer(), timeout_s=30,
                           access=access)
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        yield client


def served(client: httpx.Client, headers: dict[str, str] | None = None) -> None:
    assert client.post("/v1/chat/completions", json=HELLO, headers=headers).status_code == 200


def long_history() -> list[dict[str, str]]:
    history = [{"role": "system", "content": "You research an archive."},
               {"role": "user", "content": "Which clerk signed the most entries?"}]
    for step in range(3):
        history += [{"role": "assistant", "content": f"Reading page {step}."},
                    {"role": "user", "content": f"Page {step}. {PAGE} Clerk of page {step}: C{step}."}]
    return history


# ---- what is forwarded -------------------------------------------------------------------------------

def test_the_callers_credentials_never_reach_the_upstream(echo: tuple[Echo, str]) -> None:
    upstream, url = echo
    with proxy(url) as client:
        assert client.post("/v1/chat/completions", json=HELLO, headers=CALLER).status_code == 200
        assert client.get("/v1/models", headers=CALLER).status_code == 200
    assert [path for path, _ in upstream.seen] == ["/v1/chat/completions", "/v1/models"]
    for _, headers in upstream.seen:
        assert "authorization" not in headers and "cookie" not in headers, headers
        assert headers["x-trace"] == "t-1"   # the caller's other headers go on


def test_the_upstream_gets_the_proxys_own_key_in_place_of_the_callers(echo: tuple[Echo, str]) -> None:
    upstream, url = echo
    with proxy(url, ProxyAccess(api_key=KEY, upstream_api_key=UPSTREAM_KEY)) as client:
        assert client.post("/v1/chat/completions", json=HELLO, headers={**CALLER, **AUTH}).status_code == 200
        assert client.get("/v1/models", headers=AUTH).status_code == 200
    assert len(upstream.seen) == 2
    for _, headers in upstream.seen:
        assert headers["authorization"] == f"Bearer {UPSTREAM_KEY}" and "cookie" not in headers
        assert not any(KEY in value for value in headers.values()), headers


# ---- the callers' key and the body limit -------------------------------------------------------------

def test_every_route_but_get_health_needs_the_callers_key(echo: tuple[Echo, str]) -> None:
    upstream, url = echo
    with proxy(url, ProxyAccess(api_key=KEY)) as client:
        assert client.get("/health").json()["status"] == "ok"
        for method, path in [("POST", "/v1/chat/completions"), ("GET", "/metrics"), ("GET", "/v1/models"),
                             ("POST", "/health"), ("GET", "/anything")]:
            for authorization in (None, "Bearer sk-nope", f"Bearer {KEY}x", KEY, f"Basic {KEY}"):
                headers = {} if authorization is None else {"authorization": authorization}
                response = client.request(method, path, headers=headers, json=HELLO if method == "POST" else None)
                assert_error_object(response, 401, "invalid_api_key")
                served(client, AUTH)
        assert 'akv_proxy_requests_total{outcome="rejected"} 5' in client.get("/metrics", headers=AUTH).text
    assert {path for path, _ in upstream.seen} == {"/v1/chat/completions"}   # the refused never went on


def test_a_body_over_the_limit_is_a_413_and_never_forwarded(echo: tuple[Echo, str]) -> None:
    upstream, url = echo
    limit = 64 << 10
    with proxy(url, ProxyAccess(max_body_bytes=limit)) as client:
        for length in (limit + 1, 10**15):
            assert_error_object(declared_length(str(client.base_url).rstrip("/"), "/v1/chat/completions", length),
                                413, "request_too_large")
            served(client)
        for total in (limit + 1, 16 * limit):
            assert_error_object(client.post("/v1/chat/completions", content=chunked(total)), 413, "request_too_large")
            served(client)
    assert len(upstream.seen) == 4   # the four well-formed requests only


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_bodies_through_the_proxy_get_a_4xx_or_a_200(echo: tuple[Echo, str], name: str) -> None:
    _, url = echo
    with proxy(url, ProxyAccess(api_key=KEY)) as client:
        assert_error_object(client.post("/v1/chat/completions", content=HOSTILE[name]), 401, "invalid_api_key")
        response = client.post("/v1/chat/completions", content=HOSTILE[name],
                               headers={**AUTH, "content-type": "application/json"})
        assert_4xx_or_200(response)
        served(client, AUTH)


# ---- summaries ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("host", "api_key", "allow", "allowed"), [
    ("127.0.0.1", None, False, True), ("::1", None, False, True), ("localhost", None, False, True),
    ("0.0.0.0", None, False, False), ("::", None, False, False), ("192.168.1.20", None, False, False),
    ("0.0.0.0", KEY, False, True), ("0.0.0.0", None, True, True),
])
def test_summaries_are_written_for_authenticated_or_local_callers_or_when_allowed(
        host: str, api_key: str | None, allow: bool, allowed: bool) -> None:
    assert summaries_allowed(host, api_key, allow) is allowed


def test_a_proxy_open_to_anyone_refuses_summaries_with_a_403_naming_the_flag(echo: tuple[Echo, str]) -> None:
    upstream, url = echo
    body = {"model": "m", "messages": long_history(), "max_tokens": 1}
    with proxy(url, ProxyAccess(summaries_allowed=False), SUMMARIZE_EARLY) as client:
        error = assert_error_object(client.post("/v1/chat/completions", json=body, headers=CALLER), 403,
                                    "summaries_refused")
        assert error["type"] == "permission_error" and ALLOW_SUMMARIES_FLAG in error["message"]
        served(client)   # a short history needs no summary: it goes through
    assert len(upstream.seen) == 1


def test_summaries_are_written_with_the_upstream_key_only(echo: tuple[Echo, str]) -> None:
    upstream, url = echo
    body = {"model": "m", "messages": long_history(), "max_tokens": 1}
    with proxy(url, ProxyAccess(upstream_api_key=UPSTREAM_KEY), SUMMARIZE_EARLY) as client:
        response = client.post("/v1/chat/completions", json=body, headers=CALLER)
        assert response.status_code == 200 and response.headers["x-akv-proxy"] == "summarize"
    assert len(upstream.seen) == 2   # the summary, then the edited request
    for _, headers in upstream.seen:
        assert headers["authorization"] == f"Bearer {UPSTREAM_KEY}" and "cookie" not in headers


# ---- the command -------------------------------------------------------------------------------------

def test_akv_proxy_reads_its_keys_from_the_environment_and_warns_once_for_akv_api_key(
        echo: tuple[Echo, str]) -> None:
    upstream, url = echo
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "AKV_PROXY_API_KEY": KEY, "AKV_API_KEY": "sk-legacy"}
    env.pop("AKV_UPSTREAM_API_KEY", None)
    process = subprocess.Popen([*AKV, "proxy", "--policy", "expert-8k", "--upstream", url, "--port", "0"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        proxy_url = ready_url(process)
        assert httpx.get(proxy_url + "/health").status_code == 200
        assert_error_object(httpx.post(proxy_url + "/v1/chat/completions", json=HELLO), 401, "invalid_api_key")
        assert httpx.post(proxy_url + "/v1/chat/completions", json=HELLO, headers=AUTH, timeout=60).status_code == 200
    finally:
        interrupt(process)
    warnings = [line for line in process.stderr.read().splitlines() if "AKV_API_KEY" in line]
    assert warnings == ["warning: AKV_API_KEY is deprecated as the proxy's upstream key; set AKV_UPSTREAM_API_KEY "
                        "(or --upstream-api-key) instead"]
    assert upstream.seen[-1][1]["authorization"] == "Bearer sk-legacy"


@pytest.mark.parametrize("variable", ["AKV_PROXY_API_KEY", "AKV_UPSTREAM_API_KEY", "AKV_API_KEY"])
def test_a_key_variable_set_but_empty_is_refused_like_an_empty_option(variable: str) -> None:
    from typer.testing import CliRunner

    from akv_cli.main import app as cli

    env = {name: None for name in ("AKV_PROXY_API_KEY", "AKV_UPSTREAM_API_KEY", "AKV_API_KEY")}
    with socket.socket() as held:   # taken: a regression ends with "cannot listen" instead of serving
        held.bind(("127.0.0.1", 0))
        held.listen()
        result = CliRunner().invoke(cli, ["proxy", "--policy", "expert-8k", "--upstream", "http://127.0.0.1:9",
                                          "--port", str(held.getsockname()[1])], env={**env, variable: ""})
    assert result.exit_code == 2, result.output
    assert result.output.startswith(f"error: {variable}: expected a key of visible ASCII characters without "
                                    f"spaces (an empty one given); unset {variable}"), result.output


def test_the_upstream_key_setting_wins_over_akv_api_key_without_a_warning(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from akv_cli.proxy import _upstream_key

    monkeypatch.setenv("AKV_API_KEY", "sk-legacy")
    assert _upstream_key(UPSTREAM_KEY) == UPSTREAM_KEY
    assert capsys.readouterr().err == ""
    monkeypatch.delenv("AKV_API_KEY")
    assert _upstream_key(None) is None
