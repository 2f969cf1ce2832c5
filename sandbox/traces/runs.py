"""`akv run` trajectories as traces (format `akv-run`): this project's own agent runs as evaluation data.

A trajectory (`sandbox/runs/trajectory.py`) records every request a task run sent, so a run of the `llm`
agent on localcomp or localswe is a real model's trace. Only the agent's requests (purpose "agent")
form it: summary calls are the harness's, not the agent's history. The trace's messages are the
last agent request's messages followed by the final assistant message: the last exchange's reply
on a generating backend; on replay (reply null: a scripted agent wrote every message) the
`result` note's answer as an assistant message's content, since that message was never sent; a
run without an answer (out of steps, an error) ends with the last request's messages, one request
fewer. Each request's usage (an OpenAI usage object, AKV's counters in `prompt_tokens_details`)
sits at the index of the assistant message it produced.

A trace is replayed as it was sent, so the recorded history must be the one every request carried:
each agent request extends the previous one by one assistant message and its observations. A text
policy rewrites the history (summaries, omissions) and a cut rule's `keep_text_drop` sends kept
text only: such trajectories are refused; record under a kv policy (`full`) instead.

The trace's id is the run's task id: two runs of one task (another policy, agent or model) go
into separate trace sets.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from sandbox.runs.cost import ReportedUsage
from sandbox.runs.trajectory import RecordedRequest, read_trajectory
from sandbox.traces.model import Message, Trace, TraceError, TraceRequest
from sandbox.traces.reading import extends, file_provenance, json_lines, openai_message

RECORD_UNDER_KV = "record under a kv policy (full) to import it"
_EXCHANGE = ('expected an exchange record: "purpose" (a string), "shared" (a count), "messages" (a list), '
             '"max_tokens" and "usage" (an object of token counts)')


@dataclass(frozen=True)
class _Step:
    """One agent request: its line in the file, the model's reply (None on replay) and the request."""

    line: int
    reply: Message | None
    recorded: RecordedRequest


def read_run(path: Path, text: str) -> list[tuple[int, Trace]]:
    """The one trace of an `akv run` trajectory file (module docstring), at the header's line."""
    header_line, header, result, located = _scan(path, text)
    recorded = _rebuilt(path)
    steps = [_Step(line, reply, r) for (line, purpose, reply), r in zip(located, recorded) if purpose == "agent"]
    if not steps:
        raise TraceError(f'{path}:{header_line}: no agent requests: expected "exchange" records with purpose "agent"')
    _check_as_sent(path, str(header.get("policy")), steps)
    last = list(steps[-1].recorded.request.messages)
    final = _final_message(steps[-1].reply, result)
    messages = (*last, final) if final is not None else tuple(last)
    requests = tuple(TraceRequest(len(s.recorded.request.messages), openai_usage(s.recorded.usage)) for s in steps
                     if len(s.recorded.request.messages) < len(messages))
    provenance = file_provenance("akv-run", path, **{key: header.get(key) for key in (
        "suite", "split", "policy", "agent", "backend", "task_id")}, status=_get(result, "status"),
        score=_get(result, "score"))
    trace_id = str(header.get("task_id") or path.stem)
    return [(header_line, Trace(trace_id, messages, tuple(steps[-1].recorded.request.tools), requests, "tools",
                                provenance))]


def openai_usage(usage: ReportedUsage) -> dict[str, Any]:
    """A request's usage as an OpenAI usage object, AKV's counters (`ReportedUsage.to_dict()`) in its details."""
    details = usage.to_dict()
    prompt, completion = details.pop("prompt_tokens"), details.pop("completion_tokens")
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": details}


