"""`akv proxy --record NAME`: the proxy's answered chat requests, handed to a trace log.

Each answered chat request is recorded with the history as the agent sent it (before the policy
edited anything), the reply that came back (a JSON completion, or a stream assembled as it
passes), the upstream's `usage` and the latency. The log makes traces of them: for `--record`,
the trace set recorded in the store (`sandbox/traces/recording.py`: one trace per conversation),
which the command hands in, so the proxy itself imports neither the sandbox nor the store.

Recording runs after the agent has its reply, one request at a time (writes keep the order of
replies), each write on a worker thread. A failed write is logged and counted and never reaches
the agent.
"""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

from akv_proxy.metrics import _counter

Message = dict[str, Any]  # an OpenAI-format chat message
log = logging.getLogger("akv.proxy")


class TraceLog(Protocol):
    """Where answered requests go (`sandbox.traces.recording.TraceSetRecording` for `--record`); called
    one request at a time, on a worker thread."""

    name: str  # the trace set

    def serving(self, policy: str, upstream: str) -> None:
        """What the recorded traffic passes through (the provenance of new traces)."""

    def add(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]], reply: Mapping[str, Any],
            usage: Mapping[str, Any] | None, latency_s: float, model: str | None = None,
            policy: str | None = None) -> None:
        """Record one answered request (`policy`: the one that served it); any exception is a failed recording."""

    def under_way(self, limit: int) -> list[tuple[list[Message], str]]:
        """The `limit` most recent conversations: the history of each one's last request and the policy
        that served it (those recorded without one left out)."""

    def close(self) -> None:
        """Release what the log holds (the store)."""


@dataclass(frozen=True)
class Exchange:
    """One answered chat request as the agent saw it."""

    messages: list[Message]
    tools: list[Mapping[str, Any]]
    reply: Message
    usage: Mapping[str, Any] | None
    model: str | None
    policy: str | None = None  # the policy that served it


