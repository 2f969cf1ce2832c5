"""`akv serve --api-key` and `--max-body-bytes`: the guard in front of every route but GET /health.

A second real server (its own engine: the shared one has no key) is started with a key and a small
body limit. Missing, wrong and malformed tokens get a 401 error object on every route, bodies over
the limit a 413, hostile bodies a 4xx or a 200; the server answers a well-formed request right
after each. The exposure warning is tested through the function that decides it, with the address
as its input: no test binds anything but loopback.
"""
from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import pytest
from typer.testing import CliRunner

from akv_cli.main import app as cli
from akv_core.server import guard
from akv_core.server.guard import (bearer_matches, body_limit_for, check_api_key, exposure_warning,
                                   is_loopback)
from test_server_hostile import (HOSTILE, assert_4xx_or_200, assert_error_object, chunked, declared_length,
                                 served)
from test_server_support import MODEL

KEY = "sk-akv-test-0123456789"
AUTH = {"authorization": f"Bearer {KEY}"}
LIMIT = 64 << 10
ROUTES = [("GET", "/v1/models"), ("GET", "/server_info"), ("GET", "/metrics"), ("GET", "/openapi.json"),
          ("GET", "/docs"), ("GET", "/no/such/path"), ("POST", "/v1/chat/completions"), ("POST", "/health")]
BAD_TOKENS = {"missing": None, "wrong": "Bearer sk-nope", "longer": f"Bearer {KEY}x", "shorter": f"Bearer {KEY[:-1]}",
              "basic scheme": f"Basic {KEY}", "no scheme": KEY, "empty bearer": "Bearer",
              "trailing words": f"Bearer {KEY} please"}


# ---- the decisions, as functions --------------------------------------------------------------------

@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("0.0.0.0", False), ("::", False), ("", False), ("192.168.1.20", False), ("10.0.0.1", False),
    ("example.org", False),
])
def test_only_loopback_addresses_bind_unexposed(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback
    warning = exposure_warning(host, None, "anyone who can reach the port can use the model")
    if loopback:
        assert warning is None
    else:
        assert warning.startswith(f"warning: {host} is not a loopback address and no --api-key is set: ")
        assert "anyone who can reach the port can use the model" in warning and "\n" not in warning
    assert exposure_warning(host, KEY, "risk") is None   # a key: nothing to warn about


@pytest.mark.parametrize(("header", "matches"), [
    (f"Bearer {KEY}".encode(), True), (f"bearer {KEY}".encode(), True), (f"BEARER  {KEY} ".encode(), True),
    *[((value or "").encode() or None, False) for value in BAD_TOKENS.values()],
])
def test_a_bearer_token_matches_only_the_key(header: bytes | None, matches: bool) -> None:
    assert bearer_matches(header, KEY) is matches


def test_the_token_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[tuple[bytes, bytes]] = []

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return a == b

    monkeypatch.setattr(guard.hmac, "compare_digest", spy)
    assert not bearer_matches(b"Bearer sk-nope", KEY)
    assert compared == [(b"sk-nope", KEY.encode())]


@pytest.mark.parametrize("key", ["", "two words", " padded", "ключ", "tab\tkey"])
def test_a_key_that_cannot_travel_as_a_bearer_token_is_refused(key: str) -> None:
    with pytest.raises(ValueError, match="--api-key: expected a key of visible ASCII characters"):
        check_api_key(key)


def test_the_default_body_limit_fits_the_longest_history_of_the_context() -> None:
    assert body_limit_for(8_192) == 8 << 20
    assert body_limit_for(32_768) == 32 << 20
    assert body_limit_for(100) == 1 << 20


def test_akv_serve_refuses_a_key_it_could_not_check_from_the_option_or_its_variable() -> None:
    runner = CliRunner()
    for args, env in ((["serve", "--api-key", ""], {}), (["serve"], {"AKV_SERVE_API_KEY": "two words"})):
        result = runner.invoke(cli, args, env=env)
        assert result.exit_code == 2, result.output
        assert result.output.startswith("error: --api-key: expected a key of visible ASCII characters")
    # Set but empty: click takes the variable for unset, which would have served with no key at all (the
    # port is held, so that such a regression ends with "cannot listen" instead of serving).
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = str(held.getsockname()[1])
        result = runner.invoke(cli, ["serve", "--port", port], env={"AKV_SERVE_API_KEY": ""})
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: AKV_SERVE_API_KEY: expected a key of visible ASCII characters "
                                    "without spaces (an empty one given); unset AKV_SERVE_API_KEY")


