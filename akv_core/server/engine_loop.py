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
import re
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from akv_core.attribution import Attribution
from akv_core.cache.allocator import SlotAllocator
from akv_core.cache.key import build_key
from akv_core.cache.ops import OperationError, validate_operations
from akv_core.cache.planner import plan_request
from akv_core.cache.radix import RadixCache
from akv_core.cache.kv_cache import KVCapacityError
from akv_core.constrain import GrammarError
from akv_core.continuation import ContextLengthExceeded, TokenScore, split_final_message, text_drop_before_reply
from akv_core.request import DEFAULT_MAX_TOKENS, ERROR_ENGINE, ERROR_KV_CAPACITY, FINISH_ERROR
from akv_core.sampling import TokenLogprob
from akv_core.server.errors import APIError
from akv_core.server.metrics import PoolGauges
from akv_core.server.validation import GenerationArgs

# Polls back off from 1 ms to 20 ms while a request is quiet (a prefill, a queue wait): a
# CPU decode step takes tens of ms, so this adds little latency and few wake-ups.
POLL_MIN_SECONDS, POLL_MAX_SECONDS = 0.001, 0.02
# What the engine's ValueErrors start with: a field path such as `messages[2].content`.
_FIELD_PATH = re.compile(r"[A-Za-z_]\w*(\[\d+\]|\.\w+)*")


@dataclass(frozen=True)
class TextDelta:
    text: str
    logprob: TokenLogprob | None = None   # the token's, when the request asked for log probabilities


@dataclass(frozen=True)
class Finished:
    finish_reason: str
    usage: dict[str, int]  # the HTTP usage field names
    attribution: Attribution | None = None                      # with return_attribution
    continuation_scores: tuple[TokenScore, ...] | None = None   # with prompt_logprobs


@dataclass(frozen=True)
class Failed:
    """The engine ended the request with an error: `code` is ERROR_KV_CAPACITY (it can never fit
    the pool, found at admission) or ERROR_ENGINE (serving it failed)."""

    message: str
    code: str


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

    def submit_all(self, args: GenerationArgs) -> list[Any]:
        """Queue the request's `n` choices, each an engine request with the same prompt and its own
        seed (`choice_seed`): the radix cache shares the prompt (a choice waits for the first one's
        prefill, then reuses it), and their decode steps run in one batch. A 400 queues none."""
        handles: list[Any] = []
        try:
            for index in range(args.n):
                handles.append(self.submit(replace(args, seed=choice_seed(args.seed, index))))
        except BaseException:
            for handle in handles:
                handle.cancel()
            raise
        return handles

    def submit(self, args: GenerationArgs) -> Any:
        """Queue a request (one choice); a request the engine refuses becomes a 400 naming the field."""
        try:
            room = self.engine.context_length - prompt_end_position(self.engine, args)
            if room <= 0:
                raise context_exceeded(self.engine.context_length, self.engine.context_length - room,
                                       f"messages[{len(args.messages) - 1}]" if args.reply.continue_final_message
                                       else "messages")
            # Never reserve decode slots for tokens past the context (DEFAULT_MAX_TOKENS when unset).
            return self.engine.submit(
                args.messages, drop_message=args.drop_message, reposition=args.reposition,
                tools=args.tools, max_tokens=min(args.max_tokens or DEFAULT_MAX_TOKENS, room),
                temperature=args.temperature, top_p=args.top_p, seed=args.seed, stop=args.stop,
                thinking_drop=args.thinking_drop, grammar=args.grammar, text_drop=args.text_drop,
                top_logprobs=args.top_logprobs, attribution=args.reply.attribution,
                continue_final_message=args.reply.continue_final_message,
                prompt_logprobs=args.reply.prompt_logprobs)
        except GrammarError as error:
            raise APIError(f"{args.grammar_field}: invalid grammar: {error}", param=args.grammar_field) from None
        except OperationError as error:
            raise APIError(str(error), param=error.field) from None
        except KVCapacityError as error:
            raise APIError(str(error), param="messages", code=ERROR_KV_CAPACITY) from None
        except ContextLengthExceeded as error:
            raise context_exceeded(error.context, error.positions, error.field) from None
        except ValueError as error:  # the engine and the renderer prefix messages with the field
            field = str(error).split(":", 1)[0]
            raise APIError(str(error), param=field if _FIELD_PATH.fullmatch(field) else None) from None

    async def events(
        self, handle: Any, disconnected: Callable[[], Awaitable[bool]]
    ) -> AsyncIterator[TextDelta | Finished | Failed]:
        """The request's events until it ends; cancels it if the client leaves."""
        async for _, event in self.choice_events([handle], disconnected):
            yield event

    async def choice_events(
        self, handles: list[Any], disconnected: Callable[[], Awaitable[bool]]
    ) -> AsyncIterator[tuple[int, TextDelta | Finished | Failed]]:
        """(choice index, event) of the requests until each has ended; cancels all if the client leaves.

        One poller for all of a request's choices, in the order their events come.
        """
        pause = POLL_MIN_SECONDS
        running = list(range(len(handles)))
        try:
            while running:
                got = False
                for index in list(running):
                    try:
                        event = handles[index].events.get_nowait()
                    except queue.Empty:
                        continue
                    got = True
                    for item in _translated(event):
                        if not isinstance(item, TextDelta):
                            running.remove(index)
                        yield index, item
                if got:
                    pause = POLL_MIN_SECONDS
                    continue
                if await disconnected():
                    raise ClientGone() from None
                await asyncio.sleep(pause)
                pause = min(pause * 2, POLL_MAX_SECONDS)
        finally:
            for handle in handles:
                handle.cancel()  # a no-op once finished; frees the request's locks otherwise

    def gauges(self) -> PoolGauges:
        stats = self.engine.stats()
        return PoolGauges(
            kv_slots_total=stats.kv_slots_total,
            kv_slots_used=stats.kv_slots_used,
            kv_slots_free=stats.kv_slots_free,
            kv_slots_cached=stats.kv_slots_cached,
            kv_slots_retained=stats.kv_slots_retained,
            requests_running=stats.running,
            requests_waiting=stats.waiting,
            passes={"prefill": stats.prefill_passes, "decode": stats.decode_passes},
            pass_seconds={"prefill": stats.prefill_pass_seconds, "decode": stats.decode_pass_seconds},
        )


