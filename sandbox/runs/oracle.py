"""The hindsight oracle: the cheapest cache schedule that loses no score on a recorded trajectory.

A scripted agent records, per step, which messages it read (`AgentAction.used`). From a run
under `full` (everything visible) the oracle knows every message's last use, and drops each
message right after the step that uses it last: with trigger the agent message that step
wrote, so that message and everything before it attended to it, and nothing after does. A
message no step uses goes after the first step that sees it. The system prompt and the first
user message are kept, as every policy of the language keeps them, and each drop is followed
by a reposition, as the expert's are. The latest message is never dropped (a drop's trigger
comes after it).

It is not a policy a user can deploy: it knows the future. It is the ceiling a policy can
reach on that trajectory, and it runs as a policy object in the real harness
(`decide(history, counter)`), so its score and cost are measured, not estimated. Replaying it
must reproduce the recorded actions: if the run leaves the recorded history, `decide` raises.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from policy_dsl.decision import Decision
from sandbox.backends import Backend
from sandbox.runs.harness import RunLimits, TaskOutcome, resolve_policy, run_task
from sandbox.runs.trajectory import Trajectory, read_trajectory, step_ranges
from sandbox.suites.base import Agent, Suite, Task

PROTECTED = (0, 1)  # the system prompt and the first user message
RECORDED_POLICY = "full"


class OracleError(ValueError):
    """A trajectory the oracle cannot use, or a run that left the trajectory it was made from."""


@dataclass(frozen=True)
class AgentStep:
    """One agent step as recorded: the history it saw and the messages it read."""

    messages: Sequence[Mapping[str, Any]]
    used: tuple[int, ...] | None


def drop_schedule(steps: Sequence[AgentStep]) -> dict[int, int]:
    """Message index -> drop trigger (the agent message written at the message's last use).

    Messages whose last use is the final step are absent: no request comes after it.
    """
    last_use: dict[int, int] = {}
    for number, step in enumerate(steps):
        for index in range(len(step.messages)):
            last_use.setdefault(index, number)  # first seen here, if no later step uses it
        for index in step.used or ():
            last_use[index] = max(last_use[index], number)
    return {index: len(steps[step].messages) for index, step in last_use.items()
            if index not in PROTECTED and step < len(steps) - 1}


class HindsightOracle:
    """A kv policy object replaying `drop_schedule` of one recorded task run."""

    mode = "kv"

    def __init__(self, steps: Sequence[AgentStep], task_id: str = "", reposition: bool = True,
                 name: str = "oracle") -> None:
        if not steps:
            raise OracleError(f"trajectory of {task_id or 'the task'}: no agent steps to schedule")
        self.name, self.task_id, self.reposition = name, task_id, reposition
        self.schedule = drop_schedule(steps)
        self._recorded = list(steps[-1].messages)

    @classmethod
    def from_trajectory(cls, trajectory: Trajectory, **options: Any) -> HindsightOracle:
        """From a run held in memory (`run_task`'s trajectory)."""
        steps = [AgentStep(e.request.messages, e.used) for e in trajectory.exchanges if e.purpose == "agent"]
        where = f"the trajectory of {trajectory.header.get('task_id', 'the task')}"
        return cls(_checked_steps(trajectory.header, steps, where),
                   task_id=str(trajectory.header.get("task_id", "")), **options)

    @classmethod
    def from_file(cls, path: Path, **options: Any) -> HindsightOracle:
        """From a trajectory file written by `akv run` (`trajectories/<task>.jsonl`)."""
        header, recorded = read_trajectory(path)
        steps = [AgentStep(r.request.messages, r.used) for r in recorded if r.purpose == "agent"]
        return cls(_checked_steps(header, steps, str(path)), task_id=str(header.get("task_id", "")), **options)

    def decide(self, history: Sequence[Mapping[str, Any]], counter: Any = None) -> Decision:
        """The cumulative drop_message / reposition fields for `history` (a prefix of the recorded one)."""
        n = len(history)
        if n > len(self._recorded) or any(history[i] != self._recorded[i] for i in range(n)):
            first = next((i for i in range(min(n, len(self._recorded))) if history[i] != self._recorded[i]),
                         len(self._recorded))
            raise OracleError(f"oracle of {self.task_id}: the run left the recorded trajectory at message {first}; "
                              "the agent's use records miss a message it depends on")
        drops: dict[int, list[int]] = {}
        for index, trigger in self.schedule.items():
            if trigger < n:
                drops.setdefault(trigger, []).append(index)
        drop_message = {str(t): sorted(drops[t]) for t in sorted(drops)}
        return Decision(drop_message=drop_message, reposition=sorted(drops) if self.reposition else [])


@dataclass(frozen=True)
class OracleRun:
    """One task under `full` and under its oracle; `same_actions`: the oracle run took the recorded actions."""

    full: TaskOutcome
    oracle: TaskOutcome
    same_actions: bool


def run_oracle(task: Task, suite: Suite, backend: Callable[[], Backend], *, limits: RunLimits = RunLimits(),
               seed: int = 0, reposition: bool = True, agent: Callable[[Task], Agent] | None = None) -> OracleRun:
    """Record `task` under `full` with the suite's scripted agent (or `agent`'s), then run its oracle through
    the harness.

    `backend` makes the backend of each run, `agent` the agent of each (an llm agent's use records are
    inferred). Raises OracleError when the agent records no uses.
    """
    make_agent = agent or suite.scripted_agent
    full, recorded = run_task(task, suite, resolve_policy(RECORDED_POLICY), make_agent(task), backend(),
                              limits=limits, seed=seed)
    oracle = HindsightOracle.from_trajectory(recorded, reposition=reposition)
    result, replayed = run_task(task, suite, oracle, make_agent(task), backend(), limits=limits, seed=seed)
    return OracleRun(full, result, _actions(replayed) == _actions(recorded) and (result.status, result.answer) ==
                     (full.status, full.answer))


def _actions(trajectory: Trajectory) -> list[Any]:
    """Every agent request's history: the agent's messages and the tool results they brought."""
    return [e.request.messages for e in trajectory.exchanges if e.purpose == "agent"]


def _checked_steps(header: Mapping[str, Any], steps: list[AgentStep], where: str) -> list[AgentStep]:
    """The steps, if the run was recorded under `full` with a use record on every agent step."""
    regenerate = _regenerate_command(header)
    policy = header.get("policy")
    if policy != RECORDED_POLICY:
        raise OracleError(f"{where}: recorded under policy {policy!r}; the oracle needs a run under "
                          f"{RECORDED_POLICY!r} (everything visible): {regenerate}")
    missing = [number for number, step in enumerate(steps) if step.used is None]
    if missing:
        agent = header.get("agent", "the agent")
        why = (f"agent {agent!r} did not record which messages it read (a trajectory written before "
               "use records were inferred for agents that keep none)")
        raise OracleError(f"{where}: no use records (the exchange field \"used\") on agent steps "
                          f"{step_ranges(missing)} of {len(steps)} ({why}); regenerate them with a scripted agent "
                          f"that records its uses: {regenerate}")
    return steps


def _regenerate_command(header: Mapping[str, Any]) -> str:
    suite, split, task = header.get("suite", "SUITE"), header.get("split", "SPLIT"), header.get("task_id", "TASK")
    return (f"akv run --suite {suite} --split {split} --policy {RECORDED_POLICY} --agent scripted --task {task} "
            f"(writes trajectories/{task}.jsonl under the run's folder)")
