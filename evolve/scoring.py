"""Scoring a policy on tasks: the sandbox harness, one committed result at a time."""
from __future__ import annotations

import inspect
import re
import subprocess
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, Sequence

from evolve.context import TRAIN
from evolve.reflection import timeline_of
from sandbox.backends.tokens import shared_tokenizer
from sandbox.runs.progress import TaskDisplay
from store.records import TaskResult

OnResult = Callable[[TaskResult], None]
History = list[tuple[dict[str, Any], ...]]  # one task: the messages of each agent request, in order
HELDOUT = "heldout"
FRESH_FOLDER = "fresh"  # fresh builds for validation.heldout_seed: <data folder>/fresh/<suite>-seed<N>/
_FRESH_ID = re.compile(r"^(?P<task>.+)@seed(?P<seed>\d+)$")


def fresh_task_id(task_id: str, seed: int) -> str:
    """The stored id of a task of the seed-`seed` fresh build: builds with other seeds reuse the same ids."""
    return f"{task_id}@seed{seed}"


def build_of(task_id: str) -> tuple[str, int | None]:
    """(the suite's own task id, the seed of the fresh build it is from, or None for the run's own build)."""
    found = _FRESH_ID.match(task_id)
    return (found["task"], int(found["seed"])) if found else (task_id, None)


def fresh_folder(home: Path, suite: str, seed: int) -> Path:
    """The data folder a fresh build of `suite` with `seed` lives in (the suite writes its own folder inside)."""
    return Path(home) / FRESH_FOLDER / f"{suite}-seed{seed}"


