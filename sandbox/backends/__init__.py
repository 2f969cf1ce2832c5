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

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence

from akv_core.cache.ops import OperationError
from akv_core.cache.text_drop import TextDrop, parse_text_drop, project_kept

from sandbox.cost import Usage

Message = dict[str, Any]


class BackendError(Exception):
    """A request the backend could not serve (unreachable endpoint, rejected request).

    The harness records the task as an error with this message and the run goes on.
    """


class ServerUnavailable(BackendError):
    """The server did not answer (refused connection, timeout) or failed (HTTP 5xx): another may serve it."""


@dataclass(frozen=True)
class ServerMove:
    """A task moved from a server that stopped answering to another (`--backend URL1,URL2,...`)."""

    from_url: str
    to_url: str
    reason: str


@dataclass(frozen=True)
class BackendRequest:
    """One chat request: the full history as sent plus the cache operations."""

    messages: Sequence[Message]
    tools: Sequence[Mapping[str, Any]] = ()
    drop_message: Mapping[str, Sequence[int]] = field(default_factory=dict)
    reposition: Sequence[int] = ()
    drop_rule: Mapping[str, Any] | None = None  # the structured alternative, e.g. {"type": "thinking_drop"}
    max_tokens: int = 64
    temperature: float = 0.0
    seed: int | None = None

    def api_fields(self) -> dict[str, Any]:
        """The AKV fields for the wire, empty ones left out."""
        fields: dict[str, Any] = {}
        if self.drop_rule:
            fields["drop_rule"] = dict(self.drop_rule)
        elif self.drop_message:
            fields["drop_message"] = {k: list(v) for k, v in self.drop_message.items()}
        if self.reposition:
            fields["reposition"] = list(self.reposition)
        return fields

    def cache_operations(self) -> CacheOperations:
        """The operations as the engine and the replay simulator take them.

        Raises BackendError for a `drop_rule` the server would answer with HTTP 400: an
        unknown type, or a text_drop / keep_text_drop whose entries do not fit the history.
        """
        reposition = tuple(self.reposition)
        if not self.drop_rule:
            return CacheOperations(dict(self.drop_message) or None, reposition, False)
        kind = self.drop_rule.get("type")
        if kind == "thinking_drop":
            return CacheOperations(None, reposition, True)
        if kind == "message_drop":
            return CacheOperations(dict(self.drop_rule.get("drop_messages") or {}), reposition, False)
        if kind in ("text_drop", "keep_text_drop"):
            return self._text_operations(kind, reposition)
        raise BackendError(f"drop_rule.type: expected message_drop, thinking_drop, text_drop or keep_text_drop, "
                           f"got {kind!r}")

    def _text_operations(self, kind: str, reposition: tuple[int, ...]) -> CacheOperations:
        rule, messages = self.drop_rule, list(self.messages)
        try:
            if kind == "text_drop":
                return CacheOperations(None, reposition, False, parse_text_drop(rule.get("drop_messages"), messages))
            kept = project_kept(rule.get("full_messages"), messages, rule.get("force") is True)
        except OperationError as err:
            raise BackendError(f"the request was rejected: {err}") from err
        return CacheOperations(None, reposition, False, kept.drop, tuple(kept.messages))


@dataclass(frozen=True)
class CacheOperations:
    """A request's cache fields, `drop_rule` resolved: drop_message, thinking_drop or a text drop
    (`text_drop` against `prompt`, the history to render: the full one of a keep_text_drop,
    None for the request's own messages), and reposition."""

    drop_message: Mapping[str, Sequence[int]] | None
    reposition: tuple[int, ...]
    thinking_drop: bool
    text_drop: TextDrop | None = None
    prompt: tuple[Message, ...] | None = None


@dataclass(frozen=True)
class BackendReply:
    """The model's assistant message (None without a model) and the request's usage."""

    message: Message | None
    usage: Usage
    finish_reason: str | None = None
    server: str | None = None  # which of several servers answered (a server pool)
    moves: tuple[ServerMove, ...] = ()  # servers left for another before this reply came


class Backend(Protocol):
    name: str
    generates: bool  # False when replies carry no model text (replay)
    # How tasks run at once on it (sandbox/lanes.py): "threads" (it offers `lane()`, a backend for one
    # thread's tasks), "processes" (CPU-bound; it offers `reopen()`, a picklable maker of an equal
    # backend for a process), or "none" (one task at a time).
    parallel: str

    def start_task(self) -> None:
        """Called before each task run (replay starts a fresh cache here)."""

    def complete(self, request: BackendRequest) -> BackendReply:
        """Serve one request; raise BackendError for a request that cannot be served."""

    def close(self) -> None:
        """Release resources (clients, the engine)."""


BACKEND_KINDS = ("replay", "embedded")


def check_backend_spec(spec: str, concurrency: int = 1) -> None:
    """ValueError (one line, naming the bad item) unless `spec` is replay, embedded, a URL or a list of URLs
    that can run `concurrency` tasks at once; nothing is opened (no model loads, no server is asked)."""
    from sandbox.lanes import check_concurrency

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
