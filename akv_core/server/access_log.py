"""One access log line per request: method, path, status, tokens, cache hits and latency.

An ASGI middleware, so that a stream is logged when its last chunk has gone (with its
usage) and errors are logged with the status they were answered with. Handlers leave the
usage of a finished request in the request's state (`ACCESS_USAGE`).

    POST /v1/chat/completions 200 prompt=412 completion=16 cached=300 latency=1.234s
"""
from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

log = logging.getLogger("akv.access")

ACCESS_USAGE = "akv_usage"   # request.state key: the finished request's usage (HTTP field names)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]


class AccessLog:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        state = scope.setdefault("state", {})
        status = 0

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            log.info("%s", access_line(scope["method"], scope["path"], status or 500, state.get(ACCESS_USAGE),
                                       time.monotonic() - started))


def access_line(method: str, path: str, status: int, usage: dict[str, int] | None, seconds: float) -> str:
    """The logged line; tokens are "-" for a request that produced no usage (an error, a GET)."""
    def count(name: str) -> str:
        return "-" if usage is None else str(usage.get(name, 0))

    return (f"{method} {path} {status} prompt={count('prompt_tokens')} completion={count('completion_tokens')} "
            f"cached={count('cached_tokens')} latency={seconds:.3f}s")
