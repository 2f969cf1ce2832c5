"""The record of one task run: every request (history and cache fields) and reply with usage.

Requests are stored as deltas so a long trajectory stays linear in size: each request names
how many leading messages it shares with the previous request of the same `purpose`
("agent" for the agent's steps, "summary" for text-mode summarization calls) and lists the
rest. `Trajectory.requests()` rebuilds every full request, which is what the replay
benchmark and the parity test send again.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from sandbox.backends import BackendRequest, Message
from sandbox.runs.cost import ReportedUsage


@dataclass(frozen=True)
class Exchange:
    """One request and its reply, as recorded."""

    step: int
    purpose: str  # "agent" or "summary"
    request: BackendRequest
    reply_message: Message | None
    usage: ReportedUsage
    cost_usd: float
    used: tuple[int, ...] | None = None  # the agent's use record (`AgentAction.used`); None if not recorded
    # where use records are inferred from copied strings: the messages holding each string the step
    # copied (`policy_dsl.reuse.Reuse.holders`), every one and not only the latest visible; kept in
    # memory for the run's timeline (evolve/reflection.py), not written to trajectory files
    holders: tuple[tuple[int, ...], ...] | None = None


@dataclass
class Trajectory:
    """Exchanges and notes of one task run, kept in memory and written on demand."""

    header: dict[str, Any]
    exchanges: list[Exchange] = field(default_factory=list)
    notes: list[dict[str, Any]] = field(default_factory=list)  # tool errors, edits, the result

    def add(self, exchange: Exchange) -> None:
        self.exchanges.append(exchange)

    def note(self, kind: str, **detail: Any) -> None:
        self.notes.append({"type": kind, **detail})

    def records(self) -> Iterator[dict[str, Any]]:
        """JSON-ready records: the header, then exchanges as deltas, then notes."""
        yield {"type": "task", **self.header}
        previous: dict[str, Sequence[Message]] = {}
        for ex in self.exchanges:
            before = previous.get(ex.purpose, ())
            shared = _shared_prefix(before, ex.request.messages)
            previous[ex.purpose] = ex.request.messages
            record = {
                "type": "exchange", "step": ex.step, "purpose": ex.purpose,
                "shared": shared, "messages": list(ex.request.messages[shared:]),
                "tools": list(ex.request.tools) if not before or shared == 0 else None,
                **ex.request.api_fields(), "max_tokens": ex.request.max_tokens,
                "reply": ex.reply_message, "usage": ex.usage.to_dict(), "cost_usd": ex.cost_usd,
            }
            if ex.used is not None:
                record["used"] = list(ex.used)
            yield record
        for note in self.notes:
            yield note

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8") as out:
            for record in self.records():
                out.write(json.dumps(record, ensure_ascii=False) + "\n")


def _shared_prefix(before: Sequence[Message], now: Sequence[Message]) -> int:
    shared = 0
    for old, new in zip(before, now):
        if old is not new and old != new:
            break
        shared += 1
    return shared


@dataclass(frozen=True)
class RecordedRequest:
    """A full request rebuilt from a trajectory file, with the usage and use record stored for it."""

    purpose: str
    request: BackendRequest
    usage: ReportedUsage
    step: int = 0
    used: tuple[int, ...] | None = None  # None: the file records no uses for this request


def read_trajectory(path: Path) -> tuple[dict[str, Any], list[RecordedRequest]]:
    """The header and every full request of a trajectory file, in order."""
    header: dict[str, Any] = {}
    history: dict[str, list[Message]] = {}
    tools: dict[str, Sequence[Mapping[str, Any]]] = {}
    out: list[RecordedRequest] = []
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        record = json.loads(line)
        if record.get("type") == "task":
            header = record
        if record.get("type") != "exchange":
            continue
        purpose = record["purpose"]
        messages = history.get(purpose, [])[: record["shared"]] + record["messages"]
        if record["shared"] > len(history.get(purpose, [])):
            raise ValueError(f"{path}:{line_no}: shares {record['shared']} messages with a shorter request")
        history[purpose] = messages
        if record.get("tools") is not None:
            tools[purpose] = record["tools"]
        request = BackendRequest(
            messages=messages, tools=tuple(tools.get(purpose, ())),
            drop_message=record.get("drop_message", {}), reposition=tuple(record.get("reposition", ())),
            drop_rule=record.get("drop_rule"),
            max_tokens=record["max_tokens"],
        )
        used = record.get("used")
        out.append(RecordedRequest(purpose, request, ReportedUsage.from_fields(record["usage"]),
                                   int(record.get("step", 0)), None if used is None else tuple(int(i) for i in used)))
    return header, out


def step_ranges(steps: Sequence[int], separator: str = ", ") -> str:
    """Step numbers with each run of consecutive ones as a range: '0-3, 5' for [0, 1, 2, 3, 5]."""
    parts, start = [], None
    for a, b in zip(steps, list(steps[1:]) + [None]):
        start = a if start is None else start
        if b != a + 1:
            parts.append(str(a) if start == a else f"{start}-{a}")
            start = None
    return separator.join(parts)
