"""`akv proxy --record NAME`: the proxy's answered requests written as the trace set NAME, one trace per conversation.

The proxy (`akv_proxy/recorder.py`) hands over each answered chat request: the history as the
agent sent it (before the policy edited anything), the reply that came back, the upstream's
`usage`, the latency and the policy that served it. An agent resends its whole history each
turn, so a request continues a trace when the trace's history before its last reply is a prefix
of the new history and the new history has an assistant message right there (the agent's copy of
that reply): the trace then becomes the new history plus the new reply, since what the agent
sent is the truth. Any other request starts a trace `<set>-<NNNNN>`. The set is loaded when it
is opened, so a restarted proxy continues its conversations. The reply keeps OpenAI's keys only
(nulls left out, but a null content). Each write is the whole trace, one transaction; the trace
is kept in memory first, so after a failed write the next write of it carries it whole.
"""
from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone
from typing import Any, Mapping, Sequence

from sqlalchemy.exc import SQLAlchemyError

from store.errors import StoreError, TraceSetNotFound
from store.repository import Store

from sandbox.traces.model import Message, Trace, TraceRequest
from sandbox.traces.reading import extends, openai_message
from sandbox.traces.records import stored_of, trace_of

FORMAT = "akv-proxy"


class TraceSetRecording:
    """The trace set `name` in the store at `store_url`, written request by request (one at a time).

    Opening it opens the store and loads the set (StoreError when the store cannot be opened or
    read), so a proxy that cannot record never starts serving.
    """

    def __init__(self, store_url: str | None, name: str) -> None:
        self.name = name
        self.store = Store.open(store_url)
        try:
            self.traces: dict[str, Trace] = {t.id: t for t in self._load()}
        except BaseException:
            self.store.close()
            raise
        self.source: dict[str, str] = {}   # policy and upstream, for the provenance

    def _load(self) -> list[Trace]:
        try:
            return [trace_of(t) for t in self.store.traces.get(self.name)]
        except TraceSetNotFound:
            return []
        except SQLAlchemyError as err:
            text = str(getattr(err, "orig", None) or err).strip()
            reason = text.splitlines()[0] if text else "(no message)"
            raise StoreError(f"--db: cannot read trace set {self.name!r} in {self.store.display_url}: "
                             f"{reason}") from None

    def serving(self, policy: str, upstream: str) -> None:
        """Name what the recorded traffic passes through (the provenance of new traces)."""
        self.source = {"policy": policy, "upstream": upstream}

    def add(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]], reply: Mapping[str, Any],
            usage: Mapping[str, Any] | None, latency_s: float, model: str | None = None,
            policy: str | None = None) -> None:
        """One answered request into its trace, kept in memory first, then the whole trace written.

        `policy` names the policy that served it (the one `serving` named when not given)."""
        trace = self._next(list(messages), list(tools), _kept_reply(reply), usage, latency_s, model,
                           policy or self.source.get("policy"))
        self.traces[trace.id] = trace
        self.store.traces.put(self.name, stored_of(trace))

    def _next(self, history: list[Message], tools: list[Mapping[str, Any]], reply: Message,
              usage: Mapping[str, Any] | None, latency_s: float, model: str | None, policy: str | None) -> Trace:
        request = TraceRequest(len(history), usage, latency_s, policy)
        earlier = self._continued(history)
        if earlier is None:
            started = datetime.now(timezone.utc) - timedelta(seconds=latency_s)
            provenance = {"format": FORMAT, **self.source, "policy": policy, "model": model,
                          "recorded_at": started.isoformat(timespec="seconds")}
            return Trace(self._new_id(), (*history, reply), tuple(tools), (request,), "tools", provenance)
        return Trace(earlier.id, (*history, reply), tuple(tools or earlier.tools), (*earlier.requests, request),
                     earlier.actions, earlier.provenance)

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

    def under_way(self, limit: int) -> list[tuple[list[Message], str]]:
        """The `limit` most recently started conversations: the history of each one's last request
        and the policy that served it (those recorded without one left out)."""
        recent = list(self.traces.values())[-limit:] if limit > 0 else []
        return [(list(t.messages[:t.requests[-1].index]), t.requests[-1].policy) for t in recent
                if t.requests and t.requests[-1].policy]

    def _new_id(self) -> str:
        pattern = re.compile(re.escape(self.name) + r"-(\d+)")
        numbers = [int(m.group(1)) for m in map(pattern.fullmatch, self.traces) if m]
        return f"{self.name}-{max(numbers, default=0) + 1:05d}"

    def close(self) -> None:
        self.store.close()


def _kept_reply(reply: Mapping[str, Any]) -> Message:
    """The reply as the trace keeps it: an assistant message with OpenAI's keys, nulls left out but content's."""
    kept: Message = {"role": "assistant", "content": reply.get("content")}
    kept.update({k: v for k, v in openai_message(reply).items() if k not in kept and v is not None})
    return kept
