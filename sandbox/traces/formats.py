"""Reading recorded agent runs as traces: five file formats, their detection, and text actions as tool calls.

- `openai`: JSON Lines, one chat history a line (older function calling, an assistant `function_call`
  answered by a `function` message, read as a tool call and its tool message): `{"id", "messages", "tools", "provenance"}` (only
  `messages` required; no id: `<file stem>-<line>`) or a bare list of messages, kept as given (string,
  null or content-part content). A gateway log line may add its request's reply (`"response"`: an
  assistant message or a chat completion; or `"choices": [{"message": ...}]`), `"usage"` and
  `"latency_s"`/`"latency_ms"`: the reply is appended (OpenAI keys only), the request recorded at its
  index. A line whose history (reply included) starts with a whole earlier trace of the file
  (`extends`) continues it: the longer history replaces it, request records merge by index, the id
  stays the first line's (gateways log a completion id per request, so ids never stop this). Other
  lines start new traces, which may not reuse an id.
- `swe-agent`: a SWE-agent `.traj` (`history`, `info`, `environment`, `replay_config`). History entries
  of the first entry's `agent` become messages (OpenAI keys; a tool entry answers `tool_call_ids[0]`).
  Demonstrations (`is_demo`, message type "demonstration") are KEPT: SWE-agent sends them in every
  request, so they are part of the prefix a cache sees (counted in the provenance). Actions are
  "tools" with function calling, else "text". No per-request usage exists (`info.model_stats` is run
  totals: provenance). The id is `instance_id` if present, else the file stem: `environment` names
  the environment ("main" by default), not the run. History processors (elided observations) are
  not applied: the history is what the agent kept.
- `mini-swe-agent`: a `.traj.json` (`messages`, `info`, `trajectory_format`). Messages keep OpenAI
  keys only; an assistant message's `extra.response.usage` is its request's usage. Text actions,
  unless the run used tool calls (then `tools` is mini-swe-agent's one `bash` schema). The id is
  `instance_id` if present, else the file stem; provenance keeps exit status, model stats, model and
  version, not the submitted patch.
- `akv`: this project's JSON Lines, `Trace.to_dict()` a line, read back exactly.
- `akv-run`: a trajectory `akv run` wrote (`trajectories/<task>.jsonl`; `runs.py`): the agent's
  requests as sent, the final assistant message (the model's last reply, or on replay the run's
  answer) and each request's usage. Trajectories of text policies (rewritten histories) and of
  `keep_text_drop` cut rules (kept text only) are refused. The id is the task id.

Detection: a `.traj` or `.json` file is one JSON document, any other file JSON Lines whose first
record decides. An object with `history` is swe-agent; with `messages` and `trajectory_format` or
`info` mini-swe-agent; with `requests` and `actions` akv; a `"type": "task"` record followed by
`"type": "exchange"` records akv-run; another with `messages`, or a list, openai.

`as_tool_calls`: an assistant message's action is the last fenced block of its content (from a line
starting with ``` and an info string empty or one of bash, sh, shell, console, mswea_bash_command,
to the next line starting with ```), stripped: SWE-agent's whole command block, a multi-line `edit`
included. It becomes the message's one call `call_<n>` (n from 1) to `bash` with arguments
`{"command": ...}`; the content keeps the text outside the block (the thought, not the command
twice). The user message directly after it is its observation: the tool message answering it (same
content, `name` "bash"). Any other user message (the task, a human turn, the reply to a message
without an action) stays, and so does an assistant message without an action. Indices do not change.

Errors are TraceError `FILE:LINE: what was expected`: FILE as the caller gave it, LINE the JSON Lines
line (1 for a whole-file JSON document, or the line of its JSON syntax error).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

from sandbox.traces.model import Message, Trace, TraceError, TraceRequest, check_trace, with_requests
from sandbox.traces.reading import content_text, dig, extends, file_provenance, json_lines, openai_message

FORMATS = ("openai", "swe-agent", "mini-swe-agent", "akv", "akv-run")
BASH_TOOL: Mapping[str, Any] = {"type": "function", "function": {
    "name": "bash", "description": "Execute a bash command", "parameters": {
        "type": "object", "required": ["command"],
        "properties": {"command": {"type": "string", "description": "The bash command to execute"}}}}}
_ACTION_LANGUAGES = ("", "bash", "sh", "shell", "console", "mswea_bash_command")
_FENCE = re.compile(r"^```([\w-]*)[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def detect_format(path: Path) -> str:
    """The format of the file at `path` (one of FORMATS), from its name and content."""
    return _detect(path, _read(path))


def read_traces(path: Path, format: str | None = None) -> list[Trace]:
    """Every trace of the file, checked (`check_trace`) and with one request per assistant message."""
    if format is not None and format not in FORMATS:
        raise TraceError(f"{path}: unknown trace format {format!r}; expected one of {', '.join(FORMATS)}")
    text = _read(path)
    located = _READERS[format or _detect(path, text)](path, text)
    for line, trace in located:
        check_trace(trace, f"{path}:{line}")
    return [with_requests(trace) for _, trace in located]


def as_tool_calls(trace: Trace) -> Trace:
    """The text-action trace in tool-call form (module docstring); a "tools" trace unchanged."""
    if trace.actions != "text":
        return trace
    messages: list[Message] = []
    calls = 0
    pending: str | None = None  # the call of the previous message, until its observation
    for message in trace.messages:
        if message.get("role") == "user" and pending is not None:
            messages.append({"role": "tool", "tool_call_id": pending, "name": "bash",
                             "content": message.get("content")})
            pending = None
            continue
        pending = None
        action = _split_action(message.get("content")) if message.get("role") == "assistant" else None
        if action is None:
            messages.append(message)
            continue
        calls += 1
        pending = f"call_{calls}"
        function = {"name": "bash", "arguments": json.dumps({"command": action[1]})}
        messages.append({**message, "content": action[0],
                         "tool_calls": [{"id": pending, "type": "function", "function": function}]})
    converted = Trace(trace.id, tuple(messages), (BASH_TOOL,), trace.requests, "tools",
                      {**trace.provenance, "converted_from": "text"})
    check_trace(converted, f"trace {trace.id!r} in tool-call form")
    return with_requests(converted)


def _split_action(content: Any) -> tuple[str, str] | None:
    """(text outside the action block, command) of an assistant message, or None without an action."""
    text = content_text(content)
    found = None
    for match in _FENCE.finditer(text):
        if match.group(1).lower() in _ACTION_LANGUAGES and match.group(2).strip():
            found = match
    if found is None:
        return None
    outside = [part for part in (text[:found.start()].rstrip(), text[found.end():].strip()) if part]
    return "\n\n".join(outside), found.group(2).strip()


def _read(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise TraceError(f"{path}:1: cannot read the file ({error}): expected a UTF-8 text file") from error
    if not text.strip():
        raise TraceError(f"{path}:1: empty file: expected JSON Lines of chat histories or a trajectory JSON document")
    return text


def _detect(path: Path, text: str) -> str:
    whole = path.name.endswith((".traj", ".json"))
    line, record = (1, _load(path, text)) if whole else next(json_lines(path, text))
    kind = _classify(record)
    if kind == "akv-run" and not any(dig(r, "type") == "exchange" for _, r in json_lines(path, text)):
        kind = None  # a task header alone: no run to import
    if kind is None or (whole and kind not in ("swe-agent", "mini-swe-agent")):
        raise TraceError(f'{path}:{line}: cannot tell the trace format: expected a trajectory object ("history", or '
                         '"messages" with "info"), JSON Lines of chat histories (objects with "messages", or lists) '
                         'or an `akv run` trajectory (a "task" record, then "exchange" records)')
    return kind


def _classify(record: Any) -> str | None:
    if isinstance(record, list):
        return "openai"
    if not isinstance(record, Mapping):
        return None
    if record.get("type") == "task":
        return "akv-run"
    if "history" in record:
        return "swe-agent"
    if "messages" in record and ("trajectory_format" in record or "info" in record):
        return "mini-swe-agent"
    if "requests" in record and "actions" in record:
        return "akv"
    return "openai" if "messages" in record else None


def _load(path: Path, text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise TraceError(f"{path}:{error.lineno}: not JSON ({error.msg}): expected one JSON document") from error


def _stem(path: Path) -> str:
    """The file name without its format suffixes: `x.traj.json`, `x.traj`, `x.jsonl` give `x`."""
    name = path.name.removesuffix(".json").removesuffix(".traj")
    return name if name and name != path.name else path.stem


def _read_openai(path: Path, text: str) -> list[tuple[int, Trace]]:
    traces: list[tuple[int, Trace]] = []
    for number, record in json_lines(path, text):
        trace = _openai_line(path, number, record)
        check_trace(trace, f"{path}:{number}")
        continued = [i for i, (_, earlier) in enumerate(traces) if extends(earlier.messages, trace.messages)]
        if continued:
            i = max(continued, key=lambda k: len(traces[k][1].messages))
            traces[i] = (traces[i][0], _continue(traces[i][1], trace, number))
            continue
        for first, earlier in traces:
            if earlier.id == trace.id:
                raise TraceError(f"{path}:{number}: id {trace.id!r} already names the trace of line {first}, which "
                                 "this line does not continue: expected a new id or a history starting with that trace")
        traces.append((number, trace))
    return traces


def _openai_line(path: Path, number: int, record: Any) -> Trace:
    where = f"{path}:{number}"
    if isinstance(record, list):
        record = {"messages": record}
    if not isinstance(record, Mapping) or not isinstance(record.get("messages"), list):
        raise TraceError(f'{where}: expected a JSON object with a "messages" list, or a JSON list of messages')
    messages, requests = _legacy_functions(list(record["messages"])), ()
    reply, usage = _reply(where, record)
    latency = _latency(where, record)
    if reply is not None:
        messages.append(reply)
    if reply is not None or usage is not None or latency is not None:
        if not messages or not isinstance(messages[-1], Mapping) or messages[-1].get("role") != "assistant":
            raise TraceError(f'{where}: usage or latency without a reply: expected "response" or "choices" '
                             "with the assistant message, or a history ending with it")
        if usage is not None and not isinstance(usage, Mapping):
            raise TraceError(f'{where}: "usage" is {usage!r}: expected a JSON object (OpenAI usage)')
        requests = (TraceRequest(len(messages) - 1, usage, latency),)
    tools = record.get("tools") or []
    if not isinstance(tools, list):
        raise TraceError(f'{where}: "tools" is {tools!r}: expected a list of tool schemas')
    provenance = {"model": record["model"]} if isinstance(record.get("model"), str) else {}
    if isinstance(record.get("provenance"), Mapping):
        provenance.update(record["provenance"])
    provenance.update({"format": "openai", "file": path.name, "line": number})
    trace_id = str(record.get("id") or f"{_stem(path)}-{number}")
    return Trace(trace_id, tuple(messages), tuple(tools), requests, "tools", provenance)


def _legacy_functions(messages: list[Any]) -> list[Any]:
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


def _latency(where: str, record: Mapping[str, Any]) -> float | None:
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
                 "tools", provenance)


def _uses_tools(messages: Sequence[Any]) -> bool:
    return any(dig(m, "tool_calls") or dig(m, "role") == "tool" for m in messages)


def _read_swe_agent(path: Path, text: str) -> list[tuple[int, Trace]]:
    doc = _load(path, text)
    history = doc.get("history") if isinstance(doc, Mapping) else None
    if not isinstance(history, list):
        raise TraceError(f'{path}:1: expected a SWE-agent trajectory: a JSON object with a "history" list')
    agent = dig(history[0], "agent") if history else None
    entries = [entry for entry in history if dig(entry, "agent") in (None, agent)]
    messages = tuple(_swe_message(entry) for entry in entries)
    demos = sum(1 for e in entries if dig(e, "is_demo") or dig(e, "message_type") == "demonstration")
    info = doc.get("info")
    provenance = file_provenance("swe-agent", path, environment=doc.get("environment"), model=_swe_model(doc),
                                  exit_status=dig(info, "exit_status"), model_stats=dig(info, "model_stats"),
                                  swe_agent_version=dig(info, "swe_agent_version"), demonstration_messages=demos)
    actions = "tools" if _uses_tools(messages) else "text"
    return [(1, Trace(str(doc.get("instance_id") or _stem(path)), messages, (), (), actions, provenance))]


def _swe_message(entry: Any) -> Any:
    """The OpenAI message of a SWE-agent history entry; a tool entry answers its `tool_call_ids[0]`."""
    message = openai_message(entry)
    ids = dig(entry, "tool_call_ids")
    if dig(message, "role") == "tool" and "tool_call_id" not in message and isinstance(ids, list) and ids:
        message["tool_call_id"] = ids[0]
    return message


def _swe_model(doc: Mapping[str, Any]) -> Any:
    """The model name in the run's replay config (a JSON string since SWE-agent 1.0), if it has one."""
    config = doc.get("replay_config")
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError:
            return None  # an unreadable replay config only costs the model name
    return dig(config, "agent", "model", "name")


