"""OpenTelemetry GenAI spans (`otel`): model calls recorded under the public GenAI semantic conventions
(open-telemetry/semantic-conventions, `docs/gen-ai/`), with content capture on.

Files: OTLP JSON (`{"resourceSpans": [{"resource", "scopeSpans": [{"scope", "spans": [...]}]}]}`),
one such object as the whole file or one a line (the Collector's file exporter), spans with
`attributes` as OTLP key/value lists; or JSON Lines of spans as the SDKs' JSON (`name`, `context`
with `trace_id`, `attributes` a flat object).

A chat span (`gen_ai.operation.name` chat, text_completion or generate_content, or any span with
`gen_ai.input.messages`) is one request. Read from its attributes, or from those of its
`gen_ai.client.inference.operation.details` event:
- `gen_ai.system_instructions` (parts): a system message first;
- `gen_ai.input.messages`: the history sent, each `{"role", "parts"}`: `text` parts joined as the
  content, `tool_call` parts (`id`, `name`, `arguments`) as tool calls, each `tool_call_response`
  part (`id`, `response`) a tool message, `reasoning` parts as `reasoning_content`;
- `gen_ai.output.messages`: the reply, the first output message, read the same way;
- `gen_ai.tool.definitions` (`name`, `description`, `parameters`) as the schemas;
- `gen_ai.usage.input_tokens`, `gen_ai.usage.output_tokens` and
  `gen_ai.usage.cache_read.input_tokens` as the request's OpenAI usage (the conventions count
  cached tokens inside the input tokens); the span's duration as its latency;
- `gen_ai.response.model` (else `gen_ai.request.model`) as the metadata's model, and
  `gen_ai.agent.name` as its agent.
The messages attributes are JSON strings (or structured values). Spans of one conversation
(`gen_ai.conversation.id`, else the trace id) in start order continue one another as gateway lines
do (`openai.merge_lines`): a span whose history, reply included, starts with a whole earlier trace
continues it. The id is the conversation id, else the trace id (with `-2`, ... for further
conversations of it). The line of a trace is its first span's record.

Dropped: spans of other operations (execute_tool, invoke_agent, embeddings: the chat spans have
what the model saw), `blob`, `file` and `uri` parts and server tool parts, sampling parameters,
finish reasons, resources and scopes. A chat span without `gen_ai.input.messages` (recorded with
content capture off) is refused; so are other vendors' attributes (`gen_ai.prompt.0.content`,
`llm.input_messages`), which these conventions do not define.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator, Mapping

from sandbox.traces.model import Message, Trace, TraceError, TraceRequest
from sandbox.traces.readers.openai import merge_lines
from sandbox.traces.reading import Source, dig

FORMAT = "otel"
CHAT_OPERATIONS = ("chat", "text_completion", "generate_content")
DETAILS_EVENT = "gen_ai.client.inference.operation.details"
INPUT, OUTPUT = "gen_ai.input.messages", "gen_ai.output.messages"


def claims(source: Source) -> bool:
    """OTLP JSON (`resourceSpans`), or JSON Lines of SDK spans (`context` and `attributes`) with gen_ai.* keys."""
    first = source.records()[0][1]
    if isinstance(first, Mapping) and isinstance(first.get("resourceSpans"), list):
        return True
    return not source.whole and isinstance(first, Mapping) and isinstance(first.get("context"), Mapping) and \
        any(isinstance(r, Mapping) and any(str(k).startswith("gen_ai.") for k in dig(r, "attributes") or ())
            for _, r in source.records())


def read(source: Source) -> list[tuple[int, Trace]]:
    conversations: dict[str, list[tuple[int, int, int, Trace]]] = {}
    for n, (line, span) in enumerate(_spans(source)):
        attributes = _attributes(span)
        if not _is_chat(attributes):
            continue
        key = str(attributes.get("gen_ai.conversation.id") or _trace_id(span))
        request = _request(source.path, line, span, attributes, f"{key}\0{n}")  # renamed once merged
        conversations.setdefault(key, []).append((_start(span), line, n, request))
    if not conversations:
        raise TraceError(f"{source.path}:1: no GenAI chat spans: expected spans with gen_ai.operation.name chat "
                         f"(or {INPUT}) under the OpenTelemetry GenAI conventions")
    located: list[tuple[int, Trace]] = []
    for key, spans in conversations.items():
        merged = merge_lines(source.path, ((line, trace) for _, line, _, trace in sorted(spans, key=lambda s: s[:3])))
        located += [(line, replace(trace, id=key if n == 0 else f"{key}-{n + 1}")) for n, (line, trace) in
                    enumerate(merged)]
    return sorted(located, key=lambda item: item[0])


def _spans(source: Source) -> Iterator[tuple[int, Mapping[str, Any]]]:
    for line, record in source.records():
        if isinstance(record, Mapping) and isinstance(record.get("resourceSpans"), list):
            for resource in record["resourceSpans"]:
                for scope in _list(dig(resource, "scopeSpans") or dig(resource, "instrumentationLibrarySpans")):
                    for span in _list(dig(scope, "spans")):
                        if not isinstance(span, Mapping):
                            raise TraceError(f"{source.path}:{line}: a span is {span!r:.60}: expected a JSON object")
                        yield line, span
        elif isinstance(record, Mapping) and isinstance(record.get("attributes"), (Mapping, list)):
            yield line, record
        else:
            raise TraceError(f'{source.path}:{line}: expected OTLP JSON ("resourceSpans") or a span (a JSON object '
                             'with "attributes")')


def _attributes(span: Mapping[str, Any]) -> dict[str, Any]:
    """The span's attributes as a flat object, its details event's attributes over them."""
    out = _flat(span.get("attributes"))
    for event in _list(span.get("events")):
        if dig(event, "name") == DETAILS_EVENT:
            out.update(_flat(event.get("attributes")))
    return out


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _flat(attributes: Any) -> dict[str, Any]:
    if isinstance(attributes, Mapping):
        return dict(attributes)
    if isinstance(attributes, list):
        return {str(dig(a, "key")): _value(dig(a, "value")) for a in attributes if isinstance(a, Mapping)}
    return {}


def _value(value: Any) -> Any:
    """An OTLP AnyValue as plain JSON (int64s come as strings in OTLP JSON)."""
    if not isinstance(value, Mapping):
        return value
    if "stringValue" in value:
        return value["stringValue"]
    if "intValue" in value:  # int64s are strings in OTLP JSON
        return int(value["intValue"]) if str(value["intValue"]).lstrip("-").isdigit() else value["intValue"]
    if "doubleValue" in value:
        return value["doubleValue"]
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "arrayValue" in value:
        return [_value(v) for v in _list(dig(value, "arrayValue", "values"))]
    if "kvlistValue" in value:
        return _flat(dig(value, "kvlistValue", "values"))
    return None


def _is_chat(attributes: Mapping[str, Any]) -> bool:
    return attributes.get("gen_ai.operation.name") in CHAT_OPERATIONS or INPUT in attributes


def _trace_id(span: Mapping[str, Any]) -> str:
    return str(span.get("traceId") or dig(span, "context", "trace_id") or "trace")


def _start(span: Mapping[str, Any]) -> int:
    start = span.get("startTimeUnixNano")
    return int(start) if isinstance(start, (int, str)) and str(start).isdigit() else 0


def _seconds(span: Mapping[str, Any]) -> float | None:
    start, end = span.get("startTimeUnixNano"), span.get("endTimeUnixNano")
    if isinstance(start, (int, str)) and isinstance(end, (int, str)) and str(start).isdigit() and str(end).isdigit():
        return (int(end) - int(start)) / 1e9
    return None


def _request(path: Path, line: int, span: Mapping[str, Any], attributes: Mapping[str, Any], key: str) -> Trace:
    where = f"{path}:{line}"
    name = span.get("name") or "a chat span"
    if INPUT not in attributes:
        raise TraceError(f"{where}: span {name!r} has no {INPUT}: expected spans recorded with message content "
                         "capture on (the GenAI conventions' gen_ai.input.messages and gen_ai.output.messages)")
    messages = [*_system(where, attributes.get("gen_ai.system_instructions")),
                *(m for message in _json(where, attributes[INPUT], INPUT) for m in _messages(where, message))]
    output = _json(where, attributes.get(OUTPUT), OUTPUT) if OUTPUT in attributes else []
    requests: tuple[TraceRequest, ...] = ()
    if output:
        if not isinstance(output[0], Mapping):
            raise TraceError(f"{where}: {OUTPUT} starts with {output[0]!r:.60}: expected a message object")
        messages += _messages(where, {**output[0], "role": "assistant"})
        requests = (TraceRequest(len(messages) - 1, _usage(attributes), _seconds(span)),)
    model = attributes.get("gen_ai.response.model") or attributes.get("gen_ai.request.model")
    metadata = {k: v for k, v in (("model", model), ("agent", attributes.get("gen_ai.agent.name")))
                if isinstance(v, str)}
    provenance = {"format": FORMAT, "file": path.name, "line": line, "trace_id": _trace_id(span),
                  **({"provider": attributes["gen_ai.provider.name"]} if "gen_ai.provider.name" in attributes else {})}
    tools = _tools(where, attributes.get("gen_ai.tool.definitions"))
    return Trace(key, tuple(messages), tools, requests, "tools", provenance, metadata)


def _json(where: str, value: Any, name: str) -> list[Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise TraceError(f"{where}: {name} is not JSON ({error.msg}): expected a JSON array") from error
    if not isinstance(value, list):
        raise TraceError(f"{where}: {name} is {value!r:.60}: expected a JSON array")
    return value


def _system(where: str, value: Any) -> list[Message]:
    if value is None:
        return []
    parts = _json(where, value, "gen_ai.system_instructions")
    text = "".join(str(dig(p, "content") or "") for p in parts if dig(p, "type") == "text")
    return [{"role": "system", "content": text}] if text else []


def _messages(where: str, message: Any) -> list[Message]:
    """One convention message as OpenAI messages: a tool message per tool_call_response part, else one."""
    role, parts = dig(message, "role"), dig(message, "parts")
    if not isinstance(role, str) or not isinstance(parts, list):
        raise TraceError(f'{where}: message {message!r:.80}: expected {{"role", "parts": [...]}} (GenAI conventions)')
    answers = [{"role": "tool", "tool_call_id": p.get("id"), "content": _text(p.get("response"))}
               for p in parts if dig(p, "type") == "tool_call_response"]
    text = "".join(str(p.get("content") or "") for p in parts if dig(p, "type") == "text")
    if answers and not text:
        return answers
    out: Message = {"role": role, "content": text or (None if role == "assistant" else "")}
    calls = [{"id": p.get("id"), "type": "function",
              "function": {"name": p.get("name"), "arguments": _text(p.get("arguments"))}}
             for p in parts if dig(p, "type") == "tool_call"]
    if calls:
        out["tool_calls"] = calls
    reasoning = "".join(str(p.get("content") or "") for p in parts if dig(p, "type") == "reasoning")
    if reasoning:
        out["reasoning_content"] = reasoning
    return [*answers, out]


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value if value is not None else {}, ensure_ascii=False)


def _tools(where: str, value: Any) -> tuple[Mapping[str, Any], ...]:
    if value is None:
        return ()
    tools = _json(where, value, "gen_ai.tool.definitions")
    return tuple({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}}
                 for t in tools if isinstance(t, Mapping))


def _usage(attributes: Mapping[str, Any]) -> dict[str, Any] | None:
    prompt, completion = attributes.get("gen_ai.usage.input_tokens"), attributes.get("gen_ai.usage.output_tokens")
    if prompt is None and completion is None:
        return None
    out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion}
    if isinstance(prompt, int) and isinstance(completion, int):
        out["total_tokens"] = prompt + completion
    cached = attributes.get("gen_ai.usage.cache_read.input_tokens")
    if cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out