@dataclass(frozen=True)
class HeldOutSource:
    """Where the held-out tasks of a validation come from, as its round records them."""

    suite_version: str  # the build they are from: the run's own, or the fresh one
    seed: int | None = None  # validation.heldout_seed
    range: tuple[int, int] | None = None  # validation.heldout_range
    left_out: int = 0  # fresh tasks left out because the run's own build holds the same question

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "range": list(self.range) if self.range else None}


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

    `heldout_seed` and `heldout_range` (validation's settings) choose the held-out tasks that
    `task_ids("heldout")` lists: those of a fresh build of the suite with another seed, in its own
    folder (`fresh_folder`; ids tagged `@seedN`, `fresh_task_id`), and/or those at the range's
    indices. `heldout` says where they come from. A tagged id is run on its fresh build whatever
    the settings, so a worker of a shared run needs none of them.
    """

    def __init__(self, suite: str, agent: str, backend: str, seed: int, recorded_version: str | None = None,
                 concurrency: int = 1, display: TaskDisplay | None = None, precision: str | None = None,
                 heldout_seed: int | None = None, heldout_range: tuple[int, int] | None = None,
                 agent_mode: str = "tools", use_records: str = "references") -> None:
        from akv_core.home import akv_home
        from sandbox.backends import check_backend_spec, open_backend
        from sandbox.runs.harness import check_use_records
        from sandbox.runs.lanes import Lanes
        from sandbox.suites import get_suite
        from sandbox.suites.version import check_recorded

        check_backend_spec(backend, concurrency)  # a malformed server list stops us before the suite is built
        self.agent, self.seed = agent, seed
        self.agent_mode, self.use_records = agent_mode, use_records
        self.suite = get_suite(suite)  # ValueError names the known suites
        self.home = home = akv_home()
        if recorded_version is None or recorded_version.endswith("@unversioned"):
            self.suite.build(home, seed)
        else:
            # Never build here: with today's defaults a build could replace the very data the run scored on.
            check_recorded(self.suite.name, self._built_version(home), recorded_version, seed, home / self.suite.name)
        self.suite_version = self.suite.version(home)
        self._fresh: dict[int, Any] = {}
        self._fresh_lanes: Any = None
        self._heldout_ids: list[str] | None = None
        self.heldout = HeldOutSource(self.suite_version)
        if heldout_seed is not None or heldout_range is not None:
            self._choose_heldout(heldout_seed, heldout_range)
        self.display = display
        if display is not None and backend == "embedded":
            display.phase("loading the model smollm2 (embedded backend)")
        self.backend = open_backend(backend, None, precision)
        try:
            try:
                check_use_records(use_records, self.backend, agent)
            except ValueError as err:
                raise ValueError(f"evaluation.{err}") from None
            self.lanes = Lanes(self.backend, concurrency)
        except ValueError:
            self.backend.close()
            raise
        self.counter = shared_tokenizer()  # the timelines' token sizes

    def _built_version(self, home: Path) -> str | None:
        from sandbox.suites.version import SuiteNotBuilt

        try:
            return self.suite.version(home)
        except SuiteNotBuilt:
            return None

    # -- the held-out tasks ---------------------------------------------------------------------
    def _choose_heldout(self, seed: int | None, span: tuple[int, int] | None) -> None:
        """The held-out ids of validation's settings (ValueError naming the setting when they cannot be had)."""
        version, left_out = self.suite_version, 0
        ids = [t.id for t in self.suite.tasks(HELDOUT)]
        if seed is not None:
            if seed == self.seed:
                raise ValueError(f"validation.heldout_seed: {seed} is the run's own seed, whose build gives the train "
                                 "and the usual held-out tasks; a fresh held-out needs another seed")
            fresh = self.fresh_suite(seed)
            version = fresh.version(fresh_folder(self.home, self.suite.name, seed))
            seen = {t.prompt for split in (TRAIN, HELDOUT) for t in self.suite.tasks(split)}
            tasks = fresh.tasks(HELDOUT)
            ids = [fresh_task_id(t.id, seed) for t in tasks if t.prompt not in seen]
            left_out = len(tasks) - len(ids)
        if span is not None:
            if span[1] > len(ids):
                raise ValueError(f"validation.heldout_range: [{span[0]}, {span[1]}) reaches past the {len(ids)} "
                                 f"held-out tasks of {version}")
            ids = ids[span[0]:span[1]]
        self._heldout_ids = ids
        self.heldout = HeldOutSource(version, seed, span, left_out)

    def fresh_suite(self, seed: int) -> Any:
        """The suite built with `seed` in its own folder under the data folder (built on first use, then kept)."""
        if seed not in self._fresh:
            self._fresh[seed] = open_fresh_build(self.suite, seed, self.home)
        return self._fresh[seed]

    def task_ids(self, split: str) -> list[str]:
        if split == HELDOUT and self._heldout_ids is not None:
            return list(self._heldout_ids)
        return [t.id for t in self.suite.tasks(split)]

    # -- running --------------------------------------------------------------------------------
    def evaluate(self, policy_text: str, label: str, split: str, task_ids: Sequence[str],
                 on_result: OnResult) -> None:
        """Run the tasks in split order, each on the build it is from; a train result carries its message
        timeline (held-out ones never do)."""
        from policy_dsl import compile_policy, parse

        if not task_ids:
            return
        policy = compile_policy(parse(policy_text), name=label)
        builds: dict[int | None, list[str]] = {}
        for task_id in task_ids:
            own, seed = build_of(task_id)
            builds.setdefault(seed, []).append(own)
        for seed, ids in builds.items():
            self._run_on(seed, policy, split, ids, on_result)

    def _run_on(self, seed: int | None, policy: Any, split: str, ids: list[str], on_result: OnResult) -> None:
        """Run `ids` of the run's own build (seed None) or of the fresh build with `seed`, ids tagged back."""
        from sandbox.runs.harness import run_tasks

        suite, lanes = (self.suite, self.lanes) if seed is None else (self.fresh_suite(seed), self._lanes_for_fresh())

        def heard(result: Any, trajectory: Any) -> None:
            # Process lanes send no trajectory back: such a result carries no timeline.
            timeline = timeline_of(trajectory, self.counter.count) if split == TRAIN and trajectory is not None else None
            task_id = result.task_id if seed is None else fresh_task_id(result.task_id, seed)
            on_result(from_harness(result, timeline, task_id))
        run_tasks(suite, split, policy, agent=self.agent, task_ids=ids, seed=self.seed, build=False,
                  traced=heard, lanes=lanes, display=self.display, agent_mode=self.agent_mode,
                  use_records=self.use_records)

    def _lanes_for_fresh(self) -> Any:
        """Process lanes open suites by name, from the data folder's own build: a fresh build's tasks run in
        this process instead (threads and a single lane use the suite object they are given)."""
        from sandbox.runs.lanes import Lanes

        if self.lanes.kind != "processes":
            return self.lanes
        if self._fresh_lanes is None:
            self._fresh_lanes = Lanes(self.backend, 1)
        return self._fresh_lanes

    def request_histories(self, policy_text: str, split: str, task_ids: Sequence[str]) -> list[History]:
        from policy_dsl import compile_policy, parse
        from sandbox.backends import open_backend
        from sandbox.runs.harness import run_task, select_tasks

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
        if self._fresh_lanes is not None:
            self._fresh_lanes.close()
        self.lanes.close()
        self.backend.close()
        for suite in self._fresh.values():
            if callable(getattr(suite, "close", None)):
                suite.close()


def open_fresh_build(suite: Any, seed: int, home: Path) -> Any:
    """A new instance of `suite`, built with `seed` (and the edition of `suite`'s own build) in its fresh folder.

    A suite says it can with `fresh_builds = True`: its build makes other tasks from another seed, in
    whichever data folder it is given, and the instance then reads that folder. Others are refused
    (ValueError naming validation.heldout_seed).
    """
    from sandbox.suites import get_suite

    if not getattr(suite, "fresh_builds", False):
        raise ValueError(f"validation.heldout_seed: suite {suite.name} cannot build its tasks again from another "
                         "seed (its data is imported or recorded, or a seed only deals the same tasks out anew); "
                         "use validation.heldout_range for held-out tasks beyond those used so far")
    fresh = get_suite(suite.name)
    options = {}
    if "edition" in inspect.signature(fresh.build).parameters and getattr(suite, "edition", None) is not None:
        options["edition"] = suite.edition
    fresh.build(fresh_folder(home, suite.name, seed), seed, **options)
    return fresh


def from_harness(result: Any, timeline: Mapping[str, Any] | None = None, task_id: str | None = None) -> TaskResult:
    """The store's record of a harness result (`task_id` replaces the result's own: a fresh build's tag)."""
    tokens = result.tokens.to_dict() if hasattr(result.tokens, "to_dict") else dict(result.tokens)
    return TaskResult(task_id or result.task_id, result.split, result.status, float(result.score),
                      float(result.cost_usd), int(result.n_requests), tokens, float(result.wall_s), getattr(result, "reason", None),
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