def _read_mini_swe_agent(path: Path, text: str) -> list[tuple[int, Trace]]:
    doc = _load(path, text)
    raw = doc.get("messages") if isinstance(doc, Mapping) else None
    if not isinstance(raw, list):
        raise TraceError(f'{path}:1: expected a mini-swe-agent trajectory: a JSON object with a "messages" list')
    messages = tuple(openai_message(m) for m in raw)
    requests = tuple(TraceRequest(i, dig(m, "extra", "response", "usage")) for i, m in enumerate(raw)
                     if dig(m, "role") == "assistant" and isinstance(dig(m, "extra", "response", "usage"), Mapping))
    info = doc.get("info")
    provenance = file_provenance("mini-swe-agent", path, trajectory_format=doc.get("trajectory_format"),
                                  model=dig(info, "config", "model", "model_name"),
                                  mini_version=dig(info, "mini_version"), exit_status=dig(info, "exit_status"),
                                  model_stats=dig(info, "model_stats"))
    actions = "tools" if _uses_tools(messages) else "text"
    tools = (BASH_TOOL,) if actions == "tools" else ()
    return [(1, Trace(str(doc.get("instance_id") or _stem(path)), messages, tools, requests, actions, provenance))]


def _read_akv(path: Path, text: str) -> list[tuple[int, Trace]]:
    return [(number, _akv_trace(f"{path}:{number}", record)) for number, record in json_lines(path, text)]


