"""One live repair task: a fresh sandboxed copy of the buggy project, its tools, its grade.

Tools print what a developer would see: numbered file views, grep hits, pytest's own output
with short tracebacks. Outputs are cut at realistic sizes so a long session grows its context
the way real agents' do. Grading follows SWE-bench: the test folders are restored from the
pristine tree (an agent cannot pass by editing tests), the bug's test modules run, and the
task is resolved iff every FAIL_TO_PASS test passes and every PASS_TO_PASS test still does.
"""
from __future__ import annotations

import hashlib
import json
import re
import shlex
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Mapping

from sandbox.isolation.sandbox import Limits, PathEscape, Sandbox
from sandbox.suites.base import Grade, Task, ToolError
from sandbox.suites.localswe.bugs import Bug
from sandbox.suites.localswe.hosts import Host
from sandbox.suites.localswe.testrun import COLUMNS, TEMP_FOLDER, run_pytest

# Output kept up to 4 MiB, so that a long test log still ends with its tally when run_tests
# cuts it to its head and tail. The CPU limit is what stops runaway code (a CPU second is about
# the same on a loaded machine); the wall limit, ten times longer, is only a backstop for code
# that hangs without using CPU, and its expiry ends the task as an error (WallClockExpired)
# rather than giving the agent a result that depends on the machine's load.
TOOL_LIMITS = Limits(cpu_s=60, wall_s=600, output_bytes=4 << 20)
# How run_tests reports, per edition: edition 1 pytest's quiet dots and short tracebacks;
# edition 2 one line per test and long tracebacks (every frame's whole function), the long,
# mostly irrelevant logs of a real session.
TEST_REPORTS = {1: {"traceback": "short", "verbose": False}, 2: {"traceback": "long", "verbose": True}}
MAX_VIEW_LINES = 400
MAX_GREP_LINES = 200
MAX_LISTED_FILES = 1000
MAX_TEST_OUTPUT = 24_000  # characters kept from a test run: the head and the tail
MAX_EDIT_BYTES = 1 << 20
_HIDDEN = {"__pycache__", ".git", ".tox", ".venv", ".pytest_cache", TEMP_FOLDER}


def _params(required: dict[str, str], optional: dict[str, str] | None = None) -> dict[str, Any]:
    props = {name: {"type": kind} for name, kind in {**required, **(optional or {})}.items()}
    return {"type": "object", "properties": props, "required": list(required)}


