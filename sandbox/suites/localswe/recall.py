"""What the scripted repair agent can see at one step, and the record of what it read.

`Recall` wraps an AgentView. Every question the agent asks (the issue, the latest message,
the result of a call, its latest note, a file view) is answered from the messages visible
under the policy at this step only (a hidden newest message is not read either), and the
indices of the messages that answered it are recorded in `used`. Questions are of the kinds
"the latest visible X", "some visible X" and "is there a visible X": their answers cannot
change when messages outside `used` are hidden, which is what makes the record exact
(AgentAction.used).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from policy_dsl.decision import SUMMARY_PREFIX
from sandbox.suites.base import AgentView, Message
from sandbox.suites.localswe.notes import Note, parse_note

_VIEW_HEADER = re.compile(r"^(\S+) \(lines (\d+)-(\d+) of (\d+)\)\n")
_VIEW_LINE = re.compile(r"^ *(\d+)\t(.*)$", re.M)


@dataclass(frozen=True)
class Call:
    """One tool call of the agent that it can still see: its message, note and (visible) result."""

    index: int  # of the assistant message
    call_id: str
    name: str
    args: dict[str, Any]
    note: Note | None
    result_index: int | None
    result: str | None

    def same(self, name: str, args: dict[str, Any]) -> bool:
        return self.name == name and self.args == args


@dataclass(frozen=True)
class View:
    """Numbered lines of a file as a visible read_file result showed them."""

    path: str
    start: int
    end: int
    length: int  # lines in the file
    lines: dict[int, str]


class Recall:
    def __init__(self, view: AgentView) -> None:
        self.view = view
        self.step = view.step
        self.used: set[int] = set()
        self._visible = [i for i, seen in enumerate(view.visible) if seen and i < len(view.messages)]
        self._calls: list[Call] | None = None

    def _message(self, i: int) -> Message:
        return self.view.messages[i]

    def use(self, *indices: int | None) -> None:
        self.used.update(i for i in indices if i is not None)

    # -- fixed points of the history ---------------------------------------------------------

    def issue(self) -> str:
        """The task's text (the first user message; protected under every policy)."""
        for i in self._visible:
            message = self._message(i)
            if message.get("role") == "user" and isinstance(message.get("content"), str):
                self.use(i)
                return message["content"]
        return ""

    def latest(self) -> tuple[int, Message | None]:
        """The newest message's index, and the message when the policy leaves it visible.

        None when it is hidden: the agent must act as if it had not come (nothing is recorded as
        used), so reading it through the back door cannot make a policy look free.
        """
        i = len(self.view.messages) - 1
        if not self.view.visible[i]:
            return i, None
        self.use(i)
        return i, self._message(i)

    def last_call(self) -> Call | None:
        """The agent's call of the previous step, when the message that made it is visible.

        That is the newest visible call whose message's tool results end the history (one result
        per call, right after it); its results themselves may be hidden. None when the message is
        hidden: an older visible call is not the last one. Its message is recorded as used.
        """
        call = next(iter(self.calls()), None)
        if call is None:
            return None
        made = len(self._message(call.index).get("tool_calls") or ())
        if call.index + made != len(self.view.messages) - 1:
            return None
        self.use(call.index)
        return call

    # -- the agent's own calls and notes -------------------------------------------------------

    def calls(self) -> list[Call]:
        """The agent's visible tool calls, newest first (nothing is recorded as used)."""
        if self._calls is None:
            results = {self._message(i).get("tool_call_id"): i for i in self._visible
                       if self._message(i).get("role") == "tool"}
            self._calls = []
            for i in reversed(self._visible):
                message = self._message(i)
                if message.get("role") != "assistant":
                    continue
                note = parse_note(message.get("content") or "")
                for call in reversed(message.get("tool_calls") or ()):
                    function = call.get("function") or {}
                    r = results.get(call.get("id"))
                    self._calls.append(Call(i, call.get("id", ""), function.get("name", ""), _arguments(function),
                                            note, r, self._message(r).get("content") if r is not None else None))
        return self._calls

    def call_answered_by(self, result_index: int) -> Call | None:
        """The visible call whose result is message `result_index`."""
        call_id = self._message(result_index).get("tool_call_id")
        call = next((c for c in self.calls() if c.call_id == call_id), None)
        if call is not None:
            self.use(call.index, result_index)
        return call

    def notes(self) -> Iterator[tuple[int, Note]]:
        """Visible notes, newest first: the agent's own messages and the summaries that kept them."""
        for i in reversed(self._visible):
            message = self._message(i)
            content = message.get("content")
            if not isinstance(content, str):
                continue
            if message.get("role") == "assistant":
                note = parse_note(content)
                if note is not None:
                    yield i, note
            elif message.get("role") == "user" and content.startswith(SUMMARY_PREFIX):
                for line in reversed(content.splitlines()):
                    note = parse_note(line)
                    if note is not None:
                        yield i, note

    def latest_note(self, keep: Callable[[Note], bool]) -> Note | None:
        found = next(((i, n) for i, n in self.notes() if keep(n)), None)
        if found is None:
            return None
        self.use(found[0])
        return found[1]

    def some_note(self, keep: Callable[[Note], bool]) -> bool:
        return self.latest_note(keep) is not None

    def latest_call(self, keep: Callable[[Call], bool], answered: bool = True) -> Call | None:
        """The newest visible call that `keep` accepts (with a visible result when `answered`)."""
        call = next((c for c in self.calls() if keep(c) and (c.result is not None or not answered)), None)
        if call is not None:
            self.use(call.index, call.result_index)
        return call

    def count_calls(self, keep: Callable[[Call], bool], at_least: int) -> bool:
        """Whether at least `at_least` visible calls (answered or not) pass `keep`; those found are used."""
        found = []
        for call in self.calls():
            if keep(call):
                found.append(call.index)
                if len(found) == at_least:
                    self.use(*found)
                    return True
        return False

    # -- facts from tool results ---------------------------------------------------------------

    def file_view(self, path: str, start: int, end: int) -> View | None:
        """A visible read_file result that shows lines start..end of `path` (as far as the file goes)."""
        for i in reversed(self._visible):
            message = self._message(i)
            content = message.get("content")
            if message.get("role") != "tool" or not isinstance(content, str):
                continue
            header = _VIEW_HEADER.match(content)
            if header is None or header[1] != path:
                continue
            first, last, length = int(header[2]), int(header[3]), int(header[4])
            if first <= start and last >= min(end, length):
                self.use(i)
                return parse_view(content)
        return None


def parse_view(text: str) -> View | None:
    header = _VIEW_HEADER.match(text)
    if header is None:
        return None
    lines = {int(n): line for n, line in _VIEW_LINE.findall(text[header.end():])}
    return View(header[1], int(header[2]), int(header[3]), int(header[4]), lines)


def _arguments(function: dict[str, Any]) -> dict[str, Any]:
    raw = function.get("arguments")
    try:
        args = json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError:
        return {}
    return args if isinstance(args, dict) else {}
