"""One generation request: its arguments, its events, and its state inside the engine.

Ownership: a `Request` owns its cache `Lease` (slots and locked path) from
admission until the engine releases it; the client holds only the
`RequestHandle`, whose thread-safe queue carries the events and whose
`cancel()` asks the engine to end the request at its next step.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from akv_core.attribution import Attribution, KeyProvenance
from akv_core.cache.key import CacheKey
from akv_core.cache.kv_cache import Lease
from akv_core.cache.layout import PromptLayout
from akv_core.cache.usage import Usage
from akv_core.continuation import TokenScore

FINISH_STOP, FINISH_LENGTH, FINISH_CANCELLED, FINISH_ERROR = "stop", "length", "cancelled", "error"
# Why a request ended in an error: the pool can never hold it (the client's to fix), or the
# engine failed while serving it (a bug of ours; other requests are not affected).
ERROR_KV_CAPACITY, ERROR_ENGINE = "kv_capacity_exceeded", "engine_error"
# max_tokens when a client sends none (OpenAI: "up to the context"); decode slots are reserved up front.
DEFAULT_MAX_TOKENS = 512


class RequestFailed(RuntimeError):
    """The engine ended a request with an error; `code` says which kind (ERROR_KV_CAPACITY or ERROR_ENGINE)."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class RequestEvent:
    """A generated token (`token_id`, `text` the newly decodable text), or the final event.

    The final event has `finish_reason` set ("stop", "length", "cancelled" or
    "error") and the request's `usage`; `error` explains an "error" and `error_code`
    names its kind (ERROR_KV_CAPACITY or ERROR_ENGINE). A request that asked for them has its
    reply's `attribution` and its continuation's `continuation_scores` on the final event.
    """

    token_id: int | None
    text: str
    finish_reason: str | None = None
    usage: Usage | None = None
    error: str | None = None
    error_code: str | None = None
    attribution: Attribution | None = None
    continuation_scores: tuple[TokenScore, ...] | None = None


@dataclass(frozen=True)
class Generation:
    """A finished request: the generated text and ids (a continued message's own tokens are not
    among them), why it ended, its usage, and what it asked for: the reply's `attribution`, the
    continued message's `continuation_scores`."""

    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    attribution: Attribution | None = None
    continuation_scores: tuple[TokenScore, ...] | None = None


