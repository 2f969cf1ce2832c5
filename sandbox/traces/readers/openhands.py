"""OpenHands (`openhands`): event streams (a JSON array of events, as `tests/runtime/trajs/*.json` and
a saved conversation's trajectory hold them) and evaluation output (`output.jsonl`: one record per
instance, its events under `history`). OpenHands 0.x events; the 1.x SDK's typed events (`kind`)
are a different format and are not read.

Events are read as OpenHands' CodeAct agent turns them into messages:
- an action with `tool_call_metadata`: the first event of a model response (`model_response.id`)
  is that response's assistant message, `model_response.choices[0].message` with OpenAI keys (its
  content and every tool call of the response, so parallel calls are one message); its usage is
  the request's usage (an OpenAI usage object already); the response's other events add nothing;
- an observation with `tool_call_metadata`: the tool message answering `tool_call_id`, named
  `function_name`, its content the event's `content` (OpenHands appends a line on the exit code
  and working directory when it sends a command's output; that line is not rebuilt);
- `system` actions: the system message (`args.content`; `args.tools` are the trace's schemas);
- `message` actions: the user's as user messages, the agent's (a reply without a tool call) as
  assistant messages, `args.content`;
- an `error` observation without tool call metadata: a user message (CodeAct sends errors so).

Dropped: recall actions and observations (workspace and microagent context; CodeAct adds some of it
to the prompt, not rebuilt here), agent state changes, `null` observations, `llm_metrics`,
timestamps, `extras`, images.

Evaluation output: one trace per line, id `instance_id`; history flat or in the older
[action, observation] pairs. Metadata: task (`instance_id`), model (`metadata.llm_config.model`),
agent (`metadata.agent_class`), resolved (`report.resolved` or `test_result.report.resolved` where
an evaluation added it); provenance keeps `error`. Dropped: `instruction` (the first user message
has it), `instance`, `test_result`'s patch, `metrics`. An event stream is one trace, id the file
stem, model from the model responses.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from sandbox.traces.model import Message, Trace, TraceError, TraceRequest
from sandbox.traces.reading import Source, dig, file_provenance, file_stem, openai_message

FORMAT = "openhands"


def _is_event(value: Any) -> bool:
    return isinstance(value, Mapping) and value.get("source") in ("agent", "user", "environment") and (
        "action" in value or "observation" in value)


def _events_of(history: Any) -> list[Any] | None:
    """The events of a history: flat, or [action, observation] pairs flattened; None if not a list."""
    if not isinstance(history, list):
        return None
    return [e for item in history for e in (item if isinstance(item, list) else [item])]


def _of_events(history: Any) -> bool:
    events = _events_of(history)
    return bool(events) and all(_is_event(e) for e in events[:3])


def claims(source: Source) -> bool:
    """A JSON array of OpenHands events, or records with `instance_id` and a `history` of events."""
    if source.whole and isinstance(source.document, list):
        return _of_events(source.document)
    first = source.records()[0][1]
    return isinstance(first, Mapping) and "instance_id" in first and _of_events(first.get("history"))


def read(source: Source) -> list[tuple[int, Trace]]:
    if source.whole and isinstance(source.document, list):
        messages, tools, requests, models = _conversation(source.path, 1, _events_of(source.document) or [])
        metadata = {"agent": "openhands", **({"model": models[0]} if models else {})}
        trace = Trace(file_stem(source.path), messages, tools, requests, "tools",
                      file_provenance(FORMAT, source.path, shape="event stream"), metadata)
        return [(1, trace)]
    return [(line, _instance(source.path, line, record)) for line, record in source.records()]


def _instance(path: Path, line: int, record: Any) -> Trace:
    events = _events_of(dig(record, "history"))
    if events is None or not isinstance(record.get("instance_id"), (str, int)):
        raise TraceError(f'{path}:{line}: expected an OpenHands evaluation record: "instance_id" and a "history" '
                         "list of events")
    messages, tools, requests, models = _conversation(path, line, events)
    resolved = dig(record, "report", "resolved")
    resolved = dig(record, "test_result", "report", "resolved") if resolved is None else resolved
    metadata = {key: value for key, value in (
        ("task", record["instance_id"]), ("model", dig(record, "metadata", "llm_config", "model") or
                                                   (models[0] if models else None)),
        ("agent", dig(record, "metadata", "agent_class") or "openhands"),
        ("resolved", resolved if isinstance(resolved, bool) else None)) if value is not None}
    provenance = {"format": FORMAT, "file": path.name, "line": line, "shape": "evaluation output",
                  **({"error": record["error"]} if record.get("error") else {})}
    return Trace(str(record["instance_id"]), messages, tools, requests, "tools", provenance, metadata)


def _conversation(path: Path, line: int, events: Sequence[Any]) -> tuple[tuple[Message, ...], tuple[Any, ...],
                                                                           tuple[TraceRequest, ...], list[str]]:
    """(messages, tool schemas, requests with usage, models) of a list of events (module docstring)."""
    messages: list[Message] = []
    tools: tuple[Any, ...] = ()
    requests: list[TraceRequest] = []
    responses: set[str] = set()
    models: list[str] = []
    for n, event in enumerate(events):
        if not _is_event(event):
            raise TraceError(f'{path}:{line}: event {n} is {event!r:.80}: expected an OpenHands event ("source", '
                             'and "action" or "observation")')
        metadata = event.get("tool_call_metadata")
        if "action" in event and isinstance(metadata, Mapping):
            response = metadata.get("model_response")
            key = str(dig(response, "id") or f"event-{event.get('id', n)}")
            if key in responses:
                continue
            responses.add(key)
            reply = dig(response, "choices")
            reply = dig(reply[0], "message") if isinstance(reply, list) and reply else None
            if not isinstance(reply, Mapping):
                raise TraceError(f"{path}:{line}: event {n} (action {event['action']!r}) has no model response "
                                 "message: expected tool_call_metadata.model_response.choices[0].message")
            messages.append({**openai_message(reply), "role": "assistant", "content": reply.get("content")})
            usage = dig(response, "usage")
            requests.append(TraceRequest(len(messages) - 1, usage if isinstance(usage, Mapping) else None))
            if isinstance(dig(response, "model"), str):
                models.append(response["model"])
        elif "observation" in event and isinstance(metadata, Mapping):
            messages.append({"role": "tool", "tool_call_id": metadata.get("tool_call_id"),
                             "name": metadata.get("function_name"), "content": event.get("content", "")})
        elif event.get("action") == "system":
            messages.append({"role": "system", "content": dig(event, "args", "content") or ""})
            schemas = dig(event, "args", "tools")
            tools = tuple(schemas) if isinstance(schemas, list) else ()
        elif event.get("action") == "message":
            role = "user" if event["source"] == "user" else "assistant"
            messages.append({"role": role, "content": dig(event, "args", "content") or event.get("message", "")})
        elif event.get("observation") == "error":
            messages.append({"role": "user", "content": event.get("content", "")})
    return tuple(messages), tools, tuple(requests), models
