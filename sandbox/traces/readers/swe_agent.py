"""SWE-agent trajectories (`swe-agent`): `.traj` files of SWE-agent 0.x and 1.x.

Read: `history`, the messages the agent kept, entries of the first entry's `agent` only (a
reviewer's or a retry loop's other agents are dropped): OpenAI keys (role, content, tool_calls,
...); a tool entry answers its `tool_call_ids[0]`. Demonstrations (`is_demo`, message type
"demonstration") are KEPT: SWE-agent sends them in every request, so they are part of the prefix
a cache sees (their count is in the provenance). When the last step of `trajectory` is missing
from `history` (some versions save the history before the submitting step), its `response` is
appended as the last assistant message, so that step's request is not lost; its observation (the
patch) reached no model and is left out. Actions: "tools" with function calling, else "text".
The id is `instance_id` if present, else the file stem.

Metadata: model (`replay_config`'s agent model name), agent "swe-agent", agent_version
(`info.swe_agent_version`), exit_status and submission (`info`). Provenance: environment,
model_stats (run totals: SWE-agent keeps no per-request usage), demonstration count.

Dropped: `thought`/`action`/`message_type` of entries (the content has them), `trajectory`'s
other steps (their responses are the history's; requeried format errors never reached the
history, so their requests are not replayed), `state`, `query`, `info`'s edited-files summaries
and review, and history processors (elided observations are not applied: the history is what
the agent kept).
"""
from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from sandbox.traces.actions import uses_tools
from sandbox.traces.model import Trace, TraceError
from sandbox.traces.reading import Source, content_text, dig, file_provenance, file_stem, openai_message

FORMAT = "swe-agent"


def claims(source: Source) -> bool:
    """A JSON object with a `history` list of chat entries (objects with a role)."""
    doc = source.document
    history = dig(doc, "history")
    return source.whole and isinstance(history, list) and all(
        isinstance(entry, Mapping) and "role" in entry for entry in history[:3])


def read(source: Source) -> list[tuple[int, Trace]]:
    doc = source.document
    history = doc.get("history") if isinstance(doc, Mapping) else None
    if not isinstance(history, list):
        raise TraceError(f'{source.path}:1: expected a SWE-agent trajectory: a JSON object with a "history" list')
    agent = dig(history[0], "agent") if history else None
    entries = [entry for entry in history if dig(entry, "agent") in (None, agent)]
    messages = [_message(entry) for entry in entries]
    last_step = _missing_last_step(messages, doc.get("trajectory"))
    if last_step is not None:
        messages.append(last_step)
    demos = sum(1 for e in entries if dig(e, "is_demo") or dig(e, "message_type") == "demonstration")
    info = doc.get("info")
    provenance = file_provenance(FORMAT, source.path, environment=doc.get("environment"),
                                 model_stats=dig(info, "model_stats"), demonstration_messages=demos,
                                 last_step_from_trajectory=True if last_step is not None else None)
    metadata = {key: value for key, value in (
        ("model", _model(doc)), ("agent", "swe-agent"), ("agent_version", dig(info, "swe_agent_version")),
        ("exit_status", dig(info, "exit_status")), ("submission", dig(info, "submission"))) if value is not None}
    trace_id = str(doc.get("instance_id") or file_stem(source.path))
    actions = "tools" if uses_tools(messages) else "text"
    return [(1, Trace(trace_id, tuple(messages), (), (), actions, provenance, metadata))]


def _message(entry: Any) -> Any:
    """The OpenAI message of a SWE-agent history entry; a tool entry answers its `tool_call_ids[0]`."""
    message = openai_message(entry)
    ids = dig(entry, "tool_call_ids")
    if dig(message, "role") == "tool" and "tool_call_id" not in message and isinstance(ids, list) and ids:
        message["tool_call_id"] = ids[0]
    return message


def _missing_last_step(messages: Sequence[Any], trajectory: Any) -> dict[str, Any] | None:
    """The assistant message of the trajectory's last step when the history does not end with it."""
    step = trajectory[-1] if isinstance(trajectory, list) and trajectory else None
    response = dig(step, "response")
    if not isinstance(response, str) or not response.strip():
        return None
    last = next((m for m in reversed(messages) if dig(m, "role") == "assistant"), None)
    if last is not None and content_text(last.get("content")).strip() == response.strip():
        return None
    return {"role": "assistant", "content": response}


def _model(doc: Mapping[str, Any]) -> Any:
    """The model name in the run's replay config (a JSON string since SWE-agent 1.0), if it has one."""
    config = doc.get("replay_config")
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError:
            return None  # an unreadable replay config only costs the model name
    return dig(config, "agent", "model", "name")
