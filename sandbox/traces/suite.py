"""A stored trace set as a suite: recorded agent runs replayed under a policy, scored by fidelity.

Each trace is one task. Its run starts from the messages before the first assistant message;
at each step the request (the history so far, with the policy's cache fields) goes to the
backend, the recorded assistant message is the agent's action (billed as output), and the
environment answers with what followed it in the recording (tool results, user turns). So a
policy is scored on exactly the requests the real agent made, and text policies edit the same
history through the harness's editor.

The score is *fidelity*: of the reuses of a trace (distinctive content an assistant message
copied from earlier messages after the task, `policy_dsl/reuse.py`), the share whose content some
message still visible to the model held when it was reused; 1.0 for a trace without reuses.
Every holder counts, whatever its role: a policy that hides the agent's own messages or the
user's turns loses what only they held, as one that hides tool results does. Traces
are split train / held-out by a seeded hash of their id, so adding traces never moves one.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Mapping, Sequence

from akv_core.chat import content_text
from policy_dsl.reuse import Reuse, ReuseFinder, common_items, used_indices

from sandbox.suites.base import AgentAction, AgentView, Grade, Message, Task
from sandbox.traces.actions import as_tool_calls
from sandbox.traces.model import Trace
from sandbox.traces.records import trace_of

SPLITS = ("train", "heldout")
HELDOUT_SHARE = 0.5
EDITION = 1  # the design of this suite: split rule, score, use records


def split_of(key: str, seed: int = 0) -> str:
    """train or heldout, from a hash of the seed and the trace's split key alone (stable as traces are added)."""
    digest = hashlib.sha256(f"{seed}\0{key}".encode()).digest()
    return "heldout" if int.from_bytes(digest[:8], "big") / 2 ** 64 < HELDOUT_SHARE else "train"


def split_key(trace: Trace) -> str:
    """What decides a trace's split: the task it ran (its metadata's `task`, where the log names one),
    else its id. Runs of one task (tau-bench's trials, a SWE-bench instance from two run folders) are
    near copies of each other: they go to the same side, so a held-out task is one nobody tuned on."""
    task = trace.metadata.get("task")
    return str(task) if task not in (None, "") else trace.id


class TraceSuite:
    """The trace set `name` of the store at `db_url` (AKV_DB, or the data folder's database)."""

    # Recorded traffic of real agents and models: the baselines at full scale (`akv evolve` uses
    # these unless the config names others), not the 8K variants sized for the embedded model.
    baselines = {"expert": "expert", "standard": "standard", "text_engineering": "text-engineering"}

    def __init__(self, name: str, db_url: str | None = None, traces: Sequence[Trace] | None = None) -> None:
        self.name, self.db_url, self.seed = name, db_url, 0
        self._traces = list(traces) if traces is not None else None
        self._finder: ReuseFinder | None = None

    def traces(self) -> list[Trace]:
        """The set's traces, text actions in tool-call form, loaded once."""
        if self._traces is None:
            from store.repository import Store

            store = Store.open(self.db_url)
            try:
                self._traces = [as_tool_calls(trace_of(t)) for t in store.traces.get(self.name)]
            finally:
                store.close()
        return self._traces

    @property
    def finder(self) -> ReuseFinder:
        """One finder for the set: strings common to most of its traces are not distinctive."""
        if self._finder is None:
            self._finder = ReuseFinder(common_items([t.messages for t in self.traces()]))
        return self._finder

    def build(self, home: Path, seed: int = 0, edition: int | None = None) -> None:
        """Nothing to build: the traces are in the store. Fixes the split's seed and checks the set exists."""
        self.seed = seed
        self.traces()

    def version(self, home: Path) -> str:
        """`NAME@e1-<12 hex>` over the split seed and every trace's id and content digest."""
        digest = hashlib.sha256(f"traces\0{self.seed}".encode())
        for trace in sorted(self.traces(), key=lambda t: t.id):
            digest.update(f"\0{trace.id}\0{trace.digest()}".encode())
        return f"{self.name}@e{EDITION}-{digest.hexdigest()[:12]}"

    def tasks(self, split: str) -> list[Task]:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r} for {self.name}: expected train or heldout")
        return [_task(t, self.name, split) for t in self.traces() if split_of(split_key(t), self.seed) == split]

    def open(self, task: Task) -> TraceEnv:
        return TraceEnv(self._trace(task), self.finder)

    def scripted_agent(self, task: Task) -> TraceAgent:
        return TraceAgent(self._trace(task))

    def scored_reuses(self, trace_id: str) -> int:
        """How many reuses the trace has (the denominator of its score, whatever the policy)."""
        trace = self.trace(trace_id)
        return sum(len(self.finder.reuses(trace.messages, i)) for i in trace.assistant_indices())

    def _trace(self, task: Task) -> Trace:
        return self.trace(task.id)

    def trace(self, trace_id: str) -> Trace:
        """The trace with this id; ValueError when the set has none."""
        trace = next((t for t in self.traces() if t.id == trace_id), None)
        if trace is None:
            raise ValueError(f"trace {trace_id!r} is not in the trace set {self.name!r}")
        return trace


