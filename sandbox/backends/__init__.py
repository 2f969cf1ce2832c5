"""Backends turn a request (history, tools, the policy's API fields) into a reply with usage.

- `replay`: no model; the usage the server would report, from the same cache planner and
  accounting code (`akv_core.cache.simulator`). Replies carry no message, so only agents whose
  decisions do not depend on model text (the scripted ones) can run on it.
- `embedded`: the `Engine` in-process (the embedded SmolLM2 by default).
- a URL: any OpenAI-compatible endpoint, AKV fields sent through `extra_body`.

Replay and embedded start each task from an empty cache; a server (a URL) keeps one cache
across tasks, so there later tasks find the shared system prompt and tools cached.
"""
from __future__ import annotations

from sandbox.backends.base import (Backend, BackendError, BackendReply, BackendRequest, CacheOperations, Message,
                                   ReplyTooLong, ServerMove, ServerUnavailable, check_concurrency)

__all__ = [
    "Backend", "BackendError", "BackendReply", "BackendRequest", "CacheOperations", "Message", "ReplyTooLong",
    "ServerMove", "ServerUnavailable", "check_backend_spec", "open_backend",
]


def check_backend_spec(spec: str, concurrency: int = 1) -> None:
    """ValueError (one line, naming the bad item) unless `spec` is replay, embedded, a URL or a list of URLs
    that can run `concurrency` tasks at once; nothing is opened (no model loads, no server is asked)."""
    if spec == "replay":
        from sandbox.backends.replay import ReplayBackend as kind
    elif spec == "embedded":
        from sandbox.backends.embedded import EmbeddedBackend as kind
    else:
        from sandbox.backends.servers import ServerPool as kind, server_urls

        server_urls(spec)
    check_concurrency(kind, concurrency)


def open_backend(spec: str, model: str | None = None, precision: str | None = None) -> Backend:
    """`replay`, `embedded`, an http(s) URL or several, comma-separated; ValueError names what was expected
    otherwise.

    `precision` is the embedded model's weight precision (default float32); the other backends have no
    model of their own here (a server's is `akv serve --precision`), so it is an error with them.
    """
    if precision is not None:
        from akv_core.model.precisions import check_precision

        check_precision(precision)
        if spec != "embedded":
            raise ValueError(f"precision: applies to the embedded backend only, not {spec!r} (replay has no model; "
                             "a server's precision is `akv serve --precision`)")
    if spec == "replay":
        from sandbox.backends.replay import ReplayBackend

        return ReplayBackend()
    if spec == "embedded":
        from sandbox.backends.embedded import EmbeddedBackend

        return EmbeddedBackend(model or "smollm2", precision=precision or "float32")
    from sandbox.backends.servers import ServerPool, server_urls

    urls = server_urls(spec)
    if len(urls) == 1:
        from sandbox.backends.http import HttpBackend

        return HttpBackend(urls[0], model)
    return ServerPool(urls, model)
