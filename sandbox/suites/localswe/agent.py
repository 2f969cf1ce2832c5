"""The scripted repair agent: a deterministic, non-LLM baseline for localswe.

It works like a methodical developer without insight:

1. (edition 2) list the repository's files; run the failing tests' modules; read the test;
   (edition 1) run the failing tests named in the issue;
2. localize (`search.py`): the library frames of the tracebacks (deepest first), then the
   rest of those functions, then the functions the failing test calls and theirs;
3. at each suspect line, try every single-line repair (`mutate.repairs_of_line`): edit and
   rerun the failing tests in one turn (once more on their own when that output is hidden),
   then run their modules when they pass, and undo the edit otherwise;
4. submit when a repair holds, or give up when the search is done or its step budget spent.

It keeps nothing between steps: each action is decided from the messages visible under the
policy at that step (AgentView.visible) and the step number. Facts (test output, traceback
frames, file lines, grep hits) come from visible tool results; what it has already done comes
from the notes in its own visible messages (`notes.py`). When a fact it needs was dropped it
makes the call again and pays for it, the result of its last call included (a hidden newest
message is never read); an attempt needs the failing output and the code in view together.
It records the messages each step read in AgentAction.used (`recall.py`). It cannot repair
a deleted statement (nothing on screen says what was there), so its score is a floor, not a
measure of models.
"""
from __future__ import annotations

import json
import re
import shlex
from typing import Any

from sandbox.suites.base import AgentAction, AgentView, Message, Task
from sandbox.suites.localswe.notes import START, Cursor, Note
from sandbox.suites.localswe.recall import Call, Recall, View
from sandbox.suites.localswe.search import Attempt, Need, Search, tests_passed

DEFAULT_MAX_CALLS = 90  # steps it may start work in; the harness's default budget is 100
WIDTHS = ((0, 0), (1, 0), (1, 1), (2, 2))  # lines of context above and below an edited line
LOOP_CALLS = 2  # the same call for the same place made this often already: it gives up
_PROSE = {"orient": "Listing the repository's files.", "reproduce": "Running the failing tests.",
          "read": "Reading the code.", "grep": "Searching for a definition.",
          "check": "I cannot see the failing tests' output; running them again.",
          "verify": "Running the failing tests' modules again."}


class ScriptedRepairAgent:
    """Agent protocol implementation; it holds no state between steps."""

    name = "scripted"

    def __init__(self, task: Task, edition: int = 1, max_calls: int = DEFAULT_MAX_CALLS) -> None:
        self.task, self.edition, self.max_calls = task, edition, max_calls

    def act(self, view: AgentView) -> AgentAction:
        recall = Recall(view)
        action = _Step(self, recall).decide()
        return AgentAction(action.message, action.final_answer, action.gave_up, tuple(sorted(recall.used)))


