"""Shared by the sandbox tests (it holds no tests itself): a fixed-trajectory agent and a small
localcomp build."""
from __future__ import annotations

import json
from pathlib import Path

from sandbox.suites.base import AgentAction, AgentView
from sandbox.suites.localcomp import LocalComp

# The full build (48 / 170 tasks) takes too long for a test; the agent and tool tests share this.
SMALL_QUOTA = {"train": 16, "heldout": 24}


def small_localcomp(home: Path, edition: int | None = None) -> LocalComp:
    """A localcomp build with SMALL_QUOTA under `home` (a no-op when it is already there);
    the default edition unless `edition` says otherwise (one folder holds one edition)."""
    built = LocalComp(quota=SMALL_QUOTA)
    built.build(home, seed=0, edition=edition)
    return built


class Reader:
    """Reads documents lc-00001.. one per step, whatever it can see, then answers: a trajectory
    that is the same under every policy, so cost differences are the policy's alone."""

    name = "reader"

    def __init__(self, n_docs: int) -> None:
        self.n_docs = n_docs

    def act(self, view: AgentView) -> AgentAction:
        if view.step >= self.n_docs:
            return AgentAction({"role": "assistant", "content": "done"}, final_answer="unknown")
        call = {"id": f"r{view.step}", "type": "function",
                "function": {"name": "get_document", "arguments": json.dumps({"docid": f"lc-{view.step + 1:05d}"})}}
        return AgentAction({"role": "assistant", "content": "", "tool_calls": [call]})
