"""The scripted repair agent: a deterministic, non-LLM baseline for localswe.

It works like a methodical developer without insight:

1. run the failing tests named in the issue (or the whole suite if the issue is not visible);
2. localize: the library frames of the tracebacks (deepest first), then the rest of those
   functions, then the library functions the failing test calls (found with grep);
3. at each suspect line, try every single-line repair (`mutate.repairs_of_line`: flipped
   operators and conditions, indices moved by one, arguments swapped): edit, rerun the
   failing tests, keep the edit if they pass and the rest of their modules still pass,
   undo it otherwise;
4. submit when a repair holds or the attempt budget is spent.

It decides from what is visible only (AgentView.visible): every fact it uses, a traceback
or a file view, is read from a visible tool message, and a call is made again when the
message holding its answer was dropped or summarized away. What it keeps to itself is its
plan: where it has looked and what it has tried. It cannot repair a deleted statement
(nothing on screen says what was there), so its score is a floor, not a measure of models.
"""
from __future__ import annotations

import json
import re
import shlex
from typing import Any, Callable, Generator, Iterator

from sandbox.suite import AgentAction, AgentView, Task
from sandbox.suites.localswe.mutate import repairs_of_line

DEFAULT_MAX_ATTEMPTS = 24
DEFAULT_MAX_CALLS = 90  # it submits before the harness's default budget of 100 steps runs out
MAX_FUNCTION_LINES = 150
CALLEE_DEPTH = 2  # the test's callees, then theirs
_BRANCH = re.compile(r"^\s*(if|elif|while)\b|[<>=!]=|[<>]| (not )?in | is ")
_FRAME = re.compile(r"^([\w./-]+\.py):(\d+): (?:in (\w+)|\w)", re.M)
_PYTEST_TALLY = re.compile(r"\d+ (passed|failed|errors?)\b|no tests ran")
_VIEW_LINE = re.compile(r"^ *(\d+)\t(.*)$", re.M)
_CALLED = re.compile(r"\b([A-Za-z_]\w*)\s*\(")
_NOT_LIBRARY = {"assert", "print", "len", "str", "int", "float", "list", "dict", "set", "tuple", "isinstance",
                "range", "sorted", "type", "repr", "getattr", "hasattr", "super", "raises", "parametrize",
                "approx", "mark", "if", "for", "while", "return", "not", "and", "or", "in", "lambda", "def"}

Call = tuple[str, dict[str, Any]]
Script = Generator[Call | str, str | None, None]