# ---- a real server with a key ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def keyed() -> Iterator[httpx.Client]:
    from akv_core import Engine
    from akv_core.server import create_app, serve_in_thread

    engine = Engine.from_pretrained(MODEL, device="cpu", kv_tokens=4_096, max_running=4)
    with serve_in_thread(create_app(engine, MODEL, api_key=KEY, max_body_bytes=LIMIT)) as url:
        with httpx.Client(base_url=url, timeout=120) as client:
            yield client


def call(client: httpx.Client, method: str, path: str, authorization: str | None) -> httpx.Response:
    headers = {} if authorization is None else {"authorization": authorization}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    return client.request(method, path, headers=headers, json=body if method == "POST" else None)


@pytest.mark.server
@pytest.mark.model
@pytest.mark.parametrize(("method", "path"), ROUTES)
def test_every_route_but_get_health_needs_the_key(keyed: httpx.Client, method: str, path: str) -> None:
    for name, authorization in BAD_TOKENS.items():
        response = call(keyed, method, path, authorization)
        error = assert_error_object(response, 401, "invalid_api_key")
        assert error["type"] == "invalid_request_error" and error["param"] is None, name
        assert response.headers["www-authenticate"] == "Bearer"
        assert ("missing" in error["message"]) is (authorization is None)
        served(keyed, AUTH)
    expected = 404 if path == "/no/such/path" else 405 if path == "/health" else 200
    assert call(keyed, method, path, f"Bearer {KEY}").status_code == expected


@pytest.mark.server
@pytest.mark.model
def test_get_health_answers_without_a_key_and_metrics_count_the_refusals(keyed: httpx.Client) -> None:
    for authorization in BAD_TOKENS.values():
        assert call(keyed, "GET", "/health", authorization).json()["status"] == "ok"
    metrics = keyed.get("/metrics", headers=AUTH).text
    assert 'akv_requests_total{endpoint="chat",outcome="rejected"}' in metrics
    assert 'akv_requests_total{endpoint="other",outcome="rejected"}' in metrics


@pytest.mark.server
@pytest.mark.model
def test_the_key_is_checked_before_the_body_and_the_limit_holds_with_it(keyed: httpx.Client) -> None:
    url = str(keyed.base_url).rstrip("/")
    assert_error_object(declared_length(url, "/v1/chat/completions", 10**15), 401, "invalid_api_key")
    for length in (LIMIT + 1, 10**15):
        error = assert_error_object(declared_length(url, "/v1/chat/completions", length, AUTH), 413,
                                    "request_too_large")
        assert f"limit of {LIMIT} bytes" in error["message"]
        served(keyed, AUTH)
    for total in (LIMIT + 1, 16 * LIMIT):
        response = keyed.post("/v1/chat/completions", content=chunked(total), headers=AUTH)
        assert_error_object(response, 413, "request_too_large")
        served(keyed, AUTH)


@pytest.mark.server
@pytest.mark.model
@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_bodies_with_the_key_get_a_4xx_or_a_200(keyed: httpx.Client, name: str) -> None:
    unauthorized = keyed.post("/v1/chat/completions", content=HOSTILE[name])
    assert_error_object(unauthorized, 401, "invalid_api_key")
    response = keyed.post("/v1/chat/completions", content=HOSTILE[name],
                          headers={**AUTH, "content-type": "application/json"})
    assert_4xx_or_200(response)
    if len(HOSTILE[name]) > LIMIT:
        assert_error_object(response, 413, "request_too_large")
    served(keyed, AUTH)