def prompt_end_position(engine: Any, args: GenerationArgs) -> int:
    """The position the first generated token takes: prompt length after drops and repositions
    (and, with continue_final_message, after the final message's tokens).

    Positions follow from the cache key alone, so an empty tree gives the same answer as the
    engine's own plan.
    """
    messages, continued, text_drop = args.messages, 0, args.text_drop
    if args.reply.continue_final_message:
        split = split_final_message(engine.tokenizer, messages, args.tools, closed=False)
        rendered, continued, messages = split.prompt, len(split.reply), messages[:-1]
        text_drop = text_drop_before_reply(text_drop, len(messages))
    else:
        rendered = engine.tokenizer.render(messages, args.tools)
    operations = validate_operations(len(messages), args.drop_message, args.reposition,
                                     args.thinking_drop, text_drop)
    key = build_key(rendered, operations)
    return plan_request(RadixCache(SlotAllocator(1)), key).end_position + continued


def context_exceeded(context: int, positions: int, field: str) -> APIError:
    """OpenAI's words, which clients (litellm, LangChain) match to tell an overflow apart; the count is
    positions, after the request's drops and repositions."""
    return APIError(f"This model's maximum context length is {context} tokens. However, your messages resulted "
                    f"in {positions} tokens. Please reduce the length of the messages.", param=field,
                    code="context_length_exceeded")


def _translated(event: Any) -> list[TextDelta | Finished | Failed]:
    """An engine event as the server's: text (with its log probabilities, if asked), then the end."""
    items: list[TextDelta | Finished | Failed] = []
    logprob = getattr(event, "logprob", None)   # akv_core.engine.ScoredEvent
    if event.text or logprob is not None:
        items.append(TextDelta(event.text, logprob))
    if event.finish_reason == FINISH_ERROR:
        items.append(Failed(event.error or "the engine could not serve the request", event.error_code or ERROR_ENGINE))
    elif event.finish_reason is not None:
        items.append(Finished(event.finish_reason, usage_fields(event.usage), event.attribution,
                              event.continuation_scores))
    return items


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice `index`'s seed: the request's for the first, the next ones after it (a signed 64-bit
    integer, wrapping), so that seeded choices differ from each other and repeat as a whole."""
    if seed is None or index == 0:
        return seed
    return (seed + index + 2**63) % 2**64 - 2**63


def usage_fields(usage: Any) -> dict[str, int]:
    names = ("prompt_tokens", "completion_tokens", "total_tokens", "cached_tokens",
             "drop_skipped_tokens", "repos_tokens", "prefilled_tokens", "retained_tokens")
    return {name: int(getattr(usage, name)) for name in names}
