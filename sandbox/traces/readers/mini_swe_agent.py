"""mini-swe-agent trajectories (`mini-swe-agent`): `.traj.json` files of 1.x and 2.x.

Read: `messages` with OpenAI keys (role, content, tool_calls, tool_call_id, ...; `extra`,
`function_call: null` and `provider_specific_fields` dropped). An assistant message's
`extra.response.usage` is its request's usage. 1.x agents act in text (a fenced block, the
observation as the next user message); 2.x agents call a `bash` tool natively (`tools` is then
mini-swe-agent's one `bash` schema), or act in text with a text-based model; a run without a
tool call is a text-action run. A 2.x run ends with a
message of role `exit` (its `extra.exit_status` and its content, the submission): it is the run's
end, not a message any request carried, so it is kept as the metadata's exit_status and
submission and is not a message of the trace; an `exit` message anywhere else is refused. 2.x
runs of a Responses API model keep Responses items (a `"object": "response"` entry per model call,
`function_call_output` items): read as chat messages (`openai.responses_messages`), each
response's usage its request's.

Metadata: task (`instance_id`), model (`info.config.model.model_name`), agent "mini-swe-agent",
agent_version (`info.mini_version`), exit_status and submission (`info`, or the `exit` message).
Provenance: trajectory_format, model_stats (run totals). The id is `instance_id` if present, else
the file stem. Dropped: `info.config` but the model name (templates, environment), tracebacks,
each message's `extra` but the usage (raw outputs, timestamps, costs).
"""
from __future__ import annotations

from typing import Any, Mapping

from sandbox.traces.actions import BASH_TOOL, uses_tools
from sandbox.traces.model import Trace, TraceError, TraceRequest
from sandbox.traces.readers.openai import responses_messages
from sandbox.traces.reading import Source, content_text, dig, file_provenance, file_stem

FORMAT = "mini-swe-agent"
EXIT = "exit"


def claims(source: Source) -> bool:
    """A JSON object with a `messages` list and mini-swe-agent's `trajectory_format` or `info`."""
    doc = source.document
    return source.whole and isinstance(dig(doc, "messages"), list) and (
        "trajectory_format" in doc or "info" in doc)


def read(source: Source) -> list[tuple[int, Trace]]:
    doc = source.document
    raw = doc.get("messages") if isinstance(doc, Mapping) else None
    if not isinstance(raw, list):
        raise TraceError(f'{source.path}:1: expected a mini-swe-agent trajectory: a JSON object with a "messages" list')
    raw, end = _without_exit(source, raw)
    messages, usages = responses_messages(raw)
    for i, message in enumerate(raw):
        usage = dig(message, "extra", "response", "usage")
        if dig(message, "role") == "assistant" and isinstance(usage, Mapping):
            usages[i] = usage
    info = doc.get("info")
    metadata = {key: value for key, value in (
        ("task", doc.get("instance_id")), ("model", dig(info, "config", "model", "model_name")),
        ("agent", "mini-swe-agent"), ("agent_version", dig(info, "mini_version")),
        ("exit_status", dig(end, "extra", "exit_status") or dig(info, "exit_status")),
        ("submission", dig(info, "submission") if end is None else content_text(end.get("content"))))
        if value is not None}
    provenance = file_provenance(FORMAT, source.path, trajectory_format=doc.get("trajectory_format"),
                                 model_stats=dig(info, "model_stats"))
    actions = "tools" if uses_tools(messages) else "text"
    tools = (BASH_TOOL,) if actions == "tools" else ()
    requests = tuple(TraceRequest(i, usage) for i, usage in sorted(usages.items()))
    trace_id = str(doc.get("instance_id") or file_stem(source.path))
    return [(1, Trace(trace_id, tuple(messages), tools, requests, actions, provenance, metadata))]


def _without_exit(source: Source, raw: list[Any]) -> tuple[list[Any], Mapping[str, Any] | None]:
    """The messages before the run's `exit` message, and that message (None without one)."""
    exits = [i for i, message in enumerate(raw) if dig(message, "role") == EXIT]
    if not exits:
        return raw, None
    if exits != [len(raw) - 1]:
        raise TraceError(f"{source.path}:1: message {exits[0]} has role 'exit' before the end of the run: expected "
                         "one exit message, the last")
    return raw[:-1], raw[-1]
