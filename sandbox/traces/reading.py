"""What the trace readers share (formats.py, readers/, runs.py) with the recording of the proxy's
traffic (recording.py): a trace file's JSON (`Source`: one document, or JSON Lines), a whole file's
provenance, messages with OpenAI's keys only, and whether one history extends another as a client
resends it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from sandbox.traces.model import Message, TraceError

OPENAI_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content")


JSON_LINES_SUFFIXES = (".jsonl", ".ndjson")
TRACE_SUFFIXES = (".json", *JSON_LINES_SUFFIXES, ".traj")   # the names trace files end in


@dataclass(frozen=True)
class Source:
    """A trace file as read: the path as the caller gave it, its text, and its JSON.

    A file is one JSON document (`document`) when its text parses as one, else JSON Lines
    (`lines`: the line number and value of each non-blank line); a `.jsonl` or `.ndjson` file is
    always JSON Lines.
    """

    path: Path
    text: str
    document: Any = None
    lines: tuple[tuple[int, Any], ...] | None = None

    @property
    def whole(self) -> bool:
        """Whether the file is one JSON document."""
        return self.lines is None

    def records(self) -> Sequence[tuple[int, Any]]:
        """(line, value) of each JSON Lines record; a whole document is the one record of line 1."""
        return self.lines if self.lines is not None else ((1, self.document),)

    def items(self) -> list[tuple[int, Any]]:
        """(line, value) of each element of a document that is a JSON array (`array_items`)."""
        return array_items(self.path, self.text)


def read_source(path: Path) -> Source:
    """The file at `path` as a Source; TraceError `FILE:LINE: ...` when it is unreadable or not JSON."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise TraceError(f"{path}:1: cannot read the file ({error}): expected a UTF-8 text file") from error
    if not text.strip():
        raise TraceError(f"{path}:1: empty file: expected JSON Lines of chat histories or a trajectory JSON document")
    if path.name.endswith(JSON_LINES_SUFFIXES):
        return Source(path, text, lines=tuple(json_lines(path, text)))
    try:
        return Source(path, text, document=json.loads(text))
    except json.JSONDecodeError as error:
        if error.msg != "Extra data":  # a broken document; "Extra data": a second value follows the first
            raise TraceError(f"{path}:{error.lineno}: not JSON ({error.msg}): expected one JSON document "
                             "or JSON Lines") from error
    return Source(path, text, lines=tuple(json_lines(path, text)))


def array_items(path: Path, text: str) -> list[tuple[int, Any]]:
    """(line, value) of each element of the JSON array that `text` is, the line where it starts."""
    decoder, items = json.JSONDecoder(), []
    position, line, counted = _skip_space(text, 0), 1, 0
    if not text.startswith("[", position):
        raise TraceError(f"{path}:1: expected a JSON array")
    position = _skip_space(text, position + 1)
    while not text.startswith("]", position):
        line, counted = line + text.count("\n", counted, position), position
        try:
            value, end = decoder.raw_decode(text, position)
        except json.JSONDecodeError as error:
            raise TraceError(f"{path}:{error.lineno}: not JSON ({error.msg}): expected a JSON array") from error
        items.append((line, value))
        position = _skip_space(text, end)
        if text.startswith(",", position):
            position = _skip_space(text, position + 1)
    return items


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position] in " \t\r\n":
        position += 1
    return position


def file_stem(path: Path) -> str:
    """The file name without its format suffixes: `x.traj.json`, `x.traj`, `x.jsonl` give `x`."""
    name = path.name
    for suffix in TRACE_SUFFIXES:
        name = name.removesuffix(suffix)
    return name if name and name != path.name else path.stem


def trace_files(paths: Sequence[Path]) -> list[Path]:
    """`paths` with each folder replaced by the trace files in it (`TRACE_SUFFIXES`; sorted, at any depth;
    others, such as a README, are not trace files); TraceError naming a folder that holds none."""
    out: list[Path] = []
    for path in paths:
        if not path.is_dir():
            out.append(path)
            continue
        found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TRACE_SUFFIXES)
        if not found:
            raise TraceError(f"{path}: a folder without trace files: expected files ending in "
                             f"{', '.join(TRACE_SUFFIXES)}")
        out += found
    return out


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