def _tool(name: str, description: str, params: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


TOOLS = (
    _tool("list_files", "List the files under a folder of the repository (default: the root).",
          _params({}, {"path": "string"})),
    _tool("read_file", "Show a file with line numbers; `start` and `end` (1-based, inclusive) pick lines.",
          _params({"path": "string"}, {"start": "integer", "end": "integer"})),
    _tool("grep", "Search the repository (or `path`) for an extended regular expression.",
          _params({"pattern": "string"}, {"path": "string"})),
    _tool("run_tests", "Run pytest on test files or test ids separated by spaces (default: the whole suite).",
          _params({}, {"selector": "string"})),
    _tool("edit", "Replace the exact text `old` (it must occur once) with `new` in a file; "
          "an empty `old` creates a new file.", _params({"path": "string", "old": "string", "new": "string"})),
    _tool("submit", "Submit the repository in its current state for grading.", _params({})),
)


class RepairEnv:
    """The TaskEnv of one localswe task run."""

    def __init__(self, task: Task, host: Host, tree: Path, limits: Limits = TOOL_LIMITS, edition: int = 1):
        self.task, self.host, self.tree = task, host, tree
        self.report = TEST_REPORTS[edition]
        self.bug = Bug.from_json(task.meta["bug"])
        self.sandbox = Sandbox.copy_of(tree, limits)
        mutation = self.bug.mutation
        self.sandbox.write_text(mutation.path, mutation.apply((tree / mutation.path).read_text()))
        self.submitted = False
        self._tools: dict[str, Callable[..., str]] = {
            "list_files": self.list_files, "read_file": self.read_file, "grep": self.grep,
            "run_tests": self.run_tests, "edit": self.edit, "submit": self.submit,
        }

    # -- the TaskEnv protocol ------------------------------------------------------------

    def call_tool(self, name: str, arguments: Mapping[str, Any]) -> str:
        tool = self._tools.get(name)
        if tool is None:
            raise ToolError(f"unknown tool {name!r}: expected one of {', '.join(self._tools)}")
        spec = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)
        _check_arguments(name, spec, arguments)
        try:
            return tool(**arguments)
        except PathEscape as escape:
            raise ToolError(f"{name}: {escape}") from None

    def grade(self, answer: str | None) -> Grade:
        grade = self._grade()
        weakness = self.sandbox.mode.weakness  # a result obtained with the host exposed says so
        return Grade(grade.score, f"{grade.detail} (sandbox: {weakness})") if weakness else grade

    def _grade(self) -> Grade:
        for folder in self.host.tests:  # SWE-bench runs the original tests, whatever the agent did
            self.sandbox.replace_folder(folder, self.tree / folder)
        # Graded before on this tree (another policy's run that ended in the same repair): the same grade.
        key = (self.host.key, json.dumps(self.task.meta["bug"], sort_keys=True), _tree_digest(self.sandbox.root))
        known = _GRADES.get(key)
        if known is None:
            known = self._graded_run()
            if _tree_digest(self.sandbox.root) == key[-1]:
                _GRADES.put(key, known)
        return known

    def _graded_run(self) -> Grade:
        run = run_pytest(self.sandbox, self.host, list(self.bug.test_files))
        run.result.check_wall_clock("the grading test run")
        if not run.usable:
            return Grade(0.0, f"unresolved: the test run did not complete ({run.result.summary()}"
                              f"{', collection failed' if run.collection_failed else ''})")
        passed = run.passed()
        f2p = sum(t in passed for t in self.bug.fail_to_pass)
        p2p = sum(t in passed for t in self.bug.pass_to_pass)
        resolved = f2p == len(self.bug.fail_to_pass) and p2p == len(self.bug.pass_to_pass)
        return Grade(1.0 if resolved else 0.0,
                     f"{'resolved' if resolved else 'unresolved'}: FAIL_TO_PASS {f2p}/{len(self.bug.fail_to_pass)}"
                     f" pass, PASS_TO_PASS {p2p}/{len(self.bug.pass_to_pass)} pass")

    def close(self) -> None:
        self.sandbox.close()

    # -- tools ---------------------------------------------------------------------------

    def list_files(self, path: str = ".") -> str:
        folder = self.sandbox.root if path in ("", ".") else self.sandbox.resolve(path)
        if not folder.is_dir():
            raise ToolError(f"list_files: {path!r} is not a folder")
        files = sorted(p.relative_to(self.sandbox.root).as_posix() for p in folder.rglob("*")
                       if p.is_file() and not _HIDDEN & set(p.relative_to(self.sandbox.root).parts))
        shown = files[:MAX_LISTED_FILES]
        more = f"\n[... {len(files) - len(shown)} more files]" if len(files) > len(shown) else ""
        return "\n".join(shown) + more if shown else f"(no files under {path})"

    def read_file(self, path: str, start: int = 1, end: int | None = None) -> str:
        target = self.sandbox.resolve(path)
        if not target.is_file():
            raise ToolError(f"read_file: no file {path!r}")
        if end is not None and end < start:
            raise ToolError(f"read_file: end={end} is before start={start}")
        lines = target.read_text(errors="replace").splitlines()
        start = max(1, start)
        if start > len(lines):
            raise ToolError(f"read_file: {path} has {len(lines)} lines; start={start} is past the end")
        last = min(len(lines), start + MAX_VIEW_LINES - 1, end if end is not None else len(lines))
        body = "\n".join(f"{n:>6}\t{lines[n - 1]}" for n in range(start, last + 1))
        return f"{path} (lines {start}-{last} of {len(lines)})\n{body}"

    def grep(self, pattern: str, path: str = ".") -> str:
        target = "." if path in ("", ".") else self.sandbox.resolve(path).relative_to(self.sandbox.root).as_posix()
        key = ("grep", self.host.key, pattern, target, _tree_digest(self.sandbox.root))
        known = _TEST_OUTPUTS.get(key)
        if known is not None:
            return known
        # GNU grep runs in the sandbox: no regular expression can stall the harness.
        hidden = [f"--exclude-dir={name}" for name in sorted(_HIDDEN)]  # what the tree's digest leaves out
        result = self.sandbox.run(["grep", "-rnIE", *hidden, "-e", pattern, "--", target])
        result.check_wall_clock("grep")
        if result.returncode not in (0, 1):
            raise ToolError(f"grep: {result.output.strip() or result.summary()}")
        # grep walks folders in the file system's order (a hash order on ext4, another on tmpfs):
        # hits by path and line, so the output is a function of the tree on every machine.
        hits = sorted((line.removeprefix("./") for line in result.output.splitlines()), key=_hit_order)
        more = f"\n[... {len(hits) - MAX_GREP_LINES} more matches]" if len(hits) > MAX_GREP_LINES else ""
        output = "\n".join(hits[:MAX_GREP_LINES]) + more if result.returncode == 0 else f"no matches for {pattern!r}"
        _TEST_OUTPUTS.put(key, output)
        return output

    def run_tests(self, selector: str = "") -> str:
        try:
            selectors = shlex.split(selector)
        except ValueError as bad:
            raise ToolError(f"run_tests: cannot split selector {selector!r}: {bad}") from None
        for item in selectors:
            if item.startswith("-"):
                raise ToolError(f"run_tests: {item!r} is an option; give test files or test ids only")
            self.sandbox.resolve(item.split("::")[0])
        key = (self.host.key, tuple(selectors), tuple(sorted(self.report.items())), _tree_digest(self.sandbox.root))
        known = _TEST_OUTPUTS.get(key)
        if known is not None:
            return known
        run = run_pytest(self.sandbox, self.host, selectors or list(self.host.tests), report="fE", **self.report)
        output = _cut(_without_timing(run.result.output), MAX_TEST_OUTPUT)
        run.result.check_wall_clock("run_tests")
        if run.result.signal_name:
            raise ToolError(f"run_tests: the test run was {run.result.summary()}\n{output}")
        if _tree_digest(self.sandbox.root) == key[-1]:  # a run that changed the tree is not replayable
            _TEST_OUTPUTS.put(key, output)
        return output

    def edit(self, path: str, old: str, new: str) -> str:
        target = self.sandbox.resolve(path)
        if len(new.encode()) > MAX_EDIT_BYTES:
            raise ToolError(f"edit: the new text is over {MAX_EDIT_BYTES} bytes")
        if old == "" and not target.exists():
            self.sandbox.write_text(path, new)
            return f"Created {path} ({len(new.splitlines())} lines)"
        if not target.is_file():
            raise ToolError(f"edit: no file {path!r}")
        text = target.read_text(errors="replace")
        count = text.count(old) if old else 0
        if count != 1:
            what = "is empty" if not old else ("was not found" if count == 0 else f"occurs {count} times")
            raise ToolError(f"edit: the old text {what} in {path}; give text that occurs exactly once")
        at = text.index(old)
        self.sandbox.write_text(path, text[:at] + new + text[at + len(old):])
        first = text[:at].count("\n") + 1
        if first > len(target.read_text(errors="replace").splitlines()):
            return f"Edited {path}; nothing follows line {first - 1} now."
        return f"Edited {path}.\n" + self.read_file(path, max(1, first - 2), first + new.count("\n") + 2)

    def submit(self) -> str:
        self.submitted = True
        return "Submitted. The repository will be graded by running its tests; end with a final message."


