"""The engine's scheduling loop on its own thread, and its events on the event loop.

The engine batches every running request inside `run_forever`; handlers only
submit requests and read each request's thread-safe event queue. Reading polls
with a short sleep instead of parking an executor thread per request, so any
number of concurrent clients costs no threads, and a handler notices a client
that went away between two polls.
"""
from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from akv_core.server.metrics import PoolGauges
from akv_core.server.validation import GenerationArgs

POLL_SECONDS = 0.005


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class Finished:
    finish_reason: str
    usage: dict[str, int]  # the HTTP usage field names


class ClientGone(Exception):
    """The client closed the connection; its request has been cancelled."""


class EngineLoop:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self.engine.run_forever, args=(self._stop,), name="akv-engine", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, args: GenerationArgs) -> Any:
        return self.engine.submit(
            args.messages,
            drop_message=args.drop_message,
            reposition=args.reposition,
            tools=args.tools,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            stop=args.stop,
        )

    async def events(
        self, handle: Any, disconnected: Callable[[], Awaitable[bool]]
    ) -> AsyncIterator[TextDelta | Finished]:
        """The request's events until it finishes; cancels it if the client leaves."""
        try:
            while True:
                event = _next_event(handle)
                if event is None:
                    if await disconnected():
                        raise ClientGone()
                    await asyncio.sleep(POLL_SECONDS)
                    continue
                yield event
                if isinstance(event, Finished):
                    return
        finally:
            handle.cancel()  # a no-op once finished; frees the request's locks otherwise

    def gauges(self) -> PoolGauges:
        stats = self.engine.stats()
        return PoolGauges(
            kv_slots_total=stats.kv_slots_total,
            kv_slots_used=stats.kv_slots_used,
            kv_slots_free=stats.kv_slots_free,
            requests_running=stats.running,
            requests_waiting=stats.waiting,
        )


def _next_event(handle: Any) -> TextDelta | Finished | None:
    try:
        event = handle.events.get_nowait()
    except queue.Empty:
        return None
    if event.finish_reason is not None:
        return Finished(event.finish_reason, usage_fields(event.usage))
    return TextDelta(event.text)


def usage_fields(usage: Any) -> dict[str, int]:
    names = ("prompt_tokens", "completion_tokens", "total_tokens", "cached_tokens",
             "drop_skipped_tokens", "repos_tokens", "prefilled_tokens")
    return {name: int(getattr(usage, name)) for name in names}
