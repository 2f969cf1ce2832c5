"""OpenAI chat JSON Lines (`openai`), bare message lists (`messages`) and Responses API items.

`openai`: JSON Lines, one chat history a line: `{"id", "messages", "tools", "model", "provenance"}`
(only `messages` required; no id: `<file stem>-<line>`) or a list of messages; a file that is one
such object reads as one line. Messages are kept as given (content a string, null or parts).
Older function calling (an assistant `function_call` answered by a `function` message)
reads as a tool call and its tool message. A gateway log line may add its request's reply
(`"response"`: an assistant message or a chat completion; or `"choices": [{"message": ...}]`),
`"usage"` and `"latency_s"`/`"latency_ms"`, or hold the request body under `"request"` (or
`"request_body"`) and the reply under `"response"` (or `"response_body"`): the reply is appended,
the request recorded at its index. A line whose history (reply included) starts with a whole earlier trace of the file
(`extends`) continues it: the longer history replaces it, request records merge by index, the id
stays the first line's (gateways log a completion id per request, so ids never stop this). Other
lines start new traces, which may not reuse an id. `model` is the metadata's model; `provenance`
is kept as the trace's provenance; other keys (temperature, max_tokens, ...) are dropped.

`messages`: a file that is one JSON list of chat messages (mini-swe-agent's `tests/test_data`
`.traj.json`, and what many agents dump): one trace, id the file stem, messages as given.

`responses_messages`: OpenAI Responses API items as chat messages (for readers whose agents
logged them, mini-swe-agent 2.x's response models): a `"object": "response"` entry is one
assistant message (its `output`: `message` items' `output_text` parts joined as content,
`function_call` items as tool calls by `call_id`, `reasoning` items dropped); a
`function_call_output` item is the tool message answering its `call_id`; a `message` item with
`input_text` parts is a message of its role with the text joined. The response's `usage`
(input/output tokens, cached input tokens) becomes an OpenAI usage object.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from sandbox.traces.model import Message, Trace, TraceError, TraceRequest, check_trace
from sandbox.traces.reading import Source, dig, extends, file_provenance, file_stem, openai_message

FORMAT = "openai"
MESSAGES = "messages"


def claims(source: Source) -> bool:
    """JSON Lines of histories (objects with `messages` and no other format's keys, or lists), or one
    such object as the whole file; no line with Anthropic's top-level `system` or content blocks."""
    records = source.records()
    first = request_record(records[0][1])
    if isinstance(first, list):
        return not source.whole
    return isinstance(first, Mapping) and isinstance(first.get("messages"), list) and \
        not {"trajectory_format", "info", "requests", "actions"} & first.keys() and \
        not any(anthropic_request(record) for _, record in records)


def anthropic_request(record: Any) -> bool:
    """Whether a log line is an Anthropic Messages request or reply: a top-level `system`, content
    blocks only Anthropic's API writes (tool_use, tool_result, thinking), or a reply of type
    "message"."""
    record = request_record(record)
    if not isinstance(record, Mapping) or not isinstance(record.get("messages"), list):
        return False
    reply = record.get("response")
    return "system" in record or any(anthropic_blocks(m) for m in record["messages"]) or (
        isinstance(reply, Mapping) and reply.get("type") == "message")


def anthropic_blocks(message: Any) -> bool:
    """Whether a message's content has blocks only Anthropic's Messages API writes."""
    content = dig(message, "content")
    return isinstance(content, list) and any(
        dig(block, "type") in ("tool_use", "tool_result", "thinking", "redacted_thinking") for block in content)


def read(source: Source) -> list[tuple[int, Trace]]:
    return merge_lines(source.path, ((number, _line(source.path, number, record))
                                     for number, record in source.records()))


def merge_lines(path: Path, lines: Iterable[tuple[int, Trace]]) -> list[tuple[int, Trace]]:
    """Traces of a log of requests, one (line, trace) per logged request: a line whose history starts
    with a whole earlier trace continues it (`extends`; the module docstring), any other starts one."""
    traces: list[tuple[int, Trace]] = []
    for number, trace in lines:
        check_trace(trace, f"{path}:{number}")
        continued = [i for i, (_, earlier) in enumerate(traces) if extends(earlier.messages, trace.messages)]
        if continued:
            i = max(continued, key=lambda k: len(traces[k][1].messages))
            traces[i] = (traces[i][0], _continue(traces[i][1], trace, number))
            continue
        for first, earlier in traces:
            if earlier.id == trace.id:
                raise TraceError(f"{path}:{number}: id {trace.id!r} already names the trace of line {first}, "
                                 "which this line does not continue: expected a new id or a history starting with "
                                 "that trace")
        traces.append((number, trace))
    return traces


def claims_messages(source: Source) -> bool:
    """One JSON list of chat messages (objects with a role) as the whole file."""
    doc = source.document
    return source.whole and isinstance(doc, list) and bool(doc) and all(
        isinstance(m, Mapping) and "role" in m for m in doc)


def read_messages(source: Source) -> list[tuple[int, Trace]]:
    if not isinstance(source.document, list):
        raise TraceError(f"{source.path}:1: expected one JSON list of chat messages (objects with a role)")
    messages = tuple(legacy_functions(list(source.document)))
    return [(1, Trace(file_stem(source.path), messages, provenance=file_provenance(MESSAGES, source.path)))]


def request_record(record: Any) -> Any:
    """A gateway log line as one object: `{"request": BODY, "response": ...}` (or `request_body` /
    `response_body`) flattened to the body with the reply beside it; any other value as it is."""
    if not isinstance(record, Mapping):
        return record
    body = record.get("request", record.get("request_body"))
    if not isinstance(body, Mapping):
        return record
    rest = {k: v for k, v in record.items() if k not in ("request", "request_body", "response_body")}
    reply = record.get("response", record.get("response_body"))
    return {**body, **rest, **({"response": reply} if reply is not None else {})}


def _line(path: Path, number: int, record: Any) -> Trace:
    where = f"{path}:{number}"
    record = request_record(record)
    if isinstance(record, list):
        record = {"messages": record}
    if not isinstance(record, Mapping) or not isinstance(record.get("messages"), list):
        raise TraceError(f'{where}: expected a JSON object with a "messages" list, or a JSON list of messages')
    messages, requests = legacy_functions(list(record["messages"])), ()
    reply, usage = _reply(where, record)
    seconds = latency(where, record)
    if reply is not None:
        messages.append(reply)
    if reply is not None or usage is not None or seconds is not None:
        if not messages or not isinstance(messages[-1], Mapping) or messages[-1].get("role") != "assistant":
            raise TraceError(f'{where}: usage or latency without a reply: expected "response" or "choices" '
                             "with the assistant message, or a history ending with it")
        if usage is not None and not isinstance(usage, Mapping):
            raise TraceError(f'{where}: "usage" is {usage!r}: expected a JSON object (OpenAI usage)')
        requests = (TraceRequest(len(messages) - 1, usage, seconds),)
    tools = record.get("tools") or []
    if not isinstance(tools, list):
        raise TraceError(f'{where}: "tools" is {tools!r}: expected a list of tool schemas')
    provenance = dict(record["provenance"]) if isinstance(record.get("provenance"), Mapping) else {}
    provenance.update({"format": FORMAT, "file": path.name, "line": number})
    metadata = {"model": record["model"]} if isinstance(record.get("model"), str) else {}
    trace_id = str(record.get("id") or f"{file_stem(path)}-{number}")
    return Trace(trace_id, tuple(messages), tuple(tools), requests, "tools", provenance, metadata)


def legacy_functions(messages: list[Any]) -> list[Any]:
    """OpenAI's older function calling in today's form: an assistant `function_call` becomes its one
    tool call, and the `function` message after it the tool message answering it (logs of older
    clients and gateways have both)."""
    out, last_call = [], None
    for n, message in enumerate(messages):
        if isinstance(message, Mapping) and message.get("role") == "assistant" and \
                isinstance(message.get("function_call"), Mapping) and not message.get("tool_calls"):
            last_call = f"call_legacy_{n}"
            call = {"id": last_call, "type": "function", "function": dict(message["function_call"])}
            message = {**{k: v for k, v in message.items() if k != "function_call"}, "tool_calls": [call]}
        elif isinstance(message, Mapping) and message.get("role") == "function":
            message = {**{k: v for k, v in message.items() if k != "role"}, "role": "tool",
                       "tool_call_id": last_call}
        out.append(message)
    return out


def _reply(where: str, record: Mapping[str, Any]) -> tuple[Message | None, Any]:
    """The line's reply (an assistant message with OpenAI keys only) and usage, if it has them."""
    usage = record.get("usage")
    reply = record.get("response")
    if isinstance(reply, Mapping) and "choices" in reply:  # a whole chat completion object
        usage = usage if usage is not None else reply.get("usage")
        record = reply
    if "choices" in record:
        choices = record["choices"]
        reply = dig(choices[0], "message") if isinstance(choices, list) and choices else None
        if reply is None:
            raise TraceError(f'{where}: expected "choices": [{{"message": {{...}}}}] with the assistant reply')
    if reply is None:
        return None, usage
    if not isinstance(reply, Mapping) or reply.get("role", "assistant") != "assistant":
        raise TraceError(f"{where}: the reply is {reply!r:.80}: expected an assistant message")
    return {**openai_message(reply), "role": "assistant", "content": reply.get("content")}, usage


def latency(where: str, record: Mapping[str, Any]) -> float | None:
    """The line's `latency_s` (or `latency_ms`) in seconds; None without one."""
    for key, scale in (("latency_s", 1.0), ("latency_ms", 0.001)):
        value = record.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TraceError(f'{where}: "{key}" is {value!r}: expected a number')
        return value * scale
    return None


def _continue(earlier: Trace, later: Trace, number: int) -> Trace:
    """`earlier` continued by the line `number` whose history `later` starts with all of it."""
    recorded = {r.index: r for r in earlier.requests} | {r.index: r for r in later.requests}
    provenance = {**later.provenance, **earlier.provenance}
    provenance["lines"] = [*earlier.provenance.get("lines", [earlier.provenance["line"]]), number]
    return Trace(earlier.id, later.messages, later.tools or earlier.tools, tuple(recorded[i] for i in sorted(recorded)),
                 "tools", provenance, {**later.metadata, **earlier.metadata})


def responses_messages(items: Sequence[Any]) -> tuple[list[Any], dict[int, Mapping[str, Any]]]:
    """(chat messages, usage by assistant index) of Responses API items and chat messages mixed
    (module docstring); an item of no known shape is kept as it is, for the checks to name."""
    messages: list[Any] = []
    usages: dict[int, Mapping[str, Any]] = {}
    for item in items:
        if dig(item, "object") == "response":
            usage = dig(item, "usage")
            if isinstance(usage, Mapping):
                usages[len(messages)] = responses_usage(usage)
            messages.append(_response_message(item.get("output") or []))
        elif dig(item, "type") == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": item.get("output")})
        elif dig(item, "type") == "message" and isinstance(item.get("content"), list):
            messages.append({"role": item.get("role"), "content": _item_text(item["content"])})
        else:
            messages.append(openai_message(item))
    return messages, usages


def _response_message(output: Sequence[Any]) -> Message:
    text = "".join(_item_text(dig(item, "content") or []) for item in output if dig(item, "type") == "message")
    calls = [{"id": item.get("call_id") or item.get("id"), "type": "function",
              "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
             for item in output if dig(item, "type") == "function_call"]
    return {"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}


def _item_text(parts: Sequence[Any]) -> str:
    return "".join(str(dig(p, "text") or "") for p in parts if dig(p, "type") in ("input_text", "output_text", "text"))


def responses_usage(usage: Mapping[str, Any]) -> dict[str, Any]:
    """A Responses API usage (input_tokens, output_tokens) as an OpenAI chat usage object."""
    if "prompt_tokens" in usage:
        return dict(usage)
    prompt, completion = usage.get("input_tokens"), usage.get("output_tokens")
    out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion}
    if isinstance(prompt, int) and isinstance(completion, int):
        out["total_tokens"] = prompt + completion
    cached = dig(usage, "input_tokens_details", "cached_tokens")
    if cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out