def is_test_path(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return name.startswith("test_") or name == "conftest.py" or "/tests/" in f"/{path}" or "/test/" in f"/{path}"


def tests_passed(output: str) -> bool:
    """Whether a pytest run passed: something passed and nothing failed or errored."""
    tail = output.strip().splitlines()[-1:] or [""]
    return " passed" in tail[0] and not re.search(r"\d+ (failed|errors?)\b", tail[0])


class ScriptedRepairAgent:
    """Agent protocol implementation; one instance per task run."""

    name = "scripted"

    def __init__(self, task: Task, max_attempts: int = DEFAULT_MAX_ATTEMPTS, max_calls: int = DEFAULT_MAX_CALLS):
        self.task, self.max_attempts, self.max_calls = task, max_attempts, max_calls
        self._script = self._plan()
        self._view: AgentView | None = None
        self._pending: str | None = None
        self._calls: dict[str, Call] = {}
        self._state = 0  # 0: files as given; k: attempt k's edit is in place
        self._state_of: dict[str, int] = {}  # call id -> the state the call saw
        self._applied = 0
        self._started = False

    # -- the Agent protocol --------------------------------------------------------------

    def act(self, view: AgentView) -> AgentAction:
        self._view = view
        try:
            if not self._started:
                self._started, request = True, next(self._script)
            else:
                request = self._script.send(self._result_of(self._pending))
        except StopIteration:  # asked again after its final answer: it has nothing to add
            request = "Submitted."
        if isinstance(request, str):
            return AgentAction({"role": "assistant", "content": request}, final_answer=request)
        name, args = request
        call_id = f"call_{view.step}_{len(self._calls)}"
        self._calls[call_id] = request
        self._state_of[call_id] = self._state
        self._pending = call_id
        message = {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]}
        return AgentAction(message)

    # -- reading the visible history ---------------------------------------------------------

    def _visible_tool_messages(self) -> Iterator[tuple[str, str]]:
        for message, visible in zip(self._view.messages, self._view.visible):
            if visible and message.get("role") == "tool" and isinstance(message.get("content"), str):
                yield message.get("tool_call_id", ""), message["content"]

    def _result_of(self, call_id: str | None) -> str | None:
        return next((text for cid, text in self._visible_tool_messages() if cid == call_id), None)

    def _recall(self, call: Call) -> str | None:
        """A visible answer to the same call made while the files were as they are now."""
        for cid, text in reversed(list(self._visible_tool_messages())):
            if self._calls.get(cid) == call and self._state_of.get(cid) == self._state:
                return text
        return None

    def _visible_issue(self) -> str | None:
        for message, visible in zip(self._view.messages, self._view.visible):
            if visible and message.get("role") == "user" and isinstance(message.get("content"), str):
                return message["content"]
        return None

    # -- the plan ------------------------------------------------------------------------

    def _ask(self, name: str, args: dict[str, Any], fresh: bool = False,
             valid: Callable[[str], bool] = lambda text: True) -> Script:
        """The answer to a tool call: recalled when visible and still valid, else (re)made.

        `valid` rejects an answer that is visible but no longer says what the tool said (a
        text-mode policy may have replaced it with a summary or a placeholder).
        """
        call = (name, args)
        for _ in range(3):
            known = None if fresh else self._recall(call)
            if known is not None and valid(known):
                return known
            if len(self._calls) + 2 > self.max_calls:  # keep the last calls for undo and submit
                return ""
            answer = yield call
            if answer is not None and valid(answer):
                return answer
        return ""

    def _plan(self) -> Script:
        failing = _failing_ids(self._visible_issue() or "")
        first = yield from self._ask("run_tests", {"selector": shlex.join(failing[:3])}, fresh=True,
                                     valid=lambda text: bool(_PYTEST_TALLY.search(text)))
        failing = failing or re.findall(r"^(?:FAILED|ERROR) (\S+::\S+)", first, re.M)
        frames = [(p, int(n), fn or "") for p, n, fn in _FRAME.findall(first)]
        library = [f for f in reversed(frames) if not is_test_path(f[0])]  # deepest first
        tests = [f for f in frames if is_test_path(f[0]) and f[2]]
        stages = [("frames", [(p, n) for p, n, _ in library]), ("functions", library), ("callees", tests)]
        tried: set[tuple[str, int]] = set()
        attempts = 0
        for stage, items in stages:
            for item in items:
                suspects = [item] if stage == "frames" else (yield from self._stage_lines(stage, item))
                for path, line in suspects:
                    if (path, line) in tried or self._spent(attempts):
                        continue
                    tried.add((path, line))
                    window = yield from self._window(path, line)
                    for repair in repairs_of_line(window.get(line, ""), path, line) if line in window else []:
                        if self._spent(attempts):
                            break
                        attempts += 1
                        if (yield from self._attempt(path, line, repair.before, repair.after, window, failing)):
                            yield ("submit", {})  # its answer changes nothing: no need to see it
                            yield f"Fixed {path} line {line}; the failing tests pass."
                            return
        yield ("submit", {})  # its answer changes nothing: no need to see it
        yield f"No repair found in {attempts} attempts; submitted."

    def _spent(self, attempts: int) -> bool:
        # An attempt takes up to four calls (edit, two test runs, undo) and submit one more.
        return attempts >= self.max_attempts or len(self._calls) + 5 > self.max_calls

    def _stage_lines(self, stage: str, frame: tuple[str, int, str]) -> Script:
        if stage == "functions":
            body = yield from self._function_lines(*frame)
            return [(frame[0], n) for n in body]
        return (yield from self._callee_lines(*frame))

    # The helpers below are generators: they yield tool calls and return what they found.

    def _function_lines(self, path: str, line: int, function: str) -> Script:
        """The body of `function` (the definition at or above `line`), branch lines first."""
        hits = yield from self._ask("grep", {"pattern": rf"def {function}\(", "path": path})
        starts = [int(n) for n in re.findall(r"^(?:[\w./-]+:)?(\d+):", hits, re.M) if int(n) <= line]
        if not starts:
            return []
        window = yield from self._window(path, max(starts), before=0, after=MAX_FUNCTION_LINES)
        body = _block(window, max(starts)) if max(starts) in window else []
        return sorted(body, key=lambda n: (n != line, not _BRANCH.search(window[n]), abs(n - line)))

    def _callee_lines(self, path: str, line: int, test: str) -> Script:
        """Lines of the library functions the test calls, and of the library functions they call."""
        window = yield from self._window(path, line, before=60, after=2)
        start = max((n for n, t in window.items() if n <= line and re.match(rf"\s*def {test}\b", t)), default=line)
        names = _called_names(window.get(n, "") for n in range(start, line + 1))
        lines, seen = [], set()
        for depth in range(CALLEE_DEPTH):
            next_names = []
            for name in names:
                if name in seen:
                    continue
                seen.add(name)
                hits = yield from self._ask("grep", {"pattern": rf"def {name}\("})
                for hit_path, hit_line in re.findall(r"^([\w./-]+\.py):(\d+):", hits, re.M):
                    if not is_test_path(hit_path):
                        body = yield from self._function_lines(hit_path, int(hit_line), name)
                        lines += [(hit_path, n) for n in body]
                        view = yield from self._window(hit_path, int(hit_line), before=0, after=MAX_FUNCTION_LINES)
                        next_names += _called_names(view.get(n, "") for n in body)
            names = next_names
        return lines

    def _window(self, path: str, line: int, before: int = 12, after: int = 12) -> Script:
        """Lines around `line` as {number: text}, from a visible view or a new read_file."""
        view = yield from self._ask("read_file", {"path": path, "start": max(1, line - before), "end": line + after},
                                    valid=lambda text: bool(_VIEW_LINE.search(text)))
        return {int(n): text for n, text in _VIEW_LINE.findall(view)}

    def _attempt(self, path: str, line: int, before: str, after: str, window: dict[int, str],
                 failing: list[str]) -> Script:
        if not (yield from self._replace(path, line, before, after, window)):
            return False
        self._applied += 1
        self._state = self._applied
        quick = yield from self._ask("run_tests", {"selector": shlex.join(failing[:3])}, fresh=True)
        if tests_passed(quick):
            modules = sorted({t.split("::")[0] for t in failing})
            full = yield from self._ask("run_tests", {"selector": shlex.join(modules)}, fresh=True)
            if tests_passed(full):
                return True
        if (yield from self._replace(path, line, after, before, {**window, line: after})):
            self._state = 0
        return False

    def _replace(self, path: str, line: int, before: str, after: str, window: dict[int, str]) -> Script:
        """Edit one line, widening the context until the old text is unique; False if it never is."""
        for above, below in ((0, 0), (1, 0), (1, 1), (2, 2)):
            numbers = range(line - above, line + below + 1)
            if any(n not in window for n in numbers):
                continue
            old = "\n".join(before if n == line else window[n] for n in numbers)
            new = "\n".join(after if n == line else window[n] for n in numbers)
            answer = yield from self._ask("edit", {"path": path, "old": old, "new": new}, fresh=True)
            if answer.startswith("Edited "):
                return True
        return False


def _failing_ids(issue: str) -> list[str]:
    return re.findall(r"^- (\S+::\S.*)$", issue, re.M)


def _called_names(lines: Iterator[str]) -> list[str]:
    names: list[str] = []
    for text in lines:
        for name in _CALLED.findall(text):
            if name not in _NOT_LIBRARY and not name.startswith("test") and name not in names:
                names.append(name)
    return names


def _block(window: dict[int, str], start: int) -> list[int]:
    """Line numbers of the body of the block whose header is at `start` (by indentation)."""
    indent = len(window[start]) - len(window[start].lstrip())
    body = []
    for n in range(start + 1, max(window) + 1):
        text = window.get(n)
        if text is None:
            break
        if text.strip() and len(text) - len(text.lstrip()) <= indent:
            break
        if text.strip() and not text.strip().startswith("#"):
            body.append(n)
    return body