class RequestHandle:
    """The client's side of a submitted request."""

    def __init__(self) -> None:
        self.events: queue.Queue[RequestEvent] = queue.Queue()
        self._cancelled = threading.Event()
        self._finished = threading.Event()

    def put(self, event: RequestEvent) -> None:
        """The engine's side: deliver an event (the final one marks the handle done)."""
        self.events.put(event)
        if event.finish_reason is not None:
            self._finished.set()

    @property
    def done(self) -> bool:
        """Whether the final event has been delivered (it may still be unread)."""
        return self._finished.is_set()

    def cancel(self) -> None:
        """Ask the engine to end the request (a no-op once it has finished)."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def result(self, timeout: float | None = None) -> Generation:
        """Wait for the final event and collect the whole generation."""
        tokens: list[int] = []
        pieces: list[str] = []
        while True:
            event = self.events.get(timeout=timeout)
            if event.token_id is not None:
                tokens.append(event.token_id)
            pieces.append(event.text)
            if event.finish_reason is not None:
                if event.finish_reason == FINISH_ERROR:
                    raise RequestFailed(event.error or "the request failed", event.error_code)
                return Generation("".join(pieces), tokens, event.finish_reason, event.usage, event.attribution,
                                  event.continuation_scores)


class StreamText:
    """Decoded text of generated tokens, released as soon as it can no longer change.

    Text is held back while it ends in an incomplete UTF-8 sequence or in what
    could still become a stop string; a completed stop string ends the text.
    """

    def __init__(self, decode: Any, stop: Sequence[str]) -> None:
        self._decode = decode
        self._stop = [s for s in stop if s]
        self._ids: list[int] = []
        self._emitted = 0
        self.text = ""
        self.stopped = False

    def feed(self, token_id: int) -> str:
        """Add a token; returns the newly released text."""
        self._ids.append(token_id)
        text = self._decode(self._ids)
        if text.endswith("\ufffd"):
            return ""
        for stop in self._stop:
            at = text.find(stop, max(0, self._emitted - len(stop)))
            if at >= 0:
                text, self.stopped = text[:at], True
        self.text = text
        if self.stopped:
            return self.flush()
        safe = len(text) - self._held_back(text)
        delta = text[self._emitted:safe] if safe > self._emitted else ""
        self._emitted = max(self._emitted, safe)
        return delta

    def flush(self) -> str:
        """Release everything decoded so far (at the end of the request)."""
        delta = self.text[self._emitted:]
        self._emitted = len(self.text)
        return delta

    def _held_back(self, text: str) -> int:
        """Length of the longest suffix of `text` that starts some stop string."""
        longest = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest


@dataclass(eq=False)
class Request:
    """A request inside the engine."""

    handle: RequestHandle
    key: CacheKey
    params: SamplingParams
    stream: StreamText
    generator: Any                      # torch.Generator for sampling
    eos_token_ids: frozenset[int]
    lease: Lease | None = None
    layout: PromptLayout | None = None
    next_stage: int = 0                 # index into layout.stages while prefilling
    next_row: int = 0                   # the stage's first row not computed yet (chunked prefill)
    passed_over: bool = False           # got no prefill rows in the last step: it goes first in the next
    bypassed: int = 0                   # later requests admitted while this one waited at the head
    awaited: bool = False               # a waiting request shares its prompt: it publishes it step by step
    generated: list[int] = field(default_factory=list)
    usage: Usage | None = None
    decode_kv: Any = None               # tensor of the slots decode steps attend to (a prefix of it)
    constraint: Any = None              # akv_core.constrain.TokenConstraint of a grammar-constrained request
    # A continued final message: its tokens, fed in one teacher-forced pass once the prompt is computed
    # (they count as prompt tokens and lead `generated`); `continuation_scored`: score them, with their
    # ranks and `continuation_top` most likely alternatives each when that is an int.
    continuation: tuple[int, ...] = ()
    continuation_scored: bool = False
    continuation_top: int | None = None
    continuation_scores: tuple[TokenScore, ...] | None = None
    provenance: KeyProvenance | None = None   # set when the request asked for its reply's attribution
    attribution: Attribution | None = None
    # With provenance: the attention weights per pool slot (float64 [slots]) of the `mass_rows` reply-token
    # queries added so far (akv_core.engine._take_masses).
    attention_mass: Any = None
    mass_rows: int = 0

    @property
    def prefilling(self) -> bool:
        return self.layout is not None and self.next_stage < len(self.layout.stages)

    @property
    def prompt_computed(self) -> bool:
        return self.layout is not None and self.next_stage >= len(self.layout.stages)

    @property
    def stage_rows_left(self) -> int:
        """Rows of the current stage still to compute (0 once the prompt is computed)."""
        if not self.prefilling:
            return 0
        return len(self.layout.stages[self.next_stage].token_ids) - self.next_row

    @property
    def prefill_left(self) -> int:
        """Prompt tokens still to compute, over all stages left."""
        if not self.prefilling:
            return 0
        later = sum(len(stage.token_ids) for stage in self.layout.stages[self.next_stage + 1:])
        return self.stage_rows_left + later

    @property
    def computed_tokens(self) -> int:
        """Key tokens [0, n) whose KV exists: reused or computed (for a lease that `publishes_parts`)."""
        return len(self.key) - self.prefill_left

    def advance(self, rows: int) -> None:
        """`rows` more rows of the current stage were computed."""
        self.next_row += rows
        if self.next_row >= len(self.layout.stages[self.next_stage].token_ids):
            self.next_stage, self.next_row = self.next_stage + 1, 0
