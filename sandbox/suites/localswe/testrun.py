"""Running a host's pytest suite inside a sandbox and reading per-test outcomes.

Outcomes come from pytest's `-rA` short summary (`PASSED id`, `FAILED id - message`,
`ERROR id - message`, ...). A run whose collection failed, or that timed out, reports no
outcomes: every test it should have run counts as not passing.
"""
from __future__ import annotations

import re
import shutil
import sys
from dataclasses import dataclass, field, replace
from typing import Sequence

from sandbox.isolation.sandbox import CommandResult, Sandbox
from sandbox.suites.localswe.hosts import Host

_SUMMARY = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS) (\S.*?)(?: - (.*))?$")
# CPython's default repr (<... at 0x7ffff5fb3100>) and hosts' own (sqlparse: <Statement '...' at 0x7FFFF5F8DC50>)
_ADDRESS = re.compile(r"(?<= at )0x[0-9a-fA-F]{4,16}(?=>)")
MASKED_ADDRESS = "0x000000000000"
_COLLECTION = re.compile(r"Interrupted: \d+ errors? during collection|^ERROR collecting ", re.M)


@dataclass(frozen=True)
class TestRun:
    result: CommandResult
    outcomes: dict[str, str] = field(default_factory=dict)  # test id -> PASSED / FAILED / ERROR / ...
    messages: dict[str, str] = field(default_factory=dict)  # test id -> the summary's message

    @property
    def collection_failed(self) -> bool:
        return bool(_COLLECTION.search(self.result.output))

    @property
    def usable(self) -> bool:
        """Whether the outcomes can be trusted: no timeout, no kill, collection went through."""
        return not self.result.timed_out and self.result.returncode in (0, 1) and not self.collection_failed

    def passed(self) -> set[str]:
        return {t for t, o in self.outcomes.items() if o in ("PASSED", "XFAIL")} if self.usable else set()

    def failed(self) -> set[str]:
        return {t for t, o in self.outcomes.items() if o in ("FAILED", "ERROR")}


COLUMNS = 160  # pytest's terminal width: wide enough that summary messages are not cut to "..."
TEMP_FOLDER = ".pytest-tmp"  # in the repository copy: tmp_path and friends of each run, made afresh
# Our interpreter's library folders (the checkout's virtual environment, the base install) as
# tracebacks show them, and the one conventional place they are shown at instead.
_PYTHON_LIB = f"lib/python{sys.version_info[0]}.{sys.version_info[1]}/"
_PYTHON_PATHS = sorted({f"{p}/{_PYTHON_LIB}" for p in (sys.prefix, sys.base_prefix)}, key=len, reverse=True)


def masked_addresses(output: str) -> str:
    """Object addresses of reprs (`<function f at 0x7ffff5fb3100>`) replaced by `0x000000000000`.

    Even with address randomization off they differ from one sandbox to the next (the copy's
    path changes the interpreter's allocations), so the same tree would give another output,
    other token counts and another cost in every process. Numbering them by first appearance is
    not enough: whether a freed object's address is reused by the next one differs too, so two
    runs number different sets of objects. Masked, the output is a function of the tree. Hex
    digits in either case count (a host's own repr may print `%X`, as sqlparse's does).
    """
    return _ADDRESS.sub(MASKED_ADDRESS, output)


def pytest_argv(selectors: Sequence[str], report: str = "A", traceback: str = "short",
                verbose: bool = False) -> list[str]:
    return [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"-r{report}", f"--tb={traceback}",
            "-v" if verbose else "-q", "-o", "console_output_style=classic", f"--basetemp={TEMP_FOLDER}/run",
            *selectors]


def run_pytest(sandbox: Sandbox, host: Host, selectors: Sequence[str], wall_s: float | None = None,
               report: str = "A", traceback: str = "short", verbose: bool = False) -> TestRun:
    """Run pytest on `selectors` (test files or ids) in the sandbox's copy of `host`."""
    env = {
        "PYTHONPATH": str(sandbox.root / host.pythonpath),
        # No bytecode: an edit that keeps a file's size within the same second would otherwise
        # run the stale compiled module.
        "PYTHONDONTWRITEBYTECODE": "1",
        # The hosts need no third-party pytest plugins, and loading every plugin installed in
        # our environment costs about a second of CPU per run (most of a small test run).
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        "COLUMNS": str(COLUMNS),
    }
    # pytest's own temporary root (/tmp/pytest-of-USER) belongs to whichever command uid made
    # it first and refuses every later one: each run gets a fresh one inside the copy instead.
    temp = sandbox.root / TEMP_FOLDER
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir()
    temp.chmod(0o2775)  # the sandbox's group writes here, whichever uid runs the command
    result = sandbox.run(pytest_argv(selectors, report, traceback, verbose), env=env, wall_s=wall_s)
    # Paths relative to the repository, and our interpreter's files by their place in it: the
    # temporary folder's and the checkout's names would make outputs (and issue texts) differ.
    output = result.output.replace(f"{sandbox.root}/", "").replace(str(sandbox.root), ".")
    output = output.replace(sys.executable, f"/usr/bin/python{sys.version_info[0]}")
    for prefix in _PYTHON_PATHS:
        output = output.replace(prefix, f"/usr/{_PYTHON_LIB}")
    result = replace(result, output=masked_addresses(output))
    outcomes, messages = {}, {}
    for line in result.output.splitlines():
        match = _SUMMARY.match(line)
        if match:
            outcome, test_id, message = match.groups()
            outcomes[test_id] = outcome
            if message:
                messages[test_id] = message
    return TestRun(result, outcomes, messages)
