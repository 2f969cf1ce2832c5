"""Trace file formats: which reader reads a file, and the checks every trace passes.

Formats (each reader's docstring, under `readers/`, says field by field what it reads and drops):

| format | reader | files |
| --- | --- | --- |
| `openai` | readers/openai.py | JSON Lines of chat histories, gateway logs of chat completions |
| `messages` | readers/openai.py | one JSON list of chat messages |
| `swe-agent` | readers/swe_agent.py | SWE-agent `.traj` |
| `mini-swe-agent` | readers/mini_swe_agent.py | mini-swe-agent 1.x and 2.x `.traj.json` |
| `tau-bench` | readers/tau_bench.py | tau-bench results: one JSON array of runs |
| `openhands` | readers/openhands.py | OpenHands event streams and evaluation `output.jsonl` |
| `anthropic` | readers/anthropic.py | Anthropic Messages requests and replies as gateways log them |
| `claude-code` | readers/claude_code.py | Claude Code session logs (`~/.claude/projects/`) |
| `adp` | readers/adp.py | Agent Data Protocol standardized trajectories |
| `otel` | readers/otel.py | OpenTelemetry GenAI chat spans (OTLP JSON) |
| `akv` | readers/akv.py | `akv traces export`, `akv proxy --record` |
| `akv-run` | runs.py | a trajectory `akv run` wrote |

Detection: the file's JSON (`reading.read_source`: one document, else JSON Lines) is offered to
every reader's `claims`; exactly one must claim it. None: `cannot tell the trace format`, at the
first line; two: both named (a bug of their claims, which the tests rule out on every example).

Every trace is checked (`model.check_trace`) and gets one request per assistant message. Actions:
`actions` ("text" or "tools") overrides the reader's; without it, a trace the reader gave as
"tools" but that has no tool call is "text" when its assistant acts in fenced blocks answered by
user messages (`actions.text_actions`), whatever the format.

Errors are TraceError `FILE:LINE: what was expected (read as FORMAT, ...)`: FILE as the caller
gave it, LINE the record's line (1 for a whole-file document, or the line of its JSON syntax
error, or where an array's element starts), and the format assumed with how to force another.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from sandbox.traces.actions import BASH_TOOL, as_tool_calls, text_actions, uses_tools
from sandbox.traces.model import Trace, TraceError, check_trace, with_requests
from sandbox.traces.readers import adp, akv, anthropic, claude_code, mini_swe_agent, openai, openhands, otel, \
    swe_agent, tau_bench
from sandbox.traces.reading import Source, extends, read_source

__all__ = ["ACTIONS", "BASH_TOOL", "FORMATS", "Located", "as_tool_calls", "detect_format", "extends",
           "read_located", "read_traces"]

ACTIONS = ("text", "tools")


@dataclass(frozen=True)
class Reader:
    """One format: whether a file is of it (`claims`) and its traces with their lines (`read`)."""

    name: str
    claims: Callable[[Source], bool]
    read: Callable[[Source], list[tuple[int, Trace]]]


@dataclass(frozen=True)
class Located:
    """A trace as read from a file: where it starts and in which format it was read."""

    line: int
    trace: Trace
    format: str


def _claims_run(source: Source) -> bool:
    records = source.records()
    first = records[0][1]
    return not source.whole and isinstance(first, dict) and first.get("type") == "task" and any(
        isinstance(r, dict) and r.get("type") == "exchange" for _, r in records)


def _read_run(source: Source) -> list[tuple[int, Trace]]:
    from sandbox.traces.runs import read_run  # it loads the trajectory format: only for an akv-run file

    return read_run(source.path, source.text)


READERS = (Reader(openai.FORMAT, openai.claims, openai.read),
           Reader(openai.MESSAGES, openai.claims_messages, openai.read_messages),
           Reader(swe_agent.FORMAT, swe_agent.claims, swe_agent.read),
           Reader(mini_swe_agent.FORMAT, mini_swe_agent.claims, mini_swe_agent.read),
           Reader(tau_bench.FORMAT, tau_bench.claims, tau_bench.read),
           Reader(openhands.FORMAT, openhands.claims, openhands.read),
           Reader(anthropic.FORMAT, anthropic.claims, anthropic.read),
           Reader(claude_code.FORMAT, claude_code.claims, claude_code.read),
           Reader(adp.FORMAT, adp.claims, adp.read),
           Reader(otel.FORMAT, otel.claims, otel.read),
           Reader(akv.FORMAT, akv.claims, akv.read),
           Reader("akv-run", _claims_run, _read_run))
FORMATS = tuple(reader.name for reader in READERS)
_BY_NAME = {reader.name: reader for reader in READERS}


def detect_format(path: Path) -> str:
    """The format of the file at `path` (one of FORMATS), from its content."""
    return _detect(read_source(path)).name


def read_traces(path: Path, format: str | None = None, actions: str | None = None) -> list[Trace]:
    """Every trace of the file, checked (`check_trace`) and with one request per assistant message."""
    return [located.trace for located in read_located(path, format, actions)]


def read_located(path: Path, format: str | None = None, actions: str | None = None) -> list[Located]:
    """The file's traces with their lines and format (`read_traces`)."""
    if format is not None and format not in _BY_NAME:
        raise TraceError(f"{path}:1: --format {format!r} is not a trace format: expected one of {', '.join(FORMATS)}")
    if actions is not None and actions not in ACTIONS:
        raise TraceError(f"{path}:1: --actions {actions!r}: expected one of {', '.join(ACTIONS)}")
    source = read_source(path)
    reader = _BY_NAME[format] if format is not None else _detect(source)
    try:
        located = reader.read(source)
        for line, trace in located:
            check_trace(trace, f"{path}:{line}")
    except TraceError as error:
        how = "as --format says" if format is not None else "detected from its content"
        raise TraceError(f"{error} (read as {reader.name}, {how}; --format FORMAT reads it as another: "
                         f"{', '.join(FORMATS)})") from error
    return [Located(line, with_requests(_with_actions(trace, actions)), reader.name) for line, trace in located]


def _with_actions(trace: Trace, actions: str | None) -> Trace:
    if actions is None:
        detected = trace.actions == "tools" and not uses_tools(trace.messages) and text_actions(trace.messages)
        return replace(trace, actions="text") if detected else trace
    return replace(trace, actions=actions)


def _detect(source: Source) -> Reader:
    claiming = [reader for reader in READERS if reader.claims(source)]
    if len(claiming) == 1:
        return claiming[0]
    line = source.records()[0][0]
    if claiming:
        raise TraceError(f"{source.path}:{line}: the file reads as any of {', '.join(r.name for r in claiming)}: "
                         "expected --format naming one")
    raise TraceError(f"{source.path}:{line}: cannot tell the trace format: expected one of {', '.join(FORMATS)} "
                     "(docs/traces.md, Getting traces in), or --format naming it")