def _akv_trace(where: str, record: Any) -> Trace:
    expected = "expected a trace record (Trace.to_dict(): id, messages, requests, actions)"
    if not isinstance(record, Mapping):
        raise TraceError(f"{where}: {expected}")
    try:
        requests = tuple(TraceRequest.from_dict(r) for r in record["requests"])
        trace = Trace(record["id"], tuple(record["messages"]), tuple(record.get("tools", ())), requests,
                      record["actions"], dict(record.get("provenance", {})))
    except (KeyError, TypeError, AttributeError, ValueError) as error:
        raise TraceError(f"{where}: {expected}; {type(error).__name__}: {error}") from error
    if not isinstance(trace.id, str) or trace.actions not in ("tools", "text"):
        raise TraceError(f"{where}: id {trace.id!r}, actions {trace.actions!r}: "
                         'expected a string id and actions "tools" or "text"')
    stray = sorted({r.index for r in requests} - set(trace.assistant_indices()))
    if stray:
        raise TraceError(f"{where}: requests at {stray} name no assistant message: expected one per assistant message")
    return trace


def _read_akv_run(path: Path, text: str) -> list[tuple[int, Trace]]:
    from sandbox.traces.runs import read_run  # it loads the trajectory format: only for an akv-run file

    return read_run(path, text)


_READERS = {"openai": _read_openai, "swe-agent": _read_swe_agent, "mini-swe-agent": _read_mini_swe_agent,
            "akv": _read_akv, "akv-run": _read_akv_run}