class StreamedReply:
    """The assistant message of a streamed reply, assembled from its SSE lines as they pass.

    Content and reasoning deltas are concatenated, tool-call deltas merged by index (names and
    arguments concatenated, id and type taken as they come); the usage is the chunk's that
    carries it. Only choice 0 counts, and only a stream that reached a finish reason without an
    error event is a reply (a client that left mid-stream leaves nothing to record).
    """

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.usage: Mapping[str, Any] | None = None
        self.finished = False
        self.failed = False

    def feed(self, line: bytes) -> None:
        payload = line.rstrip(b"\r").removeprefix(b"data:").strip()
        if not (line.startswith(b"data:") and payload.startswith(b"{")):
            return
        try:
            chunk = json.loads(payload)
        except ValueError:
            self.failed = True
            return
        if not isinstance(chunk, dict) or "error" in chunk:
            self.failed = True
            return
        if isinstance(chunk.get("usage"), Mapping):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            if isinstance(choice, Mapping) and choice.get("index", 0) == 0:
                self._delta(choice.get("delta") or {})
                self.finished = self.finished or bool(choice.get("finish_reason"))

    def _delta(self, delta: Mapping[str, Any]) -> None:
        if isinstance(delta.get("content"), str):
            self.content.append(delta["content"])
        if isinstance(delta.get("reasoning_content"), str):
            self.reasoning.append(delta["reasoning_content"])
        for part in delta.get("tool_calls") or ():
            if not isinstance(part, Mapping):
                continue
            call = self.calls.setdefault(int(part.get("index", len(self.calls))),
                                         {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
            call["id"] = part.get("id") or call["id"]
            call["type"] = part.get("type") or call["type"]
            function = part.get("function") or {}
            for key in ("name", "arguments"):
                if isinstance(function.get(key), str):
                    call["function"][key] += function[key]

    def message(self) -> Message | None:
        """The assembled assistant message; None unless the stream ended properly."""
        if self.failed or not self.finished:
            return None
        message: Message = {"role": "assistant", "content": "".join(self.content) or None}
        if self.calls:
            message["tool_calls"] = [self.calls[i] for i in sorted(self.calls)]
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        return message


def exchange_of(request_body: bytes, reply: bytes | StreamedReply, policy: str | None = None) -> Exchange | None:
    """The recordable parts of a request and its reply (a JSON completion or an assembled stream).

    None when there is nothing to record: no message list, or no assistant message in the reply.
    The request is parsed again here because the policy's edits must not reach the recording.
    """
    body = json.loads(request_body)
    messages = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        return None
    if isinstance(reply, StreamedReply):
        message, usage = reply.message(), reply.usage
    else:
        message, usage = _completion(json.loads(reply))
    if message is None:
        return None
    tools = body.get("tools") if isinstance(body.get("tools"), list) else []
    model = body.get("model") if isinstance(body.get("model"), str) else None
    return Exchange(messages, tools, message, usage if isinstance(usage, Mapping) else None, model, policy)


def _completion(data: Any) -> tuple[Message | None, Any]:
    """choices[0].message of a chat completion and its usage (the log keeps the message's OpenAI keys)."""
    if not isinstance(data, dict):
        return None, None
    choices = data.get("choices")
    message = choices[0].get("message") if isinstance(choices, list) and choices and \
        isinstance(choices[0], dict) else None
    if not isinstance(message, dict):
        return None, data.get("usage")
    return message, data.get("usage")


class TraceRecorder:
    """Records answered chat requests into `traces` (a TraceLog: the set is opened, and loaded, by then)."""

    def __init__(self, traces: TraceLog) -> None:
        self.traces = traces
        self.set_name = traces.name
        self.recorded = self.errors = 0    # updated on the event loop only, like ProxyMetrics
        self._lock = asyncio.Lock()

    def serving(self, policy: str, upstream: str) -> None:
        """Name what the recorded traffic passes through (the provenance of new traces)."""
        self.traces.serving(policy, upstream)

    async def record(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None,
                     reply: Message, usage: Mapping[str, Any] | None, latency_s: float,
                     model: str | None = None, policy: str | None = None) -> None:
        """Record one answered request; a failure is logged and counted, never raised."""
        exchange = Exchange(list(messages), list(tools or ()), dict(reply), usage, model, policy)
        await self._guarded(lambda: self._write(exchange, latency_s))

    async def record_reply(self, request_body: bytes, reply: bytes | StreamedReply, latency_s: float,
                           policy: str | None = None) -> None:
        """Record a request the proxy answered, from its raw body and its reply (parsed off the loop)."""
        def work() -> bool:
            exchange = exchange_of(request_body, reply, policy)
            return exchange is not None and self._write(exchange, latency_s)
        await self._guarded(work)

    def under_way(self, limit: int) -> list[tuple[list[Message], str]]:
        """The log's most recent conversations, with the policy of each one's last request (TraceLog.under_way)."""
        return self.traces.under_way(limit)

    async def _guarded(self, work: Callable[[], bool]) -> None:
        # One recording at a time, in the order replies ended: a conversation's requests keep order.
        async with self._lock:
            try:
                written = await asyncio.to_thread(work)
            except Exception as err:  # a recording must never fail the proxy: any failure is counted
                self.errors += 1
                log.warning("recording to trace set %r failed: %s: %s", self.set_name, type(err).__name__,
                            first_line(err))
                return
        self.recorded += written

    def _write(self, exchange: Exchange, latency_s: float) -> bool:
        self.traces.add(exchange.messages, exchange.tools, exchange.reply, exchange.usage, latency_s, exchange.model,
                        exchange.policy)
        return True

    def render_metrics(self) -> str:
        """The recording's counters in the Prometheus text format, after the proxy's own."""
        lines: list[str] = []
        _counter(lines, "akv_proxy_recorded_requests_total", "Chat requests recorded into the trace set "
                 "(--record).", None, {"": self.recorded})
        _counter(lines, "akv_proxy_record_errors_total", "Recordings that failed (logged; the requests "
                 "were answered).", None, {"": self.errors})
        return "\n".join(lines) + "\n"

    def close(self) -> None:
        self.traces.close()


def first_line(err: BaseException) -> str:
    text = str(getattr(err, "orig", None) or err).strip()
    return text.splitlines()[0] if text else "(no message)"
