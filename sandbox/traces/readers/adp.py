"""The Agent Data Protocol's standardized trajectories (`adp`): neulab/agent-data-protocol's one schema
(`schema/trajectory.py`) over a dozen public agent datasets, as its `sample_std.json` (a JSON array)
or full datasets (JSON Lines, one trajectory a line) hold them.

A trajectory is `{"schema_version", "id", "content": [...], "details", ...}`; `content` alternates
actions and observations, each with a `class_`. Read, in order, as OpenAI messages:
- `text_observation`: `source` "user" (or "user_msg") a user message; "environment" the tool
  message answering its `tool_call_id` when an earlier action made that call (or, with no ids, the
  action right before it), else a user message; "agent" an assistant message;
- `code_action`: an assistant message whose content is its `description` (the thought), with one
  tool call: `bash` with `{"command": content}` for shell languages (bash, sh, shell, console,
  commandline, zsh), else `execute_code` with `{"language", "code"}`;
- `api_action`: an assistant tool call of `function` with `kwargs` as arguments, content its
  `description`;
- `message_action`: an assistant message, its `description` (if any) and `content` joined;
- actions that follow one another with no observation between are one assistant message (parallel
  calls of one model call, as ADP splits them), so one request;
- an action's `reasoning_content` is the message's `reasoning_content`;
- `web_observation`: its accessibility tree (`axtree`), else its `html`, else its `url`, as an
  observation; `image_observation`: an observation with its text (`content`, if any).
Call ids are the actions' `tool_call_id`s, or `call_<n>` where the data has none.

Metadata: reward (the last step's `reward`, where the data has one). Provenance: schema_version,
and `details`' keys (not their values: some datasets put whole task records there). The id is the
trajectory's `id`.

Dropped: images, `available_custom_tools` and `available_code_languages` (names, not schemas),
per-step rewards but the last, an observation's `name`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from sandbox.traces.model import Message, Trace, TraceError
from sandbox.traces.reading import Source, dig

FORMAT = "adp"
_ACTIONS = ("code_action", "api_action", "message_action")
_OBSERVATIONS = ("text_observation", "web_observation", "image_observation")
_SHELLS = ("bash", "sh", "shell", "console", "commandline", "zsh")


def _is_trajectory(value: Any) -> bool:
    content = dig(value, "content")
    return isinstance(content, list) and "id" in value and bool(content) and all(
        dig(item, "class_") in _ACTIONS + _OBSERVATIONS for item in content[:5])


def claims(source: Source) -> bool:
    """ADP trajectories: a JSON array of them, JSON Lines of them, or one (`id`, `content` of `class_` items)."""
    if source.whole and isinstance(source.document, list):
        return bool(source.document) and _is_trajectory(source.document[0])
    return _is_trajectory(source.records()[0][1])


def read(source: Source) -> list[tuple[int, Trace]]:
    located = source.items() if source.whole and isinstance(source.document, list) else source.records()
    seen: dict[str, int] = {}
    out = []
    for line, record in located:
        trace = _trajectory(source.path, line, record)
        if trace.id in seen:
            raise TraceError(f"{source.path}:{line}: trajectory id {trace.id!r} is the id of the one at line "
                             f"{seen[trace.id]}: expected one trajectory per id")
        seen[trace.id] = line
        out.append((line, trace))
    return out


def _trajectory(path: Path, line: int, record: Any) -> Trace:
    if not _is_trajectory(record):
        raise TraceError(f'{path}:{line}: expected an ADP trajectory: "id" and a "content" list of actions and '
                         "observations (each with a class_)")
    messages: list[Message] = []
    open_calls: list[str] = []
    reward, calls = None, 0
    for n, item in enumerate(record["content"]):
        kind = dig(item, "class_")
        if kind in _ACTIONS:
            calls = _action(messages, item, calls, open_calls)
        elif kind in _OBSERVATIONS:
            _observation(messages, item, open_calls)
        else:
            raise TraceError(f"{path}:{line}: content item {n} has class_ {kind!r}: expected one of "
                             f"{', '.join(_ACTIONS + _OBSERVATIONS)}")
        if isinstance(dig(item, "reward"), (int, float)):
            reward = item["reward"]
    details = record.get("details")
    provenance = {"format": FORMAT, "file": path.name, "line": line,
                  **({"schema_version": record["schema_version"]} if record.get("schema_version") else {}),
                  **({"details": sorted(details)} if isinstance(details, Mapping) and details else {})}
    return Trace(str(record["id"]), tuple(messages), (), (), "tools", provenance,
                 {"reward": reward} if reward is not None else {})


def _action(messages: list[Message], item: Mapping[str, Any], calls: int, open_calls: list[str]) -> int:
    """Append the action to the assistant message it belongs to (a new one after an observation)."""
    kind, description = item["class_"], _text(item.get("description"))
    if kind == "message_action":
        text = "\n\n".join(part for part in (description, _text(item.get("content"))) if part)
        call = None
    else:
        calls += 1
        call_id = str(item.get("tool_call_id") or f"call_{calls}")
        name, arguments = _call(item)
        call = {"id": call_id, "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
        open_calls.append(call_id)
        text = description
    last = messages[-1] if messages else None
    if last is None or last["role"] != "assistant" or (call is None and last.get("tool_calls")):
        last = {"role": "assistant", "content": None}
        messages.append(last)
    if text:
        last["content"] = f"{last['content']}\n\n{text}" if last["content"] else text
    if call is not None:
        last.setdefault("tool_calls", []).append(call)
    if item.get("reasoning_content"):
        last["reasoning_content"] = item["reasoning_content"]
    return calls


def _text(value: Any) -> str:
    """A text field as text: a string as it is, nothing as "", anything else as JSON."""
    if value is None or isinstance(value, str):
        return value or ""
    return json.dumps(value, ensure_ascii=False)


def _call(item: Mapping[str, Any]) -> tuple[str, Any]:
    if item["class_"] == "api_action":
        return str(item.get("function")), item.get("kwargs") or {}
    language = str(item.get("language") or "")
    if language.lower() in _SHELLS:
        return "bash", {"command": item.get("content", "")}
    return "execute_code", {"language": language, "code": item.get("content", "")}


def _observation(messages: list[Message], item: Mapping[str, Any], open_calls: list[str]) -> None:
    kind = item["class_"]
    if kind == "web_observation":
        text = item.get("axtree") or item.get("html") or item.get("url") or ""
    else:
        text = item.get("content") if isinstance(item.get("content"), str) else ""
    source = item.get("source", "environment")
    if source in ("user", "user_msg") and not item.get("tool_call_id"):
        messages.append({"role": "user", "content": text})
        return
    if source == "agent":
        messages.append({"role": "assistant", "content": text})
        return
    call_id = item.get("tool_call_id")
    if call_id is None and open_calls:
        call_id = open_calls[0]
    if call_id in open_calls:
        open_calls.remove(call_id)
        messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
    else:
        messages.append({"role": "user", "content": text})
