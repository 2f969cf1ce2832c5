"""Scoring a policy on tasks: the sandbox harness, one committed result at a time."""
from __future__ import annotations

import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, Sequence

from evolve.context import TRAIN
from evolve.reflection import timeline_of
from sandbox.backends.tokens import shared_tokenizer
from sandbox.progress import TaskDisplay
from store.records import TaskResult

OnResult = Callable[[TaskResult], None]
History = list[tuple[dict[str, Any], ...]]  # one task: the messages of each agent request, in order


class Evaluator(Protocol):
    def task_ids(self, split: str) -> list[str]:
        """The split's task ids in their fixed order."""

    def evaluate(self, policy_text: str, label: str, split: str, task_ids: Sequence[str],
                 on_result: OnResult) -> None:
        """Run the tasks; `on_result` gets each result as soon as its task finishes (train results with their
        message timeline, evolve/reflection.py)."""

    def request_histories(self, policy_text: str, split: str, task_ids: Sequence[str]) -> list[History]:
        """Per task, the histories the scripted agent sends under the policy on the replay backend."""

    def close(self) -> None:
        """Release the backend."""


class HarnessEvaluator:
    """The sandbox harness with one suite and one backend kept open for the whole run.

    A new run builds the suite if needed. A resumed run passes the suite version it recorded
    (`recorded_version`): the data folder must hold exactly that build, or a ValueError names the
    command that rebuilds it; nothing is rebuilt behind the run's back.
    """

    def __init__(self, suite: str, agent: str, backend: str, seed: int, recorded_version: str | None = None,
                 concurrency: int = 1, display: TaskDisplay | None = None, precision: str | None = None) -> None:
        from akv_core.home import akv_home
        from sandbox.backends import check_backend_spec, open_backend
        from sandbox.lanes import Lanes
        from sandbox.suite_version import check_recorded
        from sandbox.suites import get_suite

        check_backend_spec(backend, concurrency)  # a malformed server list stops us before the suite is built
        self.agent, self.seed = agent, seed
        self.suite = get_suite(suite)  # ValueError names the known suites
        home = akv_home()
        if recorded_version is None or recorded_version.endswith("@unversioned"):
            self.suite.build(home, seed)
        else:
            # Never build here: with today's defaults a build could replace the very data the run scored on.
            check_recorded(self.suite.name, self._built_version(home), recorded_version, seed, home / self.suite.name)
        self.suite_version = self.suite.version(home)
        self.display = display
        if display is not None and backend == "embedded":
            display.phase("loading the model smollm2 (embedded backend)")
        self.backend = open_backend(backend, None, precision)
        try:
            self.lanes = Lanes(self.backend, concurrency)
        except ValueError:
            self.backend.close()
            raise
        self.counter = shared_tokenizer()  # the timelines' token sizes

    def _built_version(self, home: Path) -> str | None:
        from sandbox.suite_version import SuiteNotBuilt

        try:
            return self.suite.version(home)
        except SuiteNotBuilt:
            return None

    def task_ids(self, split: str) -> list[str]:
        return [t.id for t in self.suite.tasks(split)]

    def evaluate(self, policy_text: str, label: str, split: str, task_ids: Sequence[str],
                 on_result: OnResult) -> None:
        """Run the tasks in split order; a train result carries its message timeline (held-out ones never do)."""
        from policy_dsl import compile_policy, parse
        from sandbox.harness import run_tasks

        if not task_ids:
            return
        policy = compile_policy(parse(policy_text), name=label)

        def heard(result: Any, trajectory: Any) -> None:
            # Process lanes send no trajectory back: such a result carries no timeline.
            timeline = timeline_of(trajectory, self.counter.count) if split == TRAIN and trajectory is not None else None
            on_result(from_harness(result, timeline))
        run_tasks(self.suite, split, policy, agent=self.agent, task_ids=list(task_ids), seed=self.seed, build=False,
                  traced=heard, lanes=self.lanes, display=self.display)

    def request_histories(self, policy_text: str, split: str, task_ids: Sequence[str]) -> list[History]:
        from policy_dsl import compile_policy, parse
        from sandbox.backends import open_backend
        from sandbox.harness import run_task, select_tasks

        policy = compile_policy(parse(policy_text), name="recorded")
        replay = open_backend("replay", None)  # deterministic and model-free, whatever the run's backend
        try:
            histories = []
            for task in select_tasks(self.suite, split, list(task_ids)):
                _result, trajectory = run_task(task, self.suite, policy, self.suite.scripted_agent(task), replay,
                                               seed=self.seed)
                histories.append([tuple(ex.request.messages) for ex in trajectory.exchanges if ex.purpose == "agent"])
            return histories
        finally:
            replay.close()

    def close(self) -> None:
        self.lanes.close()
        self.backend.close()


def from_harness(result, timeline: Mapping[str, Any] | None = None) -> TaskResult:
    tokens = result.tokens.to_dict() if hasattr(result.tokens, "to_dict") else dict(result.tokens)
    return TaskResult(result.task_id, result.split, result.status, float(result.score), float(result.cost_usd),
                      int(result.n_requests), tokens, float(result.wall_s), getattr(result, "reason", None),
                      timeline)


def code_version() -> str:
    """The package version plus the source commit when running from a checkout."""
    try:
        version = metadata.version("akv-agents")
    except metadata.PackageNotFoundError:
        version = "0+unknown"
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent,
                                capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return f"{version}+{commit}" if commit else version
