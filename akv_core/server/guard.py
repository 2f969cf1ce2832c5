"""Who may call a server and how much they may send: the API key and the body limit.

One ASGI middleware, shared by `akv serve` and `akv proxy`, answers before the app sees a request:

* 401 `invalid_api_key` when a key is set and the request lacks `Authorization: Bearer KEY`,
  on every path but `GET /health` (load balancers probe it without credentials; it tells nothing
  about the traffic, while `/metrics` counts requests and tokens, so it needs the key too).
  The token is compared with `hmac.compare_digest`, so the time taken says nothing about the key.
* 413 `request_too_large` when the body is over the limit: judged from Content-Length before a
  byte is read, and counted while a chunked body arrives, so no more than the limit is ever held.

Both are OpenAI error objects, like every other error of these servers (errors.py). The key is
checked first: a caller without it learns nothing, not even the limit.
"""
from __future__ import annotations

import hmac
import ipaddress
import re
from collections import deque
from collections.abc import Awaitable, Callable

from fastapi.responses import JSONResponse

from akv_core.server.access_log import ASGIApp, Message, Scope
from akv_core.server.errors import APIError

OPEN_ROUTES = frozenset({("GET", "/health")})
# A history the engine can take holds at most one context of tokens. SmolLM2's longest token is
# 81 characters, and a client may write any character as a 6-byte JSON escape ("\u0041"): 486
# bytes. 1 KiB per token leaves room for that plus the messages' structure, tool schemas and AKV
# fields, so no history the engine could serve is refused for its size.
BODY_BYTES_PER_TOKEN = 1024
MIN_BODY_BYTES = 1 << 20
_KEY_CHARACTERS = re.compile(r"[\x21-\x7e]+")   # what a header can carry unchanged: visible ASCII

Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def body_limit_for(context_tokens: int) -> int:
    """The default body limit of a server whose engine takes `context_tokens`: room for the
    longest history it can serve (8 MiB at 8,192 tokens, 32 MiB at 32,768), 1 MiB at least."""
    return max(context_tokens * BODY_BYTES_PER_TOKEN, MIN_BODY_BYTES)


def check_api_key(key: str | None, option: str = "--api-key") -> None:
    """ValueError unless `key` (when set) can be sent as a bearer token: an empty key or one with
    spaces would either match a blank header or never match at all."""
    if key is not None and not _KEY_CHARACTERS.fullmatch(key):
        raise ValueError(f"{option}: expected a key of visible ASCII characters without spaces "
                         f"({'an empty one' if not key else f'{len(key)} characters'} given)")


def is_loopback(host: str) -> bool:
    """Whether binding `host` reaches this machine only. A name other than `localhost` counts as
    exposed: what it resolves to can change, and a warning too many costs less than one missing."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, api_key: str | None, risk: str) -> str | None:
    """The warning line for binding `host` without a key, naming `risk`; None when there is none."""
    if api_key is not None or is_loopback(host):
        return None
    return (f"warning: {host} is not a loopback address and no --api-key is set: {risk}. "
            "Set --api-key, or bind 127.0.0.1 (docs: Running exposed).")


def bearer_matches(authorization: bytes | None, key: str) -> bool:
    """Whether an Authorization header value is `Bearer KEY` (the scheme in any case), in time
    that does not depend on how much of the key was right."""
    scheme, _, token = (authorization or b"").strip().partition(b" ")
    matched = hmac.compare_digest(token.strip(), key.encode())
    return scheme.lower() == b"bearer" and matched


class Guard:
    """The ASGI middleware: the API key (when set), then the body limit, then the app.

    `on_refused(path, status)` is told of each request refused here, for the app's metrics.
    """

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int,
                 on_refused: Callable[[str, int], None] | None = None) -> None:
        check_api_key(api_key, "api_key")
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes: expected a positive number of bytes, got {max_body_bytes}")
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        body: list[Message] = []
        if refusal is None:
            body, refusal = await self._read_body(receive)
        if refusal is not None:
            if self.on_refused is not None:
                self.on_refused(scope["path"], refusal.status_code)
            await refusal(scope, receive, send)
            return
        await self.app(scope, _replayed(body, receive), send)

    def _refusal(self, scope: Scope) -> JSONResponse | None:
        """The answer the headers alone earn: a 401 without the key, a 413 from Content-Length."""
        headers = {name.lower(): value for name, value in reversed(scope["headers"])}  # the first wins
        if self.api_key is not None and (scope["method"], scope["path"]) not in OPEN_ROUTES:
            given = headers.get(b"authorization")
            if not bearer_matches(given, self.api_key):
                return unauthorized(given is not None)
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return too_large(self.max_body_bytes)
        return None

    async def _read_body(self, receive: Receive) -> tuple[list[Message], JSONResponse | None]:
        """The body's messages, or a 413 as soon as they pass the limit (what comes after is never kept).

        A client that leaves mid-body gets its messages, disconnect included, passed on: the app
        handles that as it did without the guard.
        """
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                return messages, None
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                return [], too_large(self.max_body_bytes)
            if not message.get("more_body", False):
                return messages, None


def unauthorized(sent_a_key: bool) -> JSONResponse:
    message = ("invalid API key" if sent_a_key else
               "missing API key: send it as the header `Authorization: Bearer KEY`")
    response = APIError(message, status=401, code="invalid_api_key").response()
    response.headers["www-authenticate"] = "Bearer"
    return response


def too_large(limit: int) -> JSONResponse:
    return APIError(f"the request body is over this server's limit of {limit} bytes (--max-body-bytes)",
                    status=413, code="request_too_large").response()


def _replayed(messages: list[Message], receive: Receive) -> Receive:
    """`receive` for the app: the body already read, then the connection's own messages."""
    pending = deque(messages)

    async def replay() -> Message:
        return pending.popleft() if pending else await receive()
    return replay

