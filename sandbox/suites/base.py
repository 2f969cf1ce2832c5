"""What a task suite offers the harness: tasks, live task environments and a scripted agent.

A suite (localcomp, localswe) builds its data under the data folder once, lists its
tasks per split, and opens a fresh environment for each task run. The harness drives an
agent against that environment under a cache policy and a backend.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

Message = dict[str, Any]  # an OpenAI-format chat message


class ToolError(Exception):
    """A tool call the agent got wrong (unknown tool, bad arguments, missing document).

    The harness turns it into the tool message's text so the agent can react; the run goes on.
    """


@dataclass(frozen=True)
class Task:
    """One task of a suite. `meta` holds grading data and is never shown to an agent.

    A task starts from its system prompt and one user message, or, for a recorded run (a trace),
    from `history`: every message before the first assistant message, whatever their roles.
    `max_steps` is a recorded run's own number of requests, which replaces the run's step budget.
    `meta["group"]`, where a suite sets it, names the population the task belongs to (a trace set's
    agent): trajectories and their timelines carry it, so a proposer can tell rules that hold for
    every agent of a set from rules that hold for one.
    """

    id: str
    suite: str
    split: str
    system: str
    prompt: str
    tools: tuple[Mapping[str, Any], ...]
    meta: Mapping[str, Any] = field(default_factory=dict)
    history: tuple[Message, ...] = ()
    max_steps: int | None = None

    def initial_messages(self) -> list[Message]:
        if self.history:
            return [dict(m) for m in self.history]
        return [{"role": "system", "content": self.system}, {"role": "user", "content": self.prompt}]


@dataclass(frozen=True)
class Grade:
    score: float  # 0.0 .. 1.0
    detail: str


class TaskEnv(Protocol):
    """One live run of a task: fresh state, tools, grading."""

    def call_tool(self, name: str, arguments: Mapping[str, Any]) -> str:
        """Run a tool; raise ToolError for a call the agent got wrong."""

    def grade(self, answer: str | None) -> Grade:
        """Grade the final answer (or the final state, for code repair)."""

    def close(self) -> None:
        """Release the environment's resources (temporary folders, processes)."""


class RespondingEnv(TaskEnv, Protocol):
    """An environment that answers the agent's whole message itself (a recorded run's environment
    returns the recorded tool results and user turns), instead of the harness running each tool call.
    It sees the view the agent acted on, so it can judge what was visible then."""

    def respond(self, view: "AgentView", message: Message) -> list[Message]:
        """The messages that follow the agent's `message` in the history."""


@dataclass(frozen=True)
class AgentView:
    """What an agent may see before its next step.

    `messages` is the text history as sent, less what the model cannot attend to inside a
    message: under `thinking_drop` the reasoning (`reasoning_content`) of the earlier assistant
    messages is left out, and under `text_drop` the cut text (a `keep_text_drop` request sends
    the kept messages themselves). `visible` marks, per message, whether the model can still
    attend to it under the policy (False for a message that `drop_message`, a `message_drop`
    rule or a whole `text_drop` cut dropped). In text mode the history itself is already edited (summaries, placeholders) and
    all is visible. `response` is the backend's reply to this step's request (None for the
    replay backend).
    `tools` are the tool schemas the request offered (the task's, plus `drop_context` where the
    policy acts on it).
    """

    task: Task
    messages: Sequence[Message]
    visible: Sequence[bool]
    response: Message | None
    step: int
    tools: Sequence[Mapping[str, Any]] = ()


@dataclass(frozen=True)
class AgentAction:
    """The agent's next assistant message: tool calls to run, or a final answer.

    `gave_up` marks a final answer given because the agent could not finish (its step budget
    spent, nothing found): the task's status is then `gave_up`, not `ok`. `used` lists the
    indices (into `AgentView.messages`) of the visible messages this step read to decide its
    action; None when the agent keeps no record (the llm agent, a recorded trace): the harness
    then infers one from what the message reuses (`policy_dsl/reuse.py`). A scripted agent that
    records it takes the same action when every message outside `used` is hidden.
    """

    message: Message
    final_answer: str | None = None
    gave_up: bool = False
    used: tuple[int, ...] | None = None


class Agent(Protocol):
    name: str

    def act(self, view: AgentView) -> AgentAction:
        """Choose the next assistant message from what is visible."""


class Suite(Protocol):
    """A task suite. Optionally it also has `summary_facts(messages) -> list[sandbox.runs.summarize.Fact]`:
    how the replay backend's extractive summarizer reads its messages, as a summarizing model that
    knows the suite's formats would (localcomp: `sandbox/suites/localcomp/summary.py`)."""

    name: str

    def build(self, home: Path, seed: int = 0, edition: int | None = None) -> None:
        """Create the suite's data under `home` (idempotent; fast when already built).

        `edition` picks the design of the suite's generator; None keeps the edition already built
        there with the same parameters, else builds the newest."""

    def version(self, home: Path) -> str:
        """A short stable id of the data built under `home` and its build parameters, e.g.
        `localcomp@e1-3f9a1c2b7d10` (see sandbox.suites.version); SuiteNotBuilt when missing."""

    def tasks(self, split: str) -> list[Task]:
        """The tasks of a split; raises ValueError naming the known splits for an unknown one."""

    def open(self, task: Task) -> TaskEnv:
        """A fresh environment for one run of `task`."""

    def scripted_agent(self, task: Task) -> Agent:
        """The suite's deterministic non-LLM agent for `task`."""
