"""Turning validated bugs into tasks: issue text, splits, the task manifest.

The issue text is a template that names the failing tests and pytest's messages for them.
That is easier than a real issue (which describes symptoms, often without a test), and
the docs say so. Splits are by project and by bug, from the seed: one project is held out
entirely, and a third of every other project's bugs are held out too, so `heldout` measures
both an unseen code base and unseen bugs in seen ones.
"""
from __future__ import annotations

import random
from typing import Sequence

from sandbox.suites.base import Task
from sandbox.suites.localswe.bugs import Bug
from sandbox.suites.localswe.environment import TOOLS
from sandbox.suites.localswe.hosts import Host

SPLITS = ("train", "heldout")
HELDOUT_BUG_SHARE = 3  # one bug in three of a training project is held out
MAX_LISTED_TESTS = 8

SYSTEM = (
    "You are a software engineer fixing a bug in a Python project. The repository is your working "
    "folder. Use the tools to read code, search it, run its tests and edit files. Fix the library "
    "code, not the tests. When the failing tests pass and no other test breaks, call submit()."
)


def issue_text(host: Host, bug: Bug) -> str:
    failing = bug.fail_to_pass[:MAX_LISTED_TESTS]
    more = len(bug.fail_to_pass) - len(failing)
    lines = [f"Tests fail in {host.name} {host.version}.", "",
             f"These tests fail on the current code ({len(bug.fail_to_pass)} in all):"]
    lines += [f"- {test_id}" for test_id in failing]
    if more:
        lines.append(f"- ... and {more} more")
    lines += ["", "pytest reports:"]
    lines += [f"    {test_id}: {message or '(no message)'}" for test_id, message in bug.messages[:3]]
    lines += ["", f"Other tests in {', '.join(bug.test_files)} pass and must keep passing.",
              "Run the failing tests, find the cause in the library code and fix it."]
    return "\n".join(lines)


def split_of(hosts: Sequence[Host], bugs: dict[str, list[Bug]], seed: int) -> dict[str, str]:
    """Bug id -> split. One project is held out whole; a third of each other's bugs too."""
    rng = random.Random(f"localswe-split:{seed}")
    names = sorted(h.key for h in hosts)
    heldout_host = names[rng.randrange(len(names))] if len(names) > 1 else None
    split = {}
    for key in names:
        ids = sorted(b.id for b in bugs.get(key, []))
        rng.shuffle(ids)
        for i, bug_id in enumerate(ids):
            held = key == heldout_host or i % HELDOUT_BUG_SHARE == HELDOUT_BUG_SHARE - 1
            split[bug_id] = "heldout" if held else "train"
    return split


def make_task(host: Host, bug: Bug, split: str, edition: int = 1) -> Task:
    return Task(id=f"localswe/{bug.id}", suite="localswe", split=split, system=SYSTEM,
                prompt=issue_text(host, bug), tools=TOOLS,
                meta={"host": host.key, "bug": bug.to_json(), "edition": edition})
