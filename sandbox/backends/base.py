"""What every backend takes and gives: the request, the reply, the errors, the `Backend` protocol and
how many tasks it runs at once (its `parallel`).

The backends (`replay.py`, `embedded.py`, `http.py`, `servers.py`) and the lanes that run tasks on
them (`sandbox/runs/lanes.py`) import these from here; `sandbox.backends` offers them with the factory.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence

from akv_core.cache.ops import OperationError
from akv_core.cache.text_drop import TextDrop, parse_text_drop, project_kept
from akv_core.client import ChatError, ContextTooLong, ServerUnavailable

from sandbox.runs.cost import ReportedUsage

__all__ = ["Backend", "BackendError", "BackendReply", "BackendRequest", "CacheOperations", "Message", "PARALLEL_KINDS",
           "ReplyTooLong", "ServerMove", "ServerUnavailable", "check_concurrency", "lane_kind"]

Message = dict[str, Any]


# Every backend fails a request it cannot serve with the chat client's error (unreachable endpoint,
# rejected request): the harness records the task as an error with this message and the run goes on.
# `ServerUnavailable`: the server did not answer or failed (HTTP 5xx); another may serve it.
BackendError = ChatError
# A recorded reply to score (`score_reply`) whose history and tokens do not fit the model's context or
# KV pool: the scorer leaves that request out (sandbox/traces/likelihood.py).
ReplyTooLong = ContextTooLong


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
    # OpenAI's `tool_choice`: None (the server's default, `auto`), "required", or {"type": "function",
    # "function": {"name": ...}}; a backend with constrained decoding keeps the reply to such a call.
    tool_choice: str | Mapping[str, Any] | None = None
    # Ask for the reply's attention over the history (`akv_core.attribution`): a backend whose
    # `attributes` is true answers with BackendReply.attribution (the embedded engine, and a server
    # URL through `return_attribution`). A keep_text_drop request gets none (`asks_attribution`).
    attribution: bool = False

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

    def asks_attribution(self) -> bool:
        """Whether the backend computes the reply's attribution: asked for, and not under a keep_text_drop,
        which renders another history than the request's messages (its masses would name messages the
        request does not have)."""
        return self.attribution and (self.drop_rule or {}).get("type") != "keep_text_drop"

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
    usage: ReportedUsage
    finish_reason: str | None = None
    server: str | None = None  # which of several servers answered (a server pool)
    moves: tuple[ServerMove, ...] = ()  # servers left for another before this reply came
    attribution: Any = None  # akv_core.attribution.Attribution of the request's messages, when asked for


class Backend(Protocol):
    name: str
    generates: bool  # False when replies carry no model text (replay)
    # How tasks run at once on it (sandbox/runs/lanes.py): "threads" (it offers `lane()`, a backend for one
    # thread's tasks), "processes" (CPU-bound; it offers `reopen()`, a picklable maker of an equal
    # backend for a process), or "none" (one task at a time).
    parallel: str

    def start_task(self) -> None:
        """Called before each task run (replay starts a fresh cache here)."""

    def complete(self, request: BackendRequest) -> BackendReply:
        """Serve one request; raise BackendError for a request that cannot be served.

        A backend with a model may also offer `score_reply(request, reply) -> tuple[float, ...]`: the
        natural-log probability of each token of the recorded assistant message `reply` after the
        request's history under its cache fields, teacher-forced, the end-of-turn token left out;
        ReplyTooLong when they do not fit the model (the embedded engine, a server URL)."""

    def close(self) -> None:
        """Release resources (clients, the engine)."""


PARALLEL_KINDS = ("threads", "processes", "none")


def lane_kind(backend: Any) -> str:
    """How tasks run at once on `backend` (its `parallel`; "none" when it does not say)."""
    kind = getattr(backend, "parallel", "none")
    return kind if kind in PARALLEL_KINDS else "none"


def check_concurrency(backend: Any, concurrency: int) -> None:
    """ValueError (one line) for a concurrency the backend cannot serve."""
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"concurrency must be a positive number of tasks, got {concurrency!r}")
    if concurrency > 1 and lane_kind(backend) == "none":
        raise ValueError(f"concurrency {concurrency}: the {backend.name} backend runs one task at a time (each task "
                         "starts from an empty cache); serve the model with `akv serve` and pass its URL to run "
                         "tasks concurrently")