def _task(trace: Trace, suite: str, split: str) -> Task:
    first = trace.assistant_indices()[0]
    history = tuple(trace.messages[:first])
    system = next((content_text(m) for m in history if m.get("role") in ("system", "developer")), "")
    prompt = next((content_text(m) for m in history if m.get("role") == "user"), "")
    return Task(trace.id, suite, split, system, prompt, tuple(trace.tools),
                {"provenance": dict(trace.provenance), "group": agent_of(trace)}, history,
                len(trace.assistant_indices()))


def agent_of(trace: Trace) -> str:
    """The agent that wrote a trace, as far as its log says: its metadata's agent, else its format."""
    return str(trace.metadata.get("agent") or trace.provenance.get("format") or "unknown")


class TraceAgent:
    """Replays the recorded assistant messages in order; the last one is the run's answer.

    It keeps no use record itself: the harness infers it from what each message reuses, with the
    environment's finder, over what is visible at that step."""

    name = "recorded"

    def __init__(self, trace: Trace) -> None:
        self._messages = [trace.messages[i] for i in trace.assistant_indices()]
        self._step = 0

    def act(self, view: AgentView) -> AgentAction:
        message = dict(self._messages[self._step])
        self._step += 1
        if self._step == len(self._messages):
            return AgentAction(message, final_answer=content_text(message))
        return AgentAction(message)


class TraceEnv:
    """A recorded run's environment: answers each assistant message with what followed it, and
    counts the reuses whose content no visible message held when the agent reused it."""

    def __init__(self, trace: Trace, finder: ReuseFinder) -> None:
        self.trace, self.reuse_finder = trace, finder
        self._assistants = trace.assistant_indices()
        self._step = 0
        self.reuses = 0
        self.lost: list[tuple[int, str]] = []  # (message index, item) of each lost reuse

    def respond(self, view: AgentView, message: Message) -> list[Message]:
        index = self._assistants[self._step]
        self._judge(view, message, index)
        self._step += 1
        end = self._assistants[self._step] if self._step < len(self._assistants) else len(self.trace.messages)
        return [dict(m) for m in self.trace.messages[index + 1:end]]

    def _judge(self, view: AgentView, message: Message, index: int) -> None:
        """Count this step's reuses (on the recorded history) lost under the view: every holder hidden."""
        recorded = self.reuse_finder.reuses(self.trace.messages, index)
        if not recorded:
            return
        shown = {r.item: r for r in self.reuse_finder.reuses([*view.messages, message], len(view.messages))}
        self.reuses += len(recorded)
        self.lost += [(index, r.item) for r in recorded if not _still_visible(shown.get(r.item), view.visible)]

    def call_tool(self, name: str, arguments: Mapping[str, Any]) -> str:
        raise RuntimeError("a recorded run answers with its recorded messages (respond), not by tool calls")

    def grade(self, answer: str | None) -> Grade:
        """Fidelity: 1 - lost / reuses (1.0 when the trace has none)."""
        if self._step < len(self._assistants):
            raise RuntimeError(f"trace {self.trace.id!r} ended after {self._step} of {len(self._assistants)} steps")
        score = 1.0 - len(self.lost) / self.reuses if self.reuses else 1.0
        shown = ", ".join(f"{item!r} at message {i}" for i, item in self.lost[:5])
        return Grade(score, f"{len(self.lost)} of {self.reuses} reuses lost" + (f": {shown}" if shown else ""))

    def close(self) -> None:
        pass


def _still_visible(reuse: Reuse | None, visible: Sequence[bool]) -> bool:
    return reuse is not None and bool(used_indices([reuse], visible))
