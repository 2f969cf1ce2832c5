"""Bug injection and its inverse: single-line text splices found with ast."""
from __future__ import annotations

import ast

import pytest

from sandbox.suites.localswe.mutate import Mutation, bugs_in, repairs_of_line

SOURCE = '''\
"""A module docstring."""


def window(items, n):
    """Return the last n items."""
    if n <= 0:
        return []
    total = 0
    for i in range(1, len(items)):
        total += items[i] - items[0]
    result = items[-n:]
    log("window", n)
    return result if total and n < len(items) else pow(n, 2)
'''


def after_lines(kind: str) -> set[str]:
    return {m.after.strip() for m in bugs_in(SOURCE, "m.py") if m.kind == kind}


def test_each_kind_of_bug_is_found() -> None:
    assert "if n > 0:" in after_lines("flip_operator")
    assert "total += items[i] + items[0]" in after_lines("flip_operator")
    assert "if not n <= 0:" not in after_lines("invert_condition")  # a comparison gets parentheses
    assert "if not (n <= 0):" in after_lines("invert_condition")
    assert "for i in range(2, len(items)):" in after_lines("off_by_one")
    assert "total += items[i] - items[1]" in after_lines("off_by_one")
    assert "result = items[-n + 1:]" not in after_lines("off_by_one")  # -n is not a plain bound
    assert {"pass"} <= after_lines("remove_statement")
    assert 'log(n, "window")' in after_lines("swap_arguments")
    assert "return result if total and n < len(items) else pow(2, n)" in after_lines("swap_arguments")


def test_docstrings_are_never_removed_and_every_bug_still_parses() -> None:
    bugs = bugs_in(SOURCE, "m.py")
    assert not any(m.line in (1, 5) for m in bugs)
    for bug in bugs:
        ast.parse(bug.apply(SOURCE))
        assert bug.apply(SOURCE).count("\n") == SOURCE.count("\n")


def test_every_bug_but_a_removal_is_undone_by_a_repair_of_its_line_alone() -> None:
    for bug in bugs_in(SOURCE, "m.py"):
        if bug.kind != "remove_statement":
            repairs = repairs_of_line(bug.after, bug.path, bug.line)
            assert bug.before in {r.after for r in repairs}, bug


@pytest.mark.parametrize("line, expected", [
    ("    elif a == b:  # note", "    elif a != b:  # note"),
    ("        days=-values[3] + days,", "        days=-values[2] + days,"),
    ("        and x.default is not x.empty)", "        and x.default is x.empty)"),
    ("    return value[: n + 1]", "    return value[: n]"),
])
def test_repairs_work_on_fragments_of_statements(line: str, expected: str) -> None:
    assert expected in {r.after for r in repairs_of_line(line, "m.py", 7)}


def test_apply_refuses_a_line_that_changed() -> None:
    bug = Mutation("m.py", 6, "flip_operator", "    if n <= 0:", "    if n > 0:")
    assert "if n > 0:" in bug.apply(SOURCE)
    with pytest.raises(ValueError, match="m.py:6"):
        bug.apply(SOURCE.replace("n <= 0", "n < 0"))
