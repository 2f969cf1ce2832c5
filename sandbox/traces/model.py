"""A trace: one recorded agent run, the unit of evaluation data imported from real traffic."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

Message = dict[str, Any]  # an OpenAI-format chat message
ROLES = ("system", "developer", "user", "assistant", "tool")


class TraceError(ValueError):
    """A trace that cannot be used; the message names where (`FILE:LINE: ...` from the importers)."""


@dataclass(frozen=True)
class TraceRequest:
    """One recorded request: the history before the assistant message at `index` produced it.

    `usage` holds what the serving side reported for it (OpenAI's `usage` object: prompt_tokens,
    completion_tokens, and cached tokens where the provider reports them), `latency_s` the seconds
    it took; both None when the log does not say. `policy` names the cache policy that served it
    (`akv proxy --record` writes it; None when the log does not say).
    """

    index: int
    usage: Mapping[str, Any] | None = None
    latency_s: float | None = None
    policy: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        if self.usage is not None:
            out["usage"] = dict(self.usage)
        if self.latency_s is not None:
            out["latency_s"] = self.latency_s
        if self.policy is not None:
            out["policy"] = self.policy
        return out

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> TraceRequest:
        """The request of a `to_dict` record (KeyError without an index)."""
        policy = record.get("policy")
        return cls(int(record["index"]), record.get("usage"), record.get("latency_s"),
                   policy if isinstance(policy, str) else None)


@dataclass(frozen=True)
class Trace:
    """One agent run: messages, tool schemas, recorded requests and where it came from.

    `actions` is "tools" for native tool calls and "text" for agents that write their action in
    the assistant's text and get the observation back as the next user message (mini-swe-agent,
    SWE-agent without function calling); `actions.as_tool_calls` offers those in tool-call form.
    `requests` has one entry per assistant message, in order (without a recorded usage when the
    log has none). `provenance` says where the trace came from (format, file, line, and what the
    file says of itself); `metadata` what the run was and how it ended, each key only where the log
    says it: task, trial, reward, resolved, model, agent, agent_version, exit_status, submission.
    """

    id: str
    messages: tuple[Message, ...]
    tools: tuple[Mapping[str, Any], ...] = ()
    requests: tuple[TraceRequest, ...] = ()
    actions: str = "tools"
    provenance: Mapping[str, Any] = field(default_factory=dict)
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def assistant_indices(self) -> list[int]:
        return [i for i, m in enumerate(self.messages) if m.get("role") == "assistant"]

    def digest(self) -> str:
        """A hex digest of the content (messages, tools, actions): equal traces, equal digests."""
        blob = json.dumps([list(self.messages), list(self.tools), self.actions], sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(blob.encode()).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        """The JSON Lines record of `akv traces export` (read back by the `akv` format)."""
        out: dict[str, Any] = {"id": self.id, "messages": list(self.messages)}
        if self.tools:
            out["tools"] = list(self.tools)
        out["requests"] = [r.to_dict() for r in self.requests]
        out["actions"] = self.actions
        out["provenance"] = dict(self.provenance)
        if self.metadata:
            out["metadata"] = dict(self.metadata)
        return out


def with_requests(trace: Trace) -> Trace:
    """The trace with one request per assistant message, keeping the recorded ones (by index)."""
    recorded = {r.index: r for r in trace.requests}
    requests = tuple(recorded.get(i, TraceRequest(i)) for i in trace.assistant_indices())
    return replace(trace, requests=requests)


def check_trace(trace: Trace, where: str) -> None:
    """Raise TraceError (prefixed by `where`, e.g. `FILE:LINE`) unless the trace can be replayed.

    Every message needs a known role; a tool message must answer a call of an earlier assistant
    message (by `tool_call_id` when it has one); at least one assistant message must exist.
    """
    if not trace.id:
        raise TraceError(f"{where}: the trace has an empty id")
    open_calls: set[str] = set()
    any_call = False
    for i, message in enumerate(trace.messages):
        if not isinstance(message, Mapping):
            raise TraceError(f"{where}: message {i} is not a JSON object")
        role = message.get("role")
        if role not in ROLES:
            raise TraceError(f"{where}: message {i} has role {role!r}; expected one of {', '.join(ROLES)}")
        if role == "assistant":
            calls = message.get("tool_calls") or ()
            if not isinstance(calls, (list, tuple)):
                raise TraceError(f"{where}: message {i} has tool_calls {calls!r:.60}: expected a list of tool calls")
            for call in calls:
                any_call = True
                if isinstance(call, Mapping) and call.get("id"):
                    open_calls.add(str(call["id"]))
        elif role == "tool":
            call_id = message.get("tool_call_id")
            if not any_call or (call_id is not None and str(call_id) not in open_calls):
                raise TraceError(f"{where}: message {i} is a tool message that answers no call "
                                 f"(tool_call_id {call_id!r} names no earlier assistant tool call)")
    if not trace.assistant_indices():
        raise TraceError(f"{where}: trace {trace.id!r} has no assistant message: nothing to replay")