def _check_arguments(name: str, spec: Mapping[str, Any], arguments: Mapping[str, Any]) -> None:
    if not isinstance(arguments, Mapping):
        raise ToolError(f"{name}: arguments must be an object")
    known = spec["properties"]
    unknown = sorted(set(arguments) - set(known))
    if unknown:
        raise ToolError(f"{name}: unknown argument(s) {', '.join(unknown)}; expected {', '.join(known) or 'none'}")
    missing = [p for p in spec["required"] if p not in arguments]
    if missing:
        raise ToolError(f"{name}: missing argument(s) {', '.join(missing)}")
    for param, value in arguments.items():
        kind = known[param]["type"]
        ok = isinstance(value, str) if kind == "string" else (isinstance(value, int) and not isinstance(value, bool))
        if not ok and not (value is None and param not in spec["required"]):
            raise ToolError(f"{name}: argument {param!r} must be a{'n' if kind == 'integer' else ''} {kind}")


class _Outputs:
    """Tool outputs (or grades) by what determines them: the host, the call (a test selection and report,
    a grep pattern and path) and the tree.

    Tests are deterministic on a given tree (hash seed fixed, ASLR off, timings and object
    addresses removed), so a run on a tree seen before answers from here: another policy's run
    of the same task, or the same agent re-running the failing tests after an undo, costs no
    test run; likewise a grade of a repair graded before.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity, self.items = capacity, OrderedDict()
        self.lock = threading.Lock()

    def get(self, key: tuple) -> Any:
        with self.lock:
            if key in self.items:
                self.items.move_to_end(key)
            return self.items.get(key)

    def put(self, key: tuple, output: Any) -> None:
        with self.lock:
            self.items[key] = output
            while len(self.items) > self.capacity:
                self.items.popitem(last=False)


_TEST_OUTPUTS = _Outputs(capacity=2048)
_GRADES = _Outputs(capacity=2048)
_TIMING = re.compile(r" in \d+(?:\.\d+)?s(?: \(\d+:\d\d:\d\d\))?(?= =| *$)", re.M)
_BANNER = re.compile(r"^=+ (.+?) =+$", re.M)
_HIT = re.compile(r"^(.*?):(\d+):")


def _without_timing(output: str) -> str:
    """pytest's report without its run time (`3 passed in 0.14s` -> `3 passed`): the same run reads the same.

    A tally centred in a line of `=` is centred again without it: its padding depended on the
    run time's digits (`in 9.87s`, `in 10.12s`).
    """
    def banner(match: re.Match) -> str:
        title = _TIMING.sub("", match.group(1))
        if title == match.group(1):
            return match.group()
        pad = "=" * max((COLUMNS - len(title) - 2) // 2, 1)
        return f"{pad} {title} {pad}"

    return _TIMING.sub("", _BANNER.sub(banner, output))


def _hit_order(hit: str) -> tuple[str, int, str]:
    """A grep hit's place: its path, then its line number (`path:line:text`)."""
    match = _HIT.match(hit)
    return (match[1], int(match[2]), hit) if match else (hit, 0, hit)


def _tree_digest(root: Path) -> str:
    """A digest of every file's path and bytes under `root`."""
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and not _HIDDEN & set(p.relative_to(root).parts)):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def _cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    head, tail = limit // 4, limit - limit // 4
    return f"{text[:head]}\n[... {len(text) - head - tail} characters cut ...]\n{text[-tail:]}"
