"""What the trace readers share (formats.py, runs.py) with the recording of the proxy's traffic
(recording.py): JSON Lines, a whole file's provenance, messages with OpenAI's keys only, and whether
one history extends another as a client resends it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from sandbox.traces.model import Message, TraceError

OPENAI_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content")


def json_lines(path: Path, text: str) -> Iterator[tuple[int, Any]]:
    """(line number, value) of each non-blank line of a JSON Lines text."""
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as error:
            raise TraceError(f"{path}:{number}: not JSON ({error.msg}): expected one JSON value a line") from error


def file_provenance(format: str, path: Path, **fields: Any) -> dict[str, Any]:
    """Provenance of a whole-file trace: format, file name, line 1, and the fields the file has."""
    return {"format": format, "file": path.name, "line": 1, **{k: v for k, v in fields.items() if v is not None}}


def openai_message(message: Any) -> Any:
    """The message with OpenAI keys only (content kept even when null); not a mapping: as it is."""
    if not isinstance(message, Mapping):
        return message
    return {key: value for key, value in message.items()
            if key in OPENAI_KEYS and (value is not None or key == "content")}


def extends(earlier: Sequence[Message], later: Sequence[Message]) -> bool:
    """Whether `later` starts with all of `earlier`, as a client would resend it.

    Messages compare by role, name, tool_call_id, content as text (null is "", text parts joined)
    and tool calls by id, name and parsed arguments; keys a client drops when it resends a reply
    (reasoning_content, refusal, annotations) do not count.
    """
    return len(earlier) <= len(later) and all(_normal(a) == _normal(b) for a, b in zip(earlier, later))


def content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part["text"] if isinstance(part, Mapping) and part.get("type") == "text" and "text" in part
                       else json.dumps(part, sort_keys=True) for part in content)
    return json.dumps(content, sort_keys=True)


def _normal(message: Any) -> Any:
    if not isinstance(message, Mapping):
        return message
    out = {key: message[key] for key in ("role", "name", "tool_call_id") if message.get(key) is not None}
    out["content"] = content_text(message.get("content"))
    out["tool_calls"] = [[dig(c, "id"), dig(c, "function", "name"), _arguments(dig(c, "function", "arguments"))]
                         if isinstance(c, Mapping) else c for c in message.get("tool_calls") or ()]
    return out


def _arguments(arguments: Any) -> Any:
    """Parsed JSON arguments, so that re-serialized arguments compare equal; other text as it is."""
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def dig(value: Any, *keys: str) -> Any:
    for key in keys:
        value = value.get(key) if isinstance(value, Mapping) else None
    return value