def _scan(path: Path, text: str) -> tuple[int, Mapping[str, Any], Mapping[str, Any] | None,
                                          list[tuple[int, str, Message | None]]]:
    """(header line, header, result note, (line, purpose, reply) of each exchange), every record checked,
    so that `read_trajectory` meets only records it can rebuild."""
    header: tuple[int, Mapping[str, Any]] | None = None
    result, exchanges, expected_line = None, [], 1
    for number, record in json_lines(path, text):
        if number != expected_line:
            raise TraceError(f"{path}:{expected_line}: a blank line: expected one JSON record a line")
        expected_line = number + 1
        kind = record.get("type") if isinstance(record, Mapping) else None
        if header is None:
            if kind != "task":
                raise TraceError(f'{path}:{number}: expected an `akv run` trajectory: a "task" record first')
            header = (number, record)
        elif kind == "exchange":
            if not _is_exchange(record):
                raise TraceError(f"{path}:{number}: {_EXCHANGE}")
            reply = record.get("reply")
            if reply is not None and not isinstance(reply, Mapping):
                raise TraceError(f'{path}:{number}: "reply" is {reply!r:.80}: expected an assistant message or null')
            exchanges.append((number, record["purpose"], reply))
        elif kind == "result":
            result = record
        elif not isinstance(kind, str):
            raise TraceError(f'{path}:{number}: expected a trajectory record: a JSON object with a "type"')
    assert header is not None  # `json_lines` yields at least one record of a non-blank text
    return header[0], header[1], result, exchanges


def _is_exchange(record: Mapping[str, Any]) -> bool:
    shared, usage = record.get("shared"), record.get("usage")
    return (isinstance(record.get("purpose"), str) and isinstance(shared, int) and shared >= 0
            and isinstance(record.get("messages"), list) and "max_tokens" in record and isinstance(usage, Mapping)
            and all(value is None or isinstance(value, (int, float)) for value in usage.values()))


def _rebuilt(path: Path) -> list[RecordedRequest]:
    """Every full request of the file, rebuilt by the trajectory's own reader."""
    try:
        return read_trajectory(path)[1]
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        where = "" if str(error).startswith(f"{path}:") else f"{path}:1: "
        raise TraceError(f"{where}{error}: expected the requests of an `akv run` trajectory") from error


def _check_as_sent(path: Path, policy: str, steps: Sequence[_Step]) -> None:
    """TraceError unless every request carried the whole history: one assistant message and its
    observations appended to the previous request's messages, nothing rewritten, no kept text."""
    for previous, step in zip([None, *steps], steps):
        rule = step.recorded.request.drop_rule
        if isinstance(rule, Mapping) and rule.get("type") == "keep_text_drop":
            raise TraceError(f"{path}:{step.line}: recorded under policy {policy}, whose keep_text_drop requests "
                             f"send the kept text of messages, not the history; {RECORD_UNDER_KV}")
        if previous is not None and not _appends_one_turn(previous.recorded.request.messages,
                                                          step.recorded.request.messages):
            raise TraceError(f"{path}:{step.line}: recorded under text policy {policy}: the request at step "
                             f"{step.recorded.step} does not extend the previous one by an assistant message and "
                             f"its observations (the history was rewritten); {RECORD_UNDER_KV}")


def _appends_one_turn(before: Sequence[Message], now: Sequence[Message]) -> bool:
    roles = [m.get("role") if isinstance(m, Mapping) else None for m in now[len(before):]]
    return extends(before, now) and roles[:1] == ["assistant"] and "assistant" not in roles[1:]


def _final_message(reply: Message | None, result: Mapping[str, Any] | None) -> Message | None:
    """The run's last assistant message: as the agent wrote it (the result note's `final_message`),
    else the model's reply, else the answer the scripted agent gave."""
    written = _get(result, "final_message")
    if isinstance(written, Mapping):
        return {**openai_message(written), "role": "assistant", "content": written.get("content")}
    if reply is not None:
        return {**openai_message(reply), "role": "assistant", "content": reply.get("content")}
    answer = _get(result, "answer")
    return {"role": "assistant", "content": answer} if isinstance(answer, str) else None


def _get(record: Mapping[str, Any] | None, key: str) -> Any:
    return record.get(key) if record is not None else None
