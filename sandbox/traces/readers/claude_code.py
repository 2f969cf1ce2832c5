"""Claude Code session logs (`claude-code`): `~/.claude/projects/<project>/<session>.jsonl`, one JSON
line per event, and its sub-agents' `<session>/subagents/agent-<id>.jsonl`.

Each line is an event: `type` (user, assistant, system, summary, progress, file-history-snapshot,
...), `uuid`, `parentUuid`, `sessionId`, `isSidechain`, `version`, and for user and assistant events
a `message` in Anthropic's form (`anthropic.messages_of` reads its blocks). Events form a tree by
`parentUuid`; a conversation is the path from a root to its leaf.

Read:
- the main conversation: the path to the last event not on a sidechain, its user and assistant
  events in order. Claude Code writes each block of one reply as its own assistant event; events
  of one reply (one `message.id`) are one assistant message, one request, with the usage of its
  last event. Tool results are the user events' `tool_result` blocks (tool messages); a user
  event's text a user message (`isMeta` ones included: the model reads them).
- sub-agents (the Task tool's conversations) as traces of their own: events with `isSidechain`
  true, grouped by their root; a sub-agent file (every event a sidechain) is one such trace. The
  main trace keeps only the Task call and its result, as the model saw them.
- a compacted session (`/compact`: a boundary event without a parent, its `logicalParentUuid` the
  last event before it, starts a new chain with the summary as a user message) gives one trace per
  chain, since the summary replaced the history the earlier requests carried.

Ids: the main trace's is the `sessionId` (`-2`, `-3`, ... for the chains after a compaction); a
sub-agent's is `<sessionId>-agent-<agentId>` (else `-sidechain-<n>` in file order). Metadata:
model (the replies' `message.model`), agent "claude-code", agent_version (`version`).
Provenance: session id, cwd, git branch. The line of a trace is its first event's.

Dropped: conversations without a reply (a session opened and left), assistant events of model
`<synthetic>` (Claude Code's own notices, no model call), `system`,
`summary`, `progress` and snapshot events, abandoned branches (events not on a leaf's path),
`toolUseResult` (the structured copy of a tool result), timestamps. Claude Code does not log its
system prompt or tool schemas, so a trace starts at the first user message and has no schemas:
its requests carried a longer prefix than the trace shows.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from sandbox.traces.model import Trace, TraceError, TraceRequest
from sandbox.traces.readers.anthropic import assistant_message, openai_usage, user_messages
from sandbox.traces.reading import Source

FORMAT = "claude-code"
_MESSAGE_TYPES = ("user", "assistant")


def claims(source: Source) -> bool:
    """JSON Lines of events with `sessionId`, `uuid` and a `type`, one at least a user or assistant message."""
    return not source.whole and any(
        isinstance(e, Mapping) and "sessionId" in e and "uuid" in e and e.get("type") in _MESSAGE_TYPES
        and isinstance(e.get("message"), Mapping) for _, e in source.records())


def read(source: Source) -> list[tuple[int, Trace]]:
    events: dict[str, tuple[int, Mapping[str, Any]]] = {}
    order: list[str] = []
    for line, event in source.records():
        if not isinstance(event, Mapping):
            raise TraceError(f"{source.path}:{line}: expected a Claude Code event: a JSON object")
        if isinstance(event.get("uuid"), str) and event.get("type") not in ("summary", "file-history-snapshot"):
            events[event["uuid"]] = (line, event)
            order.append(event["uuid"])
    main = [u for u in order if not events[u][1].get("isSidechain")]
    located: list[tuple[int, Trace]] = []
    if main:
        segments = _segments(events, main[-1])
        session = _session(events, segments[-1])
        for n, chain in enumerate(segments):
            located.append(_trace(source, events, chain, session if n == 0 else f"{session}-{n + 1}"))
    for n, leaf in enumerate(_sidechain_leaves(events, order)):
        chain = _path(events, leaf, sidechain=True)
        agent = events[chain[0]][1].get("agentId")
        suffix = f"agent-{agent}" if isinstance(agent, str) else f"sidechain-{n + 1}"
        located.append(_trace(source, events, chain, f"{_session(events, chain)}-{suffix}"))
    located = [(line, trace) for line, trace in located if trace.assistant_indices()]
    if not located:
        raise TraceError(f"{source.path}:1: no conversation with a reply: expected a Claude Code session with "
                         "assistant events")
    return located


def _path(events: Mapping[str, tuple[int, Mapping[str, Any]]], leaf: str, sidechain: bool = False) -> list[str]:
    """The uuids from the root to `leaf` (a sidechain's path stops where the sidechain starts)."""
    path, seen, uuid = [], set(), leaf
    while isinstance(uuid, str) and uuid in events and uuid not in seen:
        if sidechain and not events[uuid][1].get("isSidechain"):
            break
        seen.add(uuid)
        path.append(uuid)
        uuid = events[uuid][1].get("parentUuid")
    return path[::-1]


def _sidechain_leaves(events: Mapping[str, tuple[int, Mapping[str, Any]]], order: Sequence[str]) -> list[str]:
    """The last event (in file order) of each sidechain root's events."""
    last: dict[str, str] = {}
    for uuid in order:
        if events[uuid][1].get("isSidechain"):
            last[_path(events, uuid, sidechain=True)[0]] = uuid
    return list(last.values())


def _segments(events: Mapping[str, tuple[int, Mapping[str, Any]]], leaf: str) -> list[list[str]]:
    """The main conversation's chains, oldest first: the path to `leaf`, and before it the path to
    each compaction's `logicalParentUuid` (the leaf the compaction summarized)."""
    segments: list[list[str]] = []
    seen: set[str] = set()
    while isinstance(leaf, str) and leaf in events and leaf not in seen:
        path = _path(events, leaf)
        seen.update(path)
        segments.insert(0, path)
        leaf = events[path[0]][1].get("logicalParentUuid")
    return segments


def _session(events: Mapping[str, tuple[int, Mapping[str, Any]]], chain: Sequence[str]) -> str:
    return str(next((events[u][1]["sessionId"] for u in chain if events[u][1].get("sessionId")), "session"))


def _trace(source: Source, events: Mapping[str, tuple[int, Mapping[str, Any]]], chain: Sequence[str],
           trace_id: str) -> tuple[int, Trace]:
    messages: list[Any] = []
    replies: dict[str, int] = {}   # a reply's message id -> its index
    blocks: dict[int, list[Any]] = {}
    usages: dict[int, Any] = {}
    models: list[str] = []
    for uuid in chain:
        event = events[uuid][1]
        message = event.get("message")
        if event.get("type") not in _MESSAGE_TYPES or not isinstance(message, Mapping):
            continue
        if event["type"] == "user":
            messages += user_messages(message.get("content"))
            continue
        if message.get("model") == "<synthetic>":
            continue
        reply = str(message.get("id") or uuid)
        if reply not in replies:
            replies[reply] = len(messages)
            messages.append(None)
            blocks[replies[reply]] = []
        index = replies[reply]
        content = message.get("content")
        blocks[index] += content if isinstance(content, list) else [{"type": "text", "text": str(content or "")}]
        usages[index] = message.get("usage") or usages.get(index)
        if isinstance(message.get("model"), str):
            models.append(message["model"])
    for index, reply_blocks in blocks.items():
        messages[index] = assistant_message(reply_blocks)[0]
    requests = tuple(TraceRequest(i, openai_usage(usages[i]) if isinstance(usages[i], Mapping) else None)
                     for i in sorted(blocks))
    first_line, first = events[chain[0]]
    metadata = {key: value for key, value in (("model", models[0] if models else None), ("agent", "claude-code"),
                                              ("agent_version", first.get("version"))) if value is not None}
    provenance = {"format": FORMAT, "file": source.path.name, "line": first_line,
                  **{key: first[name] for key, name in (("session", "sessionId"), ("cwd", "cwd"),
                                                         ("git_branch", "gitBranch")) if first.get(name)}}
    return first_line, Trace(trace_id, tuple(messages), (), requests, "tools", provenance, metadata)
