"""`akv proxy --record NAME`: the proxy's traffic recorded as a trace set, one trace per conversation.

Each answered chat request is recorded with the history as the agent sent it (before the policy
edited anything), the reply that came back, the upstream's `usage` and the latency. An agent
resends its whole history each turn, so a request continues a trace when the trace's history
before its last reply is a prefix of the new history and the new history has an assistant
message right there (the agent's copy of that reply): the trace then becomes the new history
plus the new reply, since what the agent sent is the truth. Any other request starts a trace
`<set>-<NNNNN>`. The set is loaded at start, so a restarted proxy continues its conversations.

Recording runs after the agent has its reply, one request at a time (writes keep the order of
replies), each write one transaction on a worker thread. A failed write is logged and counted
and never reaches the agent; the trace stays in memory and the next write of it carries it whole.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Mapping, Sequence

from sandbox.traces.formats import OPENAI_KEYS, extends
from sandbox.traces.model import Message, Trace, TraceRequest

from akv_proxy.metrics import _counter

FORMAT = "akv-proxy"
log = logging.getLogger("akv.proxy")


@dataclass(frozen=True)
class Exchange:
    """One answered chat request as the agent saw it."""

    messages: list[Message]
    tools: list[Mapping[str, Any]]
    reply: Message
    usage: Mapping[str, Any] | None
    model: str | None


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


def exchange_of(request_body: bytes, reply: bytes | StreamedReply) -> Exchange | None:
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
    return Exchange(messages, tools, message, usage if isinstance(usage, Mapping) else None, model)


def _completion(data: Any) -> tuple[Message | None, Any]:
    """choices[0].message of a chat completion (OpenAI's keys, nulls left out) and its usage."""
    if not isinstance(data, dict):
        return None, None
    choices = data.get("choices")
    message = choices[0].get("message") if isinstance(choices, list) and choices and \
        isinstance(choices[0], dict) else None
    if not isinstance(message, dict):
        return None, data.get("usage")
    kept: Message = {"role": "assistant", "content": message.get("content")}
    kept.update({k: v for k, v in message.items() if k in OPENAI_KEYS and k not in kept and v is not None})
    return kept, data.get("usage")


class TraceRecorder:
    """Records answered chat requests into the trace set `set_name` of the store at `store_url`.

    Opening it opens the store and loads the set (StoreError when the store cannot be opened or
    read), so a proxy that cannot record never starts serving.
    """

    def __init__(self, store_url: str | None, set_name: str) -> None:
        from store.repository import Store

        self.set_name = set_name
        self.store = Store.open(store_url)
        try:
            self.traces: dict[str, Trace] = {t.id: t for t in self._load()}
        except BaseException:
            self.store.close()
            raise
        self.source: dict[str, str] = {}   # policy and upstream, for the provenance
        self.recorded = self.errors = 0    # updated on the event loop only, like ProxyMetrics
        self._lock = asyncio.Lock()

    def _load(self) -> list[Trace]:
        from sqlalchemy.exc import SQLAlchemyError

        from sandbox.traces.records import trace_of
        from store.errors import StoreError, TraceSetNotFound

        try:
            return [trace_of(t) for t in self.store.traces.get(self.set_name)]
        except TraceSetNotFound:
            return []
        except SQLAlchemyError as err:
            raise StoreError(f"--db: cannot read trace set {self.set_name!r} in {self.store.display_url}: "
                             f"{_first_line(err)}") from None

    def serving(self, policy: str, upstream: str) -> None:
        """Name what the recorded traffic passes through (the provenance of new traces)."""
        self.source = {"policy": policy, "upstream": upstream}

    async def record(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None,
                     reply: Message, usage: Mapping[str, Any] | None, latency_s: float,
                     model: str | None = None) -> None:
        """Record one answered request; a failure is logged and counted, never raised."""
        exchange = Exchange(list(messages), list(tools or ()), dict(reply), usage, model)
        await self._guarded(lambda: self._write(exchange, latency_s))

    async def record_reply(self, request_body: bytes, reply: bytes | StreamedReply, latency_s: float) -> None:
        """Record a request the proxy answered, from its raw body and its reply (parsed off the loop)."""
        def work() -> bool:
            exchange = exchange_of(request_body, reply)
            return exchange is not None and self._write(exchange, latency_s)
        await self._guarded(work)

    async def _guarded(self, work: Callable[[], bool]) -> None:
        # One recording at a time, in the order replies ended: a conversation's requests keep order.
        async with self._lock:
            try:
                written = await asyncio.to_thread(work)
            except Exception as err:  # a recording must never fail the proxy: any failure is counted
                self.errors += 1
                log.warning("recording to trace set %r failed: %s: %s", self.set_name, type(err).__name__,
                            _first_line(err))
                return
        self.recorded += written

    def _write(self, exchange: Exchange, latency_s: float) -> bool:
        """The exchange into its trace, kept in memory first, then the whole trace written."""
        from sandbox.traces.records import stored_of

        trace = self._next(exchange, latency_s)
        self.traces[trace.id] = trace
        self.store.traces.put(self.set_name, stored_of(trace))
        return True

    def _next(self, exchange: Exchange, latency_s: float) -> Trace:
        history = exchange.messages
        request = TraceRequest(len(history), exchange.usage, latency_s)
        earlier = self._continued(history)
        if earlier is None:
            started = datetime.now(timezone.utc) - timedelta(seconds=latency_s)
            provenance = {"format": FORMAT, **self.source, "model": exchange.model,
                          "recorded_at": started.isoformat(timespec="seconds")}
            return Trace(self._new_id(), (*history, exchange.reply), tuple(exchange.tools), (request,),
                         "tools", provenance)
        return Trace(earlier.id, (*history, exchange.reply), tuple(exchange.tools or earlier.tools),
                     (*earlier.requests, request), earlier.actions, earlier.provenance)

    def _continued(self, history: Sequence[Message]) -> Trace | None:
        """The trace this history continues: the longest one whose history before its last reply
        starts the new history, with an assistant message right after it (the newest one on ties)."""
        best: Trace | None = None
        best_length = 0
        for trace in self.traces.values():
            if not trace.requests:
                continue
            before = trace.messages[:trace.requests[-1].index]
            n = len(before)
            if best_length <= n < len(history) and n > 0 and history[n].get("role") == "assistant" \
                    and extends(before, history):
                best, best_length = trace, n
        return best

    def _new_id(self) -> str:
        pattern = re.compile(re.escape(self.set_name) + r"-(\d+)")
        numbers = [int(m.group(1)) for m in map(pattern.fullmatch, self.traces) if m]
        return f"{self.set_name}-{max(numbers, default=0) + 1:05d}"

    def render_metrics(self) -> str:
        """The recording's counters in the Prometheus text format, after the proxy's own."""
        lines: list[str] = []
        _counter(lines, "akv_proxy_recorded_requests_total", "Chat requests recorded into the trace set "
                 "(--record).", None, {"": self.recorded})
        _counter(lines, "akv_proxy_record_errors_total", "Recordings that failed (logged; the requests "
                 "were answered).", None, {"": self.errors})
        return "\n".join(lines) + "\n"

    def close(self) -> None:
        self.store.close()


def _first_line(err: BaseException) -> str:
    text = str(getattr(err, "orig", None) or err).strip()
    return text.splitlines()[0] if text else "(no message)"
