"""Scoring a policy on tasks: the sandbox harness, one committed result at a time."""
from __future__ import annotations

import subprocess
from importlib import metadata
from pathlib import Path
from typing import Callable, Protocol, Sequence

from store.records import TaskResult

OnResult = Callable[[TaskResult], None]


class Evaluator(Protocol):
    def task_ids(self, split: str) -> list[str]:
        """The split's task ids in their fixed order."""

    def evaluate(self, policy_text: str, label: str, split: str, task_ids: Sequence[str],
                 on_result: OnResult) -> None:
        """Run the tasks; `on_result` gets each result as soon as its task finishes."""

    def close(self) -> None:
        """Release the backend."""


class HarnessEvaluator:
    """The sandbox harness with one suite and one backend kept open for the whole run."""

    def __init__(self, suite: str, agent: str, backend: str, seed: int) -> None:
        from akv_core.home import akv_home
        from sandbox.backends import open_backend
        from sandbox.suites import get_suite

        self.agent, self.seed = agent, seed
        self.suite = get_suite(suite)  # ValueError names the known suites
        self.suite.build(akv_home(), seed)
        self.backend = open_backend(backend, None)

    @property
    def suite_version(self) -> str:
        return f"{self.suite.name}@{getattr(self.suite, 'version', 'unversioned')}"

    def task_ids(self, split: str) -> list[str]:
        return [t.id for t in self.suite.tasks(split)]

    def evaluate(self, policy_text: str, label: str, split: str, task_ids: Sequence[str],
                 on_result: OnResult) -> None:
        from policy_dsl import compile_policy, parse
        from sandbox.harness import run_tasks

        if not task_ids:
            return
        policy = compile_policy(parse(policy_text), name=label)
        run_tasks(self.suite, split, policy, agent=self.agent, backend=self.backend, task_ids=list(task_ids),
                  seed=self.seed, build=False, progress=lambda r: on_result(from_harness(r)))

    def close(self) -> None:
        self.backend.close()


def from_harness(result) -> TaskResult:
    tokens = result.tokens.to_dict() if hasattr(result.tokens, "to_dict") else dict(result.tokens)
    return TaskResult(result.task_id, result.split, result.status, float(result.score), float(result.cost_usd),
                      int(result.n_requests), tokens, float(result.wall_s), getattr(result, "reason", None))


def code_version() -> str:
    """The package version plus the source commit when running from a checkout."""
    try:
        version = metadata.version("akv")
    except metadata.PackageNotFoundError:
        version = "0+unknown"
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent,
                                capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return f"{version}+{commit}" if commit else version