class _Step:
    """One decision, from what `recall` shows."""

    def __init__(self, agent: ScriptedRepairAgent, recall: Recall) -> None:
        self.agent, self.recall = agent, recall
        issue = recall.issue()
        self.failing = re.findall(r"^- (\S+::\S.*)$", issue, re.M)
        self.modules = sorted({t.split("::")[0] for t in self.failing})
        listed = re.search(r"^Other tests in (.+) pass and must keep passing\.$", issue, re.M)
        self.verify_modules = sorted(set(self.modules) | set(listed[1].split(", ") if listed else ()))
        self.check_args = {"selector": shlex.join(self.failing[:3])}
        self.reproduce_args = {"selector": shlex.join(self.modules)} if agent.edition >= 2 else self.check_args
        self.search = Search(recall, self.reproduce_args)

    def decide(self) -> AgentAction:
        index, latest = self.recall.latest()
        if latest is None:
            return self.unseen()
        if latest.get("role") != "tool":
            if self.recall.step == 0:
                return self.explore(START)
            return self.give_up("I can no longer see what my last call answered")
        call = self.recall.call_answered_by(index)
        if (latest.get("content") or "").startswith("Submitted."):
            return self.final(call)
        if call is None or call.note is None:
            return self.give_up("I have lost track of my work")
        return self.after(call)

    def unseen(self) -> AgentAction:
        """The newest message (what its last call answered) is hidden: it goes on from that call,
        which its own visible message names, as if no answer had come, so it asks again."""
        call = self.recall.last_call()
        if call is None or call.note is None:
            return self.give_up("I have lost track of my work")
        if call.note.kind == "submit":
            return self.final(call)
        return self.after(call)

    def after(self, call: Call) -> AgentAction:
        """The next action after `call`, the agent's last one (its result None when not visible)."""
        kind = call.note.kind
        if kind == "attempt":
            return self.after_attempt(call)
        if kind == "check":
            return self.after_check(call)
        if kind == "verify":
            return self.after_verify(call)
        if kind == "undo":
            return self.after_undo(call)
        return self.explore(self._cursor())  # a read: the search fetches again what it cannot see

    # -- searching -----------------------------------------------------------------------------

    def _cursor(self) -> Cursor:
        note = self.recall.latest_note(lambda n: n.cursor is not None and bool(n.cursor.node))
        return note.cursor if note is not None else START

    def explore(self, cursor: Cursor) -> AgentAction:
        if self.recall.step + 3 > self.agent.max_calls:
            return self.give_up("my step budget is spent")
        if cursor == START and self.agent.edition >= 2:
            if not self.recall.some_note(lambda n: n.kind == "orient"):
                return self.call(Note("orient"), "list_files", {})
            need = self.search.opening()
            if need is not None:
                return self.fetch(need)
        found = self.search.advance(cursor)
        if isinstance(found, Attempt):  # width 0: the line alone, which the view always shows
            edit = _edit(found.view, found.cursor.site, found.repair.before, found.repair.after, 0)
            return self.attempt(found.cursor, found.n, 0, edit)
        if isinstance(found, Need):
            return self.fetch(found)
        return self.give_up("no repair found")

    def fetch(self, need: Need) -> AgentAction:
        """Make the call for a fact, unless it made it twice from the same place already (a loop:
        what it needs never stays in view together)."""
        def same(c: Call) -> bool:
            return c.same(need.name, need.args) and c.note is not None and c.note.kind == need.note.kind \
                and (c.note.cursor or START) == need.note.cursor

        if self.recall.count_calls(same, at_least=LOOP_CALLS):
            return self.give_up("I keep losing sight of what I need")
        return self.call(need.note, need.name, need.args)

    # -- an attempt: edit and rerun the failing tests in one turn, then verify or undo ---------

    def attempt(self, cursor: Cursor, n: int, width: int, edit: dict[str, str]) -> AgentAction:
        path, line = cursor.site
        prose = f"Trying repair {cursor.k} of {n} at {path}:{line} and rerunning the failing tests."
        return self.message(Note("attempt", cursor, n=n, width=width).line(prose),
                            [("edit", edit), ("run_tests", self.check_args)])

    def after_attempt(self, call: Call) -> AgentAction:
        edit = self.recall.latest_call(lambda c: c.index == call.index and c.name == "edit")
        if edit is None:
            return self.give_up("I cannot see whether my edit went in")
        if not (edit.result or "").startswith("Edited "):
            return self.widen(edit)
        if call.result is None:  # the edit went in, the tests' output is hidden: run them again
            return self.fetch(Need("run_tests", self.check_args,
                                   Note("check", call.note.cursor, width=edit.note.width)))
        if tests_passed(call.result or ""):
            return self.verify(call.note.cursor)
        return self.undo(edit)

    def widen(self, edit: Call) -> AgentAction:
        """The edit's old text was not unique: the same repair with more context, when a view shows it."""
        note = edit.note
        width = (note.width or 0) + 1
        before, after = _edited_line(edit.args, note.width or 0)
        view = self._context(note.cursor.site)
        change = _edit(view, note.cursor.site, before, after, width) if view and width < len(WIDTHS) else None
        if change is None:
            return self.explore(note.cursor)  # the repair counts as tried
        return self.attempt(note.cursor, note.n or 0, width, change)

    def undo(self, edit: Call) -> AgentAction:
        args = {"path": edit.args["path"], "old": edit.args["new"], "new": edit.args["old"]}
        return self.call(Note("undo", edit.note.cursor, width=edit.note.width), "edit", args,
                         "The repair does not hold; undoing it.")

    def verify(self, cursor: Cursor) -> AgentAction:
        return self.call(Note("verify", cursor), "run_tests", {"selector": shlex.join(self.verify_modules)},
                         "The failing tests pass; running their modules.")

    def after_check(self, call: Call) -> AgentAction:
        """The failing tests rerun with the attempt's edit in place: verify it or undo it."""
        if call.result is None:
            return self.fetch(Need(call.name, call.args, call.note))
        if tests_passed(call.result):
            return self.verify(call.note.cursor)
        edit = self._attempt_edit()
        return self.undo(edit) if edit is not None else self.give_up("I can no longer see the edit to undo")

    def after_verify(self, call: Call) -> AgentAction:
        if call.result is None:
            return self.fetch(Need(call.name, call.args, call.note))
        if tests_passed(call.result or ""):
            return self.submit_fixed(call.note.cursor)
        edit = self._attempt_edit()
        return self.undo(edit) if edit is not None else self.give_up("I can no longer see the edit to undo")

    def after_undo(self, call: Call) -> AgentAction:
        if call.result is None:
            return self.give_up("I cannot see whether my undo went in")
        if (call.result or "").startswith("Edited "):
            return self.explore(call.note.cursor)
        edit = self._attempt_edit()
        width = (call.note.width or 0) + 1
        view = self._context(call.note.cursor.site)
        if edit is None or view is None or width >= len(WIDTHS):
            return self.give_up("my undo did not apply")
        before, after = _edited_line(edit.args, edit.note.width or 0)
        change = _edit(view, call.note.cursor.site, after, before, width)
        if change is None:
            return self.give_up("my undo did not apply")
        return self.call(Note("undo", call.note.cursor, width=width), "edit", change,
                         "The repair does not hold; undoing it.")

    def _attempt_edit(self) -> Call | None:
        return self.recall.latest_call(lambda c: c.name == "edit" and c.note is not None
                                       and c.note.kind == "attempt", answered=False)

    def _context(self, site: tuple[str, int]) -> View | None:
        above, below = WIDTHS[-1]
        return self.recall.file_view(site[0], max(1, site[1] - above), site[1] + below)

    # -- the end -------------------------------------------------------------------------------

    def submit_fixed(self, cursor: Cursor) -> AgentAction:
        path, line = cursor.site
        return self.message(Note("submit", word="fixed").line(f"Fixed {path} line {line}; the failing tests pass."),
                            [("submit", {})])

    def give_up(self, reason: str) -> AgentAction:
        prose = f"Giving up: {reason}; submitted." if reason != "no repair found" else "No repair found; submitted."
        return self.message(Note("submit", word="gave_up").line(prose), [("submit", {})])

    def final(self, call: Call | None) -> AgentAction:
        if call is None or call.note is None:
            answer, gave_up = "Submitted.", True
        else:
            answer = (self.recall.view.messages[call.index].get("content") or "").rsplit(" [", 1)[0]
            gave_up = call.note.word != "fixed"
        return AgentAction({"role": "assistant", "content": answer}, final_answer=answer, gave_up=gave_up)

    # -- messages ------------------------------------------------------------------------------

    def call(self, note: Note, name: str, args: dict[str, Any], prose: str | None = None) -> AgentAction:
        return self.message(note.line(prose or _PROSE.get(note.kind, "Reading the code.")), [(name, args)])

    def message(self, content: str, calls: list[tuple[str, dict[str, Any]]]) -> AgentAction:
        step = self.recall.step
        message: Message = {"role": "assistant", "content": content, "tool_calls": [
            {"id": f"call_{step}_{n}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
            for n, (name, args) in enumerate(calls)]}
        return AgentAction(message)


def _edit(view: View, site: tuple[str, int], before: str, after: str, width: int) -> dict[str, str] | None:
    """An edit of line `site` from `before` to `after` with `width`'s context lines from the view."""
    path, line = site
    above, below = WIDTHS[width]
    numbers = range(line - above, line + below + 1)
    if any(n not in view.lines for n in numbers):
        return None
    old = "\n".join(before if n == line else view.lines[n] for n in numbers)
    new = "\n".join(after if n == line else view.lines[n] for n in numbers)
    return {"path": path, "old": old, "new": new}


def _edited_line(args: dict[str, Any], width: int) -> tuple[str, str]:
    """The edited line's text before and after, out of an edit made with `width`'s context."""
    above = WIDTHS[width][0]
    return args["old"].split("\n")[above], args["new"].split("\n")[above]
