"""Anthropic Messages API logs (`anthropic`): requests and replies as gateways and proxies log them.

A file is JSON Lines, one request a line (a file that is one such object reads as one line): the
request body (`model`, `system`, `messages`, `tools`, ...), with its reply under `response` (a
Message: `{"type": "message", "role": "assistant", "content": [...], "usage": {...}}`), or the
body under `request` (or `request_body`) and the reply under `response` (or `response_body`);
`latency_s`/`latency_ms` and `id` beside them. Lines continue one another as OpenAI gateway lines
do (`openai.merge_lines`): a line whose history, reply included, starts with a whole earlier trace
continues it; the id is the first line's `id`, else `<file stem>-<line>`.

Read, in OpenAI's form (`messages_of`):
- `system` (a string or text blocks): the first message, role system;
- a message whose content is a string: as it is;
- an assistant message's blocks: `text` joined as its content, `tool_use` as tool calls (`id`,
  `name`, `input` as JSON arguments), `thinking` as its `reasoning_content`;
- a user message's blocks, in order: each `tool_result` the tool message answering its
  `tool_use_id` (its content: a string, or its text blocks joined; `is_error` dropped), other text
  blocks a user message;
- `tools`: `name`, `description` and `input_schema` as function schemas;
- the reply's `usage` as an OpenAI usage object: prompt tokens are `input_tokens` plus
  `cache_read_input_tokens` and `cache_creation_input_tokens` (Anthropic counts them apart),
  `cached_tokens` the cache reads, `cache_creation_input_tokens` kept beside it;
- `model` (the reply's, else the request's) as the metadata's model.

Dropped: images, documents and other non-text blocks (a user turn of an image alone keeps an
empty text), `redacted_thinking`, `signature`s, `cache_control`, server tools' blocks
(`server_tool_use`, web search results), sampling parameters, `stop_reason`, `metadata`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

from sandbox.traces.model import Message, Trace, TraceError, TraceRequest
from sandbox.traces.readers.openai import anthropic_request, latency, merge_lines, request_record
from sandbox.traces.reading import Source, dig, file_stem

FORMAT = "anthropic"


def claims(source: Source) -> bool:
    """JSON Lines of Messages requests (a `messages` list, in the body or under `request`) of which
    one at least has Anthropic's marks (`openai.anthropic_request`)."""
    records = source.records()
    first = request_record(records[0][1])
    return isinstance(first, Mapping) and isinstance(first.get("messages"), list) and \
        "trajectory_format" not in first and any(anthropic_request(record) for _, record in records)


def read(source: Source) -> list[tuple[int, Trace]]:
    return merge_lines(source.path, ((number, _line(source.path, number, record))
                                     for number, record in source.records()))


def _line(path: Path, number: int, raw: Any) -> Trace:
    where = f"{path}:{number}"
    record = request_record(raw)
    if not isinstance(record, Mapping) or not isinstance(record.get("messages"), list):
        raise TraceError(f'{where}: expected an Anthropic Messages request: a JSON object with a "messages" list')
    messages = messages_of(record.get("system"), record["messages"], where)
    reply = record.get("response")
    requests: tuple[TraceRequest, ...] = ()
    model = record.get("model")
    if reply is not None:
        if not isinstance(reply, Mapping) or reply.get("role", "assistant") != "assistant" or \
                not isinstance(reply.get("content"), (list, str)):
            raise TraceError(f'{where}: "response" is {reply!r:.80}: expected an Anthropic Message '
                             '(role assistant, a content list)')
        messages += assistant_message(reply["content"])
        usage = reply.get("usage")
        requests = (TraceRequest(len(messages) - 1, openai_usage(usage) if isinstance(usage, Mapping) else None,
                                 latency(where, record)),)
        model = reply.get("model") or model
    metadata = {"model": model} if isinstance(model, str) else {}
    provenance = {"format": FORMAT, "file": path.name, "line": number}
    trace_id = str(record.get("id") or f"{file_stem(path)}-{number}")
    return Trace(trace_id, tuple(messages), tools_of(record.get("tools")), requests, "tools", provenance, metadata)


def messages_of(system: Any, messages: Sequence[Any], where: str) -> list[Message]:
    """The request's system prompt and messages in OpenAI's form (module docstring)."""
    out: list[Message] = []
    if system:
        out.append({"role": "system", "content": block_text(system)})
    for n, message in enumerate(messages):
        role = dig(message, "role")
        if role == "assistant":
            out += assistant_message(message.get("content"))
        elif role == "user":
            out += user_messages(message.get("content"))
        else:
            raise TraceError(f"{where}: message {n} has role {role!r}: expected user or assistant "
                             "(Anthropic's system prompt is the request's `system`)")
    return out


def assistant_message(content: Any) -> list[Message]:
    """One assistant message of a content string or blocks: text, tool calls, reasoning."""
    if not isinstance(content, list):
        return [{"role": "assistant", "content": content}]
    text = block_text([b for b in content if dig(b, "type") == "text"])
    calls = [{"id": b.get("id"), "type": "function",
              "function": {"name": b.get("name"), "arguments": json.dumps(b.get("input", {}), ensure_ascii=False)}}
             for b in content if dig(b, "type") == "tool_use"]
    thinking = "".join(str(b.get("thinking") or "") for b in content if dig(b, "type") == "thinking")
    message: Message = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning_content"] = thinking
    return [message]


def user_messages(content: Any) -> list[Message]:
    """A user turn: its tool results as tool messages, its other text as user messages, in order."""
    if not isinstance(content, list):
        return [{"role": "user", "content": content}]
    out: list[Message] = []
    texts: list[Any] = []
    for block in content:
        if dig(block, "type") == "tool_result":
            if texts:
                out.append({"role": "user", "content": block_text(texts)})
                texts = []
            out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                        "content": block_text(block.get("content"))})
        elif dig(block, "type") == "text":
            texts.append(block)
    if texts or not out:
        out.append({"role": "user", "content": block_text(texts)})
    return out


def block_text(content: Any) -> str:
    """A string as it is; text blocks' text joined (blank lines between); anything else empty."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n\n".join(str(b.get("text")) for b in content if dig(b, "type") == "text" and "text" in b)
    return ""


def tools_of(tools: Any) -> tuple[Mapping[str, Any], ...]:
    """Anthropic tool definitions as OpenAI function schemas (server tools without a schema dropped)."""
    if not isinstance(tools, list):
        return ()
    return tuple({"type": "function", "function": {"name": t.get("name"), "description": t.get("description", ""),
                                                   "parameters": t.get("input_schema")}}
                 for t in tools if isinstance(t, Mapping) and isinstance(t.get("input_schema"), Mapping))


def openai_usage(usage: Mapping[str, Any]) -> dict[str, Any]:
    """Anthropic usage as an OpenAI usage object (module docstring)."""
    read, written, fresh, completion = (_count(usage.get(key)) for key in (
        "cache_read_input_tokens", "cache_creation_input_tokens", "input_tokens", "output_tokens"))
    read, written = read or 0, written or 0
    out: dict[str, Any] = {}
    if isinstance(fresh, int):
        out["prompt_tokens"] = fresh + read + written
    if isinstance(completion, int):
        out["completion_tokens"] = completion
    if isinstance(fresh, int) and isinstance(completion, int):
        out["total_tokens"] = out["prompt_tokens"] + completion
    out["prompt_tokens_details"] = {"cached_tokens": read, "cache_creation_input_tokens": written}
    return out


def _count(value: Any) -> int | None:
    """A token count, or None where the log has none (or something else)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None
